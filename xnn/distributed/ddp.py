"""Data-parallel training: the reducer of :mod:`xnn.training.reducer` over ``torch.distributed``.

Gradients are summed with ONE explicit flat all-reduce after the backward pass. Force
training differentiates through the forces of :func:`~xnn.models.derivatives.derive` (made
with ``create_graph=True``: a double backward), which DDP's gradient hooks do not see
reliably; a flat all-reduce after ``backward()`` is simple and exactly right. The loss on
each rank is already normalised by the global counts (:mod:`xnn.training.losses`), so the
SUM of the ranks' gradients is the gradient of the global batch's loss; no division by the
world size.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from xnn.training.reducer import LocalReducer, Pending  # noqa: F401 - re-exported


class DataParallelReducer:
    """Collectives over a data-parallel process group.

    Args:
        group: the ``dp`` process group (``None``: the default group).
    """

    is_main: bool

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_main = dist.get_rank() == 0
        self._src = dist.get_global_rank(group, 0) if group is not None else 0
        self._bucket_key = None
        self._bucket_list: list[_Bucket] = []

    def all_reduce_sum(self, tensor: Tensor) -> Tensor:
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_reduce_sum_async(self, tensor: Tensor) -> Pending:
        out = tensor.detach().clone()
        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return Pending(out, work)

    def all_reduce_grads(self, params: Iterable[nn.Parameter],
                         extra: Tensor | None = None) -> Tensor | None:
        params = [p for p in params if p.grad is not None]
        if not params:
            return None if extra is None else self.all_reduce_sum(extra)
        summed = None
        for bucket in self._buckets(params, extra):
            grads = [p.grad for p in bucket.params]
            torch._foreach_copy_(bucket.views, grads)
            if bucket.extra is not None:
                bucket.extra.copy_(extra.detach().reshape(-1))
            dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group)
            torch._foreach_copy_(grads, bucket.views)
            if bucket.extra is not None:
                summed = bucket.extra.to(extra.dtype).view_as(extra)
        return summed

    def _buckets(self, params: list[nn.Parameter], extra: Tensor | None) -> list[_Bucket]:
        """The flat buffers for these parameters' gradients (one per dtype; ``extra`` rides
        in the widest: one collective fewer per step), made once and reused while the
        parameters, their gradients' dtypes and the size of ``extra`` stay the same (no
        per-step allocation, concatenation or splitting on the host)."""
        key = (tuple(id(p) for p in params), tuple(p.grad.dtype for p in params),
               None if extra is None else extra.numel())
        if self._bucket_key != key:
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in params:
                by_dtype.setdefault(p.grad.dtype, []).append(p)
            host = max(by_dtype, key=lambda d: torch.finfo(d).bits)
            n_extra = 0 if extra is None else extra.numel()
            self._bucket_list = [_Bucket(group, n_extra if dtype == host else 0)
                                 for dtype, group in by_dtype.items()]
            self._bucket_key = key
        return self._bucket_list

    def broadcast_module(self, module: nn.Module) -> None:
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=self._src, group=self.group)

    def gather_objects(self, obj) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class _Bucket:
    """One flat buffer holding the gradients of ``params`` (one dtype) and ``n_extra`` more
    values, with a view of it shaped like each gradient."""

    def __init__(self, params: list[nn.Parameter], n_extra: int):
        self.params = params
        g0 = params[0].grad
        sizes = [p.grad.numel() for p in params]
        self.flat = torch.zeros(sum(sizes) + n_extra, dtype=g0.dtype, device=g0.device)
        pieces = self.flat.split(sizes + [n_extra])
        self.views = [v.view_as(p.grad) for v, p in zip(pieces, params)]
        self.extra = pieces[-1] if n_extra else None
