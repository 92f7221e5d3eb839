"""The streamed core of the spatial ghost plans (:mod:`.plan`, :mod:`.jittered`): one block
of atoms at a time, every atom's images inside every candidate rank's region grown by the
halo thickness, counted with the arithmetic of
:func:`~xnn.distributed.domain.partition.image_shifts` (``ceil(low - u) .. floor(high - u)``
per periodic axis, the closed interval along the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from xnn.distributed.cost.systems import System
from xnn.distributed.domain.partition import Partition

_CANDIDATES = 1 << 24  #: candidate (atom, rank) pairs per block at most


@dataclass
class Sums:
    """Per-rank accumulators (float64: sampled edges are scaled)."""

    owned: np.ndarray
    held: np.ndarray
    recv: np.ndarray
    send: np.ndarray
    edges: np.ndarray
    edges_var: np.ndarray

    @classmethod
    def zeros(cls, n: int) -> Sums:
        return cls(*(np.zeros(n) for _ in range(6)))


def add(acc: np.ndarray, index: Tensor, weights: Tensor | None = None) -> None:
    """``acc[index] += weights`` (1 where ``None``)."""
    n = acc.shape[0]
    w = None if weights is None else weights.to(torch.float64)
    acc += torch.bincount(index, w, minlength=n).numpy()[:n]


@dataclass(frozen=True)
class Regions:
    """Every rank's region and receiver region (fractional ``[n_ranks, 3]`` corners), and
    the candidate search of :func:`visit`.

    Attributes:
        part: the partition. extents: ``[n_ranks, 2, 3]`` boxes grown to hold their atoms.
        lows, highs: the regions (extents grown by the halo thickness).
        r_lows, r_highs: the receiver regions (grown by ``receiver_width``; 0: owned only).
        receiver_width: Å. margin: ``[3]`` candidate search reach. step: atoms per block.
    """

    part: Partition
    extents: Tensor
    lows: Tensor
    highs: Tensor
    r_lows: Tensor
    r_highs: Tensor
    receiver_width: float
    margin: Tensor
    step: int


def regions(part: Partition, extents: Tensor, halo_width: float, receiver_width: float,
            block: int) -> Regions:
    """The :class:`Regions` of ``extents`` (as :meth:`Partition.extent` gives them)."""
    n_ranks = math.prod(part.grid)
    box_low = torch.stack([part.box_bounds(r)[0] for r in range(n_ranks)])
    box_high = torch.stack([part.box_bounds(r)[1] for r in range(n_ranks)])
    grow = torch.maximum(box_low - extents[:, 0], extents[:, 1] - box_high)
    t_h, t_r = part.thickness(halo_width), part.thickness(receiver_width)
    margin = t_h * (1 + 1e-6) + grow.max(0).values + 1e-9
    per_atom = math.prod(min(part.grid[a] + 2, int(2 * float(margin[a]) / thinnest(part, a))
                             + 2) for a in range(3))
    step = max(1024, min(block, _CANDIDATES // per_atom))
    return Regions(part, extents, extents[:, 0] - t_h, extents[:, 1] + t_h,
                   extents[:, 0] - t_r, extents[:, 1] + t_r, receiver_width, margin, step)


def visit(sys: System, reg: Regions, ids: np.ndarray, sums: Sums, weight: Tensor,
          var: Tensor, rows: bool = True) -> None:
    """Add atoms ``ids``: their images to every rank's held, received and sent rows (when
    ``rows``), and ``weight [n]`` (variance ``var [n]``) per receiver image to the edges
    (per owned atom when the receiver width is 0)."""
    part, g = reg.part, reg.part.grid
    u, _ = part.fractional(torch.from_numpy(sys.positions(ids)))
    own = part.owner(u)
    (ix, okx), (iy, oky), (iz, okz) = axis_candidates(u, part, reg.margin)
    rank = ((ix[:, :, None, None] * g[1] + iy[:, None, :, None]) * g[2]
            + iz[:, None, None, :])
    ok = okx[:, :, None, None] & oky[:, None, :, None] & okz[:, None, None, :]
    j, flat = torch.nonzero(ok.reshape(len(ids), -1), as_tuple=True)
    r = rank.reshape(len(ids), -1)[j, flat]
    if rows:
        add(sums.owned, own)
        cnt = image_counts(u[j], reg.lows[r], reg.highs[r], part.pbc)
        add(sums.held, r, cnt)
        other = own[j] != r
        add(sums.recv, r[other], cnt[other])
        add(sums.send, own[j][other], cnt[other])
    if reg.receiver_width > 0:
        rec = image_counts(u[j], reg.r_lows[r], reg.r_highs[r], part.pbc)
        add(sums.edges, r, rec * weight[j])
        add(sums.edges_var, r, rec * rec * var[j])
    else:
        add(sums.edges, own, weight)
        add(sums.edges_var, own, var)


def axis_candidates(u: Tensor, part: Partition, margin: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per axis: ``([n, k] box index, [n, k] valid)`` of the boxes whose grown region may
    hold an image of each atom (a superset: the counts are exact per candidate)."""
    if part.cuts is not None:
        return [_cut_candidates(u[:, a], part, a, float(margin[a])) for a in range(3)]
    out = []
    for a in range(3):
        p, w, lo = part.grid[a], float(part.width[a]), float(part.lo[a])
        k_all = int(math.floor(2 * float(margin[a]) / w)) + 2
        if bool(part.pbc[a]) and k_all >= p:
            idx = torch.arange(p).expand(u.shape[0], p)
            out.append((idx, torch.ones_like(idx, dtype=torch.bool)))
            continue
        kmin = torch.floor((u[:, a] - lo - margin[a]) / w).long()
        kmax = torch.floor((u[:, a] - lo + margin[a]) / w).long()
        k = kmin[:, None] + torch.arange(min(k_all, p + 2))[None]
        ok = k <= kmax[:, None]
        if bool(part.pbc[a]):
            k = torch.remainder(k, p)
        else:
            ok &= (k >= 0) & (k < p)
            k = k.clamp(0, p - 1)
        out.append((k, ok))
    return out


def _cut_candidates(v: Tensor, part: Partition, a: int, margin: float):
    """:func:`axis_candidates` of one axis of a balanced partition (per-axis cuts): the
    boxes from that of ``v - margin`` to that of ``v + margin`` (periodic images counted)."""
    p, inner = part.grid[a], part.cuts[a][1:-1].contiguous()

    def index(x: Tensor) -> Tensor:
        if not bool(part.pbc[a]):
            return torch.searchsorted(inner, x.contiguous(), right=True)
        n = torch.floor(x)
        return n.long() * p + torch.searchsorted(inner, (x - n).contiguous(), right=True)

    kmin, kmax = index(v - margin), index(v + margin)
    count = int((kmax - kmin).max()) + 1 if v.numel() else 1
    if bool(part.pbc[a]) and count >= p:
        idx = torch.arange(p).expand(v.shape[0], p)
        return idx, torch.ones_like(idx, dtype=torch.bool)
    k = kmin[:, None] + torch.arange(count)[None]
    ok = k <= kmax[:, None]
    return (torch.remainder(k, p) if bool(part.pbc[a]) else k.clamp(0, p - 1)), ok


def thinnest(part: Partition, a: int) -> float:
    """The fractional width of the thinnest box along axis ``a``."""
    if part.cuts is None:
        return float(part.width[a])
    return float(torch.diff(part.cuts[a]).min())


def image_counts(u: Tensor, low: Tensor, high: Tensor, pbc: Tensor) -> Tensor:
    """``[m]`` images of ``u [m, 3]`` in the closed boxes ``[low, high]`` (``[m, 3]``):
    the arithmetic of :func:`~xnn.distributed.domain.partition.image_shifts`."""
    return axis_spans(u, low, high, pbc).prod(-1).long()


def axis_spans(u: Tensor, low: Tensor, high: Tensor, pbc: Tensor) -> Tensor:
    """Per axis, the images of ``u`` in ``[low, high]`` (broadcast; float): their product
    is :func:`image_counts`."""
    smin, smax = torch.ceil(low - u), torch.floor(high - u)
    span = (smax - smin + 1).clamp_min(0)
    inside = ((u >= low) & (u <= high)).to(span.dtype)
    return torch.where(pbc, span, inside)


def owners_and_extents(sys: System, part: Partition, id_blocks) -> tuple[np.ndarray, Tensor]:
    """Owned counts of the atoms of ``id_blocks`` (an iterable of id arrays) and the
    ``[n_ranks, 2, 3]`` extents: every box grown to hold them (as :meth:`Partition.extent`)."""
    n_ranks = math.prod(part.grid)
    low = torch.stack([part.box_bounds(r)[0] for r in range(n_ranks)])
    high = torch.stack([part.box_bounds(r)[1] for r in range(n_ranks)])
    owned = np.zeros(n_ranks)
    for ids in id_blocks:
        u, _ = part.fractional(torch.from_numpy(sys.positions(ids)))
        own = part.owner(u)
        add(owned, own)
        low = low.scatter_reduce(0, own[:, None].expand(-1, 3), u, "amin")
        high = high.scatter_reduce(0, own[:, None].expand(-1, 3), u, "amax")
    return owned, torch.stack([low, high], 1)
