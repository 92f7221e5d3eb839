"""Typed configuration: dataclass schemas + YAML + command-line dotlist overrides.

``load_config(Schema, "cfg.yaml", ["optim.lr=1e-3", "data.datasets.1=null"])`` merges the YAML
file and the overrides onto the schema's defaults with OmegaConf, then instantiates the
dataclasses (whose ``__post_init__`` check choices and ranges). Unknown keys and wrong types
raise :class:`ConfigError` naming the key and the valid choices.

List entries are addressed by index (``data.datasets.0.path=x.xyz``); ``key.N=null`` removes
entry N of a list, and ``key=null`` on a mapping such as ``model.hyperparameters`` empties it
(so ``model.name=painn model.hyperparameters=null`` drops the YAML's SchNet settings).

Values are read as YAML with one exception: YAML 1.1's base-60 numbers. ``1:3`` or ``1:30``
stay the strings the user typed (an ASE index, a time), not 63 and 90, in files and in
overrides; and an override whose YAML reading would be a block mapping or list (``index=-3:``,
``output.dir=run:``, ``x=a: b``) keeps its text (flow collections ``{a: 1}`` and ``[1, 2]``
are read as such).
"""

from __future__ import annotations

import dataclasses
import io
import math
import numbers
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xnn._files import require_file
from xnn.config.renamed import renamed_in, renamed_message
from xnn.errors import XnnError


class ConfigError(XnnError, ValueError):
    """An invalid configuration (unknown key, wrong type, invalid choice)."""


def field(default, help: str = "", choices: Sequence | None = None):  # noqa: A002
    """A dataclass field with a help text (and optional choices) for ``--help``."""
    meta = {"help": help, "choices": list(choices) if choices is not None else None}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        value = default
        return dataclasses.field(
            default_factory=lambda: _copy(value), metadata=meta
        )
    return dataclasses.field(default=default, metadata=meta)


def _copy(value):
    import copy

    return copy.deepcopy(value)


def check_choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not a valid choice; choose one of {list(choices)}")


def check_range(name: str, value, low=None, high=None, low_inclusive=True) -> None:
    """Raise a :class:`ConfigError` naming ``name`` unless ``low <= value <= high`` (NaN and
    ±inf are refused first: they pass every comparison)."""
    if value is None:
        return
    check_finite(name, value)
    if low is not None and (value < low if low_inclusive else value <= low):
        op = ">=" if low_inclusive else ">"
        raise ConfigError(f"{name}={value!r} must be {op} {low}")
    if high is not None and value > high:
        raise ConfigError(f"{name}={value!r} must be <= {high}")


def check_seed(name: str, value: int) -> None:
    """Raise a :class:`ConfigError` for a negative seed: every command's runs are
    reproducible from a seed >= 0 (none takes -1 to mean "random")."""
    if value < 0:
        raise ConfigError(f"{name}={value} must be >= 0 (a seed repeats a run exactly; no "
                          "value means a random one: pick any integer >= 0)")


def check_finite(name: str, value) -> None:
    """Raise a :class:`ConfigError` when ``value`` is a NaN or infinite number, or a list or
    dict holding one (``name.key`` names the entry)."""
    if isinstance(value, bool):
        return
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} is not a finite number; give a finite value")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            check_finite(f"{name}.{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_finite(f"{name}.{i}", v)


def validate(obj, prefix: str = "") -> None:
    """Check every field of a config (recursing into sections and lists of sections): numbers
    finite, then the declared ``choices``; raises :class:`ConfigError` naming the key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            validate(value, prefix + f.name + ".")
        elif isinstance(value, list) and any(dataclasses.is_dataclass(v) for v in value):
            for i, v in enumerate(value):
                validate(v, f"{prefix}{f.name}.{i}.")
        else:
            check_finite(prefix + f.name, value)
    validate_choices(obj, prefix)


def validate_choices(obj, prefix: str = "") -> None:
    """Check every field that declares ``choices`` in its metadata, recursing into sections."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        choices = f.metadata.get("choices") if f.metadata else None
        if choices is not None:
            check_choice(prefix + f.name, value, choices)
        if dataclasses.is_dataclass(value):
            validate_choices(value, prefix + f.name + ".")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    validate_choices(v, f"{prefix}{f.name}.{i}.")


def _valid_keys(cfg, path: str) -> list[str]:
    node = cfg
    path = path.replace("[", ".").replace("]", "")
    for part in [p for p in path.split(".") if p][:-1]:
        try:
            nxt = node[int(part)] if isinstance(node, ListConfig) else node[part]
        except (KeyError, ValueError, IndexError, OmegaConfBaseException):
            break
        if not isinstance(nxt, (DictConfig, ListConfig)):
            break
        node = nxt
    if isinstance(node, DictConfig):
        return list(node.keys())
    return []


def _explain(e: OmegaConfBaseException, cfg) -> ConfigError:
    key = getattr(e, "full_key", None) or ""
    msg = str(e).splitlines()[0]
    if "not in" in msg or "Key '" in msg and "not" in msg:
        valid = _valid_keys(cfg, key)
        return ConfigError(f"unknown config key {key!r}; valid keys here: {valid}")
    return ConfigError(f"invalid value for config key {key!r}: {msg}")


def _new_entry(lst: ListConfig, value):
    """A new entry for ``lst``: the default of its dataclass element type merged with ``value``."""
    elt = lst._metadata.element_type
    if isinstance(elt, type) and dataclasses.is_dataclass(elt):
        node = OmegaConf.structured(elt)
        if value is None:
            return node
        try:
            return OmegaConf.merge(node, value)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", "") or ""
            raise ConfigError(f"unknown or invalid key {key!r} in a new {elt.__name__} entry; "
                              f"valid keys: {list(node.keys())}") from None
    return value


#: YAML 1.1's base-60 integers and floats (``1:3`` = 63, ``1:30.5`` = 90.5)
_BASE60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")


def _base60_spans(root) -> list[tuple[int, int]]:
    """``(start, end)`` character offsets of the plain scalars of a composed YAML document
    that YAML 1.1 reads as base-60 numbers."""
    spans, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:  # an alias repeats a node: its text is once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.style is None and _BASE60.fullmatch(node.value):  # after any &anchor
                spans.append((node.end_mark.index - len(node.value), node.end_mark.index))
        elif isinstance(node, yaml.MappingNode):
            stack.extend(n for pair in node.value for n in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return spans


def quote_base60(text: str) -> str:
    """``text`` (YAML) with every plain scalar that YAML 1.1 reads as a base-60 number
    (``1:3``, ``-1:30``) quoted, so that it stays the string written (text that is not
    valid YAML is returned unchanged: the loader reports it)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return text
    for start, end in sorted(_base60_spans(root), reverse=True):
        if _BASE60.fullmatch(text[start:end]):  # the scalar's own text (one line)
            text = f"{text[:start]}'{text[start:end]}'{text[end:]}"
    return text


def parse_value(raw: str):
    """The value of a ``key=value`` override: YAML, except that base-60 numbers (``1:3``)
    and text YAML would read as a block mapping or list (``-3:``, ``a: b``) stay strings."""
    if raw == "":
        return ""
    try:
        value = OmegaConf.from_dotlist([f"v={quote_base60(raw)}"])["v"]
    except Exception:  # not valid YAML (e.g. index=:): keep the raw string
        return raw
    block = not raw.lstrip().startswith(("{", "["))
    if isinstance(value, (DictConfig, ListConfig)) and block:
        return raw
    return value


def _load_yaml_file(p: Path):
    """A YAML config file as an OmegaConf node (base-60 numbers kept as strings)."""
    try:
        return OmegaConf.load(io.StringIO(quote_base60(p.read_text(encoding="utf-8"))))
    except Exception as e:  # yaml errors
        msg = " ".join(str(e).split())
        hint = ""
        if "mapping values are not allowed" in msg:
            hint = ("; a value that ends in ':' or holds ': ' must be quoted, e.g. "
                    "index: \"-3:\"")
        raise ConfigError(f"cannot parse config file {str(p)!r}: {msg}{hint}") from None


def _apply_override(cfg, item: str, deletions: list[tuple[str, int]]) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    value = parse_value(raw)
    renamed = (renamed_in(value, key + ".") if isinstance(value, Mapping) else None) \
        or renamed_message(key, value)
    if renamed:
        raise ConfigError(renamed)
    parent_key, _, last = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, ListConfig) and last.isdigit():
        idx = int(last)
        if value is None:
            deletions.append((parent_key, idx))
            return
        if idx == len(parent):
            parent.append(_new_entry(parent, value))
            return
        if idx > len(parent):
            raise ConfigError(f"{key}: list {parent_key!r} has {len(parent)} entries")
    if parent is None and parent_key:
        grand_key, _, idx = parent_key.rpartition(".")
        grand = OmegaConf.select(cfg, grand_key) if grand_key else cfg
        if isinstance(grand, ListConfig) and idx.isdigit() and int(idx) == len(grand):
            grand.append(_new_entry(grand, None))  # key.N.field=value appends entry N
            OmegaConf.update(cfg, key, value, merge=True)
            return
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {_valid_keys(cfg, key)}")
    if isinstance(parent, DictConfig) and last not in parent and OmegaConf.is_struct(parent):
        raise ConfigError(f"unknown config key {key!r}; valid keys here: {list(parent.keys())}")
    if value is None and _is_mapping_field(parent, last):
        parent[last] = {}  # key=null clears a mapping (model.hyperparameters=null)
        return
    OmegaConf.update(cfg, key, value, merge=True)


def _is_mapping_field(parent, last: str) -> bool:
    """Whether ``parent.last`` is a mapping that cannot be null (a ``dict`` field such as
    ``model.hyperparameters``): ``key=null`` then empties it instead of failing."""
    if not isinstance(parent, DictConfig) or last not in parent:
        return False
    node = parent._get_node(last)
    return isinstance(node, DictConfig) and not node._is_optional()


def split_config_args(config: str | None, overrides: Sequence[str]) -> tuple[str | None,
                                                                            list[str]]:
    """The YAML file and the ``key=value`` overrides of a command line whose first argument
    may be either (``xnn md key=value ...`` without a file): the one splitter of every
    config command (train, md, relax, run).

    Raises:
        ConfigError: a first argument that is neither an override nor a ``.yaml``/``.yml``
            file.
    """
    if config is not None and "=" in config and not Path(config).is_file():
        return None, [config, *overrides]
    if config is not None and Path(config).suffix.lower() not in (".yaml", ".yml") \
            and not Path(config).is_dir():  # a folder: load_config says it is one
        raise ConfigError(f"{config} is not a YAML config (.yaml/.yml); give settings as "
                          "key=value (e.g. structure=PATH)")
    return config, list(overrides)


def load_config(schema: type, path: str | Path | None = None, overrides: Sequence[str] = ()):
    """Merge defaults ← YAML file ← dotlist overrides; return an instance of ``schema``."""
    base = OmegaConf.structured(schema)
    try:
        if path is not None:
            p = require_file(path, "config file", ConfigError)
            loaded = _load_yaml_file(p)
            if not isinstance(loaded, DictConfig):
                kind = "list" if isinstance(loaded, ListConfig) else type(loaded).__name__
                raise ConfigError(f"config file {str(p)!r} holds a {kind}; "
                                  "its top level must be a mapping of keys to values "
                                  "(key: value lines, e.g. 'max_epochs: 10')")
            renamed = renamed_in(OmegaConf.to_container(loaded))
            if renamed:
                raise ConfigError(renamed)
            base = OmegaConf.merge(base, loaded)
        deletions: list[tuple[str, int]] = []
        for item in overrides:
            _apply_override(base, item, deletions)
        for parent_key, idx in sorted(deletions, key=lambda t: -t[1]):
            lst = OmegaConf.select(base, parent_key)
            if idx >= len(lst):
                raise ConfigError(f"{parent_key}.{idx}: list has {len(lst)} entries")
            del lst[idx]
        obj = OmegaConf.to_object(base)
        validate(obj)
        return obj
    except OmegaConfBaseException as e:
        raise _explain(e, base) from None


def to_yaml(config) -> str:
    """The resolved config as YAML (for ``--print-config`` and saving with a run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def save_config(config, path: str | Path) -> None:
    Path(path).write_text(to_yaml(config))


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])}|null" if len(args) == 1 else "|".join(map(_type_name, args))
    if origin in (list, Sequence):
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "dict"
    return getattr(tp, "__name__", str(tp))


def describe(schema: type, prefix: str = "", defaults=None) -> str:
    """One line per option: ``key (type, default=...): help [choices]``, grouped by section.

    Each section's own options come right under its heading (``model:``), before its
    subsections; at the top level, options that belong to no section are listed first under
    ``top-level keys:``, so that every key is printed under the heading of its own section.
    A section's defaults are those of the command (``defaults``: the section's default
    instance, e.g. ``model.name=schnet`` in ``xnn train``, none in ``xnn md``).
    """
    hints = typing.get_type_hints(schema)
    fields = dataclasses.fields(schema)
    options = [_describe_option(f, hints[f.name], prefix, defaults) for f in fields
               if not dataclasses.is_dataclass(hints[f.name])]
    sections = [f for f in fields if dataclasses.is_dataclass(hints[f.name])]
    lines = []
    if not prefix and options and sections:
        lines.append("top-level keys:")
    lines += options
    for f in sections:
        key = f"{prefix}{f.name}"
        lines.append(f"{key}:  {f.metadata.get('help', '')}".rstrip())
        lines.append(describe(hints[f.name], key + ".", _default(f, defaults)))
    return "\n".join(lines)


def _default(f: dataclasses.Field, defaults):
    """The default of field ``f``: in the instance ``defaults`` when given, else declared."""
    if defaults is not None:
        return getattr(defaults, f.name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def _describe_option(f: dataclasses.Field, tp, prefix: str, defaults=None) -> str:
    """``  key (type, default=...): help [choices]`` of one option."""
    if defaults is not None:
        default = getattr(defaults, f.name)
    elif f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            default = dataclasses.asdict(default)
    else:
        default = "<required>"
    text = f"  {prefix}{f.name} ({_type_name(tp)}, default={default!r})"
    h = f.metadata.get("help") if f.metadata else None
    if h:
        text += f": {h}"
    ch = f.metadata.get("choices") if f.metadata else None
    if ch:
        text += f" [choices: {', '.join(map(str, ch))}]"
    return text
