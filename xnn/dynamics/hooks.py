"""Observers of an MD or relaxation run (hooks): the protocol and the runner that calls them.

A hook runs every ``every`` steps (on the steps that are multiples of ``every``) in one of
three scopes:

* ``"owned"``: :meth:`OwnedHook.per_atom` runs on every process on the atoms it owns and
  returns per-atom values ``[n_owned, k]``; the runner assembles them by global atom id and
  hands the whole array (in id order) to :meth:`OwnedHook.update`.
* ``"global"``: :meth:`GlobalHook.partial` returns per-process partial sums over the owned
  atoms (a dict of tensors of the same shapes on every process); the runner sums them over
  the processes with the run's :class:`~xnn.dynamics.reduce.Reducer` and hands the sums to
  :meth:`GlobalHook.update` on every process.
* ``"rank0"``: :meth:`Rank0Hook.observe` runs on the main process on the gathered state
  (every atom, in global-id order).

So a hook's result does not depend on how many processes hold the atoms (up to the
round-off of a sum in another order). Memory per process is of its owned atoms: what a hook
keeps per atom lives in the state as a per-atom field (:meth:`Hook.prepare`), which moves
with the atoms between processes and goes into checkpoints by atom id. Hooks hold their
results (:meth:`Hook.result`, for Python) and give rows for a CSV file (:meth:`Hook.rows`);
writing files is the application's (:mod:`xnn.app.md`: ``output.dir/hooks/<name>.csv``).
This module writes no files and imports nothing from ``torch.distributed``: the decomposed
run layer supplies the reducer and the gather (:class:`~xnn.dynamics.parallel.SerialRun`
in one process).

A hook that raises ends the run with a :class:`HookError` on every process (naming the hook
and the step); the hooks of that step run all or nothing (:meth:`HookRunner.__call__`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from xnn.dynamics.reduce import Reducer
from xnn.dynamics.state import MDState
from xnn.errors import InputError, XnnError

SCOPES = ("owned", "global", "rank0")
_UNSAFE = ("/", "\\", ":")  # path separators and Windows drives


class HookError(XnnError):
    """A hook failed during a run: it raised, or returned values the runner refuses.

    Attributes:
        hook: the hook's name. step: the step it failed at.
    """

    def __init__(self, message: str, hook: str, step: int):
        super().__init__(message)
        self.hook, self.step = hook, step


def check_name(name) -> str:
    """``name`` if it can name the hook's file ``hooks/<name>.csv`` inside the run's output
    folder (not empty, no path separator, ``:``, control character or leading ``.``, at
    most 200 bytes), else :class:`~xnn.errors.InputError`."""
    text = str(name)
    if (not text.strip() or text.startswith(".") or any(c in text for c in _UNSAFE)
            or any(ord(c) < 32 for c in text) or len(text.encode()) > 200):
        raise InputError(f"hook label {text!r} must be a plain file name, as it names "
                         "hooks/LABEL.csv inside output.dir: not empty, no '/', '\\' or "
                         "':', no leading '.', at most 200 bytes")
    return text


def reduce_sum(reduce: Reducer, value: Tensor) -> Tensor:
    """``value`` (any shape) summed over the processes of ``reduce``."""
    flat = value.reshape(1, -1)
    batch = torch.zeros(1, dtype=torch.long, device=value.device)
    return reduce.sum_per_system(flat, batch, 1)[0].reshape(value.shape)


def n_ids(graph, reduce: Reducer) -> int:
    """One more than the largest global atom id over every process."""
    ids = graph.atom_id.to(torch.float64)
    top = ids.max() if ids.numel() else ids.new_tensor(-1.0)
    batch = torch.zeros(1, dtype=torch.long, device=ids.device)
    return int(reduce.max_per_system(top.reshape(1), batch, 1)[0]) + 1


def by_id(values: Tensor, ids: Tensor, count: int, reduce: Reducer) -> Tensor:
    """``[count, ...]``: per-atom ``values [n_owned, ...]`` of every process placed at their
    global ids (rows of ids held nowhere stay zero). Exact: every id is owned once."""
    return reduce.sum_per_system(values, ids, count)


class Hook:
    """An observer called every ``every`` steps (subclass one of the scoped classes below).

    Attributes:
        name: names the hook's CSV file (``hooks/<name>.csv``); unique within a run.
        every: the hook runs at steps that are multiples of it (> 0).
        scope: ``"owned"``, ``"global"`` or ``"rank0"``.
        columns: the header of the CSV rows (``None``: set by the first rows).
        accumulates: the rows are the whole result so far (the file is replaced at each
            write); otherwise rows are appended (a time series).
    """

    scope = "global"
    accumulates = False

    def __init__(self, every: int, name: str):
        name = check_name(name)
        if int(every) != every or every < 1:
            raise InputError(f"hook {name!r}: every must be a positive integer, got {every!r}")
        self.every, self.name = int(every), name
        self.columns: tuple[str, ...] | None = None
        self.history: list[tuple] = []  # every row so far (series hooks)
        self._rows: list[tuple] = []

    def add_row(self, row: Sequence) -> None:
        """Append one row (of :attr:`columns`) to the series."""
        row = tuple(row)
        self.history.append(row)
        self._rows.append(row)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def rows(self) -> list[tuple]:
        """The rows written since the last call (``accumulates``: every row of the result)."""
        out, self._rows = self._rows, []
        return out

    def result(self) -> dict:
        """The hook's result for Python on the main process; for a series, its columns as
        lists by column name."""
        cols = self.columns or ()
        return {c: [r[i] for r in self.history] for i, c in enumerate(cols)}

    def state_dict(self) -> dict:
        """What a checkpoint stores to resume the hook (default: nothing)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (every process; a resumed run)."""
        return None

    def prepare(self, state: MDState, reduce: Reducer) -> MDState:
        """Called once on every process before the run writes anything: raise
        :class:`~xnn.errors.InputError` if the hook cannot observe this run, and return
        ``state`` with the per-atom fields the hook keeps (declared with
        :func:`xnn.data.keys.register_field`; they move with the atoms). Collectives through
        ``reduce`` are allowed. Default: ``state`` unchanged."""
        return state

    def snapshot(self) -> tuple:
        """Everything a failed call may have changed (restored by :meth:`restore`)."""
        return (copy.deepcopy(self.state_dict()), len(self.history), list(self._rows),
                self.columns)

    def restore(self, saved: tuple) -> None:
        """Back to :meth:`snapshot` (the hooks of a failed step are undone)."""
        state, n, self._rows, self.columns = saved
        self.load_state_dict(state)
        del self.history[n:]


class GlobalHook(Hook):
    """Partial sums over each process's owned atoms, reduced over the processes."""

    scope = "global"

    def setup(self, state: MDState, reduce: Reducer) -> None:
        """Called once before the first :meth:`partial` on every process (collectives
        through ``reduce`` are allowed: every process calls it at the same step)."""
        return None

    def partial(self, state: MDState) -> dict[str, Tensor]:
        """Sums over this process's owned atoms (same keys and shapes on every process)."""
        raise NotImplementedError

    def update(self, step: int, time_fs: float, sums: dict[str, Tensor]) -> None:
        """The sums over every atom (on every process)."""
        raise NotImplementedError


class OwnedHook(Hook):
    """Per-atom values computed on each process's owned atoms, assembled by atom id."""

    scope = "owned"

    def per_atom(self, state: MDState) -> Tensor:
        """``[n_owned]`` or ``[n_owned, k]`` values of this process's atoms (no collectives)."""
        raise NotImplementedError

    def update(self, step: int, time_fs: float, atom_id: Tensor, values: Tensor) -> None:
        """Every atom's values ``[n_atoms, k]`` in id order with their ``atom_id`` (main
        process)."""
        raise NotImplementedError


class Rank0Hook(Hook):
    """Runs on the main process on the gathered state (atoms in global-id order)."""

    scope = "rank0"

    def observe(self, state: MDState, time_fs: float) -> None:
        raise NotImplementedError


class HookRunner:
    """Call hooks at their steps with the reductions and gathers of a run layer.

    Args:
        hooks: the hooks (names must be unique).
        run: the run layer: ``reduce`` (a :class:`Reducer`), ``main`` (this process holds
            the results), ``guarded(phase)`` (a block whose failure every process learns
            of), ``gather(state)`` (the state with every atom in id order on the main
            process, ``None`` elsewhere; collective) and ``gather_atoms(graph, values)``
            (per-atom values by id on the main process): a
            :class:`~xnn.dynamics.parallel.SerialRun` or the decomposed run (a subclass).
        timestep: fs per step, for the ``time_fs`` column (``None``: NaN, e.g. relaxation).

    Every process must call :meth:`prepare` once, then :meth:`__call__` at the same steps
    (the collectives inside are taken by every process together).
    """

    def __init__(self, hooks: Sequence[Hook], run, timestep: float | None = None):
        names = [check_name(h.name) for h in hooks]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise InputError(f"hook names must be unique, {dup} repeat: give each a name")
        for h in hooks:
            if h.scope not in SCOPES:
                raise InputError(f"hook {h.name!r}: scope {h.scope!r} is not one of {SCOPES}")
        self.hooks, self.run = list(hooks), run
        self.timestep = timestep
        self._ready: set[str] = set()
        self.last_step: int | None = None

    def prepare(self, state: MDState) -> MDState:
        """``state`` with every hook's per-atom fields (:meth:`Hook.prepare`), after checking
        that each hook can observe it; call once before the first :meth:`__call__` and
        continue from the returned state. Collective."""
        for h in self.hooks:
            state = h.prepare(state, self.run.reduce)
        return state

    def __call__(self, state: MDState) -> list[Hook]:
        """Run the hooks due at ``state.step`` (once per step); returns those that ran.

        All or nothing: when a hook fails (on any process), every hook due at this step is
        restored to before it, and :class:`HookError` (naming the hook and the step) is
        raised on every process; a checkpoint written then resumes the hooks at this step.
        """
        due = [h for h in self.hooks if h.due(state.step)]
        if not due or state.step == self.last_step:
            return []
        saved = [h.snapshot() for h in due]
        try:
            self._run(due, state)
        except HookError:
            for h, s in zip(due, saved):
                h.restore(s)
            raise
        self.last_step = state.step
        return due

    def _run(self, due: list[Hook], state: MDState) -> None:
        reduce, step = self.run.reduce, state.step
        t = float("nan") if self.timestep is None else step * self.timestep
        for h in due:
            if h.scope == "global":
                if h.name not in self._ready:
                    h.setup(state, reduce)
                    self._ready.add(h.name)
                part = {}
                with self._running(h, step):
                    part = h.partial(state)
                sums = {k: reduce_sum(reduce, torch.as_tensor(v, device=state.positions.device))
                        for k, v in sorted(part.items())}
                with self._running(h, step):
                    h.update(step, t, sums)
            elif h.scope == "owned":
                self._owned(h, state, step, t)
        if any(h.scope == "rank0" for h in due):
            full = self.run.gather(state)
            for h in due:
                if h.scope == "rank0":
                    with self._running(h, step):
                        if self.run.main:
                            h.observe(full, t)

    @contextlib.contextmanager
    def _running(self, hook: Hook, step: int) -> Iterator[None]:
        """A block of ``hook``'s own work (no collective inside): its failure on any
        process raises :class:`HookError` on every process."""
        try:
            with self.run.guarded("the hooks"):
                try:
                    yield
                except Exception as err:  # noqa: BLE001 - the user's code: any error
                    detail = str(err) if isinstance(err, XnnError) else \
                        f"{type(err).__name__}: {err}"
                    raise HookError(f"hook {hook.name!r} failed at step {step}: {detail}",
                                    hook.name, step) from err
        except HookError:
            raise
        except XnnError as err:  # another process's hook failed (the run layer's agreement)
            raise HookError(str(err), hook.name, step) from err

    def _owned(self, hook: OwnedHook, state: MDState, step: int, t: float) -> None:
        reduce, g = self.run.reduce, state.graph
        values = g.positions.new_zeros((g.n_atoms, 0))
        with self._running(hook, step):
            values = torch.as_tensor(hook.per_atom(state), device=g.device)
            if values.shape[:1] != (g.n_atoms,):
                raise InputError(f"it returned {tuple(values.shape)} values for "
                                 f"{g.n_atoms} owned atoms; return [n_atoms] or "
                                 "[n_atoms, k]")
        values = values.detach().to(g.positions.dtype)
        values = values[:, None] if values.ndim == 1 else values.reshape(g.n_atoms, -1)
        width = torch.tensor([float(values.shape[1])], dtype=torch.float64, device=g.device)
        zero = torch.zeros(1, dtype=torch.long, device=g.device)
        k = int(reduce.max_per_system(width, zero, 1)[0])  # processes without atoms agree
        with self._running(hook, step):
            if g.n_atoms and values.shape[1] != k:
                raise InputError(f"it returned {values.shape[1]} values per atom here and "
                                 f"{k} on another process; return the same number "
                                 "everywhere")
        if values.shape[1] != k:
            values = values.new_zeros((g.n_atoms, k))
        got = self.run.gather_atoms(g, values)  # by id on the main process
        with self._running(hook, step):
            if self.run.main:
                hook.update(step, t, *got)

    def results(self) -> dict[str, dict]:
        """Every hook's :meth:`Hook.result` by name (main process)."""
        return {h.name: h.result() for h in self.hooks}

    def state_dict(self) -> dict:
        return {h.name: h.state_dict() for h in self.hooks}

    def load_state_dict(self, saved: dict) -> None:
        for h in self.hooks:
            if h.name in (saved or {}):
                h.load_state_dict(saved[h.name])
