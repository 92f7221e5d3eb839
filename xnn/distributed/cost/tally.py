"""Count and time the collectives of real decomposed runs: what the step-cost model
(:mod:`.model`) predicts, measured (issue 47).

:class:`CollectiveTally` wraps the ``torch.distributed`` calls that :mod:`xnn.distributed`
makes (``all_reduce``, ``batch_isend_irecv``, ``all_gather``, ``reduce_scatter_tensor``,
``all_gather_object``, ``broadcast_object_list``) while it is active, and records for each
call its kind, bytes, messages and wall time (the point-to-point requests it returns count
their ``wait`` as point-to-point time, so that time includes the wait for the peers). It
changes no result: every call goes to the original function with the same arguments. Sections
(:meth:`CollectiveTally.section`) time phases of a step exclusively: time spent in a nested
section or in a collective is not counted in the enclosing section, so the phases of one
step add up to its wall time::

    tally = CollectiveTally()
    with tally:
        with tally.section("step"):
            state = nve.step(state, pot, dt, reduce=pot.reducer)
    tally.calls("all_reduce"), tally.seconds["step"], tally.seconds["all_reduce"]
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch.distributed as dist

#: the kinds of collective that are counted, and the ``torch.distributed`` names of each
KINDS = {"all_reduce": ("all_reduce",), "p2p": ("batch_isend_irecv",),
         "all_gather": ("all_gather", "reduce_scatter_tensor"),
         "object": ("all_gather_object", "broadcast_object_list")}


@dataclass(frozen=True)
class Call:
    """One collective call on this rank.

    Attributes:
        kind: a key of :data:`KINDS`.
        name: the ``torch.distributed`` function.
        bytes_sent: bytes this rank contributes (all-reduce: the buffer; all-gather: its
            part; point-to-point: the sum of its sends).
        bytes_recv: bytes it receives (point-to-point: the sum of its receives; all-gather:
            the other ranks' parts; all-reduce: the buffer).
        messages: point-to-point sends (peers written to); 1 for a collective.
        seconds: wall time of the call (point-to-point: the posting only; the waits count
            in the tally's ``seconds["p2p"]``).
        section: the innermost open section when it was made (``""`` outside any).
    """

    kind: str
    name: str
    bytes_sent: int
    bytes_recv: int
    messages: int
    seconds: float
    section: str


def _nbytes(t) -> int:
    return int(t.numel()) * int(t.element_size())


def _sizes(name: str, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """(bytes sent, bytes received, messages) of one call."""
    if name == "all_reduce":
        n = _nbytes(args[0] if args else kwargs["tensor"])
        return n, n, 1
    if name == "batch_isend_irecv":
        ops = args[0] if args else kwargs["p2p_op_list"]
        sends = [op for op in ops if getattr(op.op, "__name__", "") == "isend"]
        recvs = [op for op in ops if getattr(op.op, "__name__", "") == "irecv"]
        return (sum(_nbytes(op.tensor) for op in sends),
                sum(_nbytes(op.tensor) for op in recvs), len(sends))
    if name == "all_gather":
        parts, mine = (args + (None, None))[:2]
        parts = parts if parts is not None else kwargs["tensor_list"]
        mine = mine if mine is not None else kwargs["tensor"]
        return _nbytes(mine), sum(_nbytes(p) for p in parts) - _nbytes(mine), 1
    if name == "reduce_scatter_tensor":
        out, inp = (args + (None, None))[:2]
        out = out if out is not None else kwargs["output"]
        inp = inp if inp is not None else kwargs["input"]
        return _nbytes(inp), _nbytes(out), 1
    return 0, 0, 1  # pickled objects: sizes unknown before pickling


class _TimedRequest:
    """A point-to-point request whose ``wait`` counts as the tally's ``kind`` time (a
    request is waited for once, by its caller)."""

    def __init__(self, req, tally: CollectiveTally, kind: str):
        self.req, self.tally, self.kind = req, tally, kind

    def wait(self, *args):
        self.tally._pause()
        t0 = time.perf_counter()
        try:
            return self.req.wait(*args)
        finally:
            self.tally.seconds[self.kind] += time.perf_counter() - t0
            self.tally._resume()


class CollectiveTally:
    """Counts, bytes and times of this rank's collectives and sections while active.

    Attributes:
        log: every :class:`Call`, in order.
        seconds: exclusive wall time per section name and per collective kind (s).
    """

    def __init__(self):
        self.log: list[Call] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved: dict[str, object] = {}
        self._stack: list[list] = []  # [name, start of its current exclusive interval]

    # ------------------------------------------------------------------ patching
    def __enter__(self) -> CollectiveTally:
        for names in KINDS.values():
            for name in names:
                if hasattr(dist, name):
                    self._saved[name] = getattr(dist, name)
                    setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _kind(self, name: str) -> str:
        return next(k for k, names in KINDS.items() if name in names)

    def _wrap(self, name: str, fn):
        kind = self._kind(name)

        def wrapped(*args, **kwargs):
            sent, recv, messages = _sizes(name, args, kwargs)
            self._pause()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if name == "batch_isend_irecv":
                out = [_TimedRequest(req, self, kind) for req in out]
            dt = time.perf_counter() - t0
            self._resume()
            self.seconds[kind] += dt
            section = self._stack[-1][0] if self._stack else ""
            self.log.append(Call(kind, name, sent, recv, messages, dt, section))
            return out

        return wrapped

    # ------------------------------------------------------------------ sections
    def _pause(self) -> None:
        if self._stack:
            name, start = self._stack[-1]
            self.seconds[name] += time.perf_counter() - start

    def _resume(self) -> None:
        if self._stack:
            self._stack[-1][1] = time.perf_counter()

    @contextmanager
    def section(self, name: str):
        """Time the block as ``name``, exclusive of nested sections and collectives."""
        self._pause()
        self._stack.append([name, time.perf_counter()])
        try:
            yield
        finally:
            self._pause()
            self._stack.pop()
            self._resume()

    # ------------------------------------------------------------------ summaries
    def mark(self) -> int:
        """A position in :attr:`log` (for :meth:`calls` of what came after)."""
        return len(self.log)

    def calls(self, kind: str | None = None, since: int = 0,
              section: str | None = None) -> list[Call]:
        """Calls of ``kind`` (all kinds: ``None``) after :meth:`mark` ``since``, in
        ``section`` (any: ``None``)."""
        return [c for c in self.log[since:] if (kind is None or c.kind == kind)
                and (section is None or c.section == section)]
