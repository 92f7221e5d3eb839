"""The CSV thermo log of an MD run (columns :data:`xnn.dynamics.thermo.COLUMNS`, values of
:func:`xnn.dynamics.thermo.observables`) and its plot."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from xnn._files import atomic_write_bytes, atomic_write_text
from xnn.dynamics.thermo import COLUMNS
from xnn.errors import DataFileError


class ThermoLog:
    """CSV log, one row per system per logged step.

    Args:
        path: CSV file.
        truncate_to: on resume, the number of data rows to keep; ``None`` starts a new file.
            Either way the file is replaced atomically (a kill during the rewrite leaves
            the previous file whole).
        columns: the header (:func:`xnn.dynamics.thermo.columns`: a committee adds its
            uncertainty columns); rows give a value for each.
    """

    def __init__(self, path: str | os.PathLike, truncate_to: int | None = None,
                 columns: Sequence[str] = COLUMNS):
        self.path = Path(path)
        self.rows = 0
        self.columns = tuple(columns)
        if truncate_to is None:
            atomic_write_text(self.path, ",".join(self.columns) + "\n")
        else:
            if not self.path.is_file():
                raise DataFileError(f"cannot resume: thermo log {self.path} is missing")
            lines = self.path.read_bytes().split(b"\n")
            if len(lines) < truncate_to + 2:
                raise DataFileError(f"cannot resume: {self.path} has fewer rows than the "
                                    "checkpoint says")
            atomic_write_bytes(self.path, b"\n".join(lines[: truncate_to + 1]) + b"\n")
            self.rows = truncate_to

    def write(self, step: int, dt: float, values: dict[str, torch.Tensor]) -> None:
        cols = {k: v.detach().cpu().tolist() for k, v in values.items()}
        n = len(cols["epot_eV"])
        with open(self.path, "a", newline="") as fh:
            w = csv.writer(fh, lineterminator="\n")
            for s in range(n):
                values = [repr(float(cols[c][s])) for c in self.columns[3:]]
                w.writerow([step, repr(step * dt), s, *values])
        self.rows += n


def read_log(path: str | os.PathLike) -> dict[str, list[float]]:
    """Columns of a thermo CSV as lists of floats."""
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return {c: [float(r[c]) for r in rows] for c in (rows[0].keys() if rows else COLUMNS)}


def thermo_figure(csv_path: str | os.PathLike, title: str = "",
                  targets: Mapping[str, Sequence[float]] | None = None):
    """Temperature, energies, pressure and volume against time; one line per system.

    Args:
        csv_path: a thermo CSV (:class:`ThermoLog`).
        title: the figure's title.
        targets: ``{column: values}``: dashed horizontal lines at each value on the panel of
            that column, e.g. ``{"temperature_K": [300.0], "pressure_GPa": [0.1]}`` (the
            thermostat's and barostat's targets).
    Returns:
        a matplotlib ``Figure`` (2 × 2 axes; close it with ``plt.close(fig)``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = read_log(csv_path)
    systems = sorted(set(int(s) for s in d["system"]))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = [("temperature_K", "T (K)"), ("epot_eV", "E_pot (eV)"),
              ("pressure_GPa", "P (GPa)"), ("conserved_eV", "conserved (eV)")]
    if all(v != v for v in d["pressure_GPa"]):
        panels[2] = ("etot_eV", "E_tot (eV)")
    for ax, (col, label) in zip(axes.flat, panels):
        for s in systems[:10]:
            idx = [i for i, x in enumerate(d["system"]) if int(x) == s]
            ax.plot([d["time_fs"][i] / 1000 for i in idx], [d[col][i] for i in idx],
                    lw=0.8, label=f"system {s}" if len(systems) > 1 else None)
        for k, value in enumerate(sorted(set((targets or {}).get(col, ())))):
            ax.axhline(value, ls="--", lw=1.0, color="k", label="target" if k == 0 else None)
        ax.set_ylabel(label)
        if col in (targets or {}) or len(systems) > 1 and col == "temperature_K":
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("time (ps)")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_log(csv_path: str | os.PathLike, png_path: str | os.PathLike, title: str = "",
             targets: Mapping[str, Sequence[float]] | None = None) -> Path:
    """Write :func:`thermo_figure` (with the ``targets`` as dashed lines) to ``png_path``."""
    import matplotlib.pyplot as plt

    fig = thermo_figure(csv_path, title, targets)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)
