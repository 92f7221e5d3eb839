"""Ghost atoms and the halo exchange, an autograd function whose adjoint is the reverse exchange.

A rank holds ``n_owned`` atoms. Its ghosts are images of atoms (its own or other ranks')
within the halo of its box. Ghosts owned by other ranks arrive through :func:`halo_exchange`:
the owner sends rows ``x[send_index[q]]`` to each peer ``q`` and receives its ghost rows in
peer order. The backward pass sums ghost gradients into the owners' rows (the reverse
exchange), and the reverse exchange's backward is the forward exchange, so gradients of any
order flow through it. Only ranks that share ghosts talk to each other; both sides know every
message size from the plan, so the exchange cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from xnn.distributed import collectives as C


@dataclass
class HaloPlan:
    """Who sends which rows to whom; built once per neighbor-list rebuild.

    Attributes:
        n_owned: number of atoms this rank owns.
        peers: group ranks that this rank exchanges with (symmetric relation).
        send_index: per peer, ``[n_send]`` owned rows it needs (in its ghost order).
        recv_counts: per peer, number of ghost rows received from it (in peer order).
        group: the process group (``None`` in a single process).
    """

    n_owned: int
    peers: list[int] = field(default_factory=list)
    send_index: list[Tensor] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    group: object = None

    @property
    def n_recv(self) -> int:
        return sum(self.recv_counts)

    @property
    def n_send(self) -> int:
        return sum(int(s.numel()) for s in self.send_index)

    def forward_comm(self, x: Tensor) -> Tensor:
        """``[n_recv, ...]`` ghost rows from their owners, given owned rows ``x [n_owned, ...]``."""
        out = x.new_empty((self.n_recv, *x.shape[1:]))
        recvs = list(zip(self.peers, torch.split(out, self.recv_counts)))
        sends = [(q, x.index_select(0, idx)) for q, idx in zip(self.peers, self.send_index)]
        C.exchange(sends, recvs, self.group)
        return out

    def reverse_comm(self, g: Tensor) -> Tensor:
        """``[n_owned, ...]`` sums of ghost rows ``g [n_recv, ...]`` sent back to their owners."""
        bufs = [g.new_empty((int(idx.numel()), *g.shape[1:])) for idx in self.send_index]
        sends = list(zip(self.peers, torch.split(g.contiguous(), self.recv_counts)))
        C.exchange(sends, list(zip(self.peers, bufs)), self.group)
        out = g.new_zeros((self.n_owned, *g.shape[1:]))
        for idx, buf in zip(self.send_index, bufs):
            out.index_add_(0, idx, buf)
        return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, plan: HaloPlan, reverse: bool) -> Tensor:
        ctx.plan, ctx.reverse = plan, reverse
        x = x.contiguous()
        return plan.reverse_comm(x) if reverse else plan.forward_comm(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _Exchange.apply(grad.contiguous(), ctx.plan, not ctx.reverse), None, None


def halo_exchange(x: Tensor, plan: HaloPlan) -> Tensor:
    """Differentiable forward halo exchange: ``[n_owned, ...] -> [n_recv, ...]`` ghost rows.

    Every rank of the plan's group must call it (the same number of times, in the same order).
    """
    return _Exchange.apply(x, plan, False)

