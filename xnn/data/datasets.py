"""Datasets of labelled structures, splits, batching and sharding for training.

A dataset is any object with ``len(ds)``, ``ds[i] -> AtomicGraph`` (one system) and an
``n_atoms`` integer array ``[len(ds)]`` readable without loading structures. The datasets
here also give ``label_counts()`` (``[len(ds), 3]`` labelled items per structure, see
:func:`label_counts_of`), counted once, from their files' arrays where they can;
:class:`~xnn.neighbors.datasets.WithEdges` counts any other dataset by reading it once. A
:class:`View` adds fields to another dataset's structures and takes everything else from it
(its index), reading none of them.
Every structure carries the label fields ``energy [1]`` (eV), ``forces [n, 3]`` (eV/Å)
and ``stress [1, 3, 3]`` (eV/Å³, ASE sign) with NaN where the source has no label (so
batches concatenate), and a ``weight [1]`` (the dataset's loss weight). ``origin(i)``
names the file structure ``i`` comes from and its index in that file, through
:class:`Subset` and :class:`ConcatDataset`.

The neighbor lists are attached by :class:`~xnn.neighbors.datasets.WithEdges` (a layer
above this one).

Batches are lists of structure indices, made once per epoch from a seeded permutation
(``make_batches``): a fixed number of structures, or as many as fit in ``max_atoms`` atoms.
Under data parallelism every rank makes the same global batches and keeps its share
(``shard_batch``), so a run on N ranks sees exactly the global batches of one process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import DataFileError, InputError

HDF5_SUFFIXES = (".h5", ".hdf5")


# --------------------------------------------------------------------------- labels
_LABEL_KEYS = {K.ENERGY: "energy_key", K.FORCES: "forces_key", K.STRESS: "stress_key",
               K.VIRIAL: "virial_key"}


def refuse_non_finite_labels(graph: AtomicGraph, keys: dict[str, str], where: str) -> None:
    """Refuse a label of a one-system graph read from a file that is NaN or infinite.

    A structure without some label is left out of that loss term and metric (the label is
    stored as NaN there, see :func:`normalize_labels`), but a NaN or infinite number written
    in the file is a broken label, not a missing one: it would be left out silently.

    Args:
        graph: one structure with the labels found in the file (before normalisation).
        keys: ``{energy_key, forces_key, stress_key, virial_key}: key`` the labels were
            read under (named in the message).
        where: names the structure, e.g. ``"data.xyz: structure 2"``.
    Raises:
        DataFileError: one line naming ``where``, the label, its key and, for forces, the
            first atoms with a non-finite component.
    """
    for field, key_name in _LABEL_KEYS.items():
        if field not in graph:
            continue
        value = graph[field].detach()
        if bool(torch.isfinite(value).all()):
            continue
        label = f"{field} label {keys[key_name]!r}"
        if field == K.FORCES:
            atoms = torch.nonzero(~torch.isfinite(value).all(-1)).flatten().tolist()
            label += f" of atom{'s' if len(atoms) > 1 else ''} {atoms[:5]}" + (
                f" ({len(atoms)} atoms)" if len(atoms) > 5 else "")
        bad = value[~torch.isfinite(value)].flatten()[0].item()
        raise DataFileError(f"{where}: the {label} is {bad}, not a finite number; fix or "
                            "remove that structure (a structure without this label leaves "
                            "its key out)")


def normalize_labels(graph: AtomicGraph, weight: float = 1.0) -> AtomicGraph:
    """Give a one-system graph the fields ``energy``, ``forces``, ``stress`` (NaN if missing)
    and ``weight``; a ``virial`` label becomes ``stress = -virial / V``."""
    dt, dev = graph.dtype, graph.device
    n = graph.n_atoms
    new: dict[str, torch.Tensor | None] = {}
    if K.ENERGY not in graph:
        new[K.ENERGY] = torch.full((1,), float("nan"), dtype=dt, device=dev)
    else:
        new[K.ENERGY] = graph.energy.reshape(1).to(dt)
    if K.FORCES not in graph:
        new[K.FORCES] = torch.full((n, 3), float("nan"), dtype=dt, device=dev)
    if K.STRESS in graph:
        new[K.STRESS] = graph.stress.reshape(1, 3, 3).to(dt)
    elif K.VIRIAL in graph and bool(graph.pbc.all()):
        new[K.STRESS] = -graph.virial.reshape(1, 3, 3).to(dt) / graph.volume().reshape(1, 1, 1)
    else:
        new[K.STRESS] = torch.full((1, 3, 3), float("nan"), dtype=dt, device=dev)
    new[K.VIRIAL] = None
    new[K.WEIGHT] = torch.full((1,), float(weight), dtype=dt, device=dev)
    return graph.replace(new)


def narrow(values) -> np.ndarray:
    """An integer array of per-structure numbers (atom counts, atom or byte offsets, row ids)
    as int32 where every value fits (4 bytes an entry where int64 took 8; the array itself
    where it is int32 already), else int64: the atom offsets of a 10^8-structure set pass
    ``2**31`` and stay int64. Sums and cumulative sums of int32 arrays are int64 in numpy."""
    a = np.asarray(values)
    if a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    fits = not a.size or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31)
    return a.astype(np.int32 if fits else np.int64, copy=False)


def label_counts_of(graph: AtomicGraph) -> np.ndarray:
    """``[n_systems, 3]`` int32 labelled items per system of a normalised graph: energies
    (0/1), force components (3 × atoms with a finite force) and stress components (0/9), as
    the loss counts them (:func:`xnn.training.losses.labelled`)."""
    b, s = graph.batch, graph.n_systems
    forces_ok = torch.isfinite(graph.forces).all(-1).to(torch.long)
    n_ok = torch.zeros(s, dtype=torch.long, device=graph.device).index_add(0, b, forces_ok)
    stress_ok = torch.isfinite(graph.stress).flatten(1).all(-1)
    return torch.stack([torch.isfinite(graph.energy).long(), 3 * n_ok, 9 * stress_ok.long()],
                       -1).cpu().numpy().astype(np.int32)


def origin_of(dataset, index: int) -> tuple[str, int]:
    """:meth:`LabelledDataset.origin` of a dataset here; ``(its name, index)`` for any other."""
    if isinstance(dataset, LabelledDataset):
        return dataset.origin(index)
    return getattr(dataset, "name", "dataset"), int(index)


def count_labels_by_reading(dataset) -> np.ndarray:
    rows = [label_counts_of(dataset[i]) for i in range(len(dataset))]
    return np.concatenate(rows) if rows else np.zeros((0, 3), np.int32)


class EntryStatistics(NamedTuple):
    """Per-structure numbers that give the training statistics of a set of structures without
    reading them (stored by the prepared format, :mod:`xnn.data.prepared`).

    Attributes:
        n_atoms: ``[k]`` int64 atoms.
        n_edges: ``[k]`` int64 neighbour pairs within the stored cutoff (full list).
        energy: ``[k]`` float64 energy labels (eV; NaN: none).
        composition: ``[k, 119]`` int64 atoms of each atomic number.
        force_sq: ``[k]`` float64 sum of the squared force labels (eV²/Å²).
        force_count: ``[k]`` int64 labelled force components.
    """

    n_atoms: np.ndarray
    n_edges: np.ndarray
    energy: np.ndarray
    composition: np.ndarray
    force_sq: np.ndarray
    force_count: np.ndarray

    @staticmethod
    def concat(parts: Sequence[EntryStatistics]) -> EntryStatistics:
        return EntryStatistics(*(np.concatenate(f) for f in zip(*parts)))


class LabelledDataset:
    """The base of the datasets here: label metadata from ``_count_labels()`` (``[len, 3]``,
    see :func:`label_counts_of`), computed once (:meth:`label_counts`, :meth:`label_masks`,
    :meth:`batch_label_counts`), and :meth:`origin`."""

    _label_counts: np.ndarray | None = None
    name = "dataset"

    def origin(self, index: int) -> tuple[str, int]:
        """``(file, index in that file)`` of structure ``index``, for messages: the file as
        the user named it (here: the dataset's name and ``index``)."""
        return self.name, int(index)

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        """Structures ``indices`` (at least one) as one batched graph, in that order:
        :func:`collate` of ``self[i]`` each. A dataset that reads many structures at once
        (:class:`~xnn.data.prepared.PreparedDataset`) overrides it with the same fields,
        values and dtypes."""
        return collate([self[int(i)] for i in indices])

    def _count_labels(self) -> np.ndarray:
        return count_labels_by_reading(self)

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        """``{index: (atomic number, energy label in eV)}`` of the dataset's isolated-atom
        entries: one-atom structures marked ``config_type=IsolatedAtom`` (MACE's convention,
        :func:`is_isolated_atom`; the energy is NaN where the entry has no energy label).
        None here: only files read through ASE carry ``config_type``."""
        return {}

    def stored_statistics(self, indices: Sequence[int],
                          cutoff: float) -> EntryStatistics | None:
        """The :class:`EntryStatistics` of structures ``indices`` with edges counted at
        ``cutoff`` (Å) as stored with the data, or ``None`` (here: the data store none;
        the statistics are then computed from the structures)."""
        return None

    def label_counts(self) -> np.ndarray:
        """``[len, 3]`` int32 labelled items per structure (see :func:`label_counts_of`):
        12 bytes a structure (24 as int64); their sums are int64."""
        if self._label_counts is None:
            self._label_counts = self._count_labels()
        return self._label_counts

    def label_masks(self) -> dict[str, np.ndarray]:
        """``{label: [len] bool}`` which structures carry each label (forces: every atom)."""
        c, n = self.label_counts(), np.asarray(self.n_atoms)
        return {K.ENERGY: c[:, 0] > 0, K.FORCES: c[:, 1] == 3 * n, K.STRESS: c[:, 2] > 0}

    def batch_label_counts(self, indices: Sequence[int]) -> list[float]:
        """Labelled energies, force components and stress components of the structures
        ``indices`` together: the loss normalisers of a global batch, known on every rank
        without communication."""
        return self.label_counts()[np.asarray(indices, dtype=np.int64)].sum(0).astype(
            np.float64).tolist()


# --------------------------------------------------------------------------- datasets
class InMemoryDataset(LabelledDataset):
    """Structures held in memory as one-system graphs with normalised labels.

    Args:
        graphs: one-system graphs (labels as in :func:`normalize_labels`).
        name: shown in error messages (usually the file name).
        source: the file the graphs were read from, in file order, as the user named it
            (:meth:`origin`; ``None``: ``name``).
        isolated: which entries are isolated atoms (:meth:`isolated_atoms`; ``None``: none).
    """

    def __init__(self, graphs: Sequence[AtomicGraph], name: str = "dataset",
                 source: str | None = None,
                 isolated: dict[int, tuple[int, float]] | None = None):
        self.graphs = list(graphs)
        self.name = name
        self.source = source
        self._isolated = dict(isolated or {})
        self.n_atoms = np.asarray([g.n_atoms for g in self.graphs], dtype=np.int32)

    def origin(self, index: int) -> tuple[str, int]:
        return (self.source or self.name), int(index)

    def __len__(self) -> int:
        return len(self.graphs)

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        return dict(self._isolated)

    def __getitem__(self, index: int) -> AtomicGraph:
        return self.graphs[index]

    def species(self) -> list[int]:
        if not self.graphs:
            return []
        return sorted(set(torch.cat([g.numbers for g in self.graphs]).unique().tolist()))


class HDF5Source(LabelledDataset):
    """An :class:`~xnn.data.hdf5.HDF5Dataset` with a loss weight and the dataset interface."""

    def __init__(self, path: str | os.PathLike, weight: float = 1.0):
        from xnn.data.hdf5 import HDF5Dataset

        self.inner = HDF5Dataset(path)
        self.weight = float(weight)
        self.name = Path(path).name
        self.source = os.fspath(path)
        self.n_atoms = self.inner.n_atoms  # int32
        empty = np.flatnonzero(np.asarray(self.n_atoms) == 0)
        if len(empty):
            raise DataFileError(f"{self.source}: structure {int(empty[0])} has no atoms "
                                f"({len(empty)} such structures); remove them")

    def origin(self, index: int) -> tuple[str, int]:
        return self.source, int(index)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> AtomicGraph:
        return normalize_labels(self.inner[index], self.weight)

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        """:meth:`~xnn.data.hdf5.HDF5Dataset.read_batch` (one read per array for the
        batch) with the labels normalised as ``self[i]`` has them."""
        g = self.inner.read_batch(indices)
        return g.replace({K.WEIGHT: torch.full((g.n_systems,), self.weight, dtype=g.dtype)})

    def _read(self, name: str, step: int = 1 << 20):
        f = self.inner._handle()
        ds = f[name]
        for a in range(0, ds.shape[0], step):
            yield ds[a : a + step]

    def _count_labels(self) -> np.ndarray:
        f = self.inner._handle()
        ok, start = [np.zeros(0, bool)], 0
        for c in self._read("forces"):
            ok.append(self._finite_rows(c, "forces", start))
            start += len(c)
        ok_atoms = np.concatenate(ok)
        ptr = self.inner.atom_ptr
        n_ok = np.add.reduceat(ok_atoms.astype(np.int64), ptr[:-1]) if len(ok_atoms) else ptr[:-1]
        n_ok = np.where(self.n_atoms > 0, n_ok, 0)
        energy = self._finite_rows(f["energy"][:].reshape(-1, 1), "energy")
        stress = self._finite_rows(f["stress"][:].reshape(-1, 9), "stress")
        return np.stack([energy, 3 * n_ok, 9 * stress], -1).astype(np.int32)

    def _finite_rows(self, rows: np.ndarray, name: str, start: int = 0) -> np.ndarray:
        """``[len(rows)]`` bool: the rows (an atom's force, a structure's energy or stress)
        that hold a label. A missing label is a row of NaN (the format's convention); an
        infinite value, or a row only partly NaN, is a broken label: refused."""
        nan = np.isnan(rows)
        broken = np.isinf(rows).any(-1) | (nan.any(-1) & ~nan.all(-1))
        if broken.any():
            row = start + int(np.flatnonzero(broken)[0])
            raise DataFileError(f"{self.source}: the /{name} array holds a non-finite label "
                                f"(row {row}: infinite, or partly NaN); a missing label is a "
                                "whole row of NaN; rewrite the file (xnn data convert)")
        return ~nan.any(-1)

    def species(self) -> list[int]:
        found: set[int] = set()
        for c in self._read("numbers"):
            found |= set(np.unique(c).tolist())
        return sorted(found)


class Subset(LabelledDataset):
    """The structures ``indices`` of ``dataset``, in that order.

    Held compactly: ``indices`` as int32 (int64 from ``2**31`` structures, see
    :func:`compact_indices`; an int32 array given is kept, not copied) and ``n_atoms`` as
    int32 (:func:`gather_counts`): 8 bytes a structure where two int64 arrays took 16.
    """

    def __init__(self, dataset, indices: Sequence[int]):
        self.dataset = dataset
        self.indices = compact_indices(indices, len(dataset))
        self.n_atoms = gather_counts(dataset.n_atoms, self.indices)
        self.name = getattr(dataset, "name", "dataset")

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> AtomicGraph:
        return self.dataset[int(self.indices[index])]

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        if not isinstance(self.dataset, LabelledDataset):
            return super().read_batch(indices)
        return self.dataset.read_batch(self.indices[np.asarray(indices, dtype=np.int64)])

    def origin(self, index: int) -> tuple[str, int]:
        return origin_of(self.dataset, int(self.indices[index]))

    def _count_labels(self) -> np.ndarray:
        return self.dataset.label_counts()[self.indices]

    def stored_statistics(self, indices: Sequence[int],
                          cutoff: float) -> EntryStatistics | None:
        if not isinstance(self.dataset, LabelledDataset):
            return None
        return self.dataset.stored_statistics(self.indices[np.asarray(indices, np.int64)],
                                              cutoff)

    def species(self) -> list[int]:
        if isinstance(self.dataset, InMemoryDataset):
            return InMemoryDataset([self[i] for i in range(len(self))]).species()
        return self.dataset.species()


class View(LabelledDataset):
    """Structure ``i`` is structure ``i`` of ``dataset``, with fields added by a subclass's
    ``__getitem__`` (the head of multi-head training, a committee's bootstrap weights).

    Sizes, labels, origins, stored statistics, species and isolated atoms are those of
    ``dataset``, taken from its index and metadata: making a view, and asking it for these
    (or for :func:`~xnn.training.sampling.structure_weights`), reads no structure of a lazy
    source (extxyz, ASE-LMDB, ASE SQLite, HDF5, prepared data).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.n_atoms = np.asarray(dataset.n_atoms)
        self.name = getattr(dataset, "name", "dataset")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> AtomicGraph:
        return self.dataset[index]

    def origin(self, index: int) -> tuple[str, int]:
        return origin_of(self.dataset, index)

    def _count_labels(self) -> np.ndarray:
        if isinstance(self.dataset, LabelledDataset):
            return self.dataset.label_counts()
        return count_labels_by_reading(self.dataset)

    def stored_statistics(self, indices: Sequence[int],
                          cutoff: float) -> EntryStatistics | None:
        if not isinstance(self.dataset, LabelledDataset):
            return None
        return self.dataset.stored_statistics(indices, cutoff)

    def species(self) -> list[int]:
        return self.dataset.species()

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        if not isinstance(self.dataset, LabelledDataset):
            return {}
        return self.dataset.isolated_atoms()


class ConcatDataset(LabelledDataset):
    """Several datasets one after the other."""

    def __init__(self, datasets: Sequence):
        self.datasets = [d for d in datasets]
        sizes = [len(d) for d in self.datasets]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n_atoms = (
            np.concatenate([np.asarray(d.n_atoms) for d in self.datasets])
            if self.datasets else np.zeros(0, dtype=np.int64)
        )
        self.name = "+".join(getattr(d, "name", "dataset") for d in self.datasets)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _part(self, index: int) -> tuple[int, int]:
        """``(dataset, index in it)`` of structure ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"structure {index} out of range [0, {len(self)})")
        d = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return d, index - int(self.offsets[d])

    def __getitem__(self, index: int) -> AtomicGraph:
        d, i = self._part(index)
        return self.datasets[d][i]

    def origin(self, index: int) -> tuple[str, int]:
        d, i = self._part(int(index))
        return origin_of(self.datasets[d], i)

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        """One batched read per part (shard) the batch touches, the parts' graphs then
        put in the batch's order: equal to collating ``self[i]`` each."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx) or ((idx < 0) | (idx >= len(self))).any():
            return super().read_batch(idx)  # the per-structure path's error
        part = np.searchsorted(self.offsets, idx, side="right") - 1
        graphs, taken = [], []
        for d in np.unique(part).tolist():
            at = np.flatnonzero(part == d)
            ds, local = self.datasets[d], idx[at] - self.offsets[d]
            try:
                graphs.append(ds.read_batch(local) if isinstance(ds, LabelledDataset)
                              else collate([ds[int(i)] for i in local]))
            except (DataFileError, InputError):
                return super().read_batch(idx)  # refused for the batch's first bad one
            taken.append(at)
        if len(graphs) == 1:
            return graphs[0]
        # system k of the concatenation is batch position order[k]: put them back in place
        order = np.concatenate(taken)
        return AtomicGraph.concat(graphs).select_systems(torch.as_tensor(np.argsort(order)))

    def _count_labels(self) -> np.ndarray:
        parts = [d.label_counts() for d in self.datasets]
        return np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)

    def stored_statistics(self, indices: Sequence[int],
                          cutoff: float) -> EntryStatistics | None:
        indices = np.asarray(indices, dtype=np.int64)
        part = np.searchsorted(self.offsets, indices, side="right") - 1
        if len(indices) and not np.all(part[:-1] <= part[1:]):
            return None  # kept simple: the statistics sample is in dataset order
        found = []
        for d in np.unique(part):
            ds = self.datasets[int(d)]
            stats = (ds.stored_statistics(indices[part == d] - self.offsets[d], cutoff)
                     if isinstance(ds, LabelledDataset) else None)
            if stats is None:
                return None
            found.append(stats)
        return EntryStatistics.concat(found) if found else None

    def species(self) -> list[int]:
        return sorted(set().union(*[set(d.species()) for d in self.datasets]))

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        """The parts' isolated-atom entries, by index in the concatenation."""
        return {int(self.offsets[d]) + i: entry for d, part in enumerate(self.datasets)
                if isinstance(part, LabelledDataset)
                for i, entry in part.isolated_atoms().items()}


# --------------------------------------------------------------------------- loading
#: ``atoms.info["config_type"]`` of an isolated-atom entry (MACE's convention)
ISOLATED_ATOM = "IsolatedAtom"


def is_isolated_atom(atoms) -> bool:
    """Whether an ``ase.Atoms`` is an isolated-atom entry as mace-torch reads one
    (``mace.data.utils.load_from_xyz``): exactly one atom and
    ``info["config_type"] == "IsolatedAtom"``; a one-atom structure without that mark is an
    ordinary training structure."""
    return len(atoms) == 1 and atoms.info.get("config_type") == ISOLATED_ATOM


def split_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(train, val, test)`` indices carved from one seeded permutation of ``range(n)``.

    Validation takes the first ``round(n * val_fraction)`` entries of the permutation and
    test the next ``round(n * test_fraction)``; training keeps the rest; each is returned
    sorted. A test fraction of zero therefore leaves train and validation unchanged.

    The permutation is that of ``np.random.default_rng(seed).permutation(n)``, drawn in
    int32 below ``2**31`` structures (:func:`index_dtype`, the same draws), and the training
    split is sorted in its buffer: about 4 bytes a structure at the peak, where the int64
    permutation and its sorted copy took 16 (10^8 structures: 0.4 GiB instead of 1.6).
    """
    if not (0.0 <= val_fraction < 1.0 and 0.0 <= test_fraction < 1.0):
        raise InputError(f"val_fraction={val_fraction} and test_fraction={test_fraction} "
                         "must be in [0, 1)")
    n_val = int(round(n * val_fraction))
    n_test = int(round(n * test_fraction))
    if n_val + n_test >= n and n > 0:
        raise InputError(f"val_fraction + test_fraction leave no training structure "
                         f"({n_val} + {n_test} of {n})")
    perm = np.arange(n, dtype=index_dtype(n))
    np.random.default_rng(seed).shuffle(perm)  # in place: the permutation of ``permutation(n)``
    held = n_val + n_test
    val, test = np.sort(perm[:n_val]), np.sort(perm[n_val:held])
    train = perm[held:]
    train.sort()  # in place: a view of the permutation's buffer, no copy
    return train, val, test


def compact_indices(indices: Sequence[int], n: int) -> np.ndarray:
    """``indices`` into ``n`` structures as an array of :func:`index_dtype` ``(n)``: int32
    below ``2**31`` structures (the array itself where it is one already), else int64.

    Raises:
        IndexError: an index outside ``[-n, n)`` (checked before narrowing, which would
            otherwise wrap it).
    """
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        idx = idx.astype(np.int64)  # e.g. ``[]``, float64 to numpy
    want = index_dtype(n)
    if idx.dtype == want:
        return idx
    if idx.size and (int(idx.max()) >= n or int(idx.min()) < -n):
        bad = int(idx.max()) if int(idx.max()) >= n else int(idx.min())
        raise IndexError(f"index {bad} is out of bounds for {n} structures")
    return idx.astype(want)


def gather_counts(counts: np.ndarray, indices: np.ndarray, block: int = 1 << 20) -> np.ndarray:
    """``counts[indices]`` of non-negative per-structure counts (atoms) as int32 where they
    fit (sums and cumulative sums of int32 arrays are int64 in numpy), else in their own
    type; gathered ``block`` indices at a time, so no int64 copy of the whole selection is
    made on the way.

    Raises:
        IndexError: an index out of range.
    """
    counts = np.asarray(counts)
    narrow = counts.dtype.kind in "iu" and (not counts.size or int(counts.max()) < 2**31)
    out = np.empty(len(indices), dtype=np.int32 if narrow else counts.dtype)
    for a in range(0, len(indices), block):
        out[a:a + block] = counts[indices[a:a + block]]
    return out


# --------------------------------------------------------------------------- batching
def make_batches(
    n_atoms: np.ndarray,
    batch_size: int | None = None,
    max_atoms: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    groups: int | None = None,
) -> list[list[int]]:
    """Group structure indices into global batches for one epoch.

    Args:
        n_atoms: ``[n_structures]`` atoms per structure.
        batch_size: structures per batch (the last batch may be smaller).
        max_atoms: alternatively, add structures (in order) while the batch holds at most
            this many atoms; a structure larger than ``max_atoms`` forms its own batch.
        shuffle: order the structures by a permutation seeded with ``(seed, epoch)``.
        groups: with ``max_atoms``, the number of domain-decomposition groups sharing a
            global batch (context-parallel training): ``max_atoms`` is then the budget of
            ONE group's share, a global batch joins ``groups`` consecutive shares (see
            :func:`atom_chunks`) and a structure larger than the budget is refused.
    Returns:
        list of batches, each a list of structure indices; identical on every rank (the
        lists of :func:`batch_bounds`).
    Raises:
        InputError: bad sizes, or (with ``groups``) a structure larger than ``max_atoms``.
    """
    return _split(*batch_bounds(n_atoms, batch_size, max_atoms, shuffle, seed, epoch, groups))


def index_dtype(n: int) -> type:
    """int32 for indices below ``2**31`` (half the memory of int64), else int64."""
    return np.int32 if n < 2**31 else np.int64


def batch_bounds(
    n_atoms: np.ndarray,
    batch_size: int | None = None,
    max_atoms: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    groups: int | None = None,
    stream: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The batches of :func:`make_batches` as two arrays: batch ``b`` is
    ``stream[starts[b]:starts[b + 1]]``.

    Args:
        n_atoms, batch_size, max_atoms, shuffle, seed, epoch, groups: as
            :func:`make_batches`.
        stream: the structures in the order they are batched (``shuffle`` then ignored;
            default: all, in order or permuted by ``(seed, epoch)``).
    Returns:
        ``(stream [n] int32 (int64 from 2**31 structures), starts [n_batches + 1] int64)``:
        4 bytes a structure, where the lists of :func:`make_batches` take about 36.
    """
    if (batch_size is None) == (max_atoms is None):
        raise InputError("give exactly one of batch_size and max_atoms_per_batch")
    drawn = stream is not None
    if stream is None:
        n = len(n_atoms)
        stream = np.arange(n, dtype=index_dtype(n))
        if shuffle:  # in place: the same permutation as ``permutation(n)``, in int32
            np.random.default_rng([seed, epoch]).shuffle(stream)
    n = len(stream)
    if batch_size is not None:
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        return stream, np.append(np.arange(0, n, batch_size, dtype=np.int64), n)
    if max_atoms < 1:
        raise InputError(f"max_atoms_per_batch must be >= 1, got {max_atoms}")
    if groups is None:
        return stream, chunk_starts(n_atoms, max_atoms, stream)
    big = np.flatnonzero(np.asarray(n_atoms) > max_atoms)
    if drawn:  # only the structures of the stream
        big = np.intersect1d(big, stream)
    if len(big):
        i = int(big[0])
        raise InputError(f"structure {i} has {int(n_atoms[i])} atoms, more than "
                         f"data.max_atoms_per_batch={max_atoms}, the budget of one domain-"
                         f"decomposition group's share ({len(big)} such structures); raise "
                         "data.max_atoms_per_batch or parallel.dd, or remove the structure")
    starts = chunk_starts(n_atoms, max_atoms, stream)
    return stream, np.append(starts[:-1][::groups], n)  # a batch: ``groups`` chunks


def atom_chunks(indices: Sequence[int], n_atoms: np.ndarray, max_atoms: int) -> list[list[int]]:
    """``indices`` cut in order into chunks of at most ``max_atoms`` atoms (a structure
    larger than that forms its own chunk). Deterministic: cutting a concatenation of such
    chunks again gives the same chunks (how a dd group finds its share of a batch).
    Vectorised (:func:`chunk_starts`): about 0.1 µs per structure."""
    order = np.asarray(indices, dtype=np.int64)
    return _split(order, chunk_starts(n_atoms, max_atoms, order))


#: structures per block of :func:`chunk_starts` (bounds its working memory)
CHUNK_BLOCK = 1 << 20


def chunk_starts(sizes: np.ndarray, max_atoms: int,
                 stream: np.ndarray | None = None) -> np.ndarray:
    """Where the chunks of :func:`atom_chunks` start in a stream of structures.

    A chunk takes structures while it holds at most ``max_atoms`` atoms (at least one). The
    end of the chunk starting at every position comes from one ``searchsorted`` on the
    running atom count, block by block; the chunk starts are then the walk from position 0
    (one Python step per chunk, not per structure).

    Args:
        sizes: atoms per structure: ``[n]`` of the stream's structures in stream order, or
            with ``stream``, of every structure (``sizes[stream]`` is then read a block at
            a time, never copied whole).
        max_atoms: atoms per chunk.
        stream: ``[n]`` the structures of the stream (default: ``range(len(sizes))``).
    Returns:
        ``[n_chunks + 1]`` int64: chunk ``c`` is ``stream[starts[c] : starts[c + 1]]``
        (``[0]`` for an empty stream).
    """
    sizes = np.asarray(sizes)  # any integer type: the running count is int64
    n = len(sizes) if stream is None else len(stream)
    found: list[np.ndarray] = []
    p = 0
    while p < n:
        base = p
        ends = _chunk_ends(sizes, stream, base, min(n, base + CHUNK_BLOCK), max_atoms).tolist()
        stop = base + len(ends)
        block: list[int] = []
        while p < stop:
            block.append(p)
            p = ends[p - base]
        found.append(np.asarray(block, dtype=np.int64))
    found.append(np.asarray([n], dtype=np.int64))
    return np.concatenate(found)


def _stream_sizes(sizes: np.ndarray, stream: np.ndarray | None, a: int, b: int) -> np.ndarray:
    """Atoms of stream positions ``a..b``."""
    return sizes[a:b] if stream is None else sizes[stream[a:b]]


def _chunk_ends(sizes: np.ndarray, stream: np.ndarray | None, lo: int, hi: int,
                max_atoms: int) -> np.ndarray:
    """``[hi - lo]`` the end (exclusive) of the chunk that would start at each position of
    ``lo..hi`` (the chunk holds up to ``max_atoms`` atoms, at least one structure)."""
    # the running count from lo over the block and the look-ahead of its last chunk
    n = len(sizes) if stream is None else len(stream)
    reach = hi
    total = 0
    while reach < n and total <= max_atoms:  # the last chunk may run past hi
        step = min(n, reach + CHUNK_BLOCK) - reach
        total += int(_stream_sizes(sizes, stream, reach, reach + step).sum(dtype=np.int64))
        reach += step
    cum = np.zeros(reach - lo + 1, dtype=np.int64)
    np.cumsum(_stream_sizes(sizes, stream, lo, reach), out=cum[1:])
    ends = np.searchsorted(cum, cum[: hi - lo] + max_atoms, side="right") - 1
    np.maximum(ends, np.arange(1, hi - lo + 1), out=ends)
    return ends + lo


def _split(order: np.ndarray, starts: np.ndarray) -> list[list[int]]:
    """``order`` cut at ``starts`` (as :func:`chunk_starts` gives them) into lists."""
    bounds = starts.tolist()
    if bounds[-1] != len(order):
        bounds.append(len(order))
    return [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]


def shard_batch(batch: Sequence[int], n_atoms: np.ndarray, rank: int, world: int) -> list[int]:
    """This rank's share of a global batch: structures dealt out greedily by atom count.

    Structures are taken largest first and given to the rank with the fewest atoms so far
    (ties to the lowest rank), so shards are disjoint, cover the batch, and are balanced.
    """
    if world == 1:
        return list(batch)
    load = [0] * world
    mine: list[int] = []
    for i in sorted(batch, key=lambda i: (-int(n_atoms[i]), i)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += int(n_atoms[i])
        if r == rank:
            mine.append(i)
    return sorted(mine)


def shard_batches(batches: Sequence[Sequence[int]], n_atoms: np.ndarray, rank: int,
                  world: int) -> list[list[int]]:
    """:func:`shard_batch` of every batch at once: the same shares, vectorised over batches
    (:func:`shard_stream` of the batches as arrays)."""
    if world == 1:
        return [list(b) for b in batches]
    lengths = np.fromiter((len(b) for b in batches), dtype=np.int64, count=len(batches))
    flat = np.fromiter((i for b in batches for i in b), dtype=np.int64,
                       count=int(lengths.sum()))
    starts = np.concatenate(([0], np.cumsum(lengths)))
    return [s for block in shard_stream(flat, starts, n_atoms, rank, world) for s in block]


def shard_stream(stream: np.ndarray, starts: np.ndarray, n_atoms: np.ndarray, rank: int,
                 world: int, first: int = 0):
    """This rank's :func:`shard_batch` of the batches ``stream[starts[b]:starts[b + 1]]``
    from batch ``first`` on, as lists, yielded a block of about :data:`CHUNK_BLOCK`
    structures at a time (the working memory is a block's, whatever the epoch's length).

    The k-th largest structure of every batch of a block is dealt in one numpy step (round
    ``k``) to its batch's least-loaded rank (ties to the lowest), as :func:`shard_batch`
    deals them one by one; the cost is a few numpy calls per round (the longest batch's
    length) rather than Python steps per structure.
    """
    n_batches = len(starts) - 1
    lo = first
    while lo < n_batches:
        hi = max(lo + 1, int(np.searchsorted(starts, starts[lo] + CHUNK_BLOCK,
                                             side="right")) - 1)
        hi = min(hi, n_batches)
        flat = np.asarray(stream[starts[lo]:starts[hi]], dtype=np.int64)
        yield _shard_block(flat, np.diff(starts[lo:hi + 1]), n_atoms, rank, world)
        lo = hi


def _shard_block(flat: np.ndarray, lengths: np.ndarray, n_atoms: np.ndarray,
                 rank: int, world: int) -> list[list[int]]:
    """:func:`shard_stream` of some batches (``flat``: their structures one after the
    other, ``lengths``: their sizes)."""
    if world == 1:
        return [part.tolist() for part in np.split(flat, np.cumsum(lengths)[:-1])]
    which = np.repeat(np.arange(len(lengths)), lengths)
    sizes = np.asarray(n_atoms)[flat].astype(np.int64)
    by = np.lexsort((flat, -sizes, which))  # per batch: largest first, ties by index
    flat, sizes = flat[by], sizes[by]
    first = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    load = np.zeros((len(lengths), world), dtype=np.int64)
    owner = np.empty(len(flat), dtype=np.int64)
    for k in range(int(lengths.max()) if len(lengths) else 0):
        open_ = np.flatnonzero(lengths > k)
        pos = first[open_] + k
        to = np.argmin(load[open_], axis=1)
        load[open_, to] += sizes[pos]
        owner[pos] = to
    mine = owner == rank
    keep, kept_in = flat[mine], which[mine]
    keep = keep[np.lexsort((keep, kept_in))]
    cut = np.cumsum(np.bincount(kept_in, minlength=len(lengths)))[:-1]
    return [part.tolist() for part in np.split(keep, cut)]


def collate(graphs: Sequence[AtomicGraph]) -> AtomicGraph:
    """One batched graph from one-system graphs (edges offset by :meth:`AtomicGraph.concat`)."""
    return AtomicGraph.concat(list(graphs))
