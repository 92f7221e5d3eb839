"""Training checkpoints: everything needed to continue a run bitwise, and reading them
(:func:`xnn.io.train_checkpoint.save_checkpoint` writes them, atomically).

A checkpoint is a ``torch.save`` dict::

    {"format": "xnn-checkpoint", "format_version": 1,
     "model": {"name", "hparams", "state_dict"},   # rebuildable with xnn.models.build
     "ema": {...} | None, "optimizer": {...}, "schedule": {...},
     "progress": {"epoch", "step", "batch_in_epoch",   # the sampler position
                  "best_value", "best_epoch", "best_metric", "best_mode", "bad_epochs",
                  "history": [...]},                # one row per epoch (metrics.csv)
     "rng": {"torch", "numpy", "python"},
     "precision": "fp32" | "tf32" | "bf16_mixed" | "fp64",  # a resume must use the same
     "epoch_metrics": tensor | None,   # training metric sums of the epoch so far (mid-epoch)
     "config": "<resolved YAML>"}

It holds tensors and primitives only (the numpy and python RNG states as a tensor and
tuples of ints, see :func:`rng_state`), and :func:`load_checkpoint` reads it with
``weights_only=True``: resuming from, or fine-tuning on, any file runs no code from it.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from xnn._files import require_file
from xnn.errors import InputError, ModelFileError
from xnn.models.registry import saved_hyperparameters
from xnn.models.serialization import load_failure, read_as_data, refused_global

FORMAT = "xnn-checkpoint"
FORMAT_VERSION = 1


def rng_state() -> dict:
    """The torch, numpy and python global RNG states as tensors and primitives (loadable
    with ``weights_only=True``): numpy's ``(name, key [624] uint32, pos, has_gauss,
    cached_gaussian)`` with the key as an int64 tensor."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    numpy_state = (str(name), torch.from_numpy(key.astype(np.int64)), int(pos),
                   int(has_gauss), float(cached))
    version, internal, gauss_next = random.getstate()
    return {"torch": torch.get_rng_state(), "numpy": numpy_state,
            "python": (version, tuple(int(v) for v in internal), gauss_next)}


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (also from checkpoints of earlier xnn versions)."""
    torch.set_rng_state(state["torch"])
    name, key, pos, has_gauss, cached = state["numpy"]
    key = key.numpy() if isinstance(key, torch.Tensor) else np.asarray(key)
    np.random.set_state((name, key.astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))


def _numpy_globals() -> list:
    """What the numpy RNG key of a checkpoint of an earlier xnn (a uint32 ndarray) unpickles from:
    an ndarray rebuilt from its dtype and bytes, nothing that runs code."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Read a checkpoint written by :func:`xnn.io.train_checkpoint.save_checkpoint`, as data
    (``weights_only=True``: no code from the file runs, whatever it holds).

    Raises:
        InputError: the file does not exist.
        ModelFileError: it is not an xnn checkpoint, is corrupt, or holds pickled objects.
    """
    path = require_file(path, "checkpoint", InputError, suggest=("checkpoints/last.pt",))
    try:
        payload = read_as_data(path, map_location, allow=_numpy_globals())
    except Exception as e:  # truncated, not a torch file, pickled objects
        if refused_global(e):
            raise ModelFileError(f"{str(path)!r} is not an xnn training checkpoint: "
                                 f"{load_failure(e)} (xnn reads checkpoints as data only)"
                                 ) from None
        raise ModelFileError(f"cannot read checkpoint {str(path)!r}: {load_failure(e)}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ModelFileError(f"{str(path)!r} is not an xnn training checkpoint")
    return payload


def require_fields(payload: dict, path, keys=("model", "optimizer", "progress", "rng")) -> None:
    """Raise a one-line :class:`ModelFileError` when the checkpoint lacks ``keys`` (or the
    model's name, hparams or state dict)."""
    missing = [k for k in keys if k not in payload]
    model = payload.get("model")
    if isinstance(model, dict):
        missing += [f"model.{k}" for k in ("name", "hparams", "state_dict") if k not in model]
    elif "model" not in missing:
        missing.append("model")
    if missing:
        raise ModelFileError(f"{str(path)!r} is not a complete xnn training checkpoint "
                             f"(it lacks {', '.join(missing)})")


def model_identity(model) -> tuple[str, dict]:
    """``(registry name, hparams)`` of a native model."""
    from xnn.models.serialization import registry_name

    return registry_name(model), dict(model.hparams or {})  # None: an external wrapper


def _architecture(hp: dict) -> dict:
    """Hyperparameters that define the architecture (statistics and the memory switch
    ``activation_checkpointing`` and the kernel ``backend``, which a resumed run may change,
    excluded; of a committee, the members' architecture, without its calibration)."""
    out = {k: v for k, v in hp.items()
           if k not in ("e0", "scale", "shift", "activation_checkpointing", "backend",
                        "calibration")}
    if isinstance(out.get("member"), dict):  # a committee: its members' architecture
        out["member"] = _architecture(out["member"])
    return out


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
