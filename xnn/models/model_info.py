"""What a model file says about its model: the registry name of its class, its dtype, the
units, and a one-line reason for a failure (shared by :mod:`xnn.models.serialization` and
:mod:`xnn.models.export`)."""

from __future__ import annotations

import torch
from torch import nn

from xnn.errors import InputError

UNITS = {"energy": "eV", "length": "Å"}


def registry_name(model: nn.Module) -> str:
    """The registry name under which ``model``'s class is registered."""
    from xnn.models import registry

    explicit = getattr(model, "registry_name", None)
    if isinstance(explicit, str):
        return explicit
    target = f"{type(model).__module__}:{type(model).__qualname__}"
    for name, value in registry._REGISTRY.items():
        if value == target or value is type(model):
            return name
    raise InputError(
        f"{type(model).__name__} is not in the model registry; register it with "
        "xnn.models.register_model(name, cls) before saving"
    )


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating parameter or buffer (else torch's default)."""
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float64`` -> ``"float64"``."""
    return str(dtype).removeprefix("torch.")


def first_line(err: BaseException) -> str:
    """``"ErrorType: first line of its message"``."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def safe_name(model: nn.Module) -> str | None:
    """:func:`registry_name` of ``model``, ``None`` when its class is not registered."""
    try:
        return registry_name(model)
    except InputError:
        return None
