"""Model specs of ``xnn validate --model``: a model file, or a registry name with
hyperparameters (``lj``, ``lj:sigma=2.3,epsilon=0.4,cutoff=5.0``, ``painn:cutoff=4.0``),
built or read on every rank of a launch (a file read on rank 0 and broadcast, errors raised
on every rank)."""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path

import torch

from xnn._files import require_file
from xnn.distributed import collectives as C
from xnn.errors import InputError, ModelFileError
from xnn.models.trust import granted

#: defaults of built-in specs for hyperparameters a model requires (``lj`` alone works)
SPEC_DEFAULTS = {
    "lj": {"sigma": 2.3, "epsilon": 0.4, "cutoff": 5.0},
    "morse": {"D": 0.35, "alpha": 1.4, "r0": 2.5, "cutoff": 6.0},
}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"name:key=value,..."`` to ``(name, hyperparameters)``."""
    name, _, rest = spec.partition(":")
    hp = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InputError(f"model spec {spec!r}: expected key=value, got {item!r}")
        hp[key.strip()] = _value(value.strip())
    return name.strip(), hp


def build_from_spec(spec: str, species: list[int], seed: int = 0):
    """A registry model from a spec; ``species`` fills a required ``species`` argument.

    Weights of learnable models are initialised from ``seed`` (identical on every rank).
    """
    from xnn.models.registry import build, model_class

    name, hp = parse_spec(spec)
    cls = model_class(name)
    params = inspect.signature(cls.__init__).parameters
    hp = {**{k: v for k, v in SPEC_DEFAULTS.get(name, {}).items() if k in params}, **hp}
    if "species" in params and "species" not in hp and params["species"].default is inspect._empty:
        hp["species"] = species
    torch.manual_seed(seed)
    return build(name, **hp)


def load_model_everywhere(spec: str, species: list[int], group=None, trust: bool = False):
    """The model of ``spec`` on every rank: a file read on rank 0 and broadcast, or a spec.

    A file is read as data; ``trust`` (the caller's ``--trust-file``) is passed to
    :func:`xnn.load_model`, and holds for a file a spec names (``mace:model=x.model``)."""
    is_file = C.broadcast_object(Path(spec).is_file() if C.group_rank(group) == 0 else None,
                                 group)
    if not is_file:
        with C.guarded(group, "model build"):
            if os.sep in spec or spec.endswith((".pt", ".pth", ".model")) or Path(spec).is_dir():
                require_file(spec, "model file", InputError, suggest=("model.pt",))
                raise InputError(f"model file {spec!r} does not exist on rank 0")
            with granted(trust):
                model = build_from_spec(spec, species)
        return model
    data = None
    with C.guarded(group, "model file read"):
        if C.group_rank(group) == 0:
            data = Path(spec).read_bytes()
    data = C.broadcast_object(data, group)
    with C.guarded(group, "model load"), tempfile.TemporaryDirectory() as tmp:
        from xnn.models.serialization import load_model

        path = Path(tmp) / Path(spec).name
        path.write_bytes(data)
        try:
            model = load_model(path, trust=trust)
        except ModelFileError as err:  # name the user's file, not the temporary copy
            raise type(err)(str(err).replace(str(path), spec)) from None
    return model
