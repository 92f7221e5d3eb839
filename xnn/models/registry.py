"""Models built by name: ``xnn.models.build("lj", sigma=3.4, epsilon=0.0104, cutoff=8.5)``."""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import operator
import os
import types
import typing
from collections.abc import Mapping, Sequence

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
    "d3": "xnn.models.long_range.dispersion:D3",
    "sum": "xnn.models.composed:Sum",
    "committee": "xnn.models.committee:Committee",
    "ewald": "xnn.models.long_range.coulomb:Ewald",
    "pme": "xnn.models.long_range.coulomb:PME",
    "coulomb": "xnn.models.long_range.coulomb:DirectCoulomb",
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
    missing = [p.name for p in params if p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in hyperparameters]
    if missing:
        raise InputError(f"model {name!r} needs hyperparameter(s) {missing}: give them "
                         f"(build({name!r}, {missing[0]}=...); in a config: "
                         "model.hyperparameters, or the typed model.cutoff / model.species)")
    check_types(name, cls, hyperparameters)
    check_common(name, hyperparameters)
    return cls(**hyperparameters)


def _matches(value, tp) -> bool:
    """Whether ``value`` fits the annotation ``tp`` (unknown annotations match anything)."""
    if tp is typing.Any or tp is inspect.Parameter.empty:
        return True
    if tp is type(None) or tp is None:
        return value is None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if tp is float:
        return (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value))
    if tp is str:
        return isinstance(value, str)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        return isinstance(value, Mapping) and (
            len(args) != 2 or all(_matches(v, args[1]) for v in value.values()))
    if origin is not None and isinstance(origin, type) and issubclass(origin, Sequence):
        return (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
                and (not args or all(_matches(v, args[0]) for v in value)))
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


_NAMES = {float: ("a finite number", "finite numbers"), int: ("an integer", "integers"),
          bool: ("true/false", "true/false values"), str: ("a string", "strings"),
          type(None): ("null", "nulls")}


def _describe_type(tp, plural: bool = False) -> str:
    """``int`` -> "an integer", ``Sequence[int]`` -> "a list of integers", ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return " or ".join(_describe_type(a, plural) for a in args)
    if tp in _NAMES:
        return _NAMES[tp][plural]
    kind = origin if isinstance(origin, type) else None
    if kind is not None and issubclass(kind, Mapping):
        inner = f" to {_describe_type(args[1], True)}" if len(args) == 2 else ""
        return ("mappings" if plural else "a mapping") + inner
    if kind is not None and issubclass(kind, Sequence):
        inner = f" of {_describe_type(args[0], True)}" if args else ""
        return ("lists" if plural else "a list") + inner
    return getattr(tp, "__name__", str(tp))


def check_types(name: str, cls: type, hyperparameters: Mapping) -> None:
    """Raise a one-line :class:`InputError` when a hyperparameter does not fit the type that
    ``cls.__init__`` declares for it (e.g. ``num_features="abc"`` for an ``int``)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # unresolvable annotations: leave the checks to the class
        return
    for key, value in hyperparameters.items():
        tp = hints.get(key)
        if tp is not None and not _matches(value, tp):
            raise InputError(f"model {name!r}: hyperparameter {key}={value!r} must be "
                             f"{_describe_type(tp)}")


def saved_hyperparameters(name: str, hyperparameters: dict) -> dict:
    """The hyperparameters stored in a model file or checkpoint, completed: keys that files
    of earlier versions lack get the value those versions implied (the class attribute
    ``saved_defaults``), so that old files describe, and rebuild, the same model."""
    hp = dict(hyperparameters)
    for key, value in getattr(model_class(name), "saved_defaults", {}).items():
        hp.setdefault(key, value)
    return hp


def rebuild(name: str, hyperparameters: dict, source: str | os.PathLike | None = None,
            trust: bool = False) -> nn.Module:
    """Build a model from the hyperparameters stored in a model file or checkpoint.

    They are data (:mod:`xnn.models.trust`): a ``trust`` among them is refused, and a file
    they name (a ``model_file`` term, a MACE or SevenNet file) loads only with the caller's
    ``trust``.

    Args:
        name: registry name.
        hyperparameters: as read from the file.
        source: the file (``None``: inside a load that named it, e.g. :func:`xnn.load_model`).
        trust: whether the caller trusts ``source`` (ignored inside such a load: its caller's
            trust holds).
    Raises:
        ModelFileError: the hyperparameters ask for trust or name a file, untrusted.
    """
    from xnn.models import trust as T

    with T.reading(source, trust):
        T.check_data(hyperparameters)
        return build(name, **saved_hyperparameters(name, hyperparameters))


def check_sizes(model: str, minimum: int = 1, what: str = "a size of the network",
                **sizes) -> None:
    """Refuse a layer width, basis size or layer count that is not an integer >= ``minimum``
    (a zero width builds a model that predicts a constant); lists are checked entry-wise.

    Args:
        model: the model's name in messages.
        minimum: the smallest value allowed.
        what: what the sizes are, in the message.
        sizes: ``hyperparameter=value``.
    Raises:
        InputError: naming the hyperparameter, e.g. ``schnet: num_features=0 must be an
            integer >= 1``.
    """
    for name, value in sizes.items():
        for v in value if isinstance(value, (list, tuple)) else [value]:
            ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= minimum
            if not ok:
                kind = "integers" if isinstance(value, (list, tuple)) else "an integer"
                raise InputError(f"{model}: {name}={value!r} must be {kind} >= {minimum} "
                                 f"({what})")


# --------------------------------------------------------------------------- common values
LAST_ELEMENT = 118  # oganesson


def atomic_number(element: int | str) -> int:
    """Atomic number of an element given by symbol (``"Ar"``) or number (``18``).

    Raises:
        InputError: one line: an unknown symbol, a number outside 1..118, or neither (a
            float, a bool, ...).
    """
    from ase.data import atomic_numbers

    if isinstance(element, str):
        z = atomic_numbers.get(element, 0)  # ASE's "X" (dummy atom) is 0: not an element
        if z == 0:
            raise InputError(f"unknown element symbol {element!r}")
        return z
    try:
        z = None if isinstance(element, bool) else operator.index(element)
    except TypeError:  # 29.5, None, ...; int, numpy and 0-d torch integers pass
        z = None
    if z is None:
        raise InputError(f"{element!r} is not an element: give an atomic number "
                         f"(1-{LAST_ELEMENT}) or a symbol")
    if not 1 <= z <= LAST_ELEMENT:
        raise InputError(f"unknown element {z}: atomic numbers are 1-{LAST_ELEMENT}")
    return z


def species_numbers(species, name: str) -> list[int]:
    """The atomic numbers of a model's ``species``, in their order.

    Args:
        species: a non-empty list of distinct elements, symbols or atomic numbers.
        name: how messages name it (``"model 'schnet': hyperparameter species"``,
            ``"model.species"``).
    Raises:
        InputError: one line naming it: not a list, empty, an unknown element, or an element
            given twice.
    """
    from ase.data import chemical_symbols

    what = f"{name}={species!r}"
    if isinstance(species, (str, bytes)) or not isinstance(species, Sequence) or not species:
        raise InputError(f"{what} must be a non-empty list of elements, e.g. [29, 79]")
    try:
        zs = [atomic_number(s) for s in species]
    except InputError as err:
        raise InputError(f"{what}: {err}") from None
    twice = sorted({z for z in zs if zs.count(z) > 1})
    if twice:
        raise InputError(f"{what} names {[chemical_symbols[z] for z in twice]} more than "
                         "once: give each element once")
    return zs


def check_cutoff(value, name: str) -> float:
    """``value`` as a float after checking that it is a finite distance > 0 (Å).

    Args:
        value: a cutoff radius.
        name: how the message names it (``"model 'painn': hyperparameter cutoff"``).
    Raises:
        InputError: one line naming it.
    """
    try:  # a number, numpy or 0-d torch float; not a bool or a string
        x = math.nan if isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise InputError(f"{name}={value!r} must be a finite distance > 0 (Å)")
    return x


def check_common(name: str, hyperparameters: Mapping) -> None:
    """Check the hyperparameters that every model names alike, the same way for every model
    (:func:`build` calls it, so a Python call, ``xnn train``'s ``model.hyperparameters``,
    ``xnn md``'s ``model.hyperparameters`` and ``xnn validate --model`` give the same line):

    * ``cutoff``: a finite distance > 0 (Å);
    * ``species``: a non-empty list of distinct elements (atomic numbers 1-118 or symbols).

    ``None`` (where a model allows it: ``species=None`` for any element) is not checked.

    Raises:
        InputError: one line naming the model and the hyperparameter.
    """
    if hyperparameters.get("cutoff") is not None:
        check_cutoff(hyperparameters["cutoff"], f"model {name!r}: hyperparameter cutoff")
    if hyperparameters.get("species") is not None:
        species_numbers(hyperparameters["species"], f"model {name!r}: hyperparameter species")
