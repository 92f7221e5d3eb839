"""The feature exchange of graph parallelism: an all-gather whose adjoint is a reduce-scatter.

Every rank owns a contiguous block of rows of the global order (rank 0's atoms, then rank
1's, ...). :func:`all_gather_rows` returns every rank's block on every rank; its backward
sums each rank's gradient of the gathered rows and hands every owner the sum of its own rows
(a reduce-scatter), and the reduce-scatter's backward is the all-gather again, so gradients
of any order (forces inside a training loss) flow through it.

The blocks may differ in size: they are padded to the largest. Gloo has no reduce-scatter,
so it is an all-reduce of the padded blocks of which each rank keeps its own (twice the
traffic of a true reduce-scatter; NCCL runs the true one).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from xnn.distributed import collectives as C


def _padded(x: Tensor, m: int) -> Tensor:
    if x.shape[0] == m:
        return x.contiguous()
    pad = x.new_zeros((m, *x.shape[1:]))
    pad[: x.shape[0]] = x
    return pad


def _gather(x: Tensor, counts: Sequence[int], group) -> Tensor:
    m = max(counts)
    parts = [x.new_empty((m, *x.shape[1:])) for _ in counts]
    C.all_gather_into(parts, _padded(x, m), group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)])


def _reduce_scatter(g: Tensor, counts: Sequence[int], rank: int, group) -> Tensor:
    m = max(counts)
    blocks = torch.stack([_padded(b, m) for b in torch.split(g, list(counts))])
    if dist.get_backend(group) == "nccl":
        out = g.new_empty((m, *g.shape[1:]))
        C.reduce_scatter_(out, blocks.reshape(-1, *g.shape[1:]), group)
    else:
        C.all_reduce_(blocks, group)
        out = blocks[rank]
    return out[: counts[rank]].contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, counts: tuple, rank: int, group, reverse: bool) -> Tensor:
        ctx.counts, ctx.rank, ctx.group, ctx.reverse = counts, rank, group, reverse
        x = x.contiguous()
        return _reduce_scatter(x, counts, rank, group) if reverse else _gather(x, counts, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = _AllGather.apply(grad.contiguous(), ctx.counts, ctx.rank, ctx.group,
                             not ctx.reverse)
        return g, None, None, None, None


def all_gather_rows(x: Tensor, counts: Sequence[int], group=None) -> Tensor:
    """Differentiable all-gather: ``[counts[rank], ...] -> [sum(counts), ...]`` in rank order.

    Args:
        x: this rank's rows (``counts[rank]`` of them).
        counts: every rank's row count (the same list on every rank).
        group: process group (``None``: all ranks, or one process without communication).

    Every rank of the group must call it (the same number of times, in the same order); its
    backward (a reduce-scatter) is collective too.
    """
    if not C.is_active(group) or len(counts) == 1:
        return x
    return _AllGather.apply(x, tuple(int(c) for c in counts), C.group_rank(group), group, False)
