"""Opening a dataset by path: one file, a folder of shards or a glob, read lazily.

:func:`open_source` picks the reader from ``format`` or else from the file suffix:

========== ============================== ==========================================
format     suffix                         reader
========== ============================== ==========================================
extxyz     ``.xyz``, ``.extxyz``          :class:`~.extxyz.ExtxyzSource` (frame index)
aselmdb    ``.aselmdb``, ``.lmdb``        :class:`~.asedb.LMDBSource`
db         ``.db``                        :class:`~.asedb.SQLiteSource`
hdf5       ``.h5``, ``.hdf5``             :class:`~xnn.data.datasets.HDF5Source`
prepared   a folder with ``prepared.json`` ``xnn.data.prepared.PreparedDataset``
ase        any other                      every structure read into memory by ASE
========== ============================== ==========================================

A folder stands for the dataset files in it (sorted by name; they must share one format),
and a path with ``*``, ``?`` or ``[`` that names no file is a glob (``omat/*.aselmdb``).
Several files become one :class:`~xnn.data.datasets.ConcatDataset`: structure ``i`` is found
by cumulative counts, and ``origin(i)`` names its file and index there.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from xnn._files import require_file
from xnn.data.datasets import ConcatDataset, HDF5Source
from xnn.data.sources.asedb import LMDBSource, SQLiteSource, close_lmdb_handles
from xnn.data.sources.extxyz import ExtxyzSource
from xnn.data.sources.frames import AtomsSource, read_in_memory
from xnn.errors import DataFileError, InputError

FORMATS = ("extxyz", "aselmdb", "db", "hdf5", "prepared", "ase")
SUFFIXES = {".xyz": "extxyz", ".extxyz": "extxyz", ".aselmdb": "aselmdb", ".lmdb": "aselmdb",
            ".db": "db", ".h5": "hdf5", ".hdf5": "hdf5"}
#: the file a prepared dataset's folder holds (``xnn data prepare``)
PREPARED_MANIFEST = "prepared.json"

__all__ = ["FORMATS", "SUFFIXES", "AtomsSource", "ExtxyzSource", "LMDBSource",
           "SQLiteSource", "check_format", "open_source", "read_structures", "source_files"]


def check_format(format: str | None, what: str = "format") -> None:  # noqa: A002
    """Refuse a format name not in :data:`FORMATS` (one line listing them)."""
    if format is not None and format not in FORMATS:
        raise InputError(f"{what}={format!r} is not a dataset format; choose one of "
                         f"{list(FORMATS)} (or leave it out: the file suffix decides)")


def source_files(path: str | os.PathLike, format: str | None = None  # noqa: A002
                 ) -> tuple[list[Path], str]:
    """``(files, format)`` a dataset path stands for (see the module docstring).

    Raises:
        InputError: an unknown ``format``.
        DataFileError: nothing at ``path``, an empty folder or glob, or files of several
            formats (one line each).
    """
    check_format(format)
    p = Path(path)
    if p.is_dir():
        if format == "prepared" or (format is None and (p / PREPARED_MANIFEST).is_file()):
            return [p], "prepared"
        files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                       and (f.suffix in SUFFIXES if format is None
                            else SUFFIXES.get(f.suffix) == format))
        if not files:
            kinds = ", ".join(sorted(SUFFIXES)) if format is None else f"format {format}"
            raise DataFileError(f"dataset folder {str(p)!r} holds no dataset file ({kinds})")
    elif not p.exists() and any(c in str(path) for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(path)) if Path(f).is_file())
        if not files:
            raise DataFileError(f"no file matches the dataset glob {str(path)!r}")
    else:
        files = [require_file(path, "dataset file")]
    if format is not None:
        return files, format
    found = sorted({SUFFIXES.get(f.suffix, "ase") for f in files})
    if len(found) > 1:
        raise DataFileError(f"{str(path)!r} holds files of several formats {found}; name "
                            "one format's files (a glob such as 'dir/*.aselmdb')")
    return files, found[0]


def _open_prepared(path: Path, weight: float, keys: dict[str, str]):
    """A folder written by ``xnn data prepare`` (labels are stored under their own names:
    ``keys`` do not apply)."""
    from xnn.data.prepared import PreparedDataset

    return PreparedDataset(path, weight)


def _open_one(path: Path, format: str, weight: float, keys: dict[str, str],  # noqa: A002
              workers: int | None):
    if format == "extxyz":
        return ExtxyzSource(path, weight, keys, workers)
    if format == "aselmdb":
        return LMDBSource(path, weight, keys, workers)
    if format == "db":
        return SQLiteSource(path, weight, keys, workers)
    if format == "hdf5":
        return HDF5Source(path, weight)
    if format == "prepared":
        return _open_prepared(path, weight, keys)
    close_lmdb_handles()  # ASE opens an ASE-LMDB file itself: lmdb allows one open
    return read_in_memory(path, weight, keys)


def open_source(path: str | os.PathLike, format: str | None = None, *,  # noqa: A002
                weight: float = 1.0, energy_key: str = "energy", forces_key: str = "forces",
                stress_key: str = "stress", virial_key: str = "virial",
                workers: int | None = None):
    """A dataset (``len``, ``ds[i]``, ``n_atoms``, ``label_counts()``, ``origin(i)``,
    ``species()``, ``isolated_atoms()``) of the structures at ``path``, read one at a time.

    Args:
        path: a file, a folder of files of one format, or a glob.
        format: one of :data:`FORMATS` (``None``: by suffix, see the module docstring).
        weight: the loss weight of every structure.
        energy_key, forces_key, stress_key, virial_key: where the labels are (see
            :func:`xnn.data.ase_io.from_ase`; a key equal to the property name also finds
            an attached calculator's result).
        workers: processes of the first pass over an extxyz, ``.db`` or ASE-LMDB file
            (``label_counts()``; ``None``: the machine's CPUs shared by the ranks on it,
            :func:`~xnn.data.sources.scan.default_workers`; 0 or 1: this process).
    Returns:
        a lazy dataset: opening reads only an index (atom counts; kept on disk with the
        label counts and species after the first pass, :mod:`xnn.data.sources.index`, so
        a second opening of an unchanged file reads no structure), a structure is read at
        its use; non-finite labels are refused there (one line). Several files: a
        :class:`~xnn.data.datasets.ConcatDataset` named ``path``.
    Raises:
        InputError: an unknown ``format``.
        DataFileError: no such file, an empty folder or glob, or an unreadable index.
    """
    files, fmt = source_files(path, format)
    keys = dict(energy_key=energy_key, forces_key=forces_key, stress_key=stress_key,
                virial_key=virial_key)
    parts = [_open_one(f, fmt, weight, keys, workers) for f in files]
    if len(parts) == 1:
        return parts[0]
    dataset = ConcatDataset(parts)
    dataset.name = os.fspath(path)
    return dataset


def read_structures(
    path: str | os.PathLike,
    weight: float = 1.0,
    energy_key: str = "energy",
    forces_key: str = "forces",
    stress_key: str = "stress",
    virial_key: str = "virial",
    format: str | None = None,  # noqa: A002
    workers: int | None = None,
):
    """Open a dataset (:func:`xnn.data.sources.open_source`: by suffix or ``format``; a file,
    folder of shards or glob) and check the labels of every structure read through ASE now.

    The structures stay on disk (read at their use) except for the formats ASE reads only
    whole; the check is one pass reading each structure once (the label counts are kept,
    :meth:`LabelledDataset.label_counts`). HDF5 and prepared datasets check theirs from
    their arrays at the first ``label_counts()``. :func:`~xnn.data.sources.open_source`
    opens without the pass. The pass runs over ``workers`` processes (``None``: the
    machine's CPUs shared by the ranks on it) and is stored with the file's index: a
    second opening of an unchanged file (same size and modification time, same label
    keys) reads no structure.

    Returns:
        a dataset (see the module docstring) whose structures have normalised labels.
    Raises:
        DataFileError: the file does not exist or cannot be read, or a structure has no
            atoms or a non-finite label (one line naming the file and structure).
        InputError: an unknown ``format``.
    """
    fmt = source_files(path, format)[1]
    ds = open_source(path, fmt, weight=weight, energy_key=energy_key, forces_key=forces_key,
                     stress_key=stress_key, virial_key=virial_key, workers=workers)
    if fmt in ("extxyz", "aselmdb", "db"):
        ds.label_counts()
    return ds
