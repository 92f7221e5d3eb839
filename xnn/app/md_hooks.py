"""The hooks of an ``xnn md`` / ``xnn relax`` run: built from the config's ``hooks:`` list
(plus hook objects given from Python), called by the run loop, written to
``output.dir/hooks/<name>.csv`` by rank 0, and resumed from the checkpoint's meta.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from xnn._files import atomic_write_text
from xnn.dynamics.hooks import Hook, HookRunner
from xnn.dynamics.observers import build_hook
from xnn.errors import DataFileError

HOOKS_DIR = "hooks"


def hooks_from_config(entries) -> list[Hook]:
    """One hook per ``hooks:`` entry of the config (:class:`~xnn.config.md.HookConfig`)."""
    return [build_hook(e.name, e.every, e.scope, r_max=e.r_max, bins=e.bins,
                       partials=e.partials, target=e.target, frame_format=e.format,
                       label=e.label) for e in entries]


def _csv_text(rows: Sequence[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow([repr(v) if isinstance(v, float) else v for v in row])
    return buf.getvalue()


class RunHooks:
    """The hooks of one run and their files.

    Args:
        hooks: the hooks (from the config and from Python).
        par: the run layer (reducer, gather, ``main``).
        directory: the run's output folder (files go to ``directory/hooks``).
        timestep: fs per step (``None``: relaxation, ``time_fs`` is NaN).
        meta: the checkpoint meta of a resumed run (``None``: fresh).
        keep_step: resumed: the series rows to keep are those with ``step <= keep_step``.
    """

    def __init__(self, hooks: Sequence[Hook], par, directory: Path,
                 timestep: float | None, meta: dict | None, keep_step: int | None = None):
        self.runner = HookRunner(hooks, par, timestep)
        self.par, self.dir = par, Path(directory) / HOOKS_DIR
        self._started: set[str] = set()
        if meta is not None:
            self.runner.load_state_dict(meta.get("hooks") or {})
            if par.main and keep_step is not None:
                self._truncate(keep_step)

    def __bool__(self) -> bool:
        return bool(self.runner.hooks)

    def __call__(self, state) -> None:
        """Run the hooks due at ``state.step`` and write their new rows (rank 0)."""
        ran = self.runner(state)
        if ran and self.par.main:
            self.dir.mkdir(exist_ok=True)
            for h in ran:
                self._write(h)

    def _write(self, hook: Hook) -> None:
        rows = hook.rows()
        path = self.dir / f"{hook.name}.csv"
        if hook.accumulates:
            atomic_write_text(path, _csv_text([hook.columns, *rows]))
            return
        if not rows:
            return
        fresh = hook.name not in self._started and not path.is_file()
        self._started.add(hook.name)
        with open(path, "a", newline="") as fh:
            fh.write(_csv_text([hook.columns, *rows] if fresh else rows))

    def _truncate(self, keep_step: int) -> None:
        """Cut the series files to the rows a checkpoint at ``keep_step`` had written."""
        for h in self.runner.hooks:
            path = self.dir / f"{h.name}.csv"
            if h.accumulates or not path.is_file():
                continue
            lines = path.read_text().splitlines(keepends=True)
            try:
                kept = lines[:1] + [ln for ln in lines[1:] if int(ln.split(",", 1)[0])
                                    <= keep_step]
            except ValueError:
                raise DataFileError(f"cannot resume: {path} is not a hook file of xnn") \
                    from None
            atomic_write_text(path, "".join(kept))
            reader = csv.reader(lines[:1])
            h.columns = tuple(next(reader)) if lines else h.columns

    def state_dict(self) -> dict:
        """For the checkpoint meta: every hook's state."""
        return self.runner.state_dict()

    def results(self) -> dict:
        return self.runner.results()
