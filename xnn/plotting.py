"""PNG plots of a training run (matplotlib, Agg backend: works without a display).

* :func:`learning_curves`: training/validation loss and validation MAEs per epoch (and a
  committee's validation force spread).
* :func:`parity`: predicted vs reference energy per atom, force components and (when
  labelled) stress components.
* :func:`calibration`: a committee's observed error against its predicted spread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def learning_curves(history: Sequence[dict], path: str | os.PathLike) -> Path:
    """Plot ``train_loss``/``val_loss`` (log scale) and validation MAEs against the epoch
    (:func:`learning_figure`) to ``path`` (PNG)."""
    plt = _pyplot()
    fig = learning_figure(history)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def learning_figure(history: Sequence[dict]):
    """The figure of :func:`learning_curves`: loss, energy MAE and force MAE per epoch; a
    committee's force panel also shows its validation spread (``val_forces_std_mean``, and
    ``val_forces_std_calibrated_mean``, the spread calibrated on that epoch's validation
    set), in the MAE's unit.

    Args:
        history: one dict per epoch with ``epoch`` and any of ``train_loss``, ``val_loss``,
            ``val_energy_mae`` (meV/atom), ``val_forces_mae`` (meV/Å), the spread columns.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    epochs = [h["epoch"] for h in history]
    spread = any(h.get("val_forces_std_mean") is not None for h in history)
    panels = (
        (axes[0], (("train_loss", "train"), ("val_loss", "validation")), "loss"),
        (axes[1], (("train_energy_mae", "train"), ("val_energy_mae", "validation")),
         "energy MAE (meV/atom)"),
        (axes[2], (("train_forces_mae", "train"), ("val_forces_mae", "validation"),
                   ("val_forces_std_mean", "validation mean force std"),
                   ("val_forces_std_calibrated_mean", "validation mean force std, "
                    "calibrated")),
         "force MAE, committee std (meV/Å)" if spread else "force MAE (meV/Å)"),
    )
    for ax, series, ylabel in panels:
        for key, label in series:
            pts = [(e, h[key]) for e, h in zip(epochs, history) if h.get(key) is not None]
            if pts:
                x, y = zip(*pts)
                ax.plot(x, y, marker="o", ms=3, label=label)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return fig


def _parity_panel(ax, ref: np.ndarray, pred: np.ndarray, unit: str, title: str, scale: float):
    ref, pred = np.asarray(ref) * scale, np.asarray(pred) * scale
    if ref.size == 0:
        ax.set_title(f"{title}: no data")
        return
    lo, hi = float(min(ref.min(), pred.min())), float(max(ref.max(), pred.max()))
    pad = 0.05 * (hi - lo or 1.0)
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k--", lw=0.8)
    ax.scatter(ref, pred, s=4, alpha=0.5)
    mae = float(np.abs(pred - ref).mean())
    rmse = float(np.sqrt(((pred - ref) ** 2).mean()))
    ax.set_title(f"{title}\nMAE {mae:.3g}, RMSE {rmse:.3g} ({unit})", fontsize=10)
    ax.set_xlabel(f"reference ({unit.split('/')[0] if 'meV' in unit else unit})")
    ax.set_ylabel("predicted")
    ax.set_aspect("equal", adjustable="datalim")
    ax.grid(alpha=0.3)


def parity_figure(energy: np.ndarray | None, forces: np.ndarray | None, title: str = "",
                  stress: np.ndarray | None = None):
    """The parity figure: energy per atom, force components and, when ``stress`` holds any
    labelled component, stress components (a third panel).

    Args:
        energy: ``[n_structures, 2]`` (reference, predicted) eV/atom, or ``None``.
        forces: ``[n_components, 2]`` (reference, predicted) eV/Å, or ``None``.
        title: prefix of the panel titles (e.g. ``"test"``).
        stress: ``[n_components, 2]`` (reference, predicted) eV/Å³ (the nine tensor
            components of each structure with a stress label, as the stress metrics count
            them), or ``None``.
    Returns:
        a matplotlib ``Figure`` (close it with ``plt.close(fig)``).
    """
    plt = _pyplot()
    s = None if stress is None or np.asarray(stress).size == 0 else np.asarray(stress)
    fig, axes = plt.subplots(1, 2 if s is None else 3, figsize=(9 if s is None else 13.5, 4.4))
    e = np.zeros((0, 2)) if energy is None else np.asarray(energy)
    f = np.zeros((0, 2)) if forces is None else np.asarray(forces)
    panels = [(e, "meV/atom", "energy", "energy (meV/atom)"),
              (f, "meV/Å", "forces", "force (meV/Å)")]
    if s is not None:
        panels.append((s, "meV/Å³", "stress", "stress component (meV/Å³)"))
    for ax, (data, unit, name, axis) in zip(axes, panels):
        _parity_panel(ax, data[:, 0], data[:, 1], unit, f"{title} {name}".strip(), 1000.0)
        ax.set_xlabel(f"reference {axis}")
        ax.set_ylabel(f"predicted {axis}")
    fig.tight_layout()
    return fig


def parity(energy: np.ndarray | None, forces: np.ndarray | None, path: str | os.PathLike,
           title: str = "", stress: np.ndarray | None = None) -> Path:
    """Write the parity plot of :func:`parity_figure` (energy, forces, and stress when there
    are stress labels) to the PNG file ``path``."""
    plt = _pyplot()
    fig = parity_figure(energy, forces, title, stress)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_CAL_UNITS = {"energy": "meV/atom", "forces": "meV/Å", "stress": "meV/Å³"}


def calibration(rows: dict[str, np.ndarray], path: str | os.PathLike, title: str = "",
                bins: int = 10, factors: dict[str, float] | None = None) -> Path:
    """A committee's calibration plot: per property, the RMS observed error against the RMS
    predicted standard deviation in ``bins`` groups of equal counts sorted by the latter
    (log-log, with the line error = std of a calibrated committee), over the items' scatter.

    Args:
        rows: ``{"energy" | "forces" | "stress": [n, 2]}`` (observed |error|, predicted std):
            energy per atom (eV/atom), force per atom (eV/Å), stress components (eV/Å³),
            the stds calibrated as they will be used.
        path: PNG file.
        title: prefix of the panel titles.
        factors: calibration factors shown in the titles.
    """
    from xnn.training.committee import binned_errors

    plt = _pyplot()
    props = [p for p in ("energy", "forces", "stress") if p in rows and len(rows[p])]
    fig, axes = plt.subplots(1, max(len(props), 1), figsize=(4.6 * max(len(props), 1), 4.2),
                             squeeze=False)
    for ax, prop in zip(axes[0], props):
        err, std = 1000.0 * rows[prop][:, 0], 1000.0 * rows[prop][:, 1]
        x, y, _ = binned_errors(err, std, bins)
        ax.scatter(np.maximum(std, 1e-6), np.maximum(err, 1e-6), s=3, alpha=0.2,
                   color="0.6")
        ax.plot(x, y, "o-", label="binned RMS error")
        lo = max(min(x.min(), y.min()) * 0.5, 1e-6)
        hi = max(x.max(), y.max()) * 2.0
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="error = std")
        ax.set_xscale("log")
        ax.set_yscale("log")
        c = "" if factors is None or prop not in factors else f", factor {factors[prop]:.3g}"
        ax.set_title(f"{title} {prop}{c}".strip(), fontsize=10)
        ax.set_xlabel(f"predicted std ({_CAL_UNITS[prop]})")
        ax.set_ylabel(f"observed error ({_CAL_UNITS[prop]})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
