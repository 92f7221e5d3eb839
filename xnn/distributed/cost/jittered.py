"""Spatial ghost plans of a jittered crystal (the liquid of :mod:`.systems`) at any size,
exactly, without visiting every atom.

Every count of a spatial plan is a sum over atoms of a function of the atom's fractional
coordinates that is a product over axes of per-axis step functions: the owner box (steps at
the box faces), the images inside a rank's region (steps at the region's faces, modulo whole
cells) and inside its receiver region. A liquid atom sits within :data:`~.systems.JITTER` Å
per axis of its crystal site, so its terms equal its site's unless, along some axis, the
site lies within the jitter (plus :data:`TOL` against round-off) of one of those faces: the
*band*. Hence

    count = (sum over the crystal sites outside the band, factor by factor)
          + (sum over the atoms of the band, streamed by :func:`~.stream.visit`).

Outside the band every axis's site set is a product (per FCC basis site: ``X \\ band_x ×
Y \\ band_y × Z \\ band_z``), so its per-rank and rank-pair sums cost ``O(n_ranks^2 +
n_ranks × N^(1/3))`` (:mod:`.separable`'s idea); the band (sites whose coordinate along some
axis lies near a face) is enumerated from its sites, atom ids and their jittered positions
from :class:`~.systems.System`. First the band of the box faces alone gives the extents
(only atoms within round-off of a face can grow a box); then the band of all faces.

Edges (receivers' neighbour counts within the cutoff) do not factor: with ``sample`` None
every atom's count is taken (exact); otherwise a difference estimator,
``K × receivers + sum over a seeded sample of receiver images × (count - K) / sample``,
with the receivers counted exactly and ``K`` the mean count of 4,096 atoms outside the
sample (unbiased; its standard error is stated).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor

from xnn.distributed.cost.counts import peer_counts
from xnn.distributed.cost.separable import NotSeparable
from xnn.distributed.cost.stream import (
    Regions,
    Sums,
    axis_spans,
    owners_and_extents,
    regions,
    visit,
)
from xnn.distributed.cost.systems import _BASIS, System, _hash
from xnn.distributed.domain.partition import Partition

TOL = 1e-6  #: Å added to the jitter: the band's margin against round-off
PILOT = 4096  #: atoms outside the sample whose mean neighbour count is the estimator's K


def check_banded(sys: System, part: Partition) -> None:
    """Raise :class:`NotSeparable` unless the band method applies: a jittered FCC crystal in
    a periodic diagonal cell, boxes of equal widths."""
    diagonal = torch.equal(sys.cell, torch.diag(torch.diagonal(sys.cell)))
    if (not sys.jitter or sys.name == "cylinder" or not diagonal or not bool(sys.pbc.all())
            or part.cuts is not None):
        raise NotSeparable(f"{sys.name}: not a jittered periodic crystal with equal boxes")


def _site_u(sys: System, part: Partition, a: int, x: np.ndarray) -> Tensor:
    """``[m, 3]`` wrapped fractional coordinates of sites with ``x`` along axis ``a`` (0 along
    the others: only column ``a`` is meant)."""
    full = np.zeros((len(x), 3), dtype=np.int64)
    full[:, a] = x
    return part.fractional(torch.from_numpy(sys.site_positions(full)))[0]


def _band(sys: System, part: Partition, planes: list[Tensor]) -> list[np.ndarray]:
    """Per axis, ``[2 n_a]`` bool: half-lattice coordinates whose sites lie within the
    jitter (+ :data:`TOL`) of a plane (fractional, modulo 1) of ``planes[a]``."""
    tol = part.thickness(sys.jitter + TOL)
    out = []
    for a in range(3):
        x = np.arange(2 * sys.cells[a])
        u = _site_u(sys, part, a, x)[:, a]
        p = torch.unique(torch.remainder(planes[a], 1.0))
        d = torch.remainder(u[:, None] - p[None], 1.0)
        near = (torch.minimum(d, 1 - d) <= tol[a]).any(1)
        out.append(near.numpy())
    return out


def _face_planes(part: Partition) -> list[Tensor]:
    return [part.lo[a] + torch.arange(part.grid[a] + 1, dtype=part.lo.dtype) * part.width[a]
            for a in range(3)]


def band_ids(sys: System, band: list[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """Ids of the atoms whose site lies in the band along some axis, in blocks of about
    ``size``: per basis site, the disjoint products ``Bx × Y × Z``, ``X\\Bx × By × Z``,
    ``X\\Bx × Y\\By × Bz``."""
    for b in _BASIS:
        axes = [2 * np.arange(sys.cells[a]) + b[a] for a in range(3)]
        inb = [band[a][axes[a]] for a in range(3)]
        pieces = [(axes[0][inb[0]], axes[1], axes[2]),
                  (axes[0][~inb[0]], axes[1][inb[1]], axes[2]),
                  (axes[0][~inb[0]], axes[1][~inb[1]], axes[2][inb[2]])]
        for xs, ys, zs in pieces:
            if not (len(xs) and len(ys) and len(zs)):
                continue
            per_x = len(ys) * len(zs)
            step = max(1, size // per_x)
            for i in range(0, len(xs), step):
                g = np.stack(np.meshgrid(xs[i: i + step], ys, zs, indexing="ij"), -1)
                yield sys.ids_of(g.reshape(-1, 3))


def _products(sys: System, part: Partition, reg: Regions, band: list[np.ndarray]):
    """Sums over the crystal sites outside the band: ``owned [P]``, the rank-pair images
    ``M [P, P]`` (``M[r, q]``: images of r's atoms in q's region) and receivers ``[P]``."""
    n_ranks = math.prod(part.grid)
    box = torch.tensor([part.box_index(r) for r in range(n_ranks)])
    owned = torch.zeros(n_ranks, dtype=torch.float64)
    pairs = torch.zeros(n_ranks, n_ranks, dtype=torch.float64)
    receivers = torch.zeros(n_ranks, dtype=torch.float64)
    for b in _BASIS:
        p_own = torch.ones(n_ranks, dtype=torch.float64)
        p_pair, p_rec = torch.ones_like(pairs), torch.ones_like(receivers)
        for a in range(3):
            x = 2 * np.arange(sys.cells[a]) + b[a]
            x = x[~band[a][x]]
            u3 = _site_u(sys, part, a, x)
            idx = part.axis_index(u3, a)
            u, pbc = u3[:, a, None], part.pbc[a]
            one_hot = torch.zeros(part.grid[a], len(x), dtype=torch.float64)
            one_hot[idx, torch.arange(len(x))] = 1.0
            span = axis_spans(u, reg.lows[None, :, a], reg.highs[None, :, a], pbc)
            rec = axis_spans(u, reg.r_lows[None, :, a], reg.r_highs[None, :, a], pbc)
            p_own *= one_hot.sum(1)[box[:, a]]
            p_pair *= (one_hot @ span.to(torch.float64))[box[:, a]]
            p_rec *= rec.to(torch.float64).sum(0)
        owned += p_own
        pairs += p_pair
        receivers += p_rec
    return owned, pairs, receivers


def _coordination(sys: System, ids: np.ndarray, reach: float) -> np.ndarray:
    return (sys.neighbors(ids, reach) >= 0).sum(1).astype(np.float64)


def _sampled_ids(sys: System, sample: float, block: int) -> Iterator[np.ndarray]:
    for ids in sys.blocks(block):  # the streamed plan's selection (its seed + 1, k = 3)
        yield ids[_hash(sys.seed + 1, ids, 3) < sample]


def _pilot(sys: System, sample: float, reach: float) -> float:
    """The mean neighbour count of the first :data:`PILOT` atoms outside the sample."""
    picked, start = [], 0
    while sum(len(p) for p in picked) < PILOT and start < sys.n_atoms:
        ids = np.arange(start, min(start + 4 * PILOT, sys.n_atoms), dtype=np.int64)
        picked.append(ids[_hash(sys.seed + 1, ids, 3) >= sample])
        start += 4 * PILOT
    ids = np.concatenate(picked)[:PILOT]
    return float(_coordination(sys, ids, reach).mean()) if len(ids) else 0.0


def _edges(sys: System, reg: Regions, cutoff: float, receivers: np.ndarray,
           sample: float | None, block: int) -> tuple[np.ndarray, np.ndarray, float]:
    """``(edges, variance, K)`` per rank: exact (``sample`` None: every atom, ``K = 0``) or
    the difference estimator of the module's docstring."""
    n_ranks = receivers.shape[0]
    sums = Sums.zeros(n_ranks)
    if sample is None:
        blocks, k, scale = sys.blocks(min(block, reg.step)), 0.0, 1.0
    else:
        blocks, k, scale = _sampled_ids(sys, sample, block), _pilot(sys, sample, cutoff), sample
    for ids in blocks:
        for i in range(0, len(ids), reg.step):
            chunk = ids[i: i + reg.step]
            d = torch.from_numpy((_coordination(sys, chunk, cutoff) - k) / scale)
            visit(sys, reg, chunk, sums, d, d * d * (1 - scale), rows=False)
    return k * receivers + sums.edges, sums.edges_var, k


def banded_counts(sys: System, part: Partition, mode: str, cutoff: float, halo_width: float,
                  block: int, sample: float | None) -> tuple[tuple[np.ndarray, ...], dict]:
    """Per-rank ``(owned, ghost, edges, send, recv, peers)`` (float64 / int arrays) of the
    spatial plan of ``sys`` over ``part``, and facts for the method (``band``: atoms
    streamed, ``K``, ``edges_var``).

    Raises:
        NotSeparable: not a jittered periodic crystal with equal boxes (:func:`check_banded`).
    """
    check_banded(sys, part)
    n_ranks = math.prod(part.grid)
    faces = _band(sys, part, _face_planes(part))
    _, extents = owners_and_extents(sys, part, band_ids(sys, faces, block))
    receiver_width = halo_width - cutoff if mode == "halo" else 0.0
    reg = regions(part, extents, halo_width, receiver_width, block)
    planes = [torch.cat([_face_planes(part)[a], reg.lows[:, a], reg.highs[:, a]]
                        + ([reg.r_lows[:, a], reg.r_highs[:, a]] if receiver_width > 0
                           else [])) for a in range(3)]
    band = _band(sys, part, planes)
    owned, pairs, receivers = _products(sys, part, reg, band)
    sums, n_band = Sums.zeros(n_ranks), 0
    ones = torch.ones(reg.step, dtype=torch.float64)
    for ids in band_ids(sys, band, block):
        for i in range(0, len(ids), reg.step):
            part_ids = ids[i: i + reg.step]
            n_band += len(part_ids)
            w = ones[: len(part_ids)]
            visit(sys, reg, part_ids, sums, w, torch.zeros_like(w))
    diag = torch.diagonal(pairs)
    owned_sites = owned.numpy()
    owned = owned_sites + sums.owned
    held = pairs.sum(0).numpy() + sums.held
    recv = (pairs.sum(0) - diag).numpy() + sums.recv
    send = (pairs.sum(1) - diag).numpy() + sums.send
    # the band's receivers were counted as its edges of weight 1
    receivers = (receivers.numpy() if receiver_width > 0 else owned_sites) + sums.edges
    edges, edges_var, k = _edges(sys, reg, cutoff, receivers, sample, block)
    peers, staged = peer_counts(part, extents, halo_width)
    return ((owned, held - owned, edges, send, recv, peers),
            {"band": n_band, "K": k, "edges_var": edges_var, "staged": staged})
