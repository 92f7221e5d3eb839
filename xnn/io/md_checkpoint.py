"""Checkpoint files of ``xnn md`` and ``xnn relax``: the payload of
:mod:`xnn.dynamics.checkpoint` (full integrator state, neighbor list, sizes of the output
files) written atomically and read back as data. ``meta["kind"]`` (``"md"`` or
``"relax"``) names the writer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from xnn._files import atomic_write, require_file
from xnn.dynamics.checkpoint import FORMAT, checkpoint_payload, state_from_checkpoint
from xnn.dynamics.state import MDState
from xnn.errors import DataFileError
from xnn.models.serialization import load_failure, read_as_data, refused_global


def save_checkpoint(path: str | os.PathLike, state: MDState, meta: dict, potential=None) -> None:
    """Write ``state`` and ``meta`` (ensemble, file sizes, ...) to ``path`` atomically
    (:func:`xnn._files.atomic_write`: the user's umask, file and folder fsynced); with
    ``potential``, its Verlet list's cache too."""
    payload = checkpoint_payload(state, meta, potential)
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_checkpoint(
    path: str | os.PathLike, device=None, potential=None, kind: str | None = None
) -> tuple[MDState, dict]:
    """Read a checkpoint; returns the state (on ``device``) and its ``meta`` dict.

    Args:
        kind: the run that must have written it (``"md"``, ``"relax"``); ``None``: any.
    Raises:
        DataFileError: missing, unreadable, or not a checkpoint of ``kind``.
    """
    path, what = Path(path), f"xnn {kind or 'md/relax'} checkpoint"
    require_file(path, "checkpoint", suggest=("checkpoint.pt",))
    try:  # as data: no code from the file runs
        p = read_as_data(path)
    except Exception as e:
        if refused_global(e):
            raise DataFileError(f"{path} is not an {what}: {load_failure(e)} (xnn reads "
                                "checkpoints as data only)") from None
        raise DataFileError(f"{path} is not a readable {what} ({type(e).__name__})") from None
    if not isinstance(p, dict) or p.get("format") != FORMAT:
        raise DataFileError(f"{path} is not an {what}")
    got = p["meta"].get("kind")
    if kind is not None and got != kind:
        raise DataFileError(f"{path} is an xnn {got} checkpoint, not an {what}")
    return state_from_checkpoint(p, device, potential)
