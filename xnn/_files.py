"""Atomic file writes: a file is either its previous version or its complete new one.

:func:`atomic_write` is the one way xnn replaces a file it owns (model files, training and MD
checkpoints, rewritten logs): the new content goes to a temporary file next to the target,
``.NAME.tmp``, created like any file the user writes (so with the user's umask), is fsynced,
moved over the target with ``os.replace``, and the folder is fsynced so that the rename
itself survives a power cut. A ``.NAME.tmp`` left behind by a killed write is never read
(xnn reads only the target) and is replaced by the next write of ``NAME``.

This module imports nothing from xnn: every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def temporary_path(path: str | os.PathLike) -> Path:
    """The temporary file that :func:`atomic_write` writes before replacing ``path``."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be
    opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: nothing more to do
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Replace ``path`` by what ``write(tmp)`` writes to the file ``tmp``, atomically.

    Args:
        path: the target file (its folder must exist).
        write: writes the complete new content to the path it is given (``torch.save``,
            ``Path.write_bytes`` ...).
    Returns:
        ``path``. On any error (or interrupt) the temporary file is removed and the target
        is unchanged.
    """
    path = Path(path)
    tmp = temporary_path(path)
    tmp.unlink(missing_ok=True)  # a stale one of a killed write (perhaps read-only)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` by ``data`` atomically (see :func:`atomic_write`)."""
    return atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Replace ``path`` by ``text`` (UTF-8, newlines as given) atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))
