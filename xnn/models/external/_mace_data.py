"""A mace-torch model as data: its constructor arguments as primitives, rebuilt without pickle.

xnn model files hold a MACE model as ``{"class": "MACE" | "ScaleShiftMACE", "kwargs": {...}}``
plus its state dict. The arguments come from mace-torch's own
``mace.tools.scripts_utils.extract_config_mace_model`` (what mace-torch uses to rebuild a
model for ``torch.compile``); classes and functions among them are stored by their names in
mace-torch's tables (``interaction_classes``, ``readout_classes``, ``gate_dict``), irreps as
strings, arrays as lists. Loading looks the names up in those same tables (nothing else can
be named), builds the class and loads the state dict strictly: no code from the file runs.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor, nn

from xnn.errors import InputError, ModelFileError
from xnn.models.external._optional import import_extra, preserved_environ

MODEL_CLASSES = ("MACE", "ScaleShiftMACE")
_CLASS_TABLES = {"interaction_cls": "interaction_classes",
                 "interaction_cls_first": "interaction_classes",
                 "readout_cls": "readout_classes", "gate": "gate_dict"}
_IRREPS = ("hidden_irreps", "MLP_irreps", "edge_irreps")
_ARRAYS = ("atomic_energies", "atomic_inter_scale", "atomic_inter_shift")
_MUST_BE_NONE = ("cueq_config", "oeq_config")
KEEP_PICKLE = ("keep its .model file and load it with "
               "xnn.models.build('mace', model=PATH, trust=True)")


def _modules():
    modules, scripts = import_extra("mace", "mace.modules", "mace.tools.scripts_utils")
    return modules, scripts


class ScaleShiftMACE:
    """A plain ``MACE`` model seen as a ``ScaleShiftMACE`` with scale 1 and shift 0: the
    class name and ``scale_shift`` are all that ``extract_config_mace_model`` reads beyond
    what both classes have."""

    def __init__(self, model: nn.Module):
        self._model = model
        self.scale_shift = SimpleNamespace(scale=torch.ones(()), shift=torch.zeros(()))

    def __getattr__(self, name):
        return getattr(self._model, name)


def _plain(value, key: str):
    """``value`` as lists, dicts and scalars (refused when it is anything else)."""
    if isinstance(value, (np.ndarray, np.generic, Tensor)):
        return np.asarray(value.detach().cpu() if isinstance(value, Tensor) else value).tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, key) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InputError(f"cannot store this MACE model as data: its {key} is a "
                     f"{type(value).__name__}; {KEEP_PICKLE}")


def _name_in(table: Mapping, value, key: str) -> str:
    for name, entry in table.items():
        if entry is value:
            return name
    raise InputError(f"cannot store this MACE model as data: its {key} {value!r} is not in "
                     f"mace-torch's table {sorted(table)}; {KEEP_PICKLE}")


def constructor_config(model: nn.Module) -> dict:
    """``{"class", "kwargs"}``: the arguments that rebuild ``model``'s architecture.

    Raises:
        InputError: a model class or argument that cannot be stored as data.
    """
    modules, scripts = _modules()
    name = type(model).__name__
    if name not in MODEL_CLASSES or type(model) is not getattr(modules, name):
        raise InputError(f"xnn model files store mace-torch {' and '.join(MODEL_CLASSES)} "
                         f"models, not {name}; {KEEP_PICKLE}")
    view = model if name == "ScaleShiftMACE" else ScaleShiftMACE(model)
    with preserved_environ():
        config = dict(scripts.extract_config_mace_model(view))
    if name == "MACE":
        config.pop("atomic_inter_scale", None)
        config.pop("atomic_inter_shift", None)
    kwargs = {}
    for key, value in config.items():
        if key in _MUST_BE_NONE and value is not None:
            raise InputError(f"cannot store this MACE model as data: it has a {key} "
                             f"(convert it back to plain e3nn first); {KEEP_PICKLE}")
        if key in _CLASS_TABLES:
            kwargs[key] = _name_in(getattr(modules, _CLASS_TABLES[key]), value, key)
        elif key in _IRREPS:
            kwargs[key] = None if value is None else str(value)
        else:
            kwargs[key] = _plain(value, key)
    return {"class": name, "kwargs": kwargs}


def _arguments(cls: type, kwargs: Mapping, modules) -> dict:
    """Constructor arguments from stored ``kwargs`` (names looked up in mace's tables)."""
    from e3nn import o3

    allowed = set()
    for c in (cls, modules.MACE):
        allowed |= set(inspect.signature(c.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ModelFileError(f"MACE arguments {unknown} are not arguments of {cls.__name__}")
    out = dict(kwargs)
    for key, table_name in _CLASS_TABLES.items():
        if key in out:
            table = getattr(modules, table_name)
            if not isinstance(out[key], str) or out[key] not in table:
                raise ModelFileError(f"MACE {key} {out[key]!r} is not one of {sorted(table)}")
            out[key] = table[out[key]]
    for key in _IRREPS:
        if out.get(key) is not None:
            out[key] = o3.Irreps(str(out[key]))
    for key in _ARRAYS:
        if key in out:
            out[key] = np.asarray(out[key], dtype=np.float64)
    for key in _MUST_BE_NONE:
        if out.get(key) is not None:
            raise ModelFileError(f"MACE {key} must be null in a model file")
    return out


def build_module(config: Mapping, state: Mapping, dtype: torch.dtype) -> nn.Module:
    """The mace-torch model of :func:`constructor_config` output with ``state`` loaded.

    Raises:
        ModelFileError: unknown class or argument, or a state dict that does not fit.
    """
    modules, _ = _modules()
    name, kwargs = config.get("class"), config.get("kwargs")
    if name not in MODEL_CLASSES or not isinstance(kwargs, Mapping):
        raise ModelFileError(f"MACE class {name!r} is not one of {list(MODEL_CLASSES)}")
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ModelFileError("MACE payload lacks a state dict of tensors")
    cls = getattr(modules, name)
    arguments = _arguments(cls, kwargs, modules)
    try:
        with preserved_environ(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = cls(**arguments)
        module = module.to(dtype)
        module.load_state_dict(dict(state), strict=True)
    except Exception as err:  # wrong argument values, state dict of another shape
        text = str(err).strip().splitlines()
        reason = f"{type(err).__name__}: {text[0] if text else ''}"
        raise ModelFileError(f"cannot rebuild the MACE model ({reason})") from None
    return module.eval()
