"""User functions as hooks, one class per scope (:mod:`xnn.dynamics.hooks`): a function of
the gathered frame (``rank0``), of each process's owned atoms returning per-atom values
(``owned``), or returning partial sums (``global``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.dynamics.hooks import GlobalHook, OwnedHook, Rank0Hook
from xnn.dynamics.state import MDState
from xnn.errors import InputError


def _with_results(state: MDState):
    """The state's graph with its energy, forces and stress attached."""
    return state.graph.replace({K.ENERGY: state.energy, K.FORCES: state.forces,
                                K.STRESS: state.stress})


def load_target(target: str) -> Callable:
    """The function named by ``"package.module:function"``, imported (its module's code runs)
    from the installed packages and ``PYTHONPATH``; the ``xnn`` command, ``python -m xnn``
    and ``torchrun -m xnn`` do not look in the working directory (:mod:`xnn.cli.main`)."""
    mod, sep, attr = str(target).partition(":")
    if not sep or not mod or not attr:
        raise InputError(f"callable target {target!r} must read 'package.module:function'")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        top = mod.split(".")[0]
        raise InputError(f"callable target {target!r}: cannot import {mod!r} ({e}); xnn "
                         "imports from installed packages and PYTHONPATH, not the working "
                         "directory: install it or put its folder on PYTHONPATH (e.g. "
                         f"PYTHONPATH=. for ./{top}.py)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InputError(f"callable target {target!r}: {mod!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise InputError(f"callable target {target!r} is not callable")
    return obj


def _values(out, n_systems: int, name: str) -> dict[str, list[float]]:
    if not isinstance(out, Mapping):
        raise InputError(f"hook {name!r}: the callable must return a mapping of names to "
                         f"numbers (or None), got {type(out).__name__}")
    res = {}
    for key, v in out.items():
        t = torch.as_tensor(v, dtype=torch.float64).reshape(-1)
        if t.numel() not in (1, n_systems):
            raise InputError(f"hook {name!r}: value {key!r} has {t.numel()} entries; give "
                             f"one number (or one per system, {n_systems})")
        res[str(key)] = t.expand(n_systems).tolist()
    return res


class FrameCallable(Rank0Hook):
    """A user function of the gathered frame on the main process, in global-id order.

    ``fn(frame, step)`` gets an ``ase.Atoms`` per system (``frame_format="ase"``; energy,
    forces, stress in its calculator, ``arrays["atom_id"]``) or the whole
    :class:`~xnn.data.graph.AtomicGraph` with ``energy``, ``forces``, ``stress``
    (``"graph"``). It returns ``None`` or a mapping of names to numbers (``"graph"``: a
    number or one per system); rows ``step, time_fs, system, *names``.
    """

    def __init__(self, fn: Callable, every: int = 100, name: str = "callable",
                 frame_format: str = "ase"):
        super().__init__(every, name)
        if frame_format not in ("ase", "graph"):
            raise InputError(f"hook {name!r}: format must be 'ase' or 'graph', got "
                             f"{frame_format!r}")
        self.fn, self.frame_format = fn, frame_format

    def observe(self, state: MDState, time_fs: float) -> None:
        graph, step = _with_results(state), state.step
        if self.frame_format == "ase":
            from xnn.data.ase_io import to_ase

            outs = [self.fn(atoms, step) for atoms in to_ase(graph)]
            outs = [None if o is None else _values(o, 1, self.name) for o in outs]
        else:
            out = self.fn(graph, step)
            if out is None:
                return
            vals = _values(out, graph.n_systems, self.name)
            outs = [{k: [v[s]] for k, v in vals.items()} for s in range(graph.n_systems)]
        for s, vals in enumerate(outs):
            if vals is not None:
                _check_columns(self, ("step", "time_fs", "system", *vals))
                self.add_row((step, time_fs, s, *(v[0] for v in vals.values())))


def _check_columns(hook, cols: tuple) -> None:
    if hook.columns is None:
        hook.columns = cols
    elif tuple(hook.columns) != tuple(cols):
        raise InputError(f"hook {hook.name!r}: the callable returned {list(cols[3:])} "
                         f"after {list(hook.columns[3:])}; return the same names every call")


class OwnedCallable(OwnedHook):
    """``fn(graph, step) -> [n_owned]`` or ``[n_owned, k]`` per-atom values of the atoms a
    process owns (its graph, with ``forces``); assembled by id. Rows ``step, time_fs,
    atom_id, value`` (``value_0..`` for ``k > 1``)."""

    def __init__(self, fn: Callable, every: int = 100, name: str = "callable"):
        super().__init__(every, name)
        self.fn = fn

    def per_atom(self, state: MDState) -> Tensor:
        return torch.as_tensor(self.fn(state.graph.replace({K.FORCES: state.forces}),
                                       state.step))

    def update(self, step: int, time_fs: float, atom_id: Tensor, values: Tensor) -> None:
        k = values.shape[1]
        cols = ("value",) if k == 1 else tuple(f"value_{c}" for c in range(k))
        if self.columns is None:
            self.columns = ("step", "time_fs", "atom_id", *cols)
        for a, row in zip(atom_id.tolist(), values.cpu().double().tolist()):
            self.add_row((step, time_fs, a, *row))


class GlobalCallable(GlobalHook):
    """``fn(graph, step) -> {name: tensor}`` partial sums over the atoms a process owns
    (its graph, with ``forces``), summed over the processes: the same names and shapes on
    every process, also one that owns no atom. Rows ``step, time_fs, *names`` (a tensor of
    ``m`` entries gives ``name_0..name_{m-1}``)."""

    def __init__(self, fn: Callable, every: int = 100, name: str = "callable"):
        super().__init__(every, name)
        self.fn = fn

    def partial(self, state: MDState) -> dict[str, Tensor]:
        out = self.fn(state.graph.replace({K.FORCES: state.forces}), state.step)
        if not isinstance(out, Mapping):
            raise InputError(f"hook {self.name!r}: the callable must return a mapping of "
                             f"names to tensors, got {type(out).__name__}")
        return {str(k): torch.as_tensor(v).to(state.positions.dtype) for k, v in out.items()}

    def update(self, step: int, time_fs: float, sums: dict[str, Tensor]) -> None:
        cols, vals = [], []
        for key, v in sums.items():
            flat = v.reshape(-1).cpu().double().tolist()
            cols += [key] if v.ndim == 0 else [f"{key}_{c}" for c in range(len(flat))]
            vals += flat
        if self.columns is None:
            self.columns = ("step", "time_fs", *cols)
        self.add_row((step, time_fs, *vals))


