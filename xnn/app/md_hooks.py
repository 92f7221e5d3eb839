"""The hooks of an ``xnn md`` / ``xnn relax`` run: built from the config's ``hooks:`` list
(plus hook objects given from Python), checked against the structure before anything is
written, called by the run loop, written to ``output.dir/hooks/<name>.csv`` by rank 0, and
resumed from the checkpoint's meta. A hook that fails ends the run with a
:class:`~xnn.dynamics.hooks.HookError` after the application wrote a checkpoint whose
resumed run calls that step's hooks again.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from xnn._files import atomic_write_text
from xnn.dynamics.hooks import Hook, HookError, HookRunner
from xnn.dynamics.observers import build_hook
from xnn.dynamics.state import MDState
from xnn.errors import DataFileError

HOOKS_DIR = "hooks"


def hooks_from_config(entries) -> list[Hook]:
    """One hook per ``hooks:`` entry of the config (:class:`~xnn.config.md.HookConfig`)."""
    return [build_hook(e.name, e.every, e.scope, r_max=e.r_max, bins=e.bins,
                       partials=e.partials, target=e.target, frame_format=e.format,
                       label=e.label, max_pairs=e.max_pairs) for e in entries]


def _csv_text(rows: Sequence[Sequence]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow([repr(v) if isinstance(v, float) else v for v in row])
    return buf.getvalue()


class RunHooks:
    """The hooks of one run and their files.

    Made before the run writes anything: :meth:`prepare` checks the hooks against the
    structure and adds their per-atom fields to the state, then :meth:`open` gives them the
    output folder.

    Args:
        hooks: the hooks (from the config and from Python).
        par: the run layer (reducer, gather, ``main``).
        timestep: fs per step (``None``: relaxation, ``time_fs`` is NaN).
        meta: the checkpoint meta of a resumed run (``None``: fresh).
    """

    def __init__(self, hooks: Sequence[Hook], par, timestep: float | None,
                 meta: dict | None):
        self.runner = HookRunner(hooks, par, timestep)
        self.par, self.dir = par, Path(HOOKS_DIR)
        self._started: set[str] = set()
        self.failed_step: int | None = None  # a hook failed at this step (all were undone)
        self._rerun = None if meta is None else meta.get("hooks_rerun")
        if meta is not None:
            self.runner.load_state_dict(meta.get("hooks") or {})

    def prepare(self, state: MDState) -> MDState:
        """``state`` with the hooks' per-atom fields, after checking that every hook can
        observe it (before anything is written). Collective."""
        return self.runner.prepare(state)

    def open(self, directory: Path, keep_step: int | None = None) -> RunHooks:
        """The files go to ``directory/hooks``; resumed (``keep_step``), the series files
        keep their rows with ``step <= keep_step``."""
        self.dir = Path(directory) / HOOKS_DIR
        if self.par.main and keep_step is not None:
            self._truncate(keep_step)
        return self

    def __bool__(self) -> bool:
        return bool(self.runner.hooks)

    def __call__(self, state: MDState) -> None:
        """Run the hooks due at ``state.step`` and write their new rows (rank 0).

        Raises:
            HookError: a hook failed (on every rank); :meth:`meta` then holds the hooks as
                before this step and asks a resumed run to call them again.
        """
        try:
            ran = self.runner(state)
        except HookError:
            self.failed_step = state.step
            raise
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

    def resume(self, state: MDState) -> None:
        """A run resumed from the checkpoint of a hook failure at ``state.step``: call that
        step's hooks again (their rows and state were undone)."""
        if self._rerun is not None and self._rerun == state.step:
            self(state)

    def meta(self) -> dict:
        """For the checkpoint meta: every hook's state (and the step whose hooks a resumed
        run calls again, after a hook failed)."""
        out = {"hooks": self.runner.state_dict()}
        if self.failed_step is not None:
            out["hooks_rerun"] = self.failed_step
        return out

    def results(self) -> dict:
        """Every hook's result by name (rank 0)."""
        return self.runner.results()


def hook_failed(err: HookError, path: Path) -> HookError:
    """The one-line error of a run a hook stopped, after its checkpoint ``path``."""
    return HookError(f"{err}; the run stopped after writing {path} at step {err.step}: fix "
                     f"the hook and continue with resume={path}", err.hook, err.step)
