"""Finite-difference checks of forces and stress against the autograd derivatives."""

from __future__ import annotations

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.testing.common import as_fp64, assert_close, evaluate, total_energies, with_skin_edges

#: Verlet skin (Å) of the list shared by all displaced copies; >> the displacements
FD_SKIN = 0.05


def check_forces_finite_difference(
    model: torch.nn.Module,
    graph: AtomicGraph,
    delta: float = 1e-4,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    max_atoms: int = 12,
    seed: int = 0,
) -> float:
    """Forces equal ``-dE/dx`` by central finite differences (fp64).

    Every Cartesian component of up to ``max_atoms`` atoms (chosen at random) is displaced by
    ``±delta`` Å; all displaced copies are evaluated in one batch that reuses one Verlet list
    (``cutoff + FD_SKIN``), so models must ignore edges beyond their cutoff (see
    :func:`~xnn.testing.check_edges_beyond_cutoff_ignored`).

    Returns:
        the largest absolute force error (eV/Å).
    Raises:
        AssertionError: if ``|F_fd - F| > atol + rtol * max|F|``.
    """
    model, graph = as_fp64(model, graph)
    forces = evaluate(model, graph, stress=False)[K.FORCES]
    base = with_skin_edges(model, graph, FD_SKIN)
    n = graph.n_atoms
    rng = np.random.default_rng(seed)
    atoms = np.arange(n) if n <= max_atoms else np.sort(rng.choice(n, max_atoms, replace=False))
    copies = []
    for a in atoms:
        for d in range(3):
            for sign in (1.0, -1.0):
                pos = base.positions.clone()
                pos[a, d] += sign * delta
                copies.append(base.replace(positions=pos))
    e = total_energies(model, copies).sum(-1).reshape(len(atoms), 3, 2)
    fd = -(e[..., 0] - e[..., 1]) / (2.0 * delta)
    return assert_close(
        "forces vs finite differences",
        forces[torch.as_tensor(atoms, device=forces.device)],
        fd,
        atol,
        rtol,
    )


def _strain_basis(dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Six symmetric unit strains: xx, yy, zz, then (yz+zy)/2, (xz+zx)/2, (xy+yx)/2."""
    out = []
    for a, b in ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)):
        e = torch.zeros(3, 3, dtype=dtype, device=device)
        e[a, b] += 0.5
        e[b, a] += 0.5
        out.append((a, b, e))
    return out


def check_stress_finite_difference(
    model: torch.nn.Module,
    graph: AtomicGraph,
    delta: float = 1e-5,
    atol: float = 1e-7,
    rtol: float = 1e-5,
) -> float:
    """Stress equals ``(1/V) dE/dε`` by central differences of a symmetric strain (fp64).

    Positions and cell are deformed as ``x (1 + ε)``. Only systems periodic along all three
    axes are checked; the virial must equal ``-stress * V``.

    Returns:
        the largest absolute stress error (eV/Å³).
    """
    model, graph = as_fp64(model, graph)
    periodic = graph.pbc.all(-1)
    if not periodic.any():
        raise AssertionError("check_stress_finite_difference needs a system periodic along x, y, z")
    out = evaluate(model, graph)
    vol = graph.volume()
    base = with_skin_edges(model, graph, FD_SKIN)
    eye = torch.eye(3, dtype=graph.dtype, device=graph.device)
    basis = _strain_basis(graph.dtype, graph.device)
    copies = []
    for _, _, e in basis:
        for sign in (1.0, -1.0):
            f = eye + sign * delta * e
            cell = torch.einsum("sij,jk->sik", base.cell, f)
            copies.append(base.replace(positions=base.positions @ f, cell=cell))
    en = total_energies(model, copies).reshape(6, 2, -1)
    fd = torch.zeros_like(out[K.STRESS])
    deriv = (en[:, 0] - en[:, 1]) / (2.0 * delta)  # [6, n_systems]
    for k, (a, b, _) in enumerate(basis):
        fd[:, a, b] = deriv[k] / vol
        fd[:, b, a] = deriv[k] / vol
    stress = out[K.STRESS][periodic]
    err = assert_close("stress vs finite differences", stress, fd[periodic], atol, rtol)
    virial = -stress * vol[periodic][:, None, None]
    assert_close("virial vs -stress * volume", out[K.VIRIAL][periodic], virial, atol * 1e3, rtol)
    return err
