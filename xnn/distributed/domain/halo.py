"""Ghost atoms and the halo exchange, an autograd function whose adjoint is the reverse exchange.

A rank holds ``n_owned`` atoms. Its ghosts are images of atoms (its own or other ranks')
within the halo of its box. Ghosts owned by other ranks arrive through :func:`halo_exchange`:
the owner sends rows ``x[send_index[q]]`` to each peer ``q`` and receives its ghost rows in
peer order. The backward pass sums ghost gradients into the owners' rows (the reverse
exchange), and the reverse exchange's backward is the forward exchange, so gradients of any
order flow through it. The reverse exchange is one named adjoint, :func:`exchange_rows` back
to the owners then :func:`add_returned`, which the compiled decomposed step
(:mod:`xnn.distributed.domain.compiled`) runs too, on either side of a graph break. Only
ranks that share ghosts talk to each other; both sides know every message size from the
plan, so the exchange cannot deadlock.

A plan may carry a staged ``routing`` (:mod:`xnn.distributed.domain.staged`,
``parallel.exchange=staged``): the same ghost rows in the same order, sent along x, then y,
then z to the -1 and +1 box of each axis; its reverse is the exact adjoint, so autograd and
the sync points use it unchanged.
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
        routing: ``None`` (direct: one message per peer) or a
            :class:`~xnn.distributed.domain.staged.StagedRouting` that delivers the same
            ghost rows in stages (``forward_comm`` / ``reverse_comm`` use it).
    """

    n_owned: int
    peers: list[int] = field(default_factory=list)
    send_index: list[Tensor] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    group: object = None
    routing: object = None

    @property
    def n_recv(self) -> int:
        return sum(self.recv_counts)

    @property
    def n_send(self) -> int:
        return sum(int(s.numel()) for s in self.send_index)

    @property
    def messages(self) -> int:
        """Messages this rank sends per exchange (one per peer it sends rows to, or those
        of the staged routing's stages)."""
        if self.routing is not None:
            return self.routing.messages
        return sum(1 for s in self.send_index if s.numel())

    @property
    def sent_rows(self) -> int:
        """Rows this rank sends per exchange: ``n_send``, or the staged routing's (forwarded
        rows included, each buffer row once per stage and neighbour)."""
        return self.routing.n_send if self.routing is not None else self.n_send

    @property
    def send_counts(self) -> list[int]:
        return [int(s.numel()) for s in self.send_index]

    def send_rows(self) -> Tensor:
        """``[n_send]`` the owned rows every peer needs, concatenated in peer order."""
        if not self.send_index:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat(self.send_index)

    def forward_comm(self, x: Tensor) -> Tensor:
        """``[n_recv, ...]`` ghost rows from their owners, given owned rows ``x [n_owned, ...]``."""
        if self.routing is not None:
            return self.routing.forward(x)
        out = x.new_empty((self.n_recv, *x.shape[1:]))
        send = x.index_select(0, self.send_rows().to(x.device))
        exchange_rows(send, self.send_counts, out, self.recv_counts, self.peers, self.group)
        return out

    def reverse_comm(self, g: Tensor) -> Tensor:
        """``[n_owned, ...]`` sums of ghost rows ``g [n_recv, ...]`` sent back to their owners:
        :func:`exchange_rows` back to the owners, then :func:`add_returned` (or the staged
        routing's adjoint)."""
        if self.routing is not None:
            return self.routing.reverse(g)
        returned = g.new_empty((self.n_send, *g.shape[1:]))
        exchange_rows(g.contiguous(), self.recv_counts, returned, self.send_counts, self.peers,
                      self.group)
        return add_returned(g.new_zeros((self.n_owned, *g.shape[1:])),
                            self.send_rows().to(g.device), returned)


def exchange_rows(send: Tensor, send_counts: list[int], recv: Tensor, recv_counts: list[int],
                  peers: list[int], group) -> None:
    """Point-to-point rows between peers, both exchange directions: the first
    ``sum(send_counts)`` rows of ``send`` go, split by ``send_counts``, to ``peers`` (in
    order); the first ``sum(recv_counts)`` rows of ``recv`` receive, split by
    ``recv_counts``. The forward exchange sends owned rows (``send_index`` order) and
    receives ghost rows; the reverse exchange sends ghost rows back with the counts
    swapped. Rows beyond the counts (padding) are neither sent nor written.

    Collective among the peers: every rank of the plan's group calls it together.
    """
    sends = list(zip(peers, torch.split(send[: sum(send_counts)], send_counts)))
    recvs = list(zip(peers, torch.split(recv[: sum(recv_counts)], recv_counts)))
    C.exchange(sends, recvs, group)


def add_returned(owned: Tensor, send_index: Tensor, returned: Tensor) -> Tensor:
    """The reverse exchange's sum into the owners, the adjoint of
    ``owned.index_select(0, send_index)``: ``owned [n_owned, ...]`` plus each row of
    ``returned [n_send, ...]`` (what the peers sent back, in send order) added to the owned
    row it was sent from. The backward of :func:`halo_exchange` runs it (from zeros); the
    compiled decomposed step runs it on its padded rows (from the rank's own forces)."""
    return owned.index_add(0, send_index, returned)


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


def reverse_halo_exchange(g: Tensor, plan: HaloPlan) -> Tensor:
    """Differentiable reverse halo exchange (the adjoint of :func:`halo_exchange`):
    ``[n_recv, ...]`` ghost rows summed into ``[n_owned, ...]`` owner rows."""
    return _Exchange.apply(g, plan, True)
