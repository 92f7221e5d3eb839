"""Shared pieces of the committee-uncertainty tests (``test_uncertainty*.py``,
``test_committee_relax.py``, ``test_workflow_uncertainty.py``): a small fp64 committee, a
compressed Cu structure far from any training (and both as files), ``xnn md`` / ``xnn relax``
arguments, a CSV log as columns and the step at which a guard must stop."""

from __future__ import annotations

import csv

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


def committee_files(folder) -> tuple:
    """The committee saved as ``folder/committee.pt`` and :func:`compressed_cu` as
    ``folder/cu.xyz``: ``(model path, structure path)``."""
    from xnn.models.serialization import save_model

    model = save_model(committee(), folder / "committee.pt")
    compressed_cu(folder / "cu.xyz")
    return model, folder / "cu.xyz"


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


def relax_args(structure, model, out, *extra, steps: int = STEPS):
    """``xnn relax`` of the committee for ``steps`` FIRE steps (``fmax`` too small to stop
    earlier), every step logged, a frame every 5."""
    return [f"structure={structure}", f"model.file={model}", "model.dtype=float64",
            "model.device=cpu", f"max_steps={steps}", "fmax=1e-6", f"output.dir={out}",
            "output.trajectory_every=5", "output.plot=false", "output.progress=false",
            *extra]


def read_columns(path) -> dict[str, list[float]]:
    """A CSV log (``relax.csv``) as columns of floats."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {k: [float(r[k]) for r in rows] for k in rows[0]}
