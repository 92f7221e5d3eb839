"""Ghost plans at scale without running a model: per-rank counts of a decomposition of a
10^6-10^8-atom system on up to thousands of ranks, streamed through the project's own
partition code (issue 47).

Spatial modes (``halo``, ``sync``), three streamed passes over the atoms, block by block
(:class:`~.systems.System` generates any block from integer sites):

1. the atoms' fractional bounds (:func:`~xnn.distributed.domain.partition.fractional_bounds`,
   max-reduced as :meth:`SpatialLayout.partition` all-reduces them) give the partition
   (:func:`~xnn.distributed.domain.partition.partition_from_bounds`, grid by
   :func:`~xnn.distributed.domain.partition.choose_grid` unless given);
2. owners (:meth:`Partition.fractional`, :meth:`Partition.owner`) give the owned counts and
   every rank's extent (its box grown to hold its atoms, as :meth:`Partition.extent`);
3. every atom's images inside every rank's region grown by the halo thickness, counted with
   the arithmetic of :func:`~xnn.distributed.domain.partition.image_shifts`
   (``ceil(low - u) .. floor(high - u)`` per periodic axis, the closed interval along the
   others) on the candidate ranks of its block: ghosts (images of other ranks' atoms and
   periodic images of the rank's own), received rows (images of other ranks' atoms), sent
   rows (this rank's atoms' images in other ranks' regions), and the receivers of the
   local edges (owned atoms and, in mode halo, images within ``halo_width - cutoff`` of the
   region, as :func:`~xnn.distributed.domain.local.build_local_domain` filters them).
   Peers are :meth:`Partition.peers` of the extents; the staged exchange's messages are
   those peers routed stage by stage (:func:`~.counts.staged_messages`).

The liquid (a jittered crystal) is not streamed whole: :mod:`.jittered` sums its crystal
sites factor by factor and streams only the atoms whose site lies within the jitter of a
box or region face, through the same per-block :func:`~.stream.visit` (the same counts;
``tests/test_cost_jittered.py``). Crystals are summed factor by factor (:mod:`.separable`).

Edges: the local graph's edges within ``cutoff`` (the ones a model with a skin evaluates)
are the receivers' neighbour counts (every neighbour of a receiver is in the halo, since
receiver width + cutoff <= halo width). Neighbour counts are exact (site offsets of the FCC
lattice, jittered distances in the liquid); above ``exact_edges`` atoms the liquid's are
sampled (a seeded fraction of the atoms, the estimate and its standard error stated in
``method``; the banded liquid: a difference estimator on at most ``max_sampled`` atoms).

Graph mode: owners are blocks of the project's atom order
(:func:`~xnn.distributed.graph.order.morton_codes`, ties by id, as
:func:`~xnn.distributed.graph.order.assign_owners`), found without sorting the atoms
(:mod:`.blocks`: each rank's first atom an order statistic of the streamed codes); every
rank all-gathers: it sends its
owned rows and receives the other ``N - owned`` at each exchange, from ``P - 1`` peers.
Its ghosts are the distinct atoms of other ranks within ``halo_width`` (the edges' reach,
cutoff + skin) of an owned atom, its edges those of its owned receivers within
``halo_width`` (the graph layout evaluates the whole list). Exact up to ``exact_edges``
atoms, sampled above it (ghosts and the liquid's edges; the liquid's on at most
``graph_max_sampled`` atoms).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import Tensor

from xnn.distributed.cost.blocks import graph_owners
from xnn.distributed.cost.counts import RankCounts, peer_counts
from xnn.distributed.cost.jittered import banded_counts
from xnn.distributed.cost.separable import (
    NotSeparable,
    neighbour_weights,
    separable_bounds,
    separable_counts,
    separable_histograms,
)
from xnn.distributed.cost.stream import Sums, add, owners_and_extents, regions, visit
from xnn.distributed.cost.systems import System, make_system
from xnn.distributed.domain.balance import check_balance
from xnn.distributed.domain.partition import (
    Partition,
    axis_histograms,
    balanced,
    fractional_bounds,
    partition_from_bounds,
)
from xnn.distributed.graph.order import ORDERS
from xnn.errors import InputError

PLAN_MODES = ("halo", "sync", "graph")
BLOCK = 1 << 21  #: atoms per streamed block (fewer when each has many candidate ranks)
EXACT_EDGES = 200_000  #: above this many atoms, sampled counts where exact ones are costly
SAMPLE = 0.05  #: the fraction of atoms sampled above :data:`EXACT_EDGES`
MAX_SAMPLED = 200_000  #: the liquid's spatial plans: atoms whose edges are sampled, at most
GRAPH_MAX_SAMPLED = 10**6  #: the liquid's graph plans: atoms sampled, at most


def _sampled(sys: System, ids: np.ndarray, sample: float) -> np.ndarray:
    from xnn.distributed.cost.systems import _hash

    return _hash(sys.seed + 1, ids, 3) < sample


def _coordination(sys: System, ids: np.ndarray, reach: float, sample: float | None,
                  cache: dict, nbr: np.ndarray | None = None) -> tuple[Tensor, Tensor]:
    """``(weight [n], variance [n])`` of each atom's neighbour count within ``reach``: exact
    (variance 0), or for the liquid above the exact limit, ``count / sample`` on a seeded
    sample of atoms (0 elsewhere) with variance ``count^2 (1 - sample) / sample^2``. The
    liquid's neighbours within ``reach`` of the sampled atoms (all atoms without a sample)
    are looked up unless given as ``nbr``."""
    n = len(ids)
    if sys.name == "fcc":  # every site alike
        if "fcc" not in cache:
            cache["fcc"] = int((sys.neighbors(ids[:1], reach) >= 0).sum())
        return torch.full((n,), float(cache["fcc"]), dtype=torch.float64), torch.zeros(n)
    if sys.name in ("slab", "cylinder"):  # alike per z plane / per site of a cross-section
        key = sys.sites(ids)[:, 2] if sys.name == "slab" else None
        if sys.name == "cylinder":
            n_layer = len(sys._layer[0]) + len(sys._layer[1])
            key = ids % n_layer
        table = cache.get(sys.name)
        if table is None:
            reps = (np.array([sys.ids_of(np.array([[z % 2, 0, z]]))[0]
                              for z in range(2 * sys.cells[2])]) if sys.name == "slab"
                    else np.arange(n_layer))
            table = cache[sys.name] = (sys.neighbors(reps, reach) >= 0).sum(1)
        return torch.from_numpy(table[key].astype(np.float64)), torch.zeros(n)
    if sample is None:
        c = (sys.neighbors(ids, reach) if nbr is None else nbr) >= 0
        return torch.from_numpy(c.sum(1).astype(np.float64)), torch.zeros(n)
    pick = _sampled(sys, ids, sample)
    c = np.zeros(n)
    c[pick] = ((sys.neighbors(ids[pick], reach) if nbr is None else nbr) >= 0).sum(1) / sample
    return torch.from_numpy(c), torch.from_numpy(c * c * (1 - sample))


# ---------------------------------------------------------------------- spatial modes
def _partition(sys: System, n_ranks: int, halo_width: float, grid, block: int,
               weights: dict | None, balance: str = "none") -> Partition:
    """The partition of :meth:`SpatialLayout.partition`: bounds, grid, and with balance
    ``shift`` the cuts of the summed per-axis histograms (from the crystal's factors, or
    streamed), by the same functions."""
    cell, pbc = sys.cell, sys.pbc
    bounds = torch.zeros(6, dtype=torch.float64)
    if not bool(pbc.all()) and weights is not None:
        bounds = separable_bounds(sys, weights)
    elif not bool(pbc.all()):
        bounds = torch.full((6,), float("-inf"), dtype=torch.float64)
        for ids in sys.blocks(block):
            b = fractional_bounds(torch.from_numpy(sys.positions(ids)), cell)
            bounds = torch.maximum(bounds, b)
    part = partition_from_bounds(-bounds[3:], bounds[:3], cell, pbc, n_ranks, halo_width,
                                 grid)
    if balance == "none":
        return part
    if weights is not None:
        hist = separable_histograms(sys, part, weights)
    else:
        hist = sum(axis_histograms(part, part.fractional(torch.from_numpy(
            sys.positions(ids)))[0]) for ids in sys.blocks(block))
    return balanced(part, hist, halo_width)


def _separable(sys: System, n_ranks: int, mode: str, cutoff: float, halo_width: float, grid,
               block: int, balance: str = "none") -> RankCounts:
    weights = neighbour_weights(sys, cutoff)
    part = _partition(sys, n_ranks, halo_width, grid, block, weights, balance)
    receiver_width = halo_width - cutoff if mode == "halo" else 0.0
    owned, held, own_img, send, edges, extents = separable_counts(
        sys, part, halo_width, receiver_width, weights)
    peers, staged = peer_counts(part, extents, halo_width)
    return RankCounts(mode, tuple(part.grid), float(halo_width), *_ints(
        owned, held - owned, edges, send, held - own_img, peers), staged_peers=staged)


def _spatial(sys: System, n_ranks: int, mode: str, cutoff: float, halo_width: float, grid,
             block: int, sample: float | None,
             balance: str = "none") -> tuple[RankCounts, str]:
    part = _partition(sys, n_ranks, halo_width, grid, block, None, balance)
    owned, extents = owners_and_extents(sys, part, sys.blocks(block))
    receiver_width = halo_width - cutoff if mode == "halo" else 0.0
    reg = regions(part, extents, halo_width, receiver_width, block)
    sums, cache = Sums.zeros(n_ranks), {}
    for ids in sys.blocks(reg.step):
        weight, var = _coordination(sys, ids, cutoff, sample, cache)
        visit(sys, reg, ids, sums, weight, var)
    peers, staged = peer_counts(part, extents, halo_width)
    counts = RankCounts(mode, tuple(part.grid), float(halo_width), *_ints(
        owned, sums.held - owned, sums.edges,
        sums.send, sums.recv, peers), staged_peers=staged)
    return counts, _edge_error(sums)


def _banded(sys: System, n_ranks: int, mode: str, cutoff: float, halo_width: float, grid,
            block: int, sample: float | None) -> tuple[RankCounts, str]:
    """The liquid's plan by :mod:`.jittered` (crystal sites factor by factor, the band of
    atoms near a face streamed): the same counts as :func:`_spatial`."""
    part = _partition(sys, n_ranks, halo_width, grid, block, None)
    counts, facts = banded_counts(sys, part, mode, cutoff, halo_width, block, sample)
    how = (f"exact: owned, ghost, sent/received rows, peers (crystal sites summed factor by "
           f"factor; the {facts['band']:,} atoms whose site lies within the jitter of a box "
           f"or region face streamed); ")
    if sample is None:
        how += "exact: edges (every atom's neighbours)"
    else:
        sums = Sums.zeros(n_ranks)
        sums.edges, sums.edges_var = counts[2], facts["edges_var"]
        how += (f"sampled: edges (difference estimator: K = {facts['K']:.3f} x exact receivers "
                f"+ a seeded {sample:.3g} of the atoms' (neighbours - K) / {sample:.3g})"
                + _edge_error(sums))
    return (RankCounts(mode, tuple(part.grid), float(halo_width), *_ints(*counts),
                       staged_peers=facts["staged"]), how)


def _ints(owned, ghost, edges, send, recv, peers) -> tuple[np.ndarray, ...]:
    return tuple(np.rint(np.asarray(x, dtype=np.float64)).astype(np.int64)
                 for x in (owned, ghost, edges, send, recv, peers))


def _edge_error(sums: Sums) -> str:
    if not sums.edges_var.any():
        return ""
    rel = np.sqrt(sums.edges_var) / np.maximum(sums.edges, 1)
    return f"; largest relative standard error of a rank's edges {rel.max():.2g}"


# ---------------------------------------------------------------------- graph mode
def _graph(sys: System, n_ranks: int, halo_width: float, order: str, block: int,
           sample: float | None) -> tuple[RankCounts, str]:
    owner = graph_owners(sys, n_ranks, order, block)
    sums, cache = Sums.zeros(n_ranks), {}
    ghost_var = np.zeros(n_ranks)
    for ids in sys.blocks(block // 8):
        own = torch.from_numpy(owner[ids].astype(np.int64))
        add(sums.owned, own)
        pick = _sampled(sys, ids, sample) if sample else np.ones(len(ids), dtype=bool)
        nbr = sys.neighbors(ids[pick], halo_width)
        weight, var = _coordination(sys, ids, halo_width, sample, cache, nbr)
        add(sums.edges, own, weight)
        add(sums.edges_var, own, var)
        ranks = np.where(nbr >= 0, owner[np.maximum(nbr, 0)].astype(np.int64), -1)
        ranks = np.where(ranks == owner[ids[pick]][:, None], -1, ranks)
        ranks.sort(1)
        first = np.ones_like(ranks, dtype=bool)
        first[:, 1:] = ranks[:, 1:] != ranks[:, :-1]
        hit = ranks[first & (ranks >= 0)]
        c = np.bincount(hit, minlength=n_ranks).astype(np.float64)
        if sample:
            ghost_var += c * (1 - sample) / sample ** 2
            c /= sample
        sums.held += c
    total = sys.n_atoms
    err = _edge_error(sums)
    if ghost_var.any():
        rel = np.sqrt(ghost_var) / np.maximum(sums.held, 1)
        err += f"; largest relative standard error of a rank's ghosts {rel.max():.2g}"
    counts = RankCounts("graph", (n_ranks, 1, 1), 0.0, *_ints(
        sums.owned, sums.held, sums.edges, sums.owned, total - sums.owned,
        np.full(n_ranks, n_ranks - 1)))
    return counts, err


# ---------------------------------------------------------------------- the entry point
def plan_counts(system: str, n_atoms: int, n_ranks: int, *, mode: str, cutoff: float,
                halo_width: float, seed: int = 0, order: str = "morton", grid=None,
                lattice_constant: float = 3.61, block: int = BLOCK,
                exact_edges: int = EXACT_EDGES, sample: float = SAMPLE,
                stream: bool = False, max_streamed: int = 10**9,
                max_sampled: int = MAX_SAMPLED,
                graph_max_sampled: int = GRAPH_MAX_SAMPLED,
                balance: str = "none") -> RankCounts:
    """Per-rank counts of decomposing ``system`` over ``n_ranks`` ranks, without a model.

    Args:
        system: ``fcc``, ``liquid``, ``slab`` or ``cylinder`` (:mod:`.systems`).
        n_atoms: about this many atoms (whole cells; the counts' ``n_atoms`` is exact).
        n_ranks: domain ranks.
        mode: ``halo``, ``sync`` (boxes) or ``graph`` (blocks of an atom order).
        cutoff: Å, the model's cutoff (edges shorter than it are evaluated; in mode halo the
            receivers of local edges reach ``halo_width - cutoff`` beyond the box).
        halo_width: Å, the ghost shell (receptive field + skin in mode halo, cutoff + skin
            in mode sync); in mode graph the edges' reach (cutoff + skin).
        seed: the liquid's jitter. order: graph mode's atom order (``morton``, ``index``).
        grid: ``(px, py, pz)`` or ``None`` (the project's choice, smallest halo volume).
        lattice_constant: Å (3.61: Cu).
        block: atoms per streamed block.
        exact_edges: up to this many atoms every count is exact; above it the liquid's
            edges and graph mode's ghosts are sampled on a seeded fraction ``sample`` of the
            atoms (the method says so, with the largest relative standard error).
        stream: visit every atom in the spatial modes even where the crystal factors
            (:mod:`.separable`; the same counts, for checking).
        max_sampled: the liquid's spatial plans sample the edges of at most this many
            atoms (the fraction ``min(sample, max_sampled / n_atoms)``).
        graph_max_sampled: the liquid's graph plans sample the ghosts and edges of at most
            this many atoms (its neighbour search, over jittered positions, costs far more
            an atom than a crystal's: docs/distributed.md, Ghost plans at scale).
        max_streamed: refuse (``InputError``) to stream more atoms than this in the
            spatial modes (a crystal whose extents do not factor, a liquid).
        balance: the boxes' cuts, as ``parallel.balance``: ``none`` (equal widths) or
            ``shift`` (cuts at the atom-count quantiles of each axis, by
            :func:`~xnn.distributed.domain.partition.balanced`); spatial modes only.
    Returns:
        :class:`~.counts.RankCounts` whose ``method`` says how each count was obtained.

    Raises:
        InputError: an unknown system, mode, order or balance (``shift`` in mode graph);
            ``halo_width < cutoff``; more than ``max_streamed`` atoms to stream.
    """
    if mode not in PLAN_MODES:
        raise InputError(f"mode must be one of {list(PLAN_MODES)}, got {mode!r}")
    if check_balance(balance) != "none" and mode == "graph":
        raise InputError(f"balance {balance!r} cuts boxes; mode graph has none")
    if order not in ORDERS:
        raise InputError(f"order must be one of {list(ORDERS)}, got {order!r}")
    if halo_width < cutoff:
        raise InputError(f"halo_width {halo_width} Å is below the cutoff {cutoff} Å")
    sys = make_system(system, n_atoms, seed, lattice_constant)
    over = sys.n_atoms > exact_edges
    t0 = time.perf_counter()
    if mode == "graph":
        if over and sys.jitter:
            sample = min(sample, graph_max_sampled / sys.n_atoms)
        counts, err = _graph(sys, n_ranks, halo_width, order, block, sample if over else None)
        how = ("exact: owned (blocks of the atom order; each rank's first atom an order "
               "statistic of the streamed codes, no sort), sent/received rows (all-gather), "
               "peers; " + ("sampled" if over else "exact") + ": ghosts, edges")
        if over:
            how += f" (sampled: a seeded {sample:.3g} of the atoms, counts scaled){err}"
    else:
        counts = None
        if not stream and sys.jitter and check_balance(balance) == "none":
            try:
                counts, how = _banded(sys, n_ranks, mode, cutoff, halo_width, grid, block,
                                      min(sample, max_sampled / sys.n_atoms) if over
                                      else None)
            except NotSeparable:
                counts = None
        if not stream and counts is None:
            try:
                counts = _separable(sys, n_ranks, mode, cutoff, halo_width, grid, block,
                                    balance)
                how = ("exact: owned, ghost, sent/received rows, peers, edges (a union of "
                       "products of per-axis sets, summed factor by factor)")
            except NotSeparable as err:
                if sys.n_atoms > max_streamed:
                    raise InputError(
                        f"{system}: {sys.n_atoms:,} atoms do not factor ({err}) and streaming "
                        f"them is over max_streamed={max_streamed:,}") from None
                counts = None
        if counts is None and sys.n_atoms > max_streamed:
            raise InputError(f"{system}: streaming {sys.n_atoms:,} atoms is over "
                             f"max_streamed={max_streamed:,}")
        if counts is None:
            sampled_edges = over and sys.name == "liquid"
            counts, err = _spatial(sys, n_ranks, mode, cutoff, halo_width, grid, block,
                                   sample if sampled_edges else None, balance)
            how = "exact: owned, ghost, sent/received rows, peers (every atom streamed); "
            how += (f"sampled: edges (neighbour counts of a seeded {sample:g} of the "
                    f"atoms){err}" if sampled_edges else "exact: edges")
    how += f"; streamed in blocks, {time.perf_counter() - t0:.1f} s"
    return dataclasses.replace(counts, method=how)
