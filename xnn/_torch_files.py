"""A look at a ``torch.save`` file before loading it, without unpickling anything.

``torch.save`` writes a zip archive whose ``data.pkl`` member holds the pickled object. A
file cut short (a copy or a write killed half way) has lost the archive's central directory,
which sits at the end of the file; torch then fails with messages such as ``[Errno 22]
Invalid argument``. :func:`check_complete` turns that into one line that names the file.
:func:`saved_format` reads the ``"format"`` entry that xnn writes first into its checkpoints
by walking the pickle's opcodes (``pickletools``: nothing is executed), so that a training
checkpoint given where a model file belongs is recognised as such.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from pathlib import Path

from xnn.errors import ModelFileError

_ZIP_MAGIC = b"PK\x03\x04"
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE",
               "SHORT_BINSTRING", "BINSTRING", "STRING"}
_MAX_PICKLE_BYTES = 1 << 20  # the format entry comes first: read at most this much
_MAX_OPS = 5000


def check_complete(path: str | os.PathLike, what: str = "file") -> None:
    """Raise a one-line :class:`ModelFileError` when ``path`` (an existing file) is empty or
    a ``torch.save`` archive that was cut short or damaged.

    Files that are not zip archives (legacy torch files, other formats) pass: their loader
    reports them.

    Args:
        path: the file.
        what: what the file is meant to be, for the message (``"checkpoint"``, ...).
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        raise ModelFileError(f"{what} {path} is empty (0 bytes): it was truncated or never "
                             "written; use a complete copy")
    if head == _ZIP_MAGIC and not zipfile.is_zipfile(path):
        raise ModelFileError(f"{what} {path} is truncated or corrupt ({path.stat().st_size} "
                             "bytes, its archive is incomplete); use a complete copy")


def saved_format(path: str | os.PathLike) -> str | None:
    """The ``"format"`` value of the dict a ``torch.save`` archive holds (e.g.
    ``"xnn-checkpoint"``), read from the pickle's opcodes without unpickling; ``None`` when
    the file is not such an archive or the entry is not found near the start."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                return None
            with archive.open(names[0]) as member:
                data = member.read(_MAX_PICKLE_BYTES)
    except (OSError, zipfile.BadZipFile, RuntimeError):
        return None
    previous = None
    try:
        for count, (op, arg, _) in enumerate(pickletools.genops(data)):
            if count > _MAX_OPS:
                break
            text = arg if op.name in _STRING_OPS and isinstance(arg, str) else None
            if previous == "format" and text is not None:
                return text
            if op.name not in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
                previous = text
    except Exception:  # the prefix ends inside an opcode, or it is not a pickle
        return None
    return None


def refuse_non_model_file(path: str | os.PathLike) -> None:
    """Raise a one-line :class:`ModelFileError` when ``path`` is truncated, or is an xnn
    training or MD checkpoint rather than a model file (saying which file to use instead)."""
    path = Path(path)
    check_complete(path, "model file")
    fmt = saved_format(path)
    if fmt == "xnn-checkpoint":
        run = path.parent.parent if path.parent.name == "checkpoints" else None
        model = run / "model.pt" if run is not None else None
        where = (f"use {model}" if model is not None and model.is_file() else
                 "use the model.pt that xnn train writes into the run folder when the run "
                 "finishes (resume the run to get one)")
        raise ModelFileError(f"{path} is a training checkpoint, not a model file: {where}")
    if fmt == "xnn-md-checkpoint":
        raise ModelFileError(f"{path} is an MD checkpoint (for resume=), not a model file")
