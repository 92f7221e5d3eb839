"""Training checkpoint files: a :class:`~xnn.training.loop.TrainingLoop` payload (see
:mod:`xnn.training.checkpoint`, which reads them) written atomically: to ``.NAME.tmp``,
fsynced and moved over the path (:func:`xnn._files.atomic_write`), so a crash during a
write never destroys the previous checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from xnn._files import atomic_write
from xnn.training.checkpoint import FORMAT, FORMAT_VERSION


def save_checkpoint(payload: dict, path: str | os.PathLike) -> Path:
    """Write ``payload`` (with format fields added) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, **payload}
    return atomic_write(path, lambda tmp: torch.save(full, tmp))
