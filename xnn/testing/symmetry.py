"""Symmetry contracts: rotations and reflections, translations, permutations, supercells."""

from __future__ import annotations

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.testing.common import as_fp64, assert_close, evaluate
from xnn.testing.systems import random_orthogonal, supercell


def _compare(
    label: str, out: dict, ref: dict, atol: float, rtol: float, stress: bool = True
) -> None:
    assert_close(f"{label}: energy", out[K.ENERGY], ref[K.ENERGY], atol, rtol)
    assert_close(f"{label}: per-atom energies", out[K.ENERGIES], ref[K.ENERGIES], atol, rtol)
    assert_close(f"{label}: forces", out[K.FORCES], ref[K.FORCES], atol, rtol)
    if stress:
        assert_close(f"{label}: stress", out[K.STRESS], ref[K.STRESS], atol, rtol)


def check_rotation_equivariance(
    model: torch.nn.Module,
    graph: AtomicGraph,
    n_trials: int = 2,
    atol: float = 1e-10,
    rtol: float = 1e-9,
    seed: int = 0,
) -> None:
    """Energies invariant, forces and stress equivariant under random rotations AND reflections.

    Positions and cell rows transform as ``x Q`` (``Q`` orthogonal, det ±1); forces must
    become ``F Q`` and stress ``Qᵀ σ Q``. Each trial uses one proper and one improper ``Q``.
    """
    model, graph = as_fp64(model, graph)
    ref = evaluate(model, graph)
    rng = np.random.default_rng(seed)
    for trial in range(n_trials):
        for proper in (True, False):
            q = torch.as_tensor(
                random_orthogonal(rng, proper), dtype=graph.dtype, device=graph.device
            )
            g = graph.replace(positions=graph.positions @ q, cell=graph.cell @ q)
            out = evaluate(model, g)
            expected = {
                K.ENERGY: ref[K.ENERGY],
                K.ENERGIES: ref[K.ENERGIES],
                K.FORCES: ref[K.FORCES] @ q,
                K.STRESS: q.T @ ref[K.STRESS] @ q,
            }
            kind = "rotation" if proper else "reflection"
            _compare(f"{kind} (trial {trial})", out, expected, atol, rtol)


def check_translation_invariance(
    model: torch.nn.Module,
    graph: AtomicGraph,
    atol: float = 1e-10,
    rtol: float = 1e-9,
    seed: int = 0,
) -> None:
    """Results unchanged by a rigid translation and by moving an atom by a lattice vector.

    The lattice-vector move (along periodic axes only) checks periodic-image invariance.
    """
    model, graph = as_fp64(model, graph)
    ref = evaluate(model, graph)
    rng = np.random.default_rng(seed)
    t = torch.as_tensor(rng.uniform(-5.0, 5.0, 3), dtype=graph.dtype, device=graph.device)
    _compare(
        "rigid translation",
        evaluate(model, graph.replace(positions=graph.positions + t)),
        ref,
        atol,
        rtol,
    )
    pbc = graph.pbc[graph.batch]  # [n_atoms, 3]
    n = torch.as_tensor(rng.integers(-2, 3, (graph.n_atoms, 3)), device=graph.device)
    n = torch.where(pbc, n, torch.zeros_like(n)).to(graph.dtype)
    if bool((n != 0).any()):
        moved = graph.positions + torch.einsum("ni,nij->nj", n, graph.cell[graph.batch])
        _compare(
            "atoms moved by lattice vectors",
            evaluate(model, graph.replace(positions=moved)),
            ref,
            atol,
            rtol,
        )


def check_permutation_equivariance(
    model: torch.nn.Module,
    graph: AtomicGraph,
    atol: float = 1e-10,
    rtol: float = 1e-9,
    seed: int = 0,
) -> None:
    """Permuting atoms inside each system permutes per-atom energies and forces alike."""
    model, graph = as_fp64(model, graph)
    ref = evaluate(model, graph)
    gen = torch.Generator().manual_seed(seed)
    ptr = graph.ptr.tolist()
    perm = torch.cat(
        [lo + torch.randperm(hi - lo, generator=gen) for lo, hi in zip(ptr[:-1], ptr[1:])]
    ).to(graph.device)
    out = evaluate(model, graph.select_atoms(perm))
    expected = {
        K.ENERGY: ref[K.ENERGY],
        K.ENERGIES: ref[K.ENERGIES][perm],
        K.FORCES: ref[K.FORCES][perm],
        K.STRESS: ref[K.STRESS],
    }
    _compare("permutation", out, expected, atol, rtol)


def check_supercell_consistency(
    model: torch.nn.Module,
    graph: AtomicGraph,
    reps: tuple[int, int, int] = (2, 2, 2),
    atol: float = 1e-9,
    rtol: float = 1e-9,
) -> None:
    """A ``reps`` supercell has ``prod(reps)`` × the energy, the same per-atom energies,
    forces (tiled) and stress. Checks every system periodic along x, y and z.
    """
    model, graph = as_fp64(model, graph)
    systems = torch.nonzero(graph.pbc.all(-1)).flatten().tolist()
    if not systems:
        raise AssertionError("check_supercell_consistency needs a system periodic along x, y, z")
    k = int(np.prod(reps))
    for s in systems:
        one = graph.select_systems([s])
        ref = evaluate(model, one)
        out = evaluate(model, supercell(one, reps))
        expected = {
            K.ENERGY: k * ref[K.ENERGY],
            K.ENERGIES: ref[K.ENERGIES].repeat(k),
            K.FORCES: ref[K.FORCES].repeat(k, 1),
            K.STRESS: ref[K.STRESS],
        }
        _compare(f"{reps} supercell of system {s}", out, expected, atol, rtol)
