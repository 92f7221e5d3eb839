"""The run's split record: ``split.json`` and the index array beside it, ``split.npy``.

``split.json`` (version 2) names each data file (its config key, path, label keys and
identity: size and SHA-256) and, for each split, rows ``{"file": i, "start": s, "count": c}``:
the structures of file ``i`` the split holds are ``split.npy[s : s + c]``, in the order the
split concatenates them. ``split.npy`` is one int32 array (int64 when a file holds
``2**31`` structures or more) of every row's indices, written a row at a time from the
splits' own arrays and read back memory-mapped, so a run of 10^8 structures holds no Python
list of them at start-up, writes no 1 GB JSON text at its end, and ``xnn eval --split`` reads
only the pages of its split. ``split.json`` records the array's identity (``indices``:
file name, dtype, length, fingerprint), so an array that does not belong to it is refused.

Version 1 records (earlier runs) hold each row's indices as a JSON list
(``{"file": i, "indices": [...]}``) and no array; :func:`read_split` reads both, giving every
row its ``indices`` as an integer array.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from xnn.errors import InputError

SPLIT_FORMAT = "xnn-split"
VERSION = 2
INDICES_FILE = "split.npy"
#: the keys of a split record whose value is a list of rows (file, indices)
ROW_KEYS = ("train", "val", "test", "replay_train", "replay_val")
#: a key whose value is one index array or ``None`` (indices into the replay pool)
SELECTION_KEY = "replay_selection"


def _arrays(membership: dict) -> list[np.ndarray]:
    """Every index array of ``membership``, in record order (rows, then the selection)."""
    out = [np.asarray(row["indices"]) for key in ROW_KEYS for row in membership.get(key) or []]
    if membership.get(SELECTION_KEY) is not None:
        out.append(np.asarray(membership[SELECTION_KEY]))
    return out


def _dtype(arrays: list[np.ndarray]) -> np.dtype:
    """int32 where every index fits, else int64."""
    big = any(a.size and (a.dtype.itemsize > 4 or a.dtype.kind == "u")
              and int(a.max()) >= 2**31 for a in arrays)
    return np.dtype(np.int64 if big else np.int32)


def write_indices(path: Path, arrays: list[np.ndarray]) -> dict:
    """Write the concatenation of ``arrays`` to the ``.npy`` file ``path`` a row at a time
    (no concatenated copy); return its ``indices`` entry (without the fingerprint)."""
    dtype = _dtype(arrays)
    total = sum(len(a) for a in arrays)
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
              "shape": (total,)}
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        for a in arrays:
            f.write(np.ascontiguousarray(a, dtype=dtype).data)  # a copy only to widen/narrow
    return {"path": path.name, "dtype": dtype.name, "length": total}


def write_split(membership: dict, extra: dict, path: Path) -> None:
    """Write ``split.json`` at ``path`` and its ``split.npy`` beside it.

    Args:
        membership: ``{"files": [...], "train"|"val"|"test"|...: [{"file": i, "indices":
            array}], "replay_selection": array | None}`` (:func:`xnn.app.train_data.
            split_membership`; the arrays are written as they are, not copied).
        extra: further fields of the record (``seed``, the files with their identity).
        path: the ``split.json`` to write.
    """
    from xnn.distributed.agreement import file_fingerprint

    npy = path.parent / INDICES_FILE
    entry = write_indices(npy, _arrays(membership))
    entry["fingerprint"] = file_fingerprint(npy)
    record = {"format": SPLIT_FORMAT, "version": VERSION, **extra, "indices": entry}
    record.update({k: v for k, v in membership.items()
                   if k not in record and k not in ROW_KEYS and k != SELECTION_KEY})
    start = 0  # the rows' places in split.npy, in the order of _arrays
    for key in ROW_KEYS:
        if key in membership:
            record[key] = []
            for row in membership[key] or []:
                n = len(row["indices"])
                record[key].append({"file": row["file"], "start": start, "count": n})
                start += n
    if SELECTION_KEY in membership:
        sel = membership[SELECTION_KEY]
        record[SELECTION_KEY] = None if sel is None else {"start": start, "count": len(sel)}
    path.write_text(json.dumps(record, indent=1) + "\n")


def read_split(path: Path) -> dict:
    """The split record of ``split.json`` at ``path`` (version 1 or 2), every row with its
    ``indices`` as an integer array (version 2: views of the memory-mapped ``split.npy``),
    ``replay_selection`` an array or ``None``.

    Raises:
        InputError: not a split record, or its ``split.npy`` is missing or not the array
            it recorded.
    """
    try:
        record = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is not a split record ({e})") from None
    if not isinstance(record, dict) or record.get("format") != SPLIT_FORMAT:
        raise InputError(f"{path} is not a split record written by xnn train")
    if record.get("version", 1) == 1:  # indices as JSON lists
        for key in ROW_KEYS:
            for row in record.get(key) or []:
                row["indices"] = np.asarray(row["indices"], dtype=np.int64)
        if record.get(SELECTION_KEY) is not None:
            record[SELECTION_KEY] = np.asarray(record[SELECTION_KEY], dtype=np.int64)
        return record
    flat = _read_indices(path, record["indices"])
    for key in ROW_KEYS:
        for row in record.get(key) or []:
            row["indices"] = flat[row["start"]:row["start"] + row["count"]]
    sel = record.get(SELECTION_KEY)
    if sel is not None:
        record[SELECTION_KEY] = flat[sel["start"]:sel["start"] + sel["count"]]
    return record


def _read_indices(path: Path, entry: dict) -> np.ndarray:
    """The memory-mapped index array a version-2 record names, after checking it is the one
    written with it."""
    from xnn.distributed.agreement import file_fingerprint

    npy = path.parent / entry["path"]
    if not npy.is_file():
        raise InputError(f"{path} keeps its structure indices in {npy.name}, which is "
                         f"missing from {path.parent}; copy it along with split.json")
    now = file_fingerprint(npy)
    if now != entry["fingerprint"]:
        raise InputError(f"{npy} is not the index array {path.name} was written with (it is "
                         f"{now}, the record says {entry['fingerprint']})")
    flat = np.load(npy, mmap_mode="r")
    if flat.dtype != np.dtype(entry["dtype"]) or len(flat) != entry["length"]:
        raise InputError(f"{npy} holds {len(flat)} {flat.dtype} indices, {path.name} "
                         f"recorded {entry['length']} {entry['dtype']}")
    return flat


__all__ = ["SPLIT_FORMAT", "INDICES_FILE", "read_split", "write_split", "write_indices"]
