"""Helpers of the streaming tests (``tests/test_streaming*.py``): small labelled Cu data in
an HDF5 file, and the config of a tiny fp64 run that logs every step's loss."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from xnn.config.loader import load_config
from xnn.config.train import TrainConfig

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


def small_cu(n: int, seed: int = 0) -> list:
    """``n`` rattled Cu cells of 1 to 4 atoms with EMT labels (``ase.Atoms``)."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        atoms = bulk("Cu", "fcc", a=3.6).repeat((1, 1, 1 + k % 4))
        atoms.positions += rng.normal(0.0, 0.05, atoms.positions.shape)
        atoms.calc = EMT()
        e, f, s = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False)
        atoms.calc = SinglePointCalculator(atoms, energy=e, forces=f, stress=s)
        out.append(atoms)
    return out


def write_h5(path: Path, atoms: list) -> Path:
    from xnn.data.ase_io import from_ase
    from xnn.data.hdf5 import write_hdf5

    write_hdf5(path, (from_ase([a]) for a in atoms))
    return path


def cli_args(out, *extra) -> list[str]:
    """The overrides of a tiny fp64 run writing to ``out`` (a step row per step)."""
    return ["data.datasets.0.path=unused.h5", f"output_dir={out}", "model.cutoff=3.0", TINY,
            "precision=fp64", "device=cpu", "logging.plots=false",
            "logging.progress_bar=false", "logging.every_n_steps=1", "loss.stress.weight=1.0",
            "optim.lr=5e-3", *extra]


def cfg_of(out, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, cli_args(out, *extra))


def step_losses(out) -> list[float]:
    with open(Path(out) / "steps.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def assert_same_weights(a, b):
    """The model weights of the last checkpoints of runs ``a`` and ``b`` are bitwise equal."""
    import torch

    from xnn.training.checkpoint import load_checkpoint

    a, b = (load_checkpoint(Path(p) / "checkpoints/last.pt")["model"]["state_dict"]
            for p in (a, b))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
