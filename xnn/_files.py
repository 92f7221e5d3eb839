"""Atomic file writes: a file is either its previous version or its complete new one.

:func:`atomic_write` is the one way xnn replaces a file it owns (model files, training and MD
checkpoints, rewritten logs): the new content goes to a temporary file next to the target,
``.NAME.tmp``, created like any file the user writes (so with the user's umask), is fsynced,
moved over the target with ``os.replace``, and the folder is fsynced so that the rename
itself survives a power cut. A ``.NAME.tmp`` left behind by a killed write is never read
(xnn reads only the target) and is replaced by the next write of ``NAME``.

:func:`require_file` and :func:`check_output_file` are the one check of a file a user names,
to read (it exists and is not a folder) or to write (it is not a folder and no file stands
where one of its folders should be): one line, the same words in every command.

This module imports only :mod:`xnn.errors` from xnn: every layer may use it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from xnn.errors import DataFileError, InputError


def _named(what: str, path: Path) -> str:
    """``model file '/a/b.pt'``, or ``pretrained='/a/b.pt'`` for a ``what`` ending in ``=``."""
    return f"{what}{str(path)!r}" if what.endswith("=") else f"{what} {str(path)!r}"


def require_file(path: str | os.PathLike, what: str, error: type[Exception] = DataFileError,
                 suggest: Sequence[str] = ()) -> Path:
    """``Path(path)`` after checking that it names an existing file, not a folder.

    Args:
        path: the file the user named.
        what: how the message names it: ``"model file"``, ``"structure file"``, or a config
            key with its ``=`` (``"pretrained="``).
        error: the :mod:`xnn.errors` type to raise.
        suggest: file names to look for in a folder given instead of a file (a run folder's
            ``model.pt``): the message names the first one there.
    Raises:
        error: one line: ``path`` does not exist, or is a directory.
    """
    path = Path(path)
    if path.is_dir():
        raise error(f"{_named(what, path)} is a directory, not a file; "
                    f"{_file_in(path, suggest)}")
    if not path.is_file():
        raise error(f"{_named(what, path)} does not exist")
    return path


def check_path_argument(path: object, call: str, what: str) -> None:
    """Refuse an argument of a Python call that should name a file but is no path at all
    (``None``, a number, an open file, ...), before anything reads it.

    Args:
        path: the argument.
        call: the call, for the message (``"xnn.load_model"``).
        what: the file it expects (``"model file"``).
    Raises:
        InputError: one line naming the call, the file it expects and the type given.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"{call}: expected the path of a {what} (a str or pathlib.Path), "
                         f"got {type(path).__name__} {path!r:.60}")


def _file_in(folder: Path, suggest: Sequence[str]) -> str:
    """What to give instead of ``folder``: the first of ``suggest`` in it, else a file in it."""
    found = next((folder / n for n in suggest if (folder / n).is_file()), None)
    if found is not None:
        return f"did you mean {str(found)!r}?"
    try:
        with os.scandir(folder) as entries:
            first = next((e.name for e in entries
                          if not e.name.startswith(".") and e.is_file()), None)
    except OSError:
        first = None
    if first is None:
        return "give the path of a file"
    return f"give a file in it, e.g. {str(folder / first)!r}"


def check_output_file(path: str | os.PathLike, what: str = "output file",
                      example: str = "data.xyz") -> Path:
    """``Path(path)`` after checking that a file can be written there: ``path`` is not a
    folder and no file stands where one of its folders should be (nothing is created).

    Args:
        path: the file to write.
        what: how the message names it (``"--out"``, ``"output file"``).
        example: a file name the message suggests inside a folder given instead.
    Raises:
        InputError: one line naming the folder or the file in the way.
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{_named(what, path)} is a folder; give a file name, e.g. "
                         f"{str(path / example)!r}")
    blocking = next((p for p in path.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise InputError(f"{_named(what, path)}: {str(blocking)!r} is a file, not a folder")
    return path


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
