"""What one decomposition of one system costs in atoms and rows, per rank: the interface
between the ghost plans at scale (:mod:`.plan`) and the step-cost model (:mod:`.model`).

Counts come from the project's own partition code (:mod:`xnn.distributed.domain.partition`
for spatial boxes, :mod:`xnn.distributed.graph.order` for graph mode), exactly where the
system fits in memory and by a stated sampling method where it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xnn.distributed.domain.partition import box_of, rank_of
from xnn.distributed.domain.staged import displacement


@dataclass(frozen=True)
class RankCounts:
    """Per-rank counts of one decomposition (arrays of length ``n_ranks``, int64).

    Attributes:
        mode: the decomposition mode (a key of :data:`xnn.distributed.modes.MODES` other
            than ``auto``/``spatial``: ``halo``, ``sync`` or ``graph``).
        grid: ``(px, py, pz)`` box grid (spatial modes), ``(n_ranks, 1, 1)`` in graph mode.
        halo_width: Å, the ghost shell's width (receptive field or one cutoff, plus skin);
            ``0`` in graph mode.
        owned: atoms each rank owns.
        ghost: ghost atoms each rank holds (images of other ranks' atoms and periodic
            images of its own); in graph mode the rows it receives at each sync point.
        edges: directed edges within the cutoff whose receiver the rank evaluates.
        send_rows: rows each rank sends per exchange (halo: once per step; sync and graph:
            once per sync point).
        recv_rows: rows each rank receives per exchange.
        peers: messages each rank sends per exchange (distinct peer ranks).
        method: ``"exact"`` (every atom placed) or how the counts were estimated
            (``"sampled: ..."``), said in every report that shows them.
        staged_peers: messages each rank sends per *staged* exchange
            (``parallel.exchange=staged``: the stages' sends, :func:`staged_messages`), or
            ``None`` where not counted. Its rows are priced as ``send_rows``/``recv_rows``:
            each row a rank receives in a stage is one of its ghosts when the halo is at most
            a box wide (the forwarded corner rows are ghosts of the rank that forwards them),
            so the stages move the shell the direct plan moves.
    """

    mode: str
    grid: tuple[int, int, int]
    halo_width: float
    owned: np.ndarray
    ghost: np.ndarray
    edges: np.ndarray
    send_rows: np.ndarray
    recv_rows: np.ndarray
    peers: np.ndarray
    method: str = "exact"
    staged_peers: np.ndarray | None = None

    @property
    def n_ranks(self) -> int:
        return int(self.owned.shape[0])

    @property
    def n_atoms(self) -> int:
        return int(self.owned.sum())

    @property
    def held(self) -> np.ndarray:
        """Atoms each rank holds (owned + ghost)."""
        return self.owned + self.ghost


def peer_counts(part, extents, halo_width: float) -> tuple[np.ndarray, np.ndarray]:
    """``(peers, staged)``: per rank of the partition ``part`` (a
    :class:`~xnn.distributed.domain.partition.Partition`) with owned regions ``extents``, its
    direct peers (:meth:`Partition.peers`) and the messages of its staged exchange
    (:func:`staged_messages`)."""
    lists = [part.peers(extents, halo_width, q) for q in range(int(extents.shape[0]))]
    return (np.array([len(x) for x in lists], dtype=np.int64),
            staged_messages(part.grid, [bool(b) for b in part.pbc], lists))


def staged_messages(grid: Sequence[int], pbc: Sequence[bool],
                    peers: Sequence[Sequence[int]]) -> np.ndarray:
    """``[n_ranks]`` messages each rank sends per staged exchange, from every rank's direct
    peers (each peer receiving at least one row): the routing of
    :mod:`xnn.distributed.domain.staged` run on ranks instead of rows (x, then y, then z;
    per stage one message to each of the -1 and +1 boxes that some held packet moves
    toward, one when they are the same rank)."""
    grid = tuple(int(g) for g in grid)
    n = grid[0] * grid[1] * grid[2]
    coords = [box_of(r, grid) for r in range(n)]
    held = [{(int(q), r) for q in peers[r]} for r in range(n)]  # (destination, source)
    out = np.zeros(n, dtype=np.int64)
    for a in range(3):
        g, periodic = grid[a], bool(pbc[a])
        if g == 1:
            continue
        hops = max((abs(displacement(coords[r][a], coords[d][a], g, periodic))
                    for r in range(n) for d, _ in held[r]), default=0)
        for _ in range(hops):
            moved = [set() for _ in range(n)]
            for r in range(n):
                targets = set()
                for d, src in held[r]:
                    step = displacement(coords[r][a], coords[d][a], g, periodic)
                    if step == 0:
                        moved[r].add((d, src))
                        continue
                    c = list(coords[r])
                    c[a] = (c[a] + (1 if step > 0 else -1)) % g
                    q = rank_of(c, grid)
                    targets.add(q)
                    moved[q].add((d, src))
                out[r] += len(targets)
            held = moved
    return out


def staged_messages_uniform(grid: Sequence[int], reach: Sequence[int]) -> int:
    """Messages per staged exchange of every rank of a periodic grid of equal boxes whose
    halo reaches ``reach[a]`` boxes along axis ``a`` (the same on every rank): per axis of
    more than one box, per hop ``h``, one message toward each side some box ``h`` or more
    steps away lies on (the shorter way round; one when the two sides are one rank)."""
    total = 0
    for g, r in zip(grid, reach):
        g, r = int(g), int(r)
        if g == 1:
            continue
        steps = {displacement(0, d % g, g, True) for d in range(-r, r + 1)} - {0}
        for h in range(1, max((abs(s) for s in steps), default=0) + 1):
            sides = {1 for s in steps if s >= h} | {-1 for s in steps if s <= -h}
            total += 1 if g == 2 else len(sides)
    return total
