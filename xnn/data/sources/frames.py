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
    normalize_labels,
    refuse_non_finite_labels,
)
from xnn.data.graph import AtomicGraph
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

    A subclass sets ``n_atoms`` (``[len]`` int64, from an index of the file, never from the
    structures) in its ``__init__`` and implements :meth:`_connect` (a handle to the file,
    opened once per process, so the source pickles without it: DataLoader workers reopen it)
    and :meth:`_atoms` (structure ``index`` from that handle).

    Args:
        path: the file, as the user named it (``origin`` and messages name it).
        weight: the loss weight of its structures.
        keys: ``{energy_key, forces_key, stress_key, virial_key}: key``.
    """

    def __init__(self, path: str | os.PathLike, weight: float, keys: dict[str, str]):
        self.source = os.fspath(path)
        self.name = Path(path).name
        self.weight = float(weight)
        self.keys = dict(keys)
        self._handle_cache = None
        self._handle_pid: int | None = None
        self._species: list[int] | None = None
        self._isolated: dict[int, tuple[int, float]] | None = None

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
        self.n_atoms = np.asarray(self.n_atoms, dtype=np.int64)
        if not len(self.n_atoms):
            raise DataFileError(f"no structures in {self.source}")
        self._atom_ptr = np.concatenate([[0], np.cumsum(self.n_atoms)]).astype(np.int64)
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

    def _count_labels(self) -> np.ndarray:
        """One pass reading every structure (refusing a broken one); finds the species too."""
        rows, found = [np.zeros((0, 3), np.int64)], set()
        for i in range(len(self)):
            g = self[i]
            rows.append(label_counts_of(g))
            found |= set(g.numbers.unique().tolist())
        self._species = sorted(found)
        return np.concatenate(rows)

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
