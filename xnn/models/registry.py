"""Models built by name: ``xnn.models.build("lj", sigma=3.4, epsilon=0.0104, cutoff=8.5)``."""

from __future__ import annotations

import importlib
import inspect
import numbers

from torch import nn

from xnn.errors import InputError

# name -> "module:Class"; modules are imported only when the model is built
_REGISTRY: dict[str, str] = {
    "lj": "xnn.models.classical:LennardJones",
    "morse": "xnn.models.classical:Morse",
    "schnet": "xnn.models.schnet:SchNet",
    "painn": "xnn.models.painn:PaiNN",
    "equivariant": "xnn.models.equivariant:Equivariant",
    "mace": "xnn.models.external.mace:MACEWrapper",
    "sevenn": "xnn.models.external.sevenn:SevenNetWrapper",
}


def register_model(name: str, target: str | type) -> None:
    """Register a model class (or ``"module:Class"`` string) under ``name``."""
    _REGISTRY[name] = (
        target if isinstance(target, str) else f"{target.__module__}:{target.__qualname__}"
    )


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def model_class(name: str) -> type:
    if name not in _REGISTRY:
        raise InputError(f"unknown model {name!r}; choose one of {available_models()}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build(name: str, **hyperparameters) -> nn.Module:
    """Build a model by registry name; unknown hyperparameters raise with the valid ones."""
    cls = model_class(name)
    sig = inspect.signature(cls.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        valid = [p.name for p in params]
        unknown = sorted(set(hyperparameters) - set(valid))
        if unknown:
            raise InputError(f"model {name!r} has no hyperparameter(s) {unknown}; valid: {valid}")
    return cls(**hyperparameters)


def saved_hyperparameters(name: str, hyperparameters: dict) -> dict:
    """The hyperparameters stored in a model file or checkpoint, completed: keys that files
    of earlier versions lack get the value those versions implied (the class attribute
    ``saved_defaults``), so that old files describe, and rebuild, the same model."""
    hp = dict(hyperparameters)
    for key, value in getattr(model_class(name), "saved_defaults", {}).items():
        hp.setdefault(key, value)
    return hp


def rebuild(name: str, hyperparameters: dict) -> nn.Module:
    """Build a model from the hyperparameters stored in a model file or checkpoint."""
    return build(name, **saved_hyperparameters(name, hyperparameters))


def check_sizes(model: str, minimum: int = 1, **sizes) -> None:
    """Refuse a layer width, basis size or layer count that is not an integer >= ``minimum``
    (a zero width builds a model that predicts a constant); lists are checked entry-wise.

    Raises:
        InputError: naming the hyperparameter, e.g. ``schnet: num_features=0 must be an
            integer >= 1``.
    """
    for name, value in sizes.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= minimum
            if not ok:
                what = "integers" if isinstance(value, (list, tuple)) else "an integer"
                raise InputError(f"{model}: {name}={value!r} must be {what} >= {minimum} "
                                 "(a size of the network)")
