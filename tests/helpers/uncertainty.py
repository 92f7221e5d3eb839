"""Shared pieces of the committee-uncertainty tests (``test_uncertainty*.py``): a small
fp64 committee, a compressed Cu structure far from any training, ``xnn md`` arguments and the
step at which a guard must stop."""

from __future__ import annotations

import ase.io

from helpers.models import SMALL
from helpers.structures import fcc
from xnn.models.committee import Committee

STEPS = 12


def committee() -> Committee:
    """Three small SchNet members (different seeds), fp64."""
    return Committee({"name": "schnet", "species": [29], "cutoff": 3.0, "num_interactions": 2,
                      **SMALL["schnet"]}, size=3, seeds=[1, 2, 3]).double()


def compressed_cu(path):
    """16 Cu atoms compressed to a = 3.3 Å (from 3.6) and rattled: far from any training."""
    atoms = fcc((1, 2, 2), a=3.3, rattle=0.15, seed=1)
    ase.io.write(path, atoms)
    return atoms


def md_args(structure, model, out, *extra):
    return [f"structure={structure}", f"model.file={model}", "model.dtype=float64",
            "model.device=cpu", "ensemble=nve", "initial_temperature=800", f"steps={STEPS}",
            "timestep=2", "output.log_every=1", "output.trajectory_every=5",
            "output.checkpoint_every=0", "output.plot=false", "output.progress=false",
            "safety.max_drift=null", f"output.dir={out}", *extra]


def first_record(u: list[float], after: int = 3) -> tuple[int, float]:
    """The first step ``k >= after`` whose value exceeds every earlier one, and a threshold
    between them (the guard must stop exactly there)."""
    for k in range(after, len(u)):
        if u[k] > max(u[:k]) * (1 + 1e-9):
            return k, 0.5 * (max(u[:k]) + u[k])
    raise AssertionError(f"no new maximum after step {after} in {u}")
