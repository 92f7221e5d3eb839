"""Labelling for ``xnn learn``: the labeller, structure hashes, the per-structure label store
and the decision journal.

Nothing is labelled twice. A structure is named by a content hash (:func:`structure_hash`:
atomic numbers, positions, cell and pbc, bitwise). Each label is written to its own file
``labels/<hash>.extxyz`` atomically (written, fsynced, renamed) before the next structure is
computed, so a loop killed at any moment holds every finished label, and a restart skips
every hash it finds there: only a calculation in progress when the process died is run
again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from xnn._files import atomic_write_text
from xnn.config.learn import LabelConfig
from xnn.errors import TrustError


def structure_hash(atoms) -> str:
    """A content hash of a structure: sha256 (first 16 hex digits) of its atomic numbers,
    positions (Å), cell (Å) and pbc, as float64/int64 bytes."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(atoms.numbers, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(atoms.positions, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(atoms.cell.array, dtype=np.float64).tobytes())
    h.update(np.ascontiguousarray(atoms.pbc, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def labeller_factory(cfg: LabelConfig) -> Callable[[], object]:
    """The function that makes the labeller's ASE calculator: ASE's EMT for ``emt``, else the
    user's ``package.module:factory``, imported only with ``label.trust=true``.

    Raises:
        TrustError: a user factory without ``label.trust=true``.
        InputError: the factory cannot be imported.
    """
    if cfg.calculator == "emt":
        from ase.calculators.emt import EMT

        return EMT
    if cfg.trust is not True:
        raise TrustError(f"label.calculator={cfg.calculator!r} imports and runs code from "
                         f"that module: if you trust it, add label.trust=true (on the command "
                         f"line or in your config)")
    from xnn.dynamics.callable_hooks import load_target

    return load_target(cfg.calculator)


def to_extxyz(atoms) -> str:
    """One structure (with its calculator's results) as extxyz text."""
    import ase.io

    buf = io.StringIO()
    ase.io.write(buf, atoms, format="extxyz")
    return buf.getvalue()


def write_frames(path: Path, frames: list) -> None:
    """``frames`` to the extxyz file ``path``, atomically (an empty list: an empty file)."""
    atomic_write_text(path, "".join(to_extxyz(a) for a in frames))


def read_frames(path: Path) -> list:
    """The structures of an extxyz file (an empty file: none)."""
    import ase.io

    if Path(path).stat().st_size == 0:
        return []
    return ase.io.read(str(path), index=":", format="extxyz")


class LabelStore:
    """Finished labels by hash in one folder shared by every round (``labels/``)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.extxyz"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def get(self, key: str):
        return read_frames(self.path(key))[0]

    def put(self, key: str, atoms) -> None:
        atomic_write_text(self.path(key), to_extxyz(atoms))


def label_one(atoms, calc, stress: bool):
    """A copy of ``atoms`` labelled by ``calc``: energy (eV), forces (eV/Å) and, for a
    structure periodic along all axes when ``stress``, stress (eV/Å³), on a single-point
    calculator; the info of ``atoms`` is kept."""
    from ase.calculators.singlepoint import SinglePointCalculator

    work = atoms.copy()
    work.calc = calc
    results = {"energy": float(work.get_potential_energy()),
               "forces": np.array(work.get_forces())}
    if stress and bool(np.all(work.pbc)):
        results["stress"] = np.array(work.get_stress(voigt=False))
    out = atoms.copy()
    out.calc = SinglePointCalculator(out, **results)
    return out


class Journal:
    """``journal.jsonl``: one JSON object per decision, appended and fsynced."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def log(self, event: str, **data) -> None:
        line = json.dumps({"event": event, **data}, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def events(self) -> list[dict]:
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: the decision is redone
                continue
        return out


def label_all(selected: list, store: LabelStore, cfg: LabelConfig, journal: Journal,
              round_index: int) -> list:
    """Label every structure of ``selected`` that has no label in ``store`` yet, one after
    the other, each label stored before the next is computed. Each structure gets a fresh
    calculator from the factory, so its label depends on nothing but the structure (a
    calculator reused across structures can carry state from one to the next, e.g. EMT's
    neighbor list, and a resumed loop would then label to rounding differently).

    Returns:
        the labelled structures in the order of ``selected``.
    """
    factory = None
    out = []
    for atoms in selected:
        key = atoms.info["learn_hash"]
        if store.has(key):
            journal.log("label_skipped", round=round_index, hash=key,
                        reason="already labelled")
        else:
            factory = factory or labeller_factory(cfg)
            store.put(key, label_one(atoms, factory(), cfg.stress))
            journal.log("labelled", round=round_index, hash=key, calculator=cfg.calculator)
        out.append(store.get(key))
    return out
