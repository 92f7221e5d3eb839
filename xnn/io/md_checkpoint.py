"""Checkpoint files of ``xnn md`` and ``xnn relax``: the payload of
:mod:`xnn.dynamics.checkpoint` (full integrator state, neighbor list, sizes of the output
files) written atomically and read back as data. ``meta["kind"]`` (``"md"`` or
``"relax"``) names the writer. :func:`load_checkpoint` reads both forms: one gathered file
and the per-rank shards of :mod:`xnn.io.sharded_checkpoint` (``checkpoint.pt.d/``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from xnn._files import atomic_write, require_file
from xnn.dynamics.checkpoint import (
    FORMAT,
    checkpoint_payload,
    restore_neighbor_state,
    state_from_checkpoint,
)
from xnn.dynamics.state import MDState
from xnn.errors import DataFileError
from xnn.io import sharded_checkpoint as shards
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
        path: ``checkpoint.pt`` (a file, or, when only its sharded form exists, that form),
            or the folder ``checkpoint.pt.d`` of a sharded checkpoint (whose shards are
            assembled by atom id).
        kind: the run that must have written it (``"md"``, ``"relax"``); ``None``: any.
    Raises:
        DataFileError: missing, unreadable, or not a checkpoint of ``kind``.
    """
    path, what = Path(path), f"xnn {kind or 'md/relax'} checkpoint"
    if shards.is_sharded(path):
        state, meta, neighbors = shards.load_sharded(path, device)
        check_kind(path, meta, kind)
        if potential is not None:
            restore_neighbor_state(potential, neighbors, device)
        return state, meta
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
    check_kind(path, p["meta"], kind)
    return state_from_checkpoint(p, device, potential)


def check_kind(path: str | os.PathLike, meta: dict, kind: str | None) -> None:
    """Refuse a checkpoint (its ``meta``) that a run other than ``kind`` wrote."""
    got = meta.get("kind")
    if kind is not None and got != kind:
        raise DataFileError(f"{path} is an xnn {got} checkpoint, not an xnn {kind} "
                            "checkpoint")
