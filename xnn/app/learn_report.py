"""Reports of ``xnn learn``: each round's ``summary.json`` row, ``learning_curve.csv`` and
``learning_curve.png`` (test force MAE and uncertainty against the training-set size).

Uncertainties are calibrated (the committee file's factors applied; ``forces_calibration`` is
the round's forces factor, so a raw spread is the value divided by it):
``uncertainty_mean/max_meV_A`` are the mean and largest score (a frame's largest per-atom
committee force std) over the round's candidates; ``test_forces_std_mean_meV_A`` is the
committee's per-atom force std averaged over the test set's atoms."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from xnn._files import atomic_write_text

#: the columns of ``learning_curve.csv`` (errors and uncertainties in meV, meV/atom, meV/Å)
COLUMNS = ("round", "n_train", "test_forces_mae_meV_A", "test_energy_mae_meV_atom",
           "uncertainty_mean_meV_A", "uncertainty_max_meV_A", "test_forces_std_mean_meV_A",
           "forces_calibration", "n_candidates", "n_above", "n_selected")


def write_summary(path: Path, row: dict) -> None:
    """A round's ``summary.json`` (written last: a round with one is complete)."""
    atomic_write_text(path, json.dumps(row, indent=2, sort_keys=True) + "\n")


def read_summaries(out: Path) -> list[dict]:
    """The summaries of the completed rounds, in round order."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("round_*/summary.json"))]


def write_learning_curve(out: Path) -> list[dict]:
    """``learning_curve.csv`` and ``learning_curve.png`` from the completed rounds."""
    rows = read_summaries(out)
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    atomic_write_text(out / "learning_curve.csv", buf.getvalue())
    if rows:
        _plot(rows, out / "learning_curve.png")
    return rows


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    n = [r["n_train"] for r in rows]
    for key, label in (("test_forces_mae_meV_A", "test force MAE"),
                       ("test_forces_std_mean_meV_A", "test force std (committee)"),
                       ("uncertainty_mean_meV_A", "candidates' max force std, mean")):
        pts = [(x, r[key]) for x, r in zip(n, rows, strict=True) if r.get(key) is not None]
        if pts:
            ax[0].plot(*zip(*pts, strict=True), "o-", label=label)
    ax[0].set_xlabel("training structures")
    ax[0].set_ylabel("meV/Å")
    ax[0].legend()
    ax[1].bar([r["round"] for r in rows], [r.get("n_selected") or 0 for r in rows])
    ax[1].set_xlabel("round")
    ax[1].set_ylabel("structures selected")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
