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
    """Count the keys of the frames of ``path`` (all, or the first ``limit``).

    Raises:
        DataFileError: the file is missing or cannot be read.
    """
    import ase.io

    from xnn.data.prepared import PreparedDataset, is_prepared

    p = Path(path)
    if is_prepared(p):  # labels under fixed names, as in xnn HDF5
        return _array_inventory(PreparedDataset(p), p)
    if not p.is_file():
        raise DataFileError(f"{p} is a directory, not a structure file" if p.is_dir()
                            else f"data file not found: {p}")
    if p.suffix in (".h5", ".hdf5"):
        return _array_inventory(HDF5Source(p), p)
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
