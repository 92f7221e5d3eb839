"""Spatial ghost plans of crystals without visiting their atoms: a crystal of an orthogonal
cell is a union of *products* of small coordinate sets, and so is every count of
:mod:`.plan`.

An FCC crystal (or slab) is the union over the 4 basis sites of ``X-set × Y-set × Z-set``
(one factor per axis); a rod is the union over 2 layer parities of ``(X, Y)-cross-section ×
Z-set``. With a diagonal cell an atom's fractional coordinate along an axis depends on its
coordinate along that axis only (``frac = pos @ inv_cell``, the other terms exact zeros), so
its owner box index, and the number of its images inside a rank's grown region, are
products over the factors. Summing a product over a product set is the product of the
factors' sums: owned, held, own-image and received counts of every rank cost
``O(n_ranks × factor size)``, about ``n_ranks × N^(1/3)`` (a cross-section: ``N^(2/3)``),
instead of ``O(N)``. Sent rows need the regions of all peers at once, which factor too when
every rank's extent along an axis depends only on its box index along that axis (checked;
:class:`NotSeparable` otherwise, and :mod:`.plan` streams the atoms instead).

The fractional coordinates, owners and image counts are computed by the same project code
and arithmetic as the streamed plan (:meth:`Partition.fractional`, :meth:`Partition.owner`,
``ceil(low - u) .. floor(high - u)``), so the two agree exactly (``tests/test_cost_plan.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from xnn.distributed.cost.systems import _BASIS, System
from xnn.distributed.domain.partition import Partition, axis_histogram, fractional_bounds

_CHUNK = 1 << 24  #: rank × value entries per chunk


class NotSeparable(Exception):
    """The system or its extents do not factor over axes: stream the atoms instead."""


def components(sys: System, weights: dict) -> list[list[tuple[tuple[int, ...], np.ndarray,
                                                                 np.ndarray]]]:
    """The crystal as a union of products: per component, its factors ``(axes, sites [m,
    len(axes)] half-lattice units, weights [m])``; the neighbour-count weight of each atom
    sits on one factor (``weights``: see :func:`neighbour_weights`)."""
    if sys.jitter or not torch.equal(sys.cell, torch.diag(torch.diagonal(sys.cell))):
        raise NotSeparable(sys.name)
    if sys.name == "cylinder":
        out = []
        for p in (0, 1):
            z = 2 * np.arange(sys.cells[2]) + p
            out.append([((0, 1), sys._layer[p], weights["xy"][p]),
                        ((2,), z[:, None], np.ones(len(z)))])
        return out
    out = []
    for b in _BASIS:
        factors = []
        for a in range(3):
            s = 2 * np.arange(sys.cells[a]) + b[a]
            w = (weights["z"][s] if (a == 2 and "z" in weights) else
                 np.full(len(s), weights.get("all", 1.0)) if a == 0 else np.ones(len(s)))
            factors.append(((a,), s[:, None], w.astype(np.float64)))
        out.append(factors)
    return out


def neighbour_weights(sys: System, reach: float) -> dict:
    """Neighbour counts within ``reach`` (Å): ``{"all": c}`` (FCC: every site alike),
    ``{"z": [2 nz]}`` per plane (slab), ``{"xy": [per parity, per cross-section site]}``
    (rod).

    Raises:
        NotSeparable: a liquid (every atom's count differs).
    """
    if sys.jitter:
        raise NotSeparable(sys.name)
    if sys.name == "fcc":
        return {"all": float((sys.neighbors(np.array([0]), reach) >= 0).sum())}
    if sys.name == "slab":
        reps = np.array([sys.ids_of(np.array([[z % 2, 0, z]]))[0]
                         for z in range(2 * sys.cells[2])])
        return {"z": (sys.neighbors(reps, reach) >= 0).sum(1).astype(np.float64)}
    n0 = len(sys._layer[0])
    return {"xy": [(sys.neighbors(p * n0 + np.arange(len(sys._layer[p])), reach) >= 0)
                   .sum(1).astype(np.float64) for p in (0, 1)]}


def separable_bounds(sys: System, weights: dict) -> Tensor:
    """``[6]`` the atoms' fractional bounds (as
    :func:`~xnn.distributed.domain.partition.fractional_bounds` of all of them), from the
    factors (each axis's fractional coordinate depends on that axis only)."""
    best = torch.full((6,), float("-inf"), dtype=torch.float64)
    for comp in components(sys, weights):
        for axes, sites, _ in comp:
            full = np.zeros((len(sites), 3), dtype=np.int64)
            full[:, list(axes)] = sites
            pos = torch.from_numpy(sys.positions(np.zeros(len(sites), dtype=np.int64), full))
            b = fractional_bounds(pos, sys.cell)
            cols = list(axes) + [a + 3 for a in axes]
            best[cols] = torch.maximum(best[cols], b[cols])
    return best


def separable_histograms(sys: System, part: Partition, weights: dict) -> Tensor:
    """:func:`~xnn.distributed.domain.partition.axis_histograms` of all the atoms, from the
    factors: a factor's value stands for as many atoms as the other factors of its
    component hold (the same bins of the same fractional coordinates, so the same counts)."""
    hist = [torch.zeros(0)] * 3
    for comp in components(sys, weights):
        sizes = [len(sites) for _, sites, _ in comp]
        for f, (axes, sites, _) in enumerate(comp):
            others = float(np.prod(sizes[:f] + sizes[f + 1:]))
            u, _ = _fractional(sys, part, axes, sites)
            for k, a in enumerate(axes):
                h = axis_histogram(part, u[:, k], a, torch.full((len(sites),), others))
                hist[a] = h if not hist[a].numel() else hist[a] + h
    return torch.cat(hist)


def _fractional(sys: System, part: Partition, axes, sites: np.ndarray):
    """``u [m, 3]`` (only ``axes`` meaningful) and box index ``[m, len(axes)]``."""
    full = np.zeros((len(sites), 3), dtype=np.int64)
    full[:, list(axes)] = sites
    pos = torch.from_numpy(sys.positions(np.zeros(len(sites), dtype=np.int64), full))
    u, _ = part.fractional(pos)
    rank = part.owner(u)
    px, py, pz = part.grid
    idx = torch.stack([rank // (py * pz), (rank // pz) % py, rank % pz], 1)
    return u[:, list(axes)], idx[:, list(axes)]


def _images(u: Tensor, low: Tensor, high: Tensor, pbc: Tensor) -> Tensor:
    """``[r, m]`` images of values ``u [m, k]`` in boxes ``[low, high]`` (``[r, k]``)."""
    u = u[None]
    low, high = low[:, None], high[:, None]
    span = (torch.floor(high - u) - torch.ceil(low - u) + 1).clamp_min(0)
    inside = ((u >= low) & (u <= high)).to(span.dtype)
    return torch.where(pbc, span, inside).prod(-1)


def _chunks(n_ranks: int, m: int):
    step = max(1, _CHUNK // max(m, 1))
    for start in range(0, n_ranks, step):
        yield slice(start, min(start + step, n_ranks))


def separable_counts(sys: System, part: Partition, halo_width: float, receiver_width: float,
                     weights: dict):
    """``(owned, held, own_images, send, edges, extents)`` per rank (float64 arrays and the
    ``[n_ranks, 2, 3]`` extents), edges counted on receivers within ``receiver_width`` of
    the region (0: the owned atoms).

    Raises:
        NotSeparable: not a product of factors, or extents that do not factor.
    """
    comps = components(sys, weights)
    n_ranks = int(np.prod(part.grid))
    box = torch.tensor([part.box_index(r) for r in range(n_ranks)])
    low = torch.stack([part.box_bounds(r)[0] for r in range(n_ranks)])
    high = torch.stack([part.box_bounds(r)[1] for r in range(n_ranks)])
    facts = []
    owned = np.zeros(n_ranks)
    for comp in comps:
        per = []
        present = torch.ones(n_ranks, dtype=torch.bool)
        mins, maxs = [], []
        for axes, sites, w in comp:
            u, idx = _fractional(sys, part, axes, sites)
            # everything of a factor depends on the ranks' box indices along its axes only
            combos, inverse = torch.unique(box[:, list(axes)], dim=0, return_inverse=True)
            per.append((list(axes), u, idx, torch.from_numpy(w), combos, inverse))
            n_c = combos.shape[0]
            cnt = torch.zeros(n_c)
            mn = torch.full((n_c, len(axes)), float("inf"), dtype=u.dtype)
            mx = torch.full((n_c, len(axes)), float("-inf"), dtype=u.dtype)
            for s in _chunks(n_c, len(u)):
                eq = (idx[None] == combos[s][:, None]).all(-1)
                cnt[s] = eq.sum(1).to(cnt.dtype)
                big = torch.tensor(float("inf"), dtype=u.dtype)
                mn[s] = torch.where(eq[..., None], u[None], big).amin(1)
                mx[s] = torch.where(eq[..., None], u[None], -big).amax(1)
            present &= cnt[inverse] > 0
            mins.append(mn[inverse])
            maxs.append(mx[inverse])
        facts.append(per)
        for (axes, *_), mn, mx in zip(per, mins, maxs):
            low[:, axes] = torch.where(present[:, None], torch.minimum(low[:, axes], mn),
                                       low[:, axes])
            high[:, axes] = torch.where(present[:, None], torch.maximum(high[:, axes], mx),
                                        high[:, axes])
    extents = torch.stack([low, high], 1)
    for a in range(3):  # the sent rows factor only if extents depend on the axis's index
        for j in range(part.grid[a]):
            sel = box[:, a] == j
            if not (bool((low[sel, a] == low[sel, a][0]).all())
                    and bool((high[sel, a] == high[sel, a][0]).all())):
                raise NotSeparable("extents")
    t_h, t_r = part.thickness(halo_width), part.thickness(receiver_width)
    held, own_img, send, edges = (np.zeros(n_ranks) for _ in range(4))
    for per in facts:
        p_own = torch.ones(n_ranks, dtype=torch.float64)
        p_held, p_img, p_send, p_edge = (p_own.clone() for _ in range(4))
        for axes, u, idx, w, combos, inverse in per:
            pbc = part.pbc[axes]
            first = torch.zeros(combos.shape[0], dtype=torch.long)
            first[inverse] = torch.arange(n_ranks)  # a rank of each combo (extents factor)
            c_low, c_high = low[first][:, axes], high[first][:, axes]
            f_own, f_held, f_img, f_edge, f_send = (torch.zeros(combos.shape[0],
                                                                dtype=torch.float64)
                                                    for _ in range(5))
            for s in _chunks(combos.shape[0], len(u)):
                eq = (idx[None] == combos[s][:, None]).all(-1).to(torch.float64)
                img = _images(u, c_low[s] - t_h[axes], c_high[s] + t_h[axes], pbc)
                f_own[s] = eq.sum(1)
                f_held[s] = img.sum(1)
                f_img[s] = (eq * img).sum(1)
                if receiver_width > 0:
                    rec = _images(u, c_low[s] - t_r[axes], c_high[s] + t_r[axes], pbc)
                    f_edge[s] = (rec * w[None]).sum(1)
                else:
                    f_edge[s] = (eq * w[None]).sum(1)
            # every image of a value in any rank's region, per axis (regions factor)
            out = torch.ones(len(u), dtype=torch.float64)
            for k, a in enumerate(axes):
                lo_j = torch.stack([low[box[:, a] == j, a][0] for j in range(part.grid[a])])
                hi_j = torch.stack([high[box[:, a] == j, a][0] for j in range(part.grid[a])])
                out *= _images(u[:, k:k + 1], (lo_j - t_h[a])[:, None],
                               (hi_j + t_h[a])[:, None], pbc[k:k + 1]).sum(0)
            for s in _chunks(combos.shape[0], len(u)):
                eq = (idx[None] == combos[s][:, None]).all(-1).to(torch.float64)
                f_send[s] = (eq * out[None]).sum(1)
            for prod, f in ((p_own, f_own), (p_held, f_held), (p_img, f_img),
                            (p_edge, f_edge), (p_send, f_send)):
                prod *= f[inverse]
        owned += p_own.numpy()
        held += p_held.numpy()
        own_img += p_img.numpy()
        send += p_send.numpy()
        edges += p_edge.numpy()
    return owned, held, own_img, send - own_img, edges, extents
