"""Cutoff and isolated-atom contracts: a dimer scanned across the cutoff; e0 of single atoms."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from xnn.data import keys as K
from xnn.testing.common import as_fp64, assert_close, evaluate
from xnn.testing.systems import dimer, single_atom


def _default_pair(model: torch.nn.Module) -> tuple[int, int]:
    species = model.species  # declared by AtomisticModel (None: any element)
    if species:
        return int(species[0]), int(species[-1])
    return 18, 18


def check_cutoff_smoothness(
    model: torch.nn.Module,
    numbers: Sequence[int] | None = None,
    pair_shifted_only: bool = False,
    eta: float = 1e-7,
    width: float = 0.05,
    n_points: int = 20,
    energy_atol: float = 1e-6,
    force_atol: float = 1e-5,
    skin: float = 1.0,
) -> dict[str, float]:
    """Energy (and forces) continuous as a dimer's distance crosses the cutoff.

    A dimer in vacuum is evaluated with a Verlet-like list (``cutoff + skin``) at distances
    ``r_c ± eta`` and on a scan ``r_c ± width``. Checked:

    * beyond ``r_c`` the dimer energy equals the two isolated atoms' energies, forces are 0;
    * the energy jump ``|E(r_c - eta) - E(r_c + eta)| <= energy_atol``;
    * along the scan, energy steps are bounded by the forces (no hidden jumps);
    * the force jump ``|F(r_c - eta)| <= force_atol`` unless ``pair_shifted_only`` (a
      potential shifted to zero at ``r_c``, whose force jumps there, as LJ with
      ``smooth=False``); the jump is then only reported.

    Args:
        numbers: the two atomic numbers (default: first and last of ``model.species``, or Ar).
    Returns:
        ``{"energy_jump", "force_jump", "energy_beyond"}`` (eV, eV/Å, eV).
    """
    model, _ = as_fp64(model)
    z1, z2 = numbers if numbers is not None else _default_pair(model)
    rc = float(model.cutoff)
    scan = list(np.linspace(rc - width, rc + width, n_points))
    g = dimer(z1, z2, [rc - eta, rc + eta, *scan])
    out = evaluate(model, g, stress=False, skin=skin)
    e = out[K.ENERGY]
    f = out[K.FORCES].reshape(-1, 2, 3)[:, 1].norm(dim=-1)  # force on the second atom
    isolated = sum(
        float(evaluate(model, single_atom(z), stress=False)[K.ENERGY][0]) for z in (z1, z2)
    )
    r = torch.tensor([rc - eta, rc + eta, *scan], dtype=e.dtype, device=e.device)
    beyond = r > rc + 1e-9
    energy_beyond = float((e[beyond] - isolated).abs().max())
    scale = max(1.0, abs(isolated))
    if energy_beyond > 1e-12 * scale:
        raise AssertionError(
            f"dimer {z1}-{z2} beyond the cutoff ({rc} Å) differs from isolated atoms by "
            f"{energy_beyond:.3e} eV: edges longer than the cutoff must contribute nothing"
        )
    assert_close("forces beyond the cutoff", f[beyond], torch.zeros_like(f[beyond]), 1e-12, 0.0)
    energy_jump = float((e[0] - e[1]).abs())
    force_jump = float((f[0] - f[1]).abs())
    if energy_jump > energy_atol:
        raise AssertionError(
            f"energy jumps by {energy_jump:.3e} eV at the cutoff {rc} Å (> {energy_atol:g})"
        )
    steps = (e[3:] - e[2:-1]).abs()
    bound = torch.maximum(f[3:], f[2:-1]) * (width * 2 / (n_points - 1)) * 1.5 + energy_atol
    if (steps > bound).any():
        k = int(torch.nonzero(steps > bound)[0])
        raise AssertionError(
            f"energy step {float(steps[k]):.3e} eV between r={scan[k]:.6f} and {scan[k + 1]:.6f} Å "
            f"is larger than the forces allow ({float(bound[k]):.3e} eV)"
        )
    if not pair_shifted_only and force_jump > force_atol:
        raise AssertionError(
            f"force jumps by {force_jump:.3e} eV/Å at the cutoff {rc} Å (> {force_atol:g})"
        )
    return {"energy_jump": energy_jump, "force_jump": force_jump, "energy_beyond": energy_beyond}


def check_isolated_atom_e0(model: torch.nn.Module, z: int, e0: float, atol: float = 1e-8) -> None:
    """A single atom of element ``z`` in vacuum has energy ``e0`` (eV) and zero force."""
    model, _ = as_fp64(model)
    out = evaluate(model, single_atom(int(z)), stress=False)
    expected = torch.tensor([float(e0)], dtype=out[K.ENERGY].dtype)
    assert_close(f"isolated atom Z={z}: energy", out[K.ENERGY], expected, atol, 0.0)
    assert_close(f"isolated atom Z={z}: force", out[K.FORCES], torch.zeros(1, 3), atol, 0.0)
