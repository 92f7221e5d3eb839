"""Coincident atoms: two atoms (or an atom and another's periodic image) closer than any
physical bond. The shortest bond is H₂'s 0.74 Å; below :data:`MIN_DISTANCE` a structure
is a mistake (a duplicated atom, a wrong unit, a bad cell), on which LJ gives NaN and a
learned model an arbitrary finite energy: the ASE calculator and the training data refuse
it (:mod:`xnn.io.calculator`, :mod:`xnn.training.data`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.neighbors.api import with_edges

MIN_DISTANCE = 0.1  # Å


class ClosePair(NamedTuple):
    """The closest pair of a graph: system, atom indices within that system, distance (Å)."""

    system: int
    i: int
    j: int
    distance: float


def closest_pair(graph: AtomicGraph) -> ClosePair | None:
    """The shortest edge of a graph with edges (``None`` without edges)."""
    if graph.edge_index.shape[1] == 0:
        return None
    d = graph.edge_vectors().detach().norm(dim=-1)
    e = int(torch.argmin(d))
    j, i = int(graph.edge_index[0, e]), int(graph.edge_index[1, e])
    s = int(graph.batch[i])
    first = int(graph.ptr[s])
    return ClosePair(s, min(i, j) - first, max(i, j) - first, float(d[e]))


def _short_edges(graph: AtomicGraph, min_distance: float) -> AtomicGraph:
    """``graph``'s positions and cell with the edges shorter than ``min_distance``, from the
    torch cell list: it caps its bins by the atom count, so a small radius costs nothing
    more (vesin's bins follow the radius: at 0.1 Å it was far slower on small cells than
    the torch cell list over batches of such cells)."""
    plain = AtomicGraph({k: graph[k] for k in ("positions", "numbers", "cell", "pbc", "batch")},
                        validate=False)
    return with_edges(plain, float(min_distance), backend="torch")


def find_close_pair(graph: AtomicGraph, min_distance: float = MIN_DISTANCE) -> ClosePair | None:
    """The closest pair of ``graph`` (without edges, batched) if closer than ``min_distance``
    (Å), else ``None``. One neighbor list for ``min_distance``."""
    if min_distance <= 0 or graph.n_atoms < 2 and not bool(graph.pbc.any()):
        return None
    pair = closest_pair(_short_edges(graph, min_distance))
    return pair if pair is not None and pair.distance < min_distance else None


def first_close_pair(graph: AtomicGraph, min_distance: float = MIN_DISTANCE
                     ) -> ClosePair | None:
    """The closest pair of the first system of ``graph`` (without edges, batched) that holds
    two atoms closer than ``min_distance`` (Å); ``None`` when no system does. The answer for
    a system does not depend on the other systems of the batch."""
    if min_distance <= 0:
        return None
    return first_close_edge(_short_edges(graph, min_distance), min_distance)


def first_close_edge(graph: AtomicGraph, min_distance: float = MIN_DISTANCE
                     ) -> ClosePair | None:
    """As :func:`first_close_pair` for a graph that has edges already, for a cutoff of at
    least ``min_distance`` (every closer pair is one of its edges): no neighbor list."""
    if graph.edge_index.shape[1] == 0 or _none_close_cpu(graph, min_distance):
        return None
    d = graph.edge_vectors().detach().norm(dim=-1)
    system = graph.batch.index_select(0, graph.edge_index[1])
    close = d < min_distance
    if not bool(close.any()):
        return None
    s = int(system[close].min())
    e = int(torch.where(system == s, d, torch.full_like(d, float("inf"))).argmin())
    j, i = int(graph.edge_index[0, e]), int(graph.edge_index[1, e])
    first = int(graph.ptr[s])
    return ClosePair(s, min(i, j) - first, max(i, j) - first, float(d[e]))


def _none_close_cpu(graph: AtomicGraph, min_distance: float) -> bool:
    """True when no edge of a CPU graph is shorter than ``min_distance`` (x 1.01, so that
    rounding cannot hide a pair :func:`first_close_edge` would find), found in numpy in one
    thread: over the ~50,000 edges of a training batch, torch's few element-wise ops woke
    its intra-op threads, which on busy cores took 15x longer (90 ms against 6 ms on 2
    loaded cores). False (look closer) on other devices and dtypes."""
    pos, cell = graph.positions, graph.cell
    if pos.device.type != "cpu" or pos.dtype not in (torch.float32, torch.float64):
        return False
    ei = graph.edge_index.numpy()
    p = pos.detach().numpy().astype(np.float64, copy=False)
    vec = np.take(p, ei[0], axis=0) - np.take(p, ei[1], axis=0)
    shifts = graph.get(K.SHIFTS)
    if shifts is not None:
        vec += _shift_vectors(shifts.numpy().astype(np.float64),
                              cell.detach().numpy().astype(np.float64, copy=False),
                              np.take(graph.batch.numpy(), ei[1]))
    limit = (1.01 * float(min_distance)) ** 2
    return not bool((np.einsum("ek,ek->e", vec, vec) < limit).any())


def _shift_vectors(shifts: np.ndarray, cell: np.ndarray, system: np.ndarray) -> np.ndarray:
    """``[E, 3]`` ``shifts[e] @ cell[system[e]]``: one product per system where the edges
    come grouped by system (a batched neighbor list), else one gathered product."""
    if len(system) and (system[1:] >= system[:-1]).all():
        out = np.empty_like(shifts)
        ends = np.cumsum(np.bincount(system, minlength=len(cell)))
        for s, (a, b) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist())):
            if b > a:
                out[a:b] = shifts[a:b] @ cell[s]
        return out
    return np.einsum("ek,ekl->el", shifts, cell[system])
