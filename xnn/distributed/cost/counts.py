"""What one decomposition of one system costs in atoms and rows, per rank: the interface
between the ghost plans at scale (:mod:`.plan`) and the step-cost model (:mod:`.model`).

Counts come from the project's own partition code (:mod:`xnn.distributed.domain.partition`
for spatial boxes, :mod:`xnn.distributed.graph.order` for graph mode), exactly where the
system fits in memory and by a stated sampling method where it does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
