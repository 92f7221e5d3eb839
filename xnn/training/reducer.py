"""The collective operations the training loop needs, for a single process.

The loop is written for one process and calls a *reducer* for every cross-rank operation:
summing counts/metrics, summing gradients after the (double) backward, broadcasting the
initial weights and gathering parity data. :class:`LocalReducer` is the single-process
version (every operation is the identity); :class:`xnn.distributed.ddp.DataParallelReducer`
implements the same interface with ``torch.distributed`` over the data-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn


class LocalReducer:
    """Single-process reducer: rank 0 of 1, all operations are identities."""

    rank = 0
    world_size = 1
    is_main = True

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        """Sum of ``tensor`` over the data-parallel ranks (a new tensor)."""
        return tensor.clone()

    def all_reduce_sum_async(self, tensor: Tensor) -> Pending:
        """Start :meth:`all_reduce_sum`; ``.wait()`` on the result gives the sum. On a GPU the
        host does not block: later work on the current stream is ordered after the sum."""
        return Pending(tensor.clone())

    def all_reduce_grads(self, params: Iterable[nn.Parameter],
                         extra: Tensor | None = None) -> Tensor | None:
        """Sum the ``.grad`` of ``params`` over ranks in place (grads must not be ``None``)
        and return the sum of ``extra`` (a small tensor, e.g. the loss), summed in the same
        collective in the widest gradient dtype (``None`` without ``extra``)."""
        return None if extra is None else extra.clone()

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers to every rank."""

    def gather_objects(self, obj) -> list:
        """``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
        return [obj]

    def barrier(self) -> None:
        """Wait for every rank."""


class Pending:
    """A started all-reduce: :meth:`wait` returns its result (once complete)."""

    def __init__(self, tensor: Tensor, work=None):
        self._tensor = tensor
        self._work = work

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor


def ensure_grads(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Give every parameter a (zero) ``.grad`` so that flat all-reduces line up across ranks."""
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p)
    return out
