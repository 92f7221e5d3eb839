"""Structures read one at a time as ``ase.Atoms`` from a file: the shared part of the lazy
sources (:mod:`~xnn.data.sources.asedb`, :mod:`~xnn.data.sources.extxyz`) and of the
in-memory reading of any other ASE format.

:func:`graph_of` turns one ``Atoms`` into the one-system graph every dataset here returns
(normalised labels, ``atom_id`` counted from the file's start, ``system_id`` the index in the
file); a lazy source and the in-memory reading of the same file therefore give bit-equal
graphs.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from xnn.data import ase_io
from xnn.data import keys as K
from xnn.data.datasets import (
    InMemoryDataset,
    LabelledDataset,
    is_isolated_atom,
    label_counts_of,
    narrow,
    normalize_labels,
    refuse_non_finite_labels,
)
from xnn.data.graph import AtomicGraph
from xnn.data.sources.batched import batch_graph_of
from xnn.data.sources.index import identity, load_index, save_index
from xnn.data.sources.scan import first_pass
from xnn.errors import DataFileError, InputError


def graph_of(atoms, index: int, first_atom: int, keys: dict[str, str], weight: float,
             source: str) -> AtomicGraph:
    """The one-system graph of structure ``index`` of file ``source``.

    Args:
        atoms: the structure, its labels under ``keys`` (``info``, ``arrays`` or an attached
            single-point calculator, see :func:`xnn.data.ase_io.from_ase`).
        index: its index in the file (the graph's ``system_id``).
        first_atom: atoms of the file before it (its atoms' ids count on from there).
        keys: ``{energy_key, forces_key, stress_key, virial_key}: key``.
        weight: the dataset's loss weight.
        source: the file, as the user named it (in messages).
    Raises:
        DataFileError: no atoms, a label of the wrong shape or not finite (one line naming
            ``source`` and ``index``).
        InputError: non-finite positions or cell, or a singular cell.
    """
    if len(atoms) == 0:
        raise DataFileError(f"{source}: structure {index} has no atoms; remove it from the file")
    try:
        g = ase_io.from_ase([atoms], **keys)
    except (DataFileError, InputError) as e:  # from_ase names the structure 0 of its list
        raise type(e)(f"{source}: structure {index}: "
                      f"{str(e).removeprefix('structure 0: ')}") from None
    refuse_non_finite_labels(g, keys, f"{source}: structure {index}")
    return normalize_labels(g, weight).replace({
        K.ATOM_ID: torch.arange(first_atom, first_atom + g.n_atoms),
        K.SYSTEM_ID: torch.tensor([index]),
        K.VELOCITIES: None,
    })


def _label_row(atoms, keys: dict[str, str]) -> np.ndarray | None:
    """``[3]`` the label counts :func:`~xnn.data.datasets.label_counts_of` gives the graph
    of ``atoms`` (:func:`graph_of`), or ``None`` where that graph would be refused (no
    atoms, a failed check, a non-finite label)."""
    if len(atoms) == 0:
        return None
    try:
        labels = ase_io.checked_labels(atoms, **keys)
    except (DataFileError, InputError):
        return None
    if not all(np.isfinite(v).all() for v in labels.values()):
        return None
    stress = "stress" in labels or ("virial" in labels and bool(np.all(atoms.pbc)))
    return np.asarray([int("energy" in labels), 3 * len(atoms) * int("forces" in labels),
                       9 * int(stress)], dtype=np.int32)


def counts_of_presence(bits: np.ndarray, n_atoms: np.ndarray) -> np.ndarray:
    """``[len, 3]`` int32 label counts from ``[len]`` uint8 label presence (bit 0 energy, 1
    forces of every atom, 2 stress)."""
    bits = np.asarray(bits, dtype=np.int32)
    return np.stack([bits & 1, 3 * np.asarray(n_atoms, np.int32) * ((bits >> 1) & 1),
                     9 * ((bits >> 2) & 1)], -1)


def presence_of_counts(counts: np.ndarray, n_atoms: np.ndarray) -> np.ndarray | None:
    """The label presence of :func:`counts_of_presence` (1 byte a structure instead of
    24), or ``None`` where some structure has forces on only some atoms."""
    bits = ((counts[:, 0] > 0) | (counts[:, 1] > 0) << 1 | (counts[:, 2] > 0) << 2)
    bits = bits.astype(np.uint8)
    return bits if np.array_equal(counts_of_presence(bits, n_atoms), counts) else None


def isolated_entry(atoms, graph: AtomicGraph) -> tuple[int, float] | None:
    """``(atomic number, energy label)`` of an isolated-atom entry, else ``None``."""
    if not is_isolated_atom(atoms):
        return None
    return int(atoms.numbers[0]), float(graph[K.ENERGY].reshape(-1)[0])


def read_in_memory(path: str | os.PathLike, weight: float,
                   keys: dict[str, str]) -> InMemoryDataset:
    """Every structure of a file any ASE reader reads (``ase.io.read``), held in memory."""
    p = Path(path)
    frames = ase_io.read(str(p))
    out, isolated, offset = [], {}, 0
    for k, atoms in enumerate(frames):
        g = graph_of(atoms, k, offset, keys, weight, str(p))
        out.append(g)
        entry = isolated_entry(atoms, g)
        if entry is not None:
            isolated[k] = entry
        offset += g.n_atoms
    return InMemoryDataset(out, name=p.name, source=os.fspath(path), isolated=isolated)


class AtomsSource(LabelledDataset):
    """A file of structures read one at a time, by index, as ``ase.Atoms``.

    A subclass names its :attr:`FORMAT`, implements :meth:`_scan` (``n_atoms`` and its
    own index arrays, from the file, never from the structures) and :meth:`_use` (take
    them), :meth:`_connect` (a handle to the file, opened once per process, so the source
    pickles without it: DataLoader workers reopen it) and :meth:`_atoms` (structure
    ``index`` from that handle), and calls :meth:`_open_index` at the end of its
    ``__init__``. The index, and after the first pass the label counts and species, are
    kept on disk (:mod:`xnn.data.sources.index`): a second opening of the unchanged file
    reads them back instead.

    Args:
        path: the file, as the user named it (``origin`` and messages name it).
        weight: the loss weight of its structures.
        keys: ``{energy_key, forces_key, stress_key, virial_key}: key``.
        workers: processes of the first pass over the structures (:meth:`label_counts`;
            ``None``: the machine's CPUs shared by the ranks on it; 0 or 1: this
            process).
    """

    #: the format name (:data:`xnn.data.sources.FORMATS`), part of the stored index's key
    FORMAT = ""

    def __init__(self, path: str | os.PathLike, weight: float, keys: dict[str, str],
                 workers: int | None = None):
        self.source = os.fspath(path)
        self.name = Path(path).name
        self.weight = float(weight)
        self.keys = dict(keys)
        self.workers = workers
        self._handle_cache = None
        self._handle_pid: int | None = None
        self._species: list[int] | None = None
        self._isolated: dict[int, tuple[int, float]] | None = None
        self._made_for: dict | None = None

    # ------------------------------------------------------------------ the index
    def _scan(self) -> None:
        """Read the index from the file: set ``n_atoms`` (``[len]``) and the subclass's own
        arrays."""
        raise NotImplementedError

    def _index_arrays(self) -> dict[str, np.ndarray]:
        """``{"n_atoms": ..., ...}``: the index :meth:`_scan` read, as it is stored."""
        raise NotImplementedError

    def _use(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the arrays of :meth:`_index_arrays` read back from disk."""
        raise NotImplementedError

    def _open_index(self) -> None:
        """The index from disk where one was made for the file as it is, else from
        :meth:`_scan` (written to disk with the label counts after the first pass, which
        checks every structure: a file with a broken structure leaves nothing on disk);
        refuses an empty file or structure."""
        self._made_for = identity(self.source, self.FORMAT, self.keys)
        stored = load_index(self.source, self.FORMAT, self.keys)
        if stored is not None:
            try:
                self._use(stored)
                self._restore(stored)
            except KeyError:  # not what this source stores: made again
                stored = None
        if stored is None:
            self._scan()
        self._refuse_empty()

    def _restore(self, stored: dict[str, np.ndarray]) -> None:
        if "labels" in stored:
            self._label_counts = counts_of_presence(stored["labels"], self.n_atoms)
        elif "label_counts" in stored:
            self._label_counts = stored["label_counts"].astype(np.int32)
        if "species" in stored:
            self._species = stored["species"].astype(np.int64).tolist()

    def _save_index(self) -> None:
        out = self._index_arrays()
        if self._label_counts is not None:
            bits = presence_of_counts(self._label_counts, self.n_atoms)
            if bits is not None:
                out["labels"] = bits
            else:
                out["label_counts"] = self._label_counts
        if self._species is not None:
            out["species"] = np.asarray(self._species, dtype=np.int64)
        save_index(self.source, self.FORMAT, self.keys, self._made_for, out)

    # ------------------------------------------------------------------ the file
    def _connect(self):
        """A new handle to the file (called once per process)."""
        raise NotImplementedError

    def _atoms(self, index: int):
        """Structure ``index`` (``0 <= index < len``) as an ``ase.Atoms``."""
        raise NotImplementedError

    def _handle(self):
        if self._handle_cache is None or self._handle_pid != os.getpid():
            self._handle_cache = self._connect()
            self._handle_pid = os.getpid()
        return self._handle_cache

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_handle_cache"] = None
        state["_handle_pid"] = None
        return state

    def _refuse_empty(self) -> None:
        """Refuse a file without structures, or a structure without atoms, when the index is
        read (one line)."""
        self.n_atoms = narrow(self.n_atoms)  # int32: 4 bytes a structure
        if not len(self.n_atoms):
            raise DataFileError(f"no structures in {self.source}")
        # the first atom's global id: int64 from 2**31 atoms (a 10^8-structure set)
        self._atom_ptr = narrow(np.concatenate([[0], np.cumsum(self.n_atoms)]))
        empty = np.flatnonzero(self.n_atoms == 0)
        if len(empty):
            raise DataFileError(f"{self.source}: structure {int(empty[0])} has no atoms; "
                                f"remove it from the file ({len(empty)} such structures)")

    # ------------------------------------------------------------------ dataset
    def __len__(self) -> int:
        return len(self.n_atoms)

    def origin(self, index: int) -> tuple[str, int]:
        return self.source, int(index)

    def atoms(self, index: int):
        """Structure ``index`` as the ``ase.Atoms`` read from the file (labels unconverted:
        what ``xnn data inspect`` lists)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"structure {index} out of range [0, {len(self)})")
        return self._atoms(index)

    def _read(self, index: int):
        """``(atoms, graph)`` of structure ``index``."""
        atoms = self.atoms(index)
        if len(atoms) != self.n_atoms[index]:
            raise DataFileError(f"{self.source}: structure {index} has {len(atoms)} atoms, "
                                f"its index {int(self.n_atoms[index])}: the file changed "
                                "since it was opened; open it again")
        return atoms, graph_of(atoms, index, int(self._atom_ptr[index]), self.keys,
                               self.weight, self.source)

    def __getitem__(self, index: int) -> AtomicGraph:
        return self._read(index)[1]

    def _atoms_batch(self, indices: list[int]) -> list:
        """Structures ``indices`` (distinct, in range) as ``ase.Atoms``: :meth:`atoms` each
        here; a format that reads many rows at once overrides it."""
        return [self._atoms(i) for i in indices]

    def read_batch(self, indices) -> AtomicGraph:
        """Structures ``indices`` as one batched graph, equal field by field to collating
        ``self[i]`` each: the rows read at once (:meth:`_atoms_batch`) and converted in one
        call (:func:`batch_graph_of`); a batch that needs the per-structure graphs (a
        refused structure, labels in some structures only) is read one structure at a
        time."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx) or ((idx < 0) | (idx >= len(self))).any():
            return super().read_batch(idx)  # the per-structure path's error
        uniq, inverse = np.unique(idx, return_inverse=True)
        found = self._atoms_batch(uniq.tolist())
        atoms = [found[j] for j in inverse.tolist()]
        if all(len(a) == self.n_atoms[i] for a, i in zip(atoms, idx.tolist())):
            g = batch_graph_of(atoms, idx, np.asarray(self._atom_ptr)[idx], self.keys,
                               self.weight)
            if g is not None:
                return g
        return super().read_batch(idx)

    def count_range(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``([hi - lo, 3] label counts, atomic numbers present)`` of structures
        ``lo..hi``, each read once (refusing a broken one).

        A structure's labels are counted from its ``Atoms`` (:func:`~xnn.data.ase_io.
        checked_labels`: the checks of the graph's conversion, no graph built); one that
        fails a check or holds a non-finite label is read again as a graph, which refuses
        it with the message of any other read."""
        rows = np.zeros((hi - lo, 3), np.int32)
        found: set[int] = set()
        for i in range(lo, hi):
            atoms = self._counted_atoms(i)
            row = _label_row(atoms, self.keys) if len(atoms) == self.n_atoms[i] else None
            if row is None:  # refused here, as at any read
                row = label_counts_of(self[i])[0]
            rows[i - lo] = row
            found.update(np.unique(atoms.numbers).tolist())
        return rows, np.asarray(sorted(found), dtype=np.int64)

    def _counted_atoms(self, index: int):
        """What :meth:`count_range` reads of structure ``index``: its ``ase.Atoms``
        (:meth:`atoms`), or a lighter object with the same ``numbers``, ``positions``,
        ``cell``, ``pbc``, ``info``, ``arrays`` and ``calc.results`` (a format whose record
        holds them without building an ``Atoms``)."""
        return self.atoms(index)

    def _count_labels(self) -> np.ndarray:
        """One pass reading every structure (:func:`~xnn.data.sources.scan.first_pass`,
        over ``workers`` processes); finds the species too, and stores both with the
        index."""
        counts, self._species = first_pass(self, self.workers)
        self._label_counts = counts
        self._save_index()
        return counts

    def species(self) -> list[int]:
        """Atomic numbers present (found by the pass of :meth:`label_counts`)."""
        if self._species is None:
            self.label_counts()
        return list(self._species)

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        """Isolated-atom entries: only the one-atom structures are read."""
        if self._isolated is None:
            self._isolated = {}
            for k in np.flatnonzero(self.n_atoms == 1).tolist():
                entry = isolated_entry(*self._read(k))
                if entry is not None:
                    self._isolated[k] = entry
        return dict(self._isolated)
