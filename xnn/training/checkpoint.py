"""Training checkpoints: everything needed to continue a run bitwise, written atomically.

A checkpoint is a ``torch.save`` dict::

    {"format": "xnn-checkpoint", "format_version": 1,
     "model": {"name", "hparams", "state_dict"},   # rebuildable with xnn.models.build
     "ema": {...} | None, "optimizer": {...}, "schedule": {...},
     "progress": {"epoch", "step", "batch_in_epoch"},  # the sampler position
     "rng": {"torch", "numpy", "python"},
     "best": {"metric", "value", "epoch"}, "early_stopping": {...}, "history": [...],
     "config": "<resolved YAML>"}

It is written to ``.NAME.tmp``, fsynced and moved over ``path`` with ``os.replace``
(:func:`xnn._files.atomic_write`), so a crash during a write never destroys the previous
checkpoint.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from xnn._files import atomic_write
from xnn.errors import InputError, ModelFileError
from xnn.models.registry import saved_hyperparameters

FORMAT = "xnn-checkpoint"
FORMAT_VERSION = 1


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
            "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(payload: dict, path: str | os.PathLike) -> Path:
    """Write ``payload`` (with format fields added) atomically to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, **payload}
    return atomic_write(path, lambda tmp: torch.save(full, tmp))


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` (a trusted file: it holds the
    numpy/python RNG states, so it is unpickled with ``weights_only=False``).

    Raises:
        InputError: the file does not exist.
        ModelFileError: it is not an xnn checkpoint or is corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"checkpoint {str(path)!r} does not exist")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as e:  # truncated / not a torch file
        raise ModelFileError(f"cannot read checkpoint {str(path)!r}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ModelFileError(f"{str(path)!r} is not an xnn training checkpoint")
    return payload


def model_identity(model) -> tuple[str, dict]:
    """``(registry name, hparams)`` of a native model."""
    from xnn.models.serialization import registry_name

    return registry_name(model), dict(getattr(model, "hparams", {}))


def _architecture(hp: dict) -> dict:
    """Hyperparameters that define the architecture (statistics excluded)."""
    return {k: v for k, v in hp.items() if k not in ("e0", "scale", "shift")}


def check_same_architecture(payload: dict, model, path) -> None:
    """Raise a one-line :class:`InputError` when the checkpoint holds another architecture."""
    name, hp = model_identity(model)
    saved_name = payload["model"]["name"]
    if saved_name != name:
        raise InputError(f"checkpoint {str(path)!r} holds a {saved_name!r} model, the config "
                         f"builds {name!r}")
    a = _architecture(saved_hyperparameters(saved_name, payload["model"]["hparams"]))
    b = _architecture(hp)
    if a != b:
        diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        raise InputError(f"checkpoint {str(path)!r} holds another {name!r} architecture "
                         f"(hyperparameters differ: {diff})")
