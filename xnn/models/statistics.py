"""Dataset statistics that set a model's reference energies, scale and shift.

Every function takes ``graphs``: one :class:`~xnn.data.graph.AtomicGraph` (possibly a batch
of many systems), or any iterable of them (a list, a dataset, a data loader), or of
``ase.Atoms`` carrying energies/forces (from a calculator or ``atoms.info["energy"]``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.neighbors.coincident import ClosePair

Graphs = AtomicGraph | Iterable


def _from_atoms(atoms) -> AtomicGraph:
    extra = {}
    calc_results = getattr(atoms.calc, "results", {}) if atoms.calc is not None else {}
    energy = calc_results.get("energy", atoms.info.get("energy"))
    forces = calc_results.get("forces", atoms.arrays.get("forces"))
    if energy is not None:
        extra[K.ENERGY] = np.array([float(energy)])
    if forces is not None:
        extra[K.FORCES] = np.asarray(forces)
    return AtomicGraph.from_arrays(
        atoms.positions, atoms.numbers, atoms.cell[:], atoms.pbc, extra=extra
    )


def iter_graphs(graphs: Graphs) -> Iterator[AtomicGraph]:
    """Yield ``AtomicGraph`` s from a graph, an iterable of graphs, or of ``ase.Atoms``."""
    if isinstance(graphs, AtomicGraph):
        yield graphs
        return
    for item in graphs:
        if isinstance(item, AtomicGraph):
            yield item
        elif hasattr(item, "get_positions") and hasattr(item, "numbers"):
            yield _from_atoms(item)
        else:
            raise InputError(f"expected AtomicGraph or ase.Atoms items, got {type(item).__name__}")


def _composition(graph: AtomicGraph, index: Mapping[int, int]) -> np.ndarray:
    """``[n_systems, n_species]`` element counts of each system."""
    numbers = graph.numbers.cpu().numpy()
    batch = graph.batch.cpu().numpy()
    unknown = sorted(set(np.unique(numbers).tolist()) - set(index))
    if unknown:
        raise InputError(f"data holds species {unknown} not in the species list {sorted(index)}")
    counts = np.zeros((graph.n_systems, len(index)))
    cols = np.array([index[int(z)] for z in numbers], dtype=np.int64)
    np.add.at(counts, (batch, cols), 1.0)
    return counts


def _require(graph: AtomicGraph, field: str) -> torch.Tensor:
    if field not in graph:
        raise InputError(f"statistics need {field!r} labels, absent from a structure")
    return graph[field]


def fit_e0(graphs: Graphs, species: Sequence[int]) -> dict[int, float]:
    """Per-element reference energies by least squares of total energy on composition.

    Structures whose energy label is missing (NaN) are skipped.

    Solves ``min_E0 Σ_s (E_s - Σ_Z n_sZ E0_Z)^2``; elements that never occur get 0
    (minimum-norm solution), so do linearly dependent ones only as far as the data allows.

    Args:
        graphs: structures with ``energy`` labels (eV).
        species: atomic numbers to fit.
    Returns:
        ``{Z: E0_Z}`` in eV.
    """
    species = [int(z) for z in species]
    index = {z: k for k, z in enumerate(species)}
    rows, energies = [], []
    for g in iter_graphs(graphs):
        rows.append(_composition(g, index))
        energies.append(_require(g, K.ENERGY).detach().cpu().double().numpy().reshape(-1))
    if not rows:
        raise InputError("fit_e0 needs at least one structure")
    a, b = np.concatenate(rows), np.concatenate(energies)
    keep = np.isfinite(b)  # missing labels are NaN
    if not keep.any():
        raise InputError("fit_e0 needs at least one structure with an energy label")
    e0, *_ = np.linalg.lstsq(a[keep], b[keep], rcond=None)
    return {z: float(e0[index[z]]) for z in species}


def _e0_energy(graph: AtomicGraph, e0: Mapping[int, float] | None) -> np.ndarray:
    """``[n_systems]`` sum of reference energies of each system."""
    if not e0:
        return np.zeros(graph.n_systems)
    table = np.zeros(119)
    for z, v in e0.items():
        table[int(z)] = float(v)
    out = np.zeros(graph.n_systems)
    np.add.at(out, graph.batch.cpu().numpy(), table[graph.numbers.cpu().numpy()])
    return out


def energy_per_atom_stats(
    graphs: Graphs, e0: Mapping[int, float] | None = None
) -> dict[str, float]:
    """Mean and standard deviation of ``(E_s - Σ_i E0[Z_i]) / N_s`` over structures.

    Structures whose energy label is missing (NaN) are skipped.

    Returns:
        ``{"mean": eV/atom, "std": eV/atom, "count": number of structures}``.
    """
    values = []
    for g in iter_graphs(graphs):
        e = _require(g, K.ENERGY).detach().cpu().double().numpy().reshape(-1)
        n = g.n_atoms_per_system.cpu().numpy()
        values.append((e - _e0_energy(g, e0)) / np.maximum(n, 1))
    if not values:
        raise InputError("energy_per_atom_stats needs at least one structure")
    v = np.concatenate(values)
    v = v[np.isfinite(v)]  # missing labels are NaN
    if v.size == 0:
        raise InputError("energy_per_atom_stats needs at least one structure with an energy label")
    return {"mean": float(v.mean()), "std": float(v.std()), "count": int(v.size)}


def force_rms(graphs: Graphs) -> float:
    """Root mean square of all force components ``sqrt(mean(F_ia^2))`` (eV/Å); NaN skipped."""
    total, count = 0.0, 0
    for g in iter_graphs(graphs):
        f = _require(g, K.FORCES).detach().double()
        f = f[torch.isfinite(f)]  # missing labels are NaN
        total += float((f * f).sum())
        count += f.numel()
    if count == 0:
        raise InputError("force_rms needs at least one atom with force labels")
    return math.sqrt(total / count)


def _chunks(graphs: Graphs, size: int) -> Iterator[AtomicGraph]:
    """The geometry of ``graphs`` (labels dropped) joined into batches of about ``size``
    systems."""
    part: list[AtomicGraph] = []
    for g in iter_graphs(graphs):
        part.append(AtomicGraph({k: g[k] for k in (K.POSITIONS, K.NUMBERS, K.CELL, K.PBC,
                                                   K.BATCH)}, validate=False))
        if sum(p.n_systems for p in part) >= size:
            yield AtomicGraph.concat(part)
            part = []
    if part:
        yield AtomicGraph.concat(part)


class NeighborCounts(NamedTuple):
    """What :func:`neighbor_counts` found.

    Attributes:
        edges: neighbour pairs within the cutoff (full list, images counted).
        atoms: atoms.
        close: the closest pair of the first system with two atoms closer than
            :data:`~xnn.neighbors.coincident.MIN_DISTANCE` (its ``system``: the index of
            that system among all systems of the graphs), or ``None``.
    """

    edges: int
    atoms: int
    close: ClosePair | None = None


def neighbor_counts(graphs: Graphs, cutoff: float, chunk: int = 64) -> NeighborCounts:
    """Neighbour pairs within ``cutoff`` (Å, full list, images counted) and atoms of
    ``graphs`` (sums over parts give :func:`average_num_neighbors` of the whole, exactly),
    and, read from the same lists (for ``cutoff`` >= 0.1 Å), the first system with
    coincident atoms. One neighbor list per ``chunk`` systems (faster than one per
    structure for small cells)."""
    from xnn.neighbors import with_edges
    from xnn.neighbors.coincident import MIN_DISTANCE, first_close_edge

    edges, atoms, systems, close = 0, 0, 0, None
    for g in _chunks(graphs, chunk):
        g = with_edges(g, float(cutoff))
        edges += int(g.edge_index.shape[1])
        atoms += g.n_atoms
        pair = first_close_edge(g) if close is None and cutoff >= MIN_DISTANCE else None
        if pair is not None:
            close = pair._replace(system=systems + pair.system)
        systems += g.n_systems
    return NeighborCounts(edges, atoms, close)


def average_num_neighbors(graphs: Graphs, cutoff: float) -> float:
    """Mean number of neighbours within ``cutoff`` (Å) per atom (full list, images counted)."""
    edges, atoms, _ = neighbor_counts(graphs, cutoff)
    if atoms == 0:
        raise InputError("average_num_neighbors needs at least one atom")
    return edges / atoms


# --------------------------------------------------------------------------- stored counts
# The same statistics from per-structure counts (:class:`~xnn.data.datasets.EntryStatistics`,
# stored by the prepared format): no structure is read and no neighbor list built.
def fit_e0_counts(composition: np.ndarray, energy: np.ndarray,
                  species: Sequence[int]) -> dict[int, float]:
    """:func:`fit_e0` from ``composition [k, 119]`` (atoms per atomic number) and ``energy
    [k]`` (eV, NaN: no label): the same least squares on the same matrix."""
    species = [int(z) for z in species]
    keep = np.isfinite(energy)
    if not keep.any():
        raise InputError("fit_e0 needs at least one structure with an energy label")
    a = np.asarray(composition)[keep][:, species].astype(np.float64)
    e0, *_ = np.linalg.lstsq(a, np.asarray(energy, np.float64)[keep], rcond=None)
    return {z: float(v) for z, v in zip(species, e0)}


def energy_per_atom_counts(composition: np.ndarray, energy: np.ndarray,
                           e0: Mapping[int, float] | None = None) -> dict[str, float]:
    """:func:`energy_per_atom_stats` from ``composition [k, 119]`` and ``energy [k]``."""
    table = np.zeros(119)
    for z, v in (e0 or {}).items():
        table[int(z)] = float(v)
    comp = np.asarray(composition, np.float64)
    v = (np.asarray(energy) - comp @ table) / np.maximum(comp.sum(1), 1)
    v = v[np.isfinite(v)]
    if v.size == 0:
        raise InputError("energy_per_atom_stats needs at least one structure with an energy label")
    return {"mean": float(v.mean()), "std": float(v.std()), "count": int(v.size)}


def force_rms_counts(force_sq: np.ndarray, force_count: np.ndarray) -> float:
    """:func:`force_rms` from per-structure sums of squared force labels and their counts."""
    count = int(np.sum(force_count))
    if count == 0:
        raise InputError("force_rms needs at least one atom with force labels")
    return math.sqrt(float(np.sum(force_sq)) / count)
