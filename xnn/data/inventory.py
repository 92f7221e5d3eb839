"""The inventory of a structure file's keys (``xnn data inspect FILE``, the label errors of
``xnn train`` / ``xnn eval``): extxyz and other ASE formats frame by frame, xnn's HDF5
and prepared folders from their arrays (:mod:`xnn.data.label_keys` counts and describes the
keys)."""

from __future__ import annotations

import os
from pathlib import Path

from xnn.data.datasets import HDF5Source
from xnn.data.label_keys import KeyInventory, inventory_of
from xnn.errors import DataFileError


def inventory(path: str | os.PathLike, limit: int | None = None) -> KeyInventory:
    """Count the keys of the frames of ``path`` (all, or the first ``limit``): a file, or a
    folder or glob of shards (:func:`xnn.data.sources.source_files`), read as training reads
    it (a database row's key-value pairs and ``data`` are ``info`` keys).

    Raises:
        DataFileError: the file is missing or cannot be read.
    """
    import ase.io

    from xnn.data.prepared import PreparedDataset
    from xnn.data.sources import open_source, source_files

    files, fmt = source_files(path)
    if fmt == "prepared":  # labels under fixed names, as in xnn HDF5
        return _array_inventory(PreparedDataset(files[0]), files[0])
    if fmt == "hdf5":
        return _array_inventory(HDF5Source(files[0]), files[0])
    if fmt in ("extxyz", "aselmdb", "db"):
        sources = (open_source(f, fmt) for f in files)
        frames = (src.atoms(i) for src in sources for i in range(len(src)))
        return inventory_of(frames, os.fspath(path), limit)
    p = files[0]
    if not p.is_file():
        raise DataFileError(f"{p} is a directory, not a structure file")
    try:
        return inventory_of(ase.io.iread(str(p), index=":"), str(p), limit)
    except Exception as e:  # ASE raises many types for malformed files
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataFileError(f"cannot parse {p}: {msg}") from None


def _array_inventory(ds, path: Path) -> KeyInventory:
    """The inventory of an xnn HDF5 file or prepared folder ``ds`` (labels by fixed names)."""
    inv = KeyInventory(str(path), n_frames=len(ds), hdf5=True)
    inv.n_atoms = [int(n) for n in ds.n_atoms]
    inv.species = set(ds.species())
    for key, labelled in ds.label_masks().items():
        if labelled.any():
            inv.calc[key] = int(labelled.sum())
    return inv


__all__ = ["inventory"]
