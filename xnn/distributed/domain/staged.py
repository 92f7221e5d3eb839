"""The staged halo exchange (``parallel.exchange=staged``): ghosts routed along x, then y,
then z, each stage talking only to the -1 and +1 box of one axis (as LAMMPS's ``Comm``).

The direct plan (:class:`~xnn.distributed.domain.halo.HaloPlan`) sends one message per peer
box: up to 26 in 3-D, more when the halo spans several boxes. A staged routing delivers the
same ghost rows in the same ghost order with at most 2 messages per stage: rows received in
an earlier stage are forwarded in later ones (corners and edges ride along the faces), and a
halo that reaches ``k`` boxes along an axis takes ``k`` stages (hops) there. Each stage is
itself a direct plan over the rank's growing *buffer* ``[owned rows | rows received in
earlier stages]``, so its forward and its adjoint are the direct plan's own; the routing
ends with ``ghost_index`` taking buffer rows to the direct plan's ghost order (duplicates
allowed: an atom several ghosts of which this rank holds arrives once).

A row that several destinations need travels once per stage and direction (deduplicated by
buffer row). Along a periodic axis a packet takes the shorter way round (``+`` on a tie),
along a non-periodic axis the straight one; a periodic axis of 2 boxes has one neighbour
(one message per stage); an axis of 1 box has no stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.distributed import collectives as C
from xnn.distributed.domain.halo import HaloPlan
from xnn.distributed.domain.partition import box_of, rank_of
from xnn.errors import InputError

#: the words of ``parallel.exchange``: how ghost rows travel between boxes
EXCHANGES = {"direct": "one message per peer box (up to 26 in 3-D, more when the halo "
                       "spans several boxes)",
             "staged": "along x, then y, then z, each stage to the -1 and +1 box only, rows "
                       "of earlier stages forwarded (2 messages per axis and box-width of "
                       "halo)"}


def check_exchange(word: str) -> str:
    """``word`` if it is a key of :data:`EXCHANGES`, else ``InputError`` listing them."""
    if word not in EXCHANGES:
        raise InputError(f"exchange must be one of {list(EXCHANGES)}, got {word!r}")
    return word


@dataclass
class StagedRouting:
    """The stages of a staged exchange and the map from its buffer to the ghost order.

    Attributes:
        stages: per stage a :class:`HaloPlan` over the buffer as it stands before the stage
            (its ``n_owned`` is the buffer's length then; at most 2 peers).
        ghost_index: ``[n_recv]`` buffer row of each ghost row of the direct plan.
        n_owned: the rank's owned rows (the buffer's first rows).
    """

    stages: list[HaloPlan]
    ghost_index: Tensor
    n_owned: int

    @property
    def messages(self) -> int:
        """Messages this rank sends per exchange (non-empty sends of every stage)."""
        return sum(sum(1 for c in s.send_counts if c) for s in self.stages)

    @property
    def n_send(self) -> int:
        """Rows this rank sends per exchange (forwarded rows included)."""
        return sum(s.n_send for s in self.stages)

    def forward(self, x: Tensor) -> Tensor:
        """``[n_recv, ...]`` ghost rows (direct plan order) from owned rows ``x``."""
        buf = x
        for stage in self.stages:
            buf = torch.cat([buf, stage.forward_comm(buf)])
        return buf.index_select(0, self.ghost_index.to(x.device))

    def reverse(self, g: Tensor) -> Tensor:
        """``[n_owned, ...]``: the adjoint of :meth:`forward` for ghost rows ``g``."""
        n_buf = self.stages[-1].n_owned + self.stages[-1].n_recv if self.stages else self.n_owned
        buf = g.new_zeros((n_buf, *g.shape[1:])).index_add(0, self.ghost_index.to(g.device), g)
        for stage in reversed(self.stages):
            n = stage.n_owned
            buf = buf[:n] + stage.reverse_comm(buf[n:n + stage.n_recv].contiguous())
        return buf[: self.n_owned]


def displacement(here, there, g: int, periodic: bool):
    """Signed box steps from coordinate ``here`` to ``there`` (ints or tensors) along one axis
    of ``g`` boxes: the shorter way round a periodic axis, ``+`` on a tie."""
    d = there - here
    if periodic:
        d = d % g
        d = d - g * (d > g // 2)
    return d


def _neighbour(coord: tuple[int, int, int], axis: int, step: int, grid, periodic: bool):
    c = list(coord)
    c[axis] += step
    if not 0 <= c[axis] < grid[axis]:
        if not periodic:
            return None
        c[axis] %= grid[axis]
    return rank_of(c, grid)


def _targets(coord, axis: int, d: Tensor, grid, periodic: bool) -> list[tuple[int, Tensor]]:
    """``(neighbour, mask of the packets it gets)`` of one stage (one entry when the -1 and
    +1 neighbours are the same rank)."""
    plus = _neighbour(coord, axis, 1, grid, periodic)
    minus = _neighbour(coord, axis, -1, grid, periodic)
    out: list[tuple[int, Tensor]] = []
    if plus is not None:
        out.append((plus, d > 0))
    if minus is not None:
        if minus == plus:
            out[0] = (plus, d != 0)
        else:
            out.append((minus, d < 0))
    return out


def _stage(packets: Tensor, coords: Tensor, coord, axis: int, grid, periodic: bool, n_buf: int,
           group) -> tuple[HaloPlan, Tensor]:
    """One stage: packets ``[n, 4]`` (buffer row, destination, source, slot) that must move
    along ``axis`` go one box; returns the stage's plan and the packets held after it."""
    d = displacement(coord[axis], coords[packets[:, 1], axis], grid[axis], periodic)
    targets = _targets(coord, axis, d, grid, periodic)
    sends, metas, heads = [], [], []
    for _, mask in targets:
        rows, inverse = torch.unique(packets[mask, 0], return_inverse=True)
        sends.append(rows)
        metas.append(torch.cat([inverse[:, None], packets[mask, 1:]], 1).contiguous())
        heads.append(packets.new_tensor([rows.numel(), metas[-1].shape[0]]))
    peers = [p for p, _ in targets]
    got = [packets.new_empty(2) for _ in peers]
    C.exchange(list(zip(peers, heads)), list(zip(peers, got)), group)
    received = [packets.new_empty(int(h[1]), 4) for h in got]
    C.exchange(list(zip(peers, metas)), list(zip(peers, received)), group)
    counts = [int(h[0]) for h in got]
    held = [packets[d == 0]]
    offset = n_buf
    for meta, count in zip(received, counts):
        held.append(torch.cat([meta[:, :1] + offset, meta[:, 1:]], 1))
        offset += count
    used = [k for k in range(len(peers)) if counts[k] or sends[k].numel()]
    plan = HaloPlan(n_buf, [peers[k] for k in used], [sends[k] for k in used],
                    [counts[k] for k in used], group)
    return plan, torch.cat(held)


def staged_routing(plan: HaloPlan, grid: Sequence[int], pbc: Sequence[bool], rank: int,
                   device: torch.device) -> StagedRouting:
    """The staged routing that delivers ``plan``'s ghost rows (collective over its group).

    Args:
        plan: the direct plan (its peers, the owned rows each needs, the ghost order).
        grid: ``(px, py, pz)`` of the boxes; rank ``r`` has box
            ``((r // (py * pz)), (r // pz) % py, r % pz)``.
        pbc: ``[3]`` periodic axes (a periodic axis wraps round).
        rank: this rank (in ``plan.group``).
        device: where the index tensors live (the positions' device).

    One all-reduce (the hops of the three axes), then per stage one exchange of counts and
    one of packet metadata (4 integers per row and destination) with the stage's neighbours.
    """
    grid = tuple(int(g) for g in grid)
    n_ranks = grid[0] * grid[1] * grid[2]
    coords = torch.tensor([box_of(r, grid) for r in range(n_ranks)], device=device)
    coord = box_of(rank, grid)
    sends = [s.to(device) for s in plan.send_index]
    packets = torch.cat([torch.zeros(0, 4, dtype=torch.long, device=device)] + [
        torch.stack([s, torch.full_like(s, q), torch.full_like(s, rank),
                     torch.arange(s.numel(), device=device)], 1)
        for q, s in zip(plan.peers, sends)])
    hops = torch.zeros(3, dtype=torch.long, device=device)
    for a in range(3):
        if grid[a] > 1 and packets.shape[0]:
            d = displacement(coord[a], coords[packets[:, 1], a], grid[a], bool(pbc[a]))
            hops[a] = d.abs().max()
    hops = C.all_reduce_max(hops, plan.group)
    stages, n_buf = [], plan.n_owned
    for a in range(3):
        for _ in range(int(hops[a]) if grid[a] > 1 else 0):
            stage, packets = _stage(packets, coords, coord, a, grid, bool(pbc[a]), n_buf,
                                    plan.group)
            stages.append(stage)
            n_buf += stage.n_recv
    return StagedRouting(stages, _ghost_index(plan, packets, rank, device), plan.n_owned)


def _ghost_index(plan: HaloPlan, packets: Tensor, rank: int, device) -> Tensor:
    """``[n_recv]`` buffer row of each ghost row, from the packets that reached ``rank``."""
    if packets.shape[0] and bool((packets[:, 1] != rank).any()):
        raise RuntimeError("staged halo exchange: a ghost row did not reach its destination")
    offsets = torch.zeros(C.group_size(plan.group), dtype=torch.long, device=device)
    start = 0
    for q, n in zip(plan.peers, plan.recv_counts):
        offsets[q] = start
        start += n
    slot = offsets[packets[:, 2]] + packets[:, 3]
    index = torch.full((plan.n_recv,), -1, dtype=torch.long, device=device)
    index[slot] = packets[:, 0]
    if slot.numel() != plan.n_recv or bool((index < 0).any()):
        raise RuntimeError(f"staged halo exchange: {slot.numel()} rows routed for "
                           f"{plan.n_recv} ghosts")
    return index
