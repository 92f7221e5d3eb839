"""A lazy source's index kept on disk, so that a second start reads no structure.

What opening a file and the first pass over it find (atom counts, the extxyz frame offsets or
database row ids, the label counts under the configured keys, the species) is written once
to an ``.npz`` file:

* beside the data, as ``.<file name>.<key hash>.xnn-index.npz`` (hidden: folders of shards
  and globs never take it for data);
* where the data's folder cannot be written, in the cache folder ``$XNN_CACHE_DIR/index``
  (default ``~/.cache/xnn/index``), under the same name; where neither can be written,
  nowhere (the next start makes the pass again).

An index is used only when it was made for this file as it is now: the file's absolute
path, size and modification time (``st_mtime_ns``), the format, the label keys and the
index version are stored in it and compared on reading (the hash in the name only keeps
the indices of different keys apart). Anything else (a changed, moved or touched file,
other keys, an unreadable or foreign ``.npz``) is ignored and the index made again.
Writing is atomic (a temporary file renamed over the old one), so ranks opening the same
file at once each write a whole index and any reader sees a whole one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

#: bumped whenever what an index holds or means changes
INDEX_VERSION = 1
SUFFIX = ".xnn-index.npz"
_IDENTITY = "identity"


def cache_dir() -> Path:
    """``$XNN_CACHE_DIR/index`` (default ``~/.cache/xnn/index``)."""
    root = os.environ.get("XNN_CACHE_DIR") or os.path.join("~", ".cache", "xnn")
    return Path(root).expanduser() / "index"


def identity(path: str | os.PathLike, format: str, keys: dict[str, str]) -> dict:  # noqa: A002
    """What an index of ``path`` must have been made for (compared on reading)."""
    st = os.stat(path)
    return {"version": INDEX_VERSION, "path": os.path.abspath(path), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "format": format,
            "keys": {k: keys[k] for k in sorted(keys)}}


def index_paths(path: str | os.PathLike, format: str, keys: dict[str, str]  # noqa: A002
                ) -> tuple[Path, Path]:
    """``(beside the data, in the cache folder)``: where the index of ``path`` read with
    ``keys`` as ``format`` is looked for, in that order."""
    p = Path(os.path.abspath(path))
    what = json.dumps([str(p), format, {k: keys[k] for k in sorted(keys)}])
    name = f".{p.name}.{hashlib.sha1(what.encode()).hexdigest()[:12]}{SUFFIX}"
    return p.with_name(name), cache_dir() / name


def _compact(a: np.ndarray) -> np.ndarray:
    """An int64 array as int32 where its values fit (the sources hold it so too)."""
    a = np.asarray(a)
    if a.dtype == np.int64 and (not a.size or (a.min() >= -(2**31) and a.max() < 2**31)):
        return a.astype(np.int32)
    return a


def load_index(path: str | os.PathLike, format: str,  # noqa: A002
               keys: dict[str, str]) -> dict[str, np.ndarray] | None:
    """The arrays of the stored index of ``path`` as it is now, or ``None`` (none stored,
    or stale, or unreadable)."""
    want = identity(path, format, keys)
    for where in index_paths(path, format, keys):
        try:
            with np.load(where, allow_pickle=False) as z:
                if json.loads(bytes(z[_IDENTITY]).decode()) != want:
                    continue
                return {k: z[k] for k in z.files if k != _IDENTITY}
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            continue
    return None


def save_index(path: str | os.PathLike, format: str, keys: dict[str, str],  # noqa: A002
               made_for: dict, arrays: dict[str, np.ndarray]) -> Path | None:
    """Write ``arrays`` as the index of ``path`` (beside it, else in the cache folder).

    Args:
        made_for: :func:`identity` of the file taken before it was read: nothing is written
            if the file changed since (the arrays may describe neither version).
    Returns:
        where the index was written, or ``None`` (the file changed, or no folder could be
        written: silently, the index is only a saving).
    """
    try:
        if identity(path, format, keys) != made_for:
            return None
    except OSError:
        return None
    blob = np.frombuffer(json.dumps(made_for).encode(), dtype=np.uint8)
    arrays = {k: _compact(v) for k, v in arrays.items()}
    for where in index_paths(path, format, keys):
        tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                np.savez(f, **{_IDENTITY: blob}, **arrays)
            os.replace(tmp, where)
            return where
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            continue
    return None
