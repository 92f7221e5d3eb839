"""What a structure file holds, to name its labels: ``xnn data inspect FILE`` and the label
errors of ``xnn train`` / ``xnn eval``.

:func:`~xnn.data.inventory.inventory` reads a file (every frame, or the first ``limit``)
and counts, for every key, how many frames hold it: ``atoms.info`` keys (per structure:
``REF_energy``, ``config_type``), ``atoms.arrays`` keys (per atom: ``REF_forces``) and the
results of a single-point calculator (ASE's extxyz reader moves ``energy=``, ``forces``,
``stress=`` there). :func:`describe_keys` says it in one line; :func:`suggest_key` picks the
key most likely to hold a label (the property's name in the key, e.g. ``DFT_energy`` for
energy, with the right shape).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: per-atom arrays every ASE structure has: not labels
STRUCTURE_ARRAYS = ("numbers", "positions")
#: words that name each label in a key (lower case)
LABEL_WORDS = {"energy": ("energy",), "forces": ("force",), "stress": ("stress",),
               "virial": ("virial",)}


@dataclass
class KeyInventory:
    """Keys of the frames of one file, each with the number of frames that hold it.

    Attributes:
        path: the file.
        n_frames: frames read.
        truncated: the file has more frames than were read.
        info: ``atoms.info`` keys (one value per structure).
        arrays: ``atoms.arrays`` keys other than numbers and positions (one row per atom).
        calc: results of the frames' calculator (single-point energy, forces, stress, ...).
        shapes: ``{key: shape}`` of the first value seen (``[n]`` stands for the atom count).
        n_atoms: atoms of each frame read.
        species: atomic numbers seen.
        hdf5: the file is xnn HDF5, whose labels have fixed names.
    """

    path: str
    n_frames: int = 0
    truncated: bool = False
    info: Counter = field(default_factory=Counter)
    arrays: Counter = field(default_factory=Counter)
    calc: Counter = field(default_factory=Counter)
    shapes: dict = field(default_factory=dict)
    n_atoms: list = field(default_factory=list)
    species: set = field(default_factory=set)
    hdf5: bool = False


def _shape(value, n_atoms: int, per_atom: bool) -> str:
    """``[n, 3]``-style shape of a value (``n``: the atom count)."""
    if isinstance(value, str):
        return "(text)"
    shape: list = list(np.shape(value))
    if not shape:
        return "(number)"
    if per_atom or (len(shape) == 2 and shape[0] == n_atoms and n_atoms != 3):
        shape[0] = "n"
    return "[" + ", ".join(map(str, shape)) + "]"


def _add(inv: KeyInventory, atoms) -> None:
    n = len(atoms)
    inv.n_frames += 1
    inv.n_atoms.append(n)
    inv.species.update(int(z) for z in atoms.numbers)
    results = atoms.calc.results if atoms.calc is not None else {}
    arrays = {k: v for k, v in atoms.arrays.items() if k not in STRUCTURE_ARRAYS}
    for where, keys, per_atom in ((inv.info, atoms.info, False), (inv.calc, results, False),
                                  (inv.arrays, arrays, True)):
        for key, value in keys.items():
            where[key] += 1
            inv.shapes.setdefault(key, _shape(value, n, per_atom))


def inventory_of(frames: Iterable, name: str, limit: int | None = None) -> KeyInventory:
    """Count the keys of ASE ``frames`` (all, or the first ``limit``) read from ``name``."""
    inv = KeyInventory(name)
    for atoms in frames:
        if limit is not None and inv.n_frames >= limit:
            inv.truncated = True
            break
        _add(inv, atoms)
    return inv


def _listing(counts: Counter, n_frames: int, shapes: dict) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k!r} {shapes.get(k, '')}" + ("" if c == n_frames else f" ({c} frames)")
                     for k, c in counts.items())


def describe_keys(inv: KeyInventory) -> str:
    """One line: the info keys, per-atom arrays and calculator results the file holds."""
    if inv.hdf5:
        return (f"{Path(inv.path).name} is xnn HDF5, whose labels have fixed names: "
                f"{_listing(inv.calc, inv.n_frames, {}) if inv.calc else 'no labels'}")
    seen = f"first {inv.n_frames} frames" if inv.truncated else f"{inv.n_frames} frame(s)"
    return (f"{Path(inv.path).name} ({seen}) holds info keys "
            f"{_listing(inv.info, inv.n_frames, inv.shapes)}; per-atom arrays "
            f"{_listing(inv.arrays, inv.n_frames, inv.shapes)}; calculator results "
            f"{_listing(inv.calc, inv.n_frames, inv.shapes)}")


def _fits(prop: str, shape: str) -> bool:
    if prop == "energy":
        return shape in ("(number)", "[1]")
    dims = shape.strip("[]").split(", ")
    if prop == "forces":
        return dims == ["n", "3"]
    return dims in (["6"], ["9"], ["3", "3"])


def suggest_key(inv: KeyInventory, prop: str) -> str | None:
    """The key of ``inv`` most likely to hold label ``prop`` (``energy``, ``forces``,
    ``stress``, ``virial``): the property's own name among calculator results, else a key
    with its name in it and the right shape, held by the most frames; ``None`` if none."""
    if inv.hdf5:
        return None
    if prop in inv.calc:
        return prop
    where = inv.arrays if prop == "forces" else inv.info
    words = LABEL_WORDS[prop]
    found = [(c, k) for k, c in where.items()
             if any(w in k.lower() for w in words) and _fits(prop, inv.shapes.get(k, ""))]
    if prop == "energy":  # free_energy, energy_per_atom, ...: prefer plain *energy names
        found = [(c - ("free" in k.lower() or "per" in k.lower()) * 0.5, k) for c, k in found]
    return max(found)[1] if found else None


def label_count(inv: KeyInventory, prop: str, key: str) -> int:
    """Frames in which label ``prop`` is found under ``key`` (as :func:`xnn.data.ase_io.read`
    looks: ``info``, then ``arrays``, then the calculator's results when ``key == prop``)."""
    if inv.hdf5:
        return inv.calc.get(prop, 0)
    found = inv.info.get(key, 0) or inv.arrays.get(key, 0)
    return found or (inv.calc.get(prop, 0) if key == prop else 0)


def report(inv: KeyInventory, keys: dict[str, str]) -> str:
    """The multi-line report of ``xnn data inspect``: sizes, species, every key with the
    frames that hold it, and where each label is found with ``keys`` (``{prop: key}``)."""
    from ase.data import chemical_symbols

    n = inv.n_frames
    sizes = f"{min(inv.n_atoms)} to {max(inv.n_atoms)}" if inv.n_atoms else "0"
    seen = f" (the first {n} read)" if inv.truncated else ""
    lines = [f"{inv.path}: {n} structures{seen}, {sum(inv.n_atoms)} atoms ({sizes} per "
             f"structure), species {' '.join(chemical_symbols[z] for z in sorted(inv.species))}"]
    for title, counts in (("info keys (one value per structure)", inv.info),
                          ("per-atom arrays", inv.arrays),
                          ("calculator results" if not inv.hdf5 else "labels", inv.calc)):
        lines.append(f"{title}:" + ("" if counts else " none"))
        lines += [f"  {k:<24}{inv.shapes.get(k, ''):<12}in {c} of {n}" for k, c in counts.items()]
    lines.append("labels read with these keys (xnn train: data.datasets.N.<label>_key=KEY; "
                 "xnn eval: --<label>-key KEY):")
    for prop, key in keys.items():
        found = label_count(inv, prop, key)
        hint = suggest_key(inv, prop)
        note = f"; try {prop}_key={hint}" if not found and hint and hint != key else ""
        lines.append(f"  {prop}_key={key}: in {found} of {n}{note}")
    return "\n".join(lines)


__all__ = ["KeyInventory", "inventory_of", "describe_keys", "suggest_key",
           "label_count", "report"]
