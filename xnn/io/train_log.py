"""What a run shows and writes: a progress bar, one table line per epoch, CSV and TensorBoard.

Per epoch: a console table line, a ``metrics.csv`` row and TensorBoard scalars named after
the columns. With ``logging.every_n_steps``, also per N steps: a ``steps.csv`` row (columns
``epoch`` (the epoch in progress, from 1), ``step``, ``lr``, ``loss`` (that step's loss),
``train_*`` (the epoch's training metrics so far), ``time_s`` (since the loop started)) and
TensorBoard scalars ``steps/<column>``; no console line (the progress bar shows the loss).

Only the main rank logs; the numbers it logs are all-reduced, so they are the same on every
rank.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

from xnn._files import atomic_write_text

TABLE_COLUMNS = (
    ("epoch", "{:>5d}", "epoch"), ("step", "{:>7d}", "step"), ("lr", "{:>9.2e}", "lr"),
    ("train_loss", "{:>10.4g}", "train loss"), ("val_loss", "{:>10.4g}", "val loss"),
    ("val_energy_mae", "{:>10.2f}", "E meV/at"), ("val_forces_mae", "{:>10.1f}", "F meV/Å"),
    ("val_stress_mae", "{:>10.3f}", "S meV/Å³"), ("time_s", "{:>7.1f}", "time s"),
)


def table_header() -> str:
    return " ".join(f"{title:>{len(fmt.format(0 if 'd' in fmt else 0.0))}}"
                    for _, fmt, title in TABLE_COLUMNS)


def table_row(row: dict) -> str:
    cells = []
    for key, fmt, _ in TABLE_COLUMNS:
        width = len(fmt.format(0 if "d" in fmt else 0.0))
        value = row.get(key)
        cells.append(fmt.format(value) if value is not None else " " * (width - 1) + "-")
    return " ".join(cells)


class RunLogger:
    """CSV + TensorBoard + console table for the main rank; a no-op elsewhere.

    Args:
        out_dir: run folder.
        enabled: this rank writes.
        csv_log: write ``metrics.csv``.
        tensorboard: write TensorBoard events in ``out_dir/tensorboard``.
        progress_bar: show a tqdm bar per epoch when stderr is a terminal.
        stream: where the table goes (stdout).
    """

    def __init__(self, out_dir: Path, enabled: bool, csv_log: bool = True,
                 tensorboard: bool = False, progress_bar: bool = True, stream=None):
        self.enabled = enabled
        self.out_dir = Path(out_dir)
        self.csv_path = self.out_dir / "metrics.csv" if csv_log else None
        self.steps_path = self.out_dir / "steps.csv" if csv_log else None
        self.stream = stream or sys.stdout
        self.progress_bar = progress_bar and enabled and sys.stderr.isatty()
        self._tb = None
        self._header_done = False
        self._csv_fields: list[str] | None = None
        self._step_fields: list[str] | None = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:
                self.print("tensorboard is not installed: logging.tensorboard ignored")

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def bar(self, total: int, initial: int, desc: str):
        """A tqdm bar (or a silent stand-in) with ``update(n)``, ``set_postfix`` and ``close``."""
        from tqdm import tqdm

        return tqdm(total=total, initial=initial, desc=desc, disable=not self.progress_bar,
                    leave=False, dynamic_ncols=True)

    def epoch(self, row: dict) -> None:
        """Log one epoch's metrics (console line, CSV row, TensorBoard scalars)."""
        if not self.enabled:
            return
        if not self._header_done:
            self.print(table_header())
            self._header_done = True
        self.print(table_row(row))
        if self.csv_path is not None:
            self._write_csv(row)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("epoch", "step"):
                    self._tb.add_scalar(k, v, row.get("step", 0))
            self._tb.flush()

    def step(self, row: dict) -> None:
        """Log one ``every_n_steps`` row (``steps.csv`` and TensorBoard ``steps/*``)."""
        if not self.enabled:
            return
        if self.steps_path is not None:
            self._step_fields = _append_row(self.steps_path, self._step_fields, row)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("epoch", "step"):
                    self._tb.add_scalar(f"steps/{k}", v, row["step"])
            self._tb.flush()

    def _write_csv(self, row: dict) -> None:
        self._csv_fields = _append_row(self.csv_path, self._csv_fields, row)

    def restore_steps_csv(self, step: int) -> None:
        """On resume: drop the ``steps.csv`` rows after ``step`` (the checkpoint's), which
        the resumed run logs again."""
        if not self.enabled or self.steps_path is None or not self.steps_path.is_file():
            return
        with open(self.steps_path, newline="") as f:
            rows = list(csv.DictReader(f))
            fields = rows and list(rows[0])
        buf = io.StringIO(newline="")
        kept = [r for r in rows if int(r["step"]) <= step]
        if kept:
            w = csv.DictWriter(buf, fieldnames=fields)
            w.writeheader()
            w.writerows(kept)
        self._step_fields = fields if kept else None
        atomic_write_text(self.steps_path, buf.getvalue())

    def restore_csv(self, history: list[dict]) -> None:
        """On resume: rewrite ``metrics.csv`` (atomically) as the rows of the checkpoint's
        ``history``, so that rows of epochs after the checkpoint (a run killed after it) are
        dropped instead of repeated when those epochs run again."""
        if not self.enabled or self.csv_path is None:
            return
        buf = io.StringIO(newline="")
        self._csv_fields = list(history[0]) if history else None
        if history:
            w = csv.DictWriter(buf, fieldnames=self._csv_fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(history)
        if history or self.csv_path.is_file():
            atomic_write_text(self.csv_path, buf.getvalue())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _append_row(path: Path, fields: list[str] | None, row: dict) -> list[str]:
    """Append ``row`` to the CSV file ``path`` (a header first when it is new or empty, with
    the columns of ``row``); returns the file's columns (keys outside them are dropped)."""
    exists = path.is_file()
    if fields is None:
        if exists:
            with open(path, newline="") as f:
                fields = next(csv.reader(f), None)
        if not fields:
            fields = list(row)
            exists = False
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if not exists:
            w.writeheader()
        w.writerow(row)
    return fields
