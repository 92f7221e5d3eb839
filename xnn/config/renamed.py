"""Config keys that were renamed: each old spelling is refused with one line naming the new
one, from a YAML file and from a ``key=value`` override, for every command (no silent
aliasing: a config means one thing, and an old one says how to write it today). The loader
(:func:`xnn.config.loader.load_config`) raises the messages built here."""

from __future__ import annotations

from collections.abc import Mapping

#: old key -> its new spelling (a key under an old section is refused by the section's entry)
RENAMED: dict[str, str] = {
    "model.params": "model.hyperparameters (with model.cutoff and model.species as typed "
                    "keys)",
    "model.backend": "model.kernel_backend",
    "model.add": "model.name: sum with model.hyperparameters.terms: [...] (the model itself "
                 "one of the terms, e.g. [{model_file: model.pt}, {name: d3, functional: "
                 "pbe}])",
    "dd.mode": "parallel.mode",
    "dd.order": "parallel.order",
    "dd": "the parallel section (parallel.mode, parallel.order)",
}

#: old ``dd.mode`` values -> the ``parallel.mode`` word of the same meaning
OLD_DD_MODES = {"halo": "spatial", "graph": "graph", "auto": "auto"}


def old_key(key: str) -> str | None:
    """The renamed key that ``key`` (dotted) is or lies under, else ``None``."""
    for old in sorted(RENAMED, key=len, reverse=True):
        if key == old or key.startswith(old + "."):
            return old
    return None


def renamed_message(key: str, value=None) -> str | None:
    """The one-line message refusing ``key`` (dotted, set to ``value``) if it is an old
    spelling, else ``None``."""
    old = old_key(key)
    if old is None:
        return None
    if old == "dd.mode" and isinstance(value, str) and value in OLD_DD_MODES:
        note = (" (parallel.mode=halo now means pure halo: ghosts of the whole receptive "
                "field, no exchange between layers)" if value == "halo" else "")
        return f"dd.mode is now parallel.mode: write parallel.mode={OLD_DD_MODES[value]}{note}"
    return f"config key {key!r} was renamed: write {RENAMED[old]}"


def renamed_in(tree: Mapping, prefix: str = "") -> str | None:
    """:func:`renamed_message` of the first old key of a YAML mapping (nested mappings
    walked, a section's keys before the section), else ``None``."""
    for k, v in tree.items():
        key = f"{prefix}{k}"
        inner = renamed_in(v, key + ".") if isinstance(v, Mapping) else None
        message = inner or renamed_message(key, v)
        if message:
            return message
    return None
