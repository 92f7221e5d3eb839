"""Errors of a trained model on a labelled data file (``xnn eval MODEL DATA``)."""

from __future__ import annotations

import os

import torch

from xnn.data.datasets import make_batches
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError
from xnn.models.base import as_model
from xnn.neighbors.datasets import WithEdges
from xnn.training.losses import TermSpec
from xnn.training.trainer import Trainer


def evaluate_model(model, data, batch_size: int = 8, device: str | torch.device = "cpu",
                   energy_key: str = "energy", forces_key: str = "forces",
                   stress_key: str = "stress", virial_key: str = "virial"):
    """MAE/RMSE of ``model`` on ``data`` and the parity data.

    Args:
        model: a per-atom-energy model (or a model file path).
        data: a dataset file (extxyz/HDF5) or a dataset object.
        batch_size: structures per evaluation batch.
        device: where to evaluate.
    Returns:
        ``(metrics, parity)``: ``{"energy_mae": meV/atom, "forces_mae": meV/Å,
        "stress_mae": meV/Å³, ..._rmse, "forces_mae_<El>": ...}`` and ``{"energy": [n, 2]
        (ref, pred) eV/atom, "forces": [m, 2] eV/Å}``.
    Raises:
        DataFileError: no structure carries any of the labels (an unlabelled file).
    """
    if isinstance(model, (str, os.PathLike)):
        from xnn.models.serialization import load_model

        model = load_model(model)
    if isinstance(data, (str, os.PathLike)):
        data = read_structures(data, 1.0, energy_key, forces_key, stress_key, virial_key)
    if len(data) == 0:
        raise InputError("no structure to evaluate")
    if not data.label_counts().any():
        raise DataFileError(
            f"{getattr(data, 'name', 'the data')!r} holds no energy, forces or stress label "
            f"(keys {energy_key!r}, {forces_key!r}, {stress_key!r}/{virial_key!r}): there is "
            "nothing to compare the model with; name the file's labels with --energy-key/"
            "--forces-key/--stress-key, or get predictions with xnn.Calculator or xnn md")
    as_model(model, "the evaluated model").check_species(
        torch.tensor(data.species(), dtype=torch.long))
    device = torch.device(device)
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    dtype = floats[0].dtype if floats else torch.get_default_dtype()  # LJ: buffers only
    model = model.to(device)
    ds = WithEdges(data, float(model.cutoff), cache=False)
    specs = {"energy": TermSpec(1.0), "forces": TermSpec(1.0), "stress": TermSpec(0.0)}
    trainer = Trainer(model, specs, optimizer=None, device=device, dtype=dtype)
    batches = make_batches(ds.n_atoms, batch_size=batch_size)
    sums, parity = trainer.evaluate(ds, batches, lambda b: list(b), collect=True)
    metrics = sums.finalize()
    metrics.pop("loss", None)
    return metrics, parity


def format_metrics(metrics: dict) -> str:
    """A small table of MAE/RMSE per property (and per element for forces)."""
    from xnn.training.metrics import UNITS

    lines = [f"{'property':<16}{'MAE':>12}{'RMSE':>12}  unit"]
    for name in ("energy", "forces", "stress"):
        if f"{name}_mae" in metrics:
            lines.append(f"{name:<16}{metrics[f'{name}_mae']:>12.3f}"
                         f"{metrics[f'{name}_rmse']:>12.3f}  {UNITS[name]}")
    for key in sorted(k for k in metrics if k.startswith("forces_mae_")):
        el = key.removeprefix("forces_mae_")
        lines.append(f"{'forces ' + el:<16}{metrics[key]:>12.3f}"
                     f"{metrics['forces_rmse_' + el]:>12.3f}  {UNITS['forces']}")
    rows = [name for name in ("energy", "forces", "stress") if f"{name}_std_rms" in metrics]
    if rows:  # a committee (xnn.app.evaluate.uncertainty_metrics)
        lines.append(f"{'uncertainty':<16}{'RMS std':>12}{'RMS error':>12}  unit"
                     "        factor  error/std")
        for name in rows:
            ratio = metrics.get(f"{name}_uncertainty_ratio", float("nan"))
            lines.append(f"{name:<16}{metrics[f'{name}_std_rms']:>12.3f}"
                         f"{metrics[f'{name}_error_rms']:>12.3f}  {UNITS[name]:<11}"
                         f"{metrics[f'{name}_calibration']:>7.3g}{ratio:>11.3g}")
    return "\n".join(lines)
