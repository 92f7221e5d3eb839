"""ASE databases read lazily: SQLite (``.db``) and ASE-LMDB (``.aselmdb``/``.lmdb``, the
format of fairchem's datasets such as OMat24, written by the ``ase-db-backends`` package).

Structure ``i`` of a file is its row of the ``i``-th smallest id (ids need not be
contiguous: a deleted row leaves a gap). Opening reads only the index:

- SQLite: ``SELECT id, natoms FROM systems`` (one query, no structure built);
- ASE-LMDB: the ids come from the database's ``nextid`` and ``deleted_ids`` entries, and
  each row's atom count from the first bytes of its compressed record (the record starts
  with the ``numbers`` array, whose shape is read after decompressing about 60 bytes), so no
  structure is decoded.

A row's labels are found as in any ASE file (:func:`xnn.data.ase_io.from_ase`): its
calculator results (``energy``, ``forces``, ``stress`` written by
``db.write(atoms_with_a_SinglePointCalculator)``) and, under other keys, its key-value pairs
and ``data`` (both copied into ``atoms.info``, so ``config_type=IsolatedAtom`` marks an
isolated-atom entry).
"""

from __future__ import annotations

import os
import re
import sqlite3
import zlib

import numpy as np

from xnn.data.datasets import narrow
from xnn.data.sources.frames import AtomsSource
from xnn.errors import DataFileError

#: the start of an ASE-LMDB record: ``{"numbers": {"__ndarray__": [[N], "int64", [Z, ...]``
_NUMBERS = re.compile(rb'^\{"numbers": \{"__ndarray__": \[\[(\d+)\], "\w+", \[')
_PREFIX = 64

#: ASE-LMDB databases open in this process, by absolute path (with the inode, size and
#: modification time of the file they were opened on). The lmdb library refuses to
#: open one file twice in a process, so two datasets of one file share its handle; and a
#: forked child inherits that refusal for the files its parent holds open, so every handle
#: is closed before a fork (DataLoader workers) and reopened at its next use, in the parent
#: and the child alike.
_LMDB_OPEN: dict[str, tuple[object, tuple[int, int, int]]] = {}


def close_lmdb_handles() -> None:
    """Close the ASE-LMDB databases this process holds (they reopen at their next read)."""
    while _LMDB_OPEN:
        _LMDB_OPEN.popitem()[1][0].close()


os.register_at_fork(before=close_lmdb_handles)


class _Rows:
    """The index of a database source: row ids and atom counts."""

    def _index_arrays(self) -> dict[str, np.ndarray]:
        return {"ids": self.ids, "n_atoms": self.n_atoms}

    def _use(self, arrays: dict[str, np.ndarray]) -> None:
        self.ids = narrow(arrays["ids"])
        self.n_atoms = narrow(arrays["n_atoms"])


def _atoms_of_row(row):
    """``row.toatoms()`` with the row's key-value pairs and ``data`` in ``atoms.info``."""
    atoms = row.toatoms()
    atoms.info.update(row.key_value_pairs)
    atoms.info.update(row.data)
    return atoms


#: per-atom arrays an ``Atoms`` made from a database row holds besides numbers and positions
#: (``AtomsRow.toatoms``: ``magmoms``, ``charges``, ``tags``, ``masses``, ``momenta``)
_ROW_ARRAYS = ("initial_magmoms", "initial_charges", "tags", "masses", "momenta")


class _CalcResults:
    """The ``results`` of the single-point calculator ``AtomsRow.toatoms`` attaches."""

    def __init__(self, results: dict):
        self.results = results


class _RecordAtoms:
    """What the first pass reads of an ``ase.Atoms`` (``numbers``, ``positions``, ``cell``,
    ``pbc``, ``info``, ``arrays``, ``calc.results``, ``len``), taken from a decoded ASE-LMDB
    record as :func:`_atoms_of_row` would give them, without building the ``Atoms``, its
    calculator and their copies (a third of the pass's time per row).

    Args:
        record: the row's record, decoded (``ase.io.jsonio.decode``).
    Raises:
        KeyError, TypeError, ValueError: a record without ``numbers``, ``positions``,
            ``cell`` or ``pbc`` (then read as an ``Atoms``).
    """

    def __init__(self, record: dict):
        from ase.calculators.calculator import all_properties
        from ase.cell import Cell

        self.numbers = np.asarray(record["numbers"], dtype=int)
        self.positions = np.asarray(record["positions"], dtype=float).reshape(-1, 3)
        self.cell = Cell(np.asarray(record["cell"], dtype=float).reshape(3, 3))
        self.pbc = np.asarray(record["pbc"], dtype=bool).reshape(3)
        self.info = {**record.get("key_value_pairs", {}), **record.get("data", {})}
        self.arrays = {"numbers": self.numbers, "positions": self.positions,
                       **{k: np.asarray(record[k]) for k in _ROW_ARRAYS
                          if record.get(k) is not None}}
        results = {p: record[p] for p in all_properties if record.get(p) is not None}
        self.calc = _CalcResults(results) if results else None

    def __len__(self) -> int:
        return len(self.numbers)

    # what ase_io.from_ase reads of an Atoms besides the attributes (batched reads)
    def has(self, name: str) -> bool:
        return name in self.arrays

    def get_masses(self) -> np.ndarray:
        from ase.data import atomic_masses

        if "masses" in self.arrays:
            return np.array(self.arrays["masses"], dtype=float)
        return atomic_masses[self.numbers]

    def get_velocities(self) -> np.ndarray:
        momenta = self.arrays.get("momenta", np.zeros((len(self), 3)))
        return np.asarray(momenta, dtype=float) / self.get_masses()[:, None]

    def get_initial_charges(self) -> np.ndarray:
        return np.array(self.arrays.get("initial_charges", np.zeros(len(self))), dtype=float)


def _decoded(blob) -> _RecordAtoms | None:
    """An ASE-LMDB record (one zlib-compressed JSON text) decoded into a
    :class:`_RecordAtoms`; ``None`` for a record of another layout (or a broken one: the
    caller reads it as ``db.get`` does, which refuses it)."""
    from ase.io.jsonio import decode

    try:
        return _RecordAtoms(decode(zlib.decompress(blob).decode("utf-8")))
    except (TypeError, KeyError, ValueError, AttributeError, zlib.error):
        return None


class SQLiteSource(_Rows, AtomsSource):
    """The structures of an ASE SQLite database (``.db``), read one row at a time."""

    FORMAT = "db"

    def __init__(self, path: str | os.PathLike, weight: float, keys: dict[str, str],
                 workers: int | None = None):
        super().__init__(path, weight, keys, workers)
        self._open_index()

    def _scan(self) -> None:
        rows = self._query("SELECT id, natoms FROM systems ORDER BY id")
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        self.ids, self.n_atoms = narrow(table[:, 0]), narrow(table[:, 1])

    def _query(self, sql: str) -> list:
        uri = "file:" + os.path.abspath(self.source) + "?mode=ro"
        try:
            with sqlite3.connect(uri, uri=True) as con:
                return con.execute(sql).fetchall()
        except sqlite3.Error as e:
            raise DataFileError(f"cannot read {self.source} as an ASE database (.db): "
                                f"{e}") from None

    def _connect(self):
        import ase.db

        db = ase.db.connect(self.source, type="db", create_indices=False,
                            use_lock_file=False)
        # one connection held for the process (never committed: reads only); without it
        # every row opens its own (4x slower)
        return db.__enter__()

    def _atoms(self, index: int):
        return _atoms_of_row(self._handle().get(id=int(self.ids[index])))

    def species(self) -> list[int]:
        """From the ``numbers`` column (int32 arrays), building no structure."""
        if self._species is None:
            found: set[int] = set()
            for (blob,) in self._query("SELECT numbers FROM systems"):
                found |= set(np.unique(np.frombuffer(blob, np.int32)).tolist())
            self._species = sorted(found)
        return list(self._species)


class LMDBSource(_Rows, AtomsSource):
    """The structures of an ASE-LMDB file (``.aselmdb``/``.lmdb``), read one row at a time,
    read-only and without locks (safe with many readers)."""

    FORMAT = "aselmdb"

    def __init__(self, path: str | os.PathLike, weight: float, keys: dict[str, str],
                 workers: int | None = None):
        super().__init__(path, weight, keys, workers)
        self._open_index()

    def _scan(self) -> None:
        db = self._handle()
        self.ids = narrow(np.asarray(db.ids, dtype=np.int64))
        with db.env.begin() as txn:
            self.n_atoms = narrow([self._count(txn, i) for i in self.ids.tolist()])

    def _handle(self):
        """The database, opened at most once per process and file (see ``_LMDB_OPEN``), and
        again where the file changed since (a handle would read the file it was opened on)."""
        from ase_db_backends.aselmdb import LMDBDatabase
        from lmdb import Error

        key = os.path.abspath(self.source)
        try:
            st = os.stat(key)
        except OSError as e:
            raise DataFileError(f"cannot read {self.source}: {e.strerror}") from None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        held = _LMDB_OPEN.get(key)
        if held is not None and held[1] != version:
            _LMDB_OPEN.pop(key)[0].close()
            held = None
        if held is None:
            try:
                held = _LMDB_OPEN[key] = (LMDBDatabase(self.source, readonly=True,
                                                       readahead=False), version)
            except Error as e:
                raise DataFileError(f"cannot read {self.source} as an ASE-LMDB database: "
                                    f"{e}") from None
        return held[0]

    def _head(self, txn, row_id: int, size: int) -> bytes:
        """The first ``size`` bytes of row ``row_id``'s decompressed record."""
        blob = txn.get(str(row_id).encode("ascii"))
        if blob is None:
            raise DataFileError(f"{self.source}: row id {row_id} is missing (a damaged "
                                "database)")
        return zlib.decompressobj().decompress(blob, size)

    def _count(self, txn, row_id: int) -> int:
        """Atoms of row ``row_id``, from its record's first bytes."""
        match = _NUMBERS.match(self._head(txn, row_id, _PREFIX))
        if match is None:  # a record not written by ase-db-backends: decode it whole
            return int(self._handle().get(id=row_id).natoms)
        return int(match.group(1))

    def _numbers(self, txn, row_id: int) -> np.ndarray:
        """Atomic numbers of row ``row_id``, from the start of its record."""
        head = self._head(txn, row_id, _PREFIX + 6 * self._count(txn, row_id))
        match = _NUMBERS.match(head)
        end = head.find(b"]", match.end()) if match else -1
        if end < 0:
            return np.asarray(self._handle().get(id=row_id).numbers)
        return np.asarray(head[match.end():end].replace(b",", b" ").split(), dtype=np.int64)

    def _atoms(self, index: int):
        return _atoms_of_row(self._handle().get(id=int(self.ids[index])))

    def _atoms_batch(self, indices: list[int]) -> list:
        """Rows of structures ``indices`` read in one transaction, each decoded into a
        :class:`_RecordAtoms` (what the conversion reads of the ``Atoms`` that ``db.get``
        gives, without building it and its calculator); a record of another layout is read
        by ``db.get``."""
        ids = [str(int(self.ids[i])).encode("ascii") for i in indices]
        with self._handle().env.begin() as txn:
            blobs = [txn.get(i) for i in ids]
        out = [_decoded(blob) for blob in blobs]
        return [self._atoms(i) if a is None else a  # refused there, if broken
                for i, a in zip(indices, out)]

    def _counted_atoms(self, index: int):
        """Structure ``index`` for the first pass: its record decoded (one zlib-compressed
        JSON text a row: the labels follow the positions, so the whole record is read) into
        a :class:`_RecordAtoms`, not an ``ase.Atoms`` with its calculator; a record of
        another layout is read as :meth:`atoms` reads it."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"structure {index} out of range [0, {len(self)})")
        row_id = int(self.ids[index])
        with self._handle().env.begin() as txn:
            blob = txn.get(str(row_id).encode("ascii"))
        found = _decoded(blob)
        return self.atoms(index) if found is None else found

    def species(self) -> list[int]:
        """From the start of every record (its ``numbers`` array), building no structure."""
        if self._species is None:
            found: set[int] = set()
            with self._handle().env.begin() as txn:
                for i in self.ids.tolist():
                    found |= set(np.unique(self._numbers(txn, i)).tolist())
            self._species = sorted(found)
        return list(self._species)
