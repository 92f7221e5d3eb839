"""Small collectives used by domain decomposition: agreement on errors, broadcast, gather,
neighbour-only point-to-point exchange, and an autograd-aware all-reduce; and
:func:`explain_collective_error`, which turns a collective's timeout into a message naming
the collective and the ranks that did not arrive.

Every ``torch.distributed`` call of the decomposed paths goes through these wrappers, so
:func:`count_collectives` sees each one (kind, calls, bytes) for tests and benchmarks; the
reductions traced into compiled regions (:func:`traced_collectives`) are counted at every
call of the compiled function (:func:`count_traced`).

Every helper accepts ``group=None`` in a single process (no ``torch.distributed``) and then
does no communication.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from xnn.errors import XnnError


class RemoteRankError(XnnError):
    """Another rank failed; this rank stops instead of waiting for a collective timeout."""


class CollectiveTimeout(XnnError):
    """A collective timed out: the message names it and the ranks that did not arrive."""


# --------------------------------------------------------------------------- counting
#: kinds whose every call blocks the calling rank until its peers arrive (an exchange is
#: one blocking round of point-to-point messages)
BLOCKING = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "reduce_scatter",
            "all_to_all", "exchange", "barrier")


@dataclass
class CollectiveCount:
    """Collectives made through this module's wrappers while a :func:`count_collectives`
    block ran (this rank's view; only calls that communicate, i.e. in an initialised
    process group, are counted).

    Attributes:
        calls: calls per kind (``"all_reduce"``, ``"all_gather"``, ``"all_gather_object"``,
            ``"broadcast"``, ``"reduce_scatter"``, ``"all_to_all"``, ``"exchange"``,
            ``"barrier"``).
        nbytes: bytes per kind: this rank's input of a reduction or gather, the payload of a
            broadcast, the bytes sent plus received in exchanges (pickled objects: 0).
        messages: point-to-point messages of the exchanges (sent plus received, empty ones
            skipped).
        seconds: wall time per kind spent inside the calls (s): transfer plus waiting for
            the slowest rank to arrive.
    """

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    messages: int = 0
    seconds: Counter = field(default_factory=Counter)

    @property
    def blocking(self) -> int:
        """Calls that block until the peers arrive (every kind of :data:`BLOCKING`)."""
        return sum(self.calls[k] for k in BLOCKING)

    def add(self, kind: str, nbytes: int = 0, messages: int = 0, seconds: float = 0.0
            ) -> None:
        self.calls[kind] += 1
        self.nbytes[kind] += int(nbytes)
        self.messages += int(messages)
        self.seconds[kind] += float(seconds)


_COUNTS: list[CollectiveCount] = []


@contextmanager
def count_collectives() -> Iterator[CollectiveCount]:
    """Count the collectives this rank makes through this module inside the block.

    Blocks nest (each counts every call made while it is open)::

        with count_collectives() as n:
            state = nve.step(state, pot, dt, reduce=pot.reducer)
        print(n.calls["all_reduce"], n.blocking, n.nbytes)
    """
    c = CollectiveCount()
    _COUNTS.append(c)
    try:
        yield c
    finally:
        _COUNTS.remove(c)


@contextmanager
def _counted(kind: str, nbytes: int = 0, messages: int = 0) -> Iterator[None]:
    """Around one communicating call: adds it to every open :func:`count_collectives`."""
    if not _COUNTS:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        for c in _COUNTS:
            c.add(kind, nbytes, messages, dt)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# --------------------------------------------------------------------------- in a trace
#: open :func:`traced_collectives` blocks (innermost last)
_TRACED: list[list[tuple[str, int]]] = []


@contextmanager
def traced_collectives() -> Iterator[list[tuple[str, int]]]:
    """Inside the block (the trace of a compiled region), :func:`all_reduce_sum` (and so
    :func:`all_reduce_sum_many`), :func:`all_reduce_max` and :func:`all_gather_tensor` emit
    *functional* collectives (:mod:`torch.distributed._functional_collectives`, traced as
    ``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` and ``wait_tensor``: part of
    the graph, run at every call of the compiled function) and list each as ``(kind,
    nbytes)`` in the yielded list instead of counting it; the caller counts them per call
    of the compiled function with :func:`count_traced`. The same wrappers, the same fusion
    (one all-reduce per dtype of :func:`all_reduce_sum_many`), in both paths.

    Host decisions (a reduced flag read with ``.item()``) cannot be traced;
    :func:`tracing` tells a caller to refuse them."""
    calls: list[tuple[str, int]] = []
    _TRACED.append(calls)
    try:
        yield calls
    finally:
        _TRACED.remove(calls)


def tracing() -> bool:
    """True inside a :func:`traced_collectives` block."""
    return bool(_TRACED)


def count_traced(calls: Sequence[tuple[str, int]]) -> None:
    """Count one call of a compiled function whose trace listed ``calls`` (from
    :func:`traced_collectives`) in every open :func:`count_collectives` block (no wall
    time: the collectives run inside the compiled code)."""
    for c in _COUNTS:
        for kind, nbytes in calls:
            c.add(kind, nbytes)


def _functional(kind: str, t: Tensor, group, op: str = "sum") -> Tensor:
    """The functional collective ``kind`` of ``t`` in a trace, listed in the open
    :func:`traced_collectives` block."""
    import torch.distributed._functional_collectives as fc

    _TRACED[-1].append((kind, _nbytes(t)))
    group = group or dist.group.WORLD
    if kind == "all_reduce":
        return fc.wait_tensor(fc.all_reduce(t, op, group))
    return fc.wait_tensor(fc.all_gather_tensor(t.contiguous(), 0, group))


def is_active(group=None) -> bool:
    """True when ``torch.distributed`` is initialised (``group`` then names a group or WORLD)."""
    return dist.is_available() and dist.is_initialized()


def group_size(group=None) -> int:
    return dist.get_world_size(group) if is_active(group) else 1


def group_rank(group=None) -> int:
    return dist.get_rank(group) if is_active(group) else 0


def global_rank(group, rank: int) -> int:
    """Global rank of ``rank`` of ``group`` (for point-to-point calls)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def _flag_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, phase: str, error: BaseException | None) -> None:
    """All ranks learn whether any rank failed in ``phase``; raise on every rank if so.

    The failing rank re-raises its own error; the others raise :class:`RemoteRankError`
    carrying the first failing rank's message. One all-reduce when nobody failed.
    """
    if not is_active(group):
        if error is not None:
            raise error
        return
    flag = torch.tensor([0.0 if error is None else 1.0], device=_flag_device(group))
    all_reduce_(flag, group)
    if flag.item() == 0:
        return
    _raise_agreed(group, phase, error)


def agree_sum(group, phase: str, error: BaseException | None, values: Tensor | None,
              like: Tensor) -> Tensor | None:
    """:func:`agree` fused with a sum of ``values`` over the ranks: one all-reduce, not two.

    Every rank calls it after rank-local work that may have failed. A rank without error
    passes ``values [n]`` (differentiable, as :func:`all_reduce_sum`); a failing rank passes
    ``values=None`` and contributes zeros. If any rank failed, every rank raises as in
    :func:`agree`; else every rank gets the summed ``values`` (in their dtype).

    Args:
        like: ``[n]``, the same dtype, device and length on every rank (e.g. zeros of the
            owned positions' dtype): the buffer's dtype and the number of values.
    """
    if not is_active(group):
        if error is not None:
            raise error
        return values
    if error is None:
        packed = torch.cat([like.new_zeros(1), values.reshape(-1).to(like.dtype)])
    else:
        packed = torch.cat([like.new_ones(1), torch.zeros_like(like)])
    out = all_reduce_sum(packed, group)
    if float(out[0].detach()) != 0.0:
        _raise_agreed(group, phase, error)
    return out[1:].to(values.dtype).reshape(values.shape)


def _raise_agreed(group, phase: str, error: BaseException | None) -> None:
    """Some rank failed in ``phase``: raise ``error`` here, or the first failing rank's
    message as :class:`RemoteRankError` (one all-gather of the messages)."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    messages = all_gather_object(text, group)
    if error is not None:
        raise error
    rank, msg = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise RemoteRankError(f"rank {global_rank(group, rank)} failed during {phase}: {msg}")


@contextmanager
def guarded(group, phase: str) -> Iterator[None]:
    """Run a block of rank-local work; afterwards every rank agrees on whether it failed.

    Put no collective inside the block (a rank that raised would not reach it).
    """
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised below on every rank
        error = e
    agree(group, phase, error)


def broadcast_object(obj, group=None, src: int = 0):
    """``obj`` from group rank ``src`` on every rank (pickled)."""
    if not is_active(group):
        return obj
    box = [obj]
    with _counted("broadcast"):
        dist.broadcast_object_list(box, src=global_rank(group, src), group=group)
    return box[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` in rank order (``[obj]`` in a single process)."""
    if not is_active(group):
        return [obj]
    out: list = [None] * group_size(group)
    with _counted("all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_(t: Tensor, group=None, src: int = 0) -> Tensor:
    """In-place broadcast of ``t`` from group rank ``src`` (a no-op in a single process)."""
    if is_active(group):
        with _counted("broadcast", _nbytes(t)):
            dist.broadcast(t, src=global_rank(group, src), group=group)
    return t


def barrier(group=None, device_ids: list[int] | None = None) -> None:
    """Wait for every rank of ``group`` (a no-op in a single process)."""
    if is_active(group):
        with _counted("barrier"):
            if device_ids is None:
                dist.barrier(group=group)
            else:
                dist.barrier(group=group, device_ids=device_ids)


def all_reduce_(t: Tensor, group=None, op=None) -> Tensor:
    """In-place all-reduce (sum by default); a no-op in a single process."""
    if is_active(group):
        with _counted("all_reduce", _nbytes(t)):
            dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


def gather_rows(rows: Tensor, group=None) -> Tensor:
    """Concatenate every rank's ``rows [n_r, ...]`` in rank order, on every rank."""
    if not is_active(group):
        return rows
    n = group_size(group)
    count = torch.tensor([rows.shape[0]], device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(n)]
    all_gather_into(counts, count, group)
    counts = [int(c.item()) for c in counts]
    m = max(counts)
    pad = rows.new_zeros((m, *rows.shape[1:]))
    pad[: rows.shape[0]] = rows
    parts = [torch.empty_like(pad) for _ in range(n)]
    all_gather_into(parts, pad.contiguous(), group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def all_gather_into(parts: list[Tensor], t: Tensor, group=None) -> list[Tensor]:
    """``dist.all_gather``: ``parts[r]`` receives rank ``r``'s ``t`` (``parts`` holds one
    tensor of ``t``'s shape per rank); in a single process ``parts[0]`` is filled."""
    if not is_active(group):
        parts[0].copy_(t)
        return parts
    with _counted("all_gather", _nbytes(t)):
        dist.all_gather(parts, t, group=group)
    return parts


def reduce_scatter_(out: Tensor, t: Tensor, group=None) -> Tensor:
    """``dist.reduce_scatter_tensor`` (sum): ``out`` receives this rank's block of the sum of
    every rank's ``t`` (``[n_ranks * len(out), ...]``)."""
    if not is_active(group):
        out.copy_(t)
        return out
    with _counted("reduce_scatter", _nbytes(t)):
        dist.reduce_scatter_tensor(out, t, group=group)
    return out


def all_to_all_single_(out: Tensor, t: Tensor, group=None) -> Tensor:
    """``dist.all_to_all_single`` with even splits (``out`` and ``t`` of one length)."""
    if not is_active(group):
        out.copy_(t)
        return out
    with _counted("all_to_all", _nbytes(t)):
        dist.all_to_all_single(out, t, group=group)
    return out


def all_gather_tensor(t: Tensor, group=None) -> Tensor:
    """``[n_ranks, *t.shape]``: every rank's ``t`` (same shape on every rank), in rank order
    (in a :func:`traced_collectives` block: a functional all-gather)."""
    if not is_active(group):
        return t.unsqueeze(0)
    if _TRACED:
        return _functional("all_gather", t.reshape(1, -1), group).reshape(-1, *t.shape)
    parts = [torch.empty_like(t) for _ in range(group_size(group))]
    all_gather_into(parts, t.contiguous(), group)
    return torch.stack(parts)


def all_reduce_max(t: Tensor, group=None) -> Tensor:
    """In-place maximum over the ranks (a no-op in a single process; in a
    :func:`traced_collectives` block: a functional all-reduce copied into ``t``)."""
    if is_active(group) and _TRACED:
        return t.copy_(_functional("all_reduce", t, group, "max"))
    if is_active(group):
        with _counted("all_reduce", _nbytes(t)):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def exchange(sends: Sequence[tuple[int, Tensor]], recvs: Sequence[tuple[int, Tensor]],
             group=None) -> None:
    """Post all sends and receives with group peers at once and wait (``batch_isend_irecv``).

    Both sides must agree on which messages exist: empty tensors are skipped on both sides.
    """
    ops = []
    for peer, t in recvs:
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, global_rank(group, peer), group))
    for peer, t in sends:
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t.contiguous(), global_rank(group, peer), group))
    if ops:
        nbytes = sum(_nbytes(t) for _, t in recvs) + sum(_nbytes(t) for _, t in sends)
        with _counted("exchange", nbytes, len(ops)):
            for req in dist.batch_isend_irecv(ops):
                req.wait()


class _AllReduceSum(torch.autograd.Function):
    """``y = sum_r x_r`` on every rank; the adjoint is again a sum over ranks."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        y = x.clone()
        all_reduce_(y, group)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _AllReduceSum.apply(grad.contiguous(), ctx.group), None


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Differentiable all-reduce (sum); twice differentiable (in a
    :func:`traced_collectives` block: a functional all-reduce, not differentiated).

    The adjoint treats each rank's output as a separate value, so backpropagating a loss
    ``L = sum_r L_r(y_r)`` gives every rank the true gradient of ``L``. A value replicated on
    every rank (e.g. the total energy) is thus counted once per rank: divide by the group
    size when each rank backpropagates it.
    """
    if not is_active(group):
        return x
    if _TRACED:  # not differentiable there (the compiled regions reduce no leaf)
        return _functional("all_reduce", x, group)
    return _AllReduceSum.apply(x, group)


def all_reduce_sum_many(tensors: Sequence[Tensor], group=None) -> list[Tensor]:
    """:func:`all_reduce_sum` of each tensor, in one all-reduce per (dtype, device): the
    tensors are flattened into one buffer, reduced and split again (differentiable). Each
    element is summed over the ranks as on its own (on 2 ranks bitwise; the ring order of
    more ranks may differ in the last bit)."""
    if not is_active(group):
        return list(tensors)
    out: list = [None] * len(tensors)
    kinds: dict = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    for idx in kinds.values():
        flat = all_reduce_sum(torch.cat([tensors[i].reshape(-1) for i in idx]), group)
        parts = torch.split(flat, [tensors[i].numel() for i in idx])
        for i, part in zip(idx, parts):
            out[i] = part.reshape(tensors[i].shape)
    return out


# --------------------------------------------------------------------------- failures
#: store keys of the ranks' positions after a failed collective; one failure per process
#: group (a group whose collective timed out cannot be used again)
_FAILURE_KEY = "xnn/collective_failure/"


def _collective_site(tb) -> tuple[str, object] | None:
    """``("all_reduce in all_reduce_grads (xnn/distributed/ddp.py:62)", group)`` for the
    outermost ``torch.distributed`` call of a traceback, ``None`` if it holds none."""
    caller, frames = None, []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for t in frames:
        code = t.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        if path.endswith("distributed_c10d.py") and code.co_name != "wrapper":
            where = ""
            if caller is not None:
                rel = os.path.relpath(caller.tb_frame.f_code.co_filename, os.path.dirname(root))
                where = f" in {caller.tb_frame.f_code.co_name} ({rel}:{caller.tb_lineno})"
            return f"{code.co_name}{where}", t.tb_frame.f_locals.get("group")
        if path.startswith(root + os.sep):
            caller = t
    return None


def _where_others_are(name: str, ranks: list[int], wait_s: float) -> dict[int, str]:
    """Publish this rank's collective in the job's store and collect the other ranks'
    (those that time out, or fail, within ``wait_s``): ``{rank: collective}``."""
    prefix = _FAILURE_KEY
    me = dist.get_rank()
    seen = {me: name}
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(prefix + str(me), name)
        deadline = time.monotonic() + wait_s
        while len(seen) < len(ranks) and time.monotonic() < deadline:
            for r in ranks:
                if r not in seen and store.check([prefix + str(r)]):
                    seen[r] = store.get(prefix + str(r)).decode()
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone: report less
        pass
    return seen


def explain_collective_error(error: BaseException, timeout_s: float,
                             timeout_key: str | None = None) -> XnnError | None:
    """A one-line error for a ``torch.distributed`` collective that failed (``None`` when
    ``error`` is something else); a timeout's names ``timeout_key``, the option of the
    running command that raises the timeout (e.g. ``"parallel.timeout_s"``).

    On a timeout this rank publishes which collective it waited in and waits up to
    ``min(timeout_s, 60)`` s for the other ranks of the group to do the same (they time out
    too if they wait in a collective): ranks that never answer did not arrive (busy in
    rank-local work, hung or dead); ranks that answer with another collective took another
    path. A lost connection means another rank stopped: its own message says why.
    """
    if not isinstance(error, RuntimeError) or not is_active():
        return None
    site = _collective_site(error.__traceback__)
    if site is None:
        return None
    name, group = site
    text = str(error)
    if "timed out" in text.lower() or "timeout" in text.lower():
        ranks = (dist.get_process_group_ranks(group) if group is not None
                 and group is not dist.GroupMember.WORLD else list(range(dist.get_world_size())))
        seen = _where_others_are(name, ranks, min(float(timeout_s), 60.0))
        missing = [r for r in ranks if r not in seen]
        elsewhere = [f"rank {r} waits in {w}" for r, w in sorted(seen.items()) if w != name]
        parts = []
        if missing:
            parts.append(f"rank(s) {missing} did not arrive (busy in rank-local work, hung "
                         "or dead)")
        parts += elsewhere
        detail = "; ".join(parts) or "every rank arrived (a slow network?)"
        raise_it = (f"raise {timeout_key} (e.g. {timeout_key}={2 * float(timeout_s):g})"
                    if timeout_key else "raise the collective timeout")
        return CollectiveTimeout(
            f"collective {name} timed out after {timeout_s:g} s on rank {dist.get_rank()}: "
            f"{detail}; the ranks took different paths or one is far slower (if it is only "
            f"slow, {raise_it})")
    if any(s in text for s in ("Connection closed", "Connection reset", "Broken pipe")):
        return RemoteRankError(f"lost the connection to another rank during collective {name}: "
                               "that rank stopped (its own message says why)")
    return None
