"""Training, validation and test sets from the ``data`` section of the config.

Each training file is split on its own by a permutation seeded with ``(seed, file index)``
(see :func:`xnn.data.datasets.split_indices`) unless explicit ``data.val``/``data.test`` files
are given. Labels are checked against the loss weights, and species of validation/test
structures against the training set.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ase.data import chemical_symbols

from xnn.config.train import DataConfig, DatasetConfig, LossConfig
from xnn.data import keys as K
from xnn.data.datasets import (
    ConcatDataset,
    InMemoryDataset,
    Subset,
    WithEdges,
    read_structures,
    split_indices,
)
from xnn.errors import DataFileError, InputError


@dataclass
class DataSplits:
    """Datasets (with neighbor lists) of one run; ``raw_train`` has no edges (for statistics)."""

    train: WithEdges
    val: WithEdges | None
    test: WithEdges | None
    raw_train: object
    species: list[int]


def _open(entry: DatasetConfig):
    if not entry.path:
        raise DataFileError("a dataset entry has an empty path (set data.datasets.N.path)")
    ds = read_structures(entry.path, entry.weight, entry.energy_key, entry.forces_key,
                         entry.stress_key, entry.virial_key)
    refuse_coincident(ds, entry.path)
    return ds


def refuse_coincident(dataset, path: str, chunk: int = 64) -> None:
    """Raise :class:`DataFileError` naming the first structure of a file (its index in the
    file) with two atoms closer than :data:`~xnn.neighbors.coincident.MIN_DISTANCE`: its
    labels would teach the model an energy for coincident atoms."""
    from xnn.data.graph import AtomicGraph
    from xnn.neighbors.coincident import MIN_DISTANCE, find_close_pair

    for start in range(0, len(dataset), chunk):
        stop = min(start + chunk, len(dataset))
        pair = find_close_pair(AtomicGraph.concat([dataset[i] for i in range(start, stop)]))
        if pair is not None:
            raise DataFileError(
                f"structure {start + pair.system} of {path!r}: atoms {pair.i} and {pair.j} are "
                f"{pair.distance:.3g} Å apart, closer than {MIN_DISTANCE} Å (coincident atoms: "
                "a duplicated atom?); remove or fix that structure")


def _concat(parts: list):
    parts = [p for p in parts if p is not None and len(p) > 0]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def _symbols(zs) -> list[str]:
    return [chemical_symbols[int(z)] for z in zs]


def check_labels(dataset, loss: LossConfig, what: str) -> None:
    """Raise when weighted properties lack labels (energy/forces: every structure; stress:
    at least one structure, the others are masked)."""
    masks = dataset.label_masks()
    for name, key in (("energy", K.ENERGY), ("forces", K.FORCES)):
        if getattr(loss, name).weight > 0 and not masks[key].all():
            bad = np.flatnonzero(~masks[key])
            raise DataFileError(
                f"{len(bad)} {what} structure(s) of {getattr(dataset, 'name', 'the data')!r} "
                f"have no {name} label (first: index {int(bad[0])}) but loss.{name}.weight="
                f"{getattr(loss, name).weight}; fix the {name}_key or set the weight to 0"
            )
    if loss.stress.weight > 0 and not masks[K.STRESS].any():
        raise DataFileError(f"no {what} structure has a stress (or virial) label but "
                            f"loss.stress.weight={loss.stress.weight}; check stress_key/virial_key")


def _check_species(dataset, train_species: list[int], what: str) -> None:
    extra = sorted(set(dataset.species()) - set(train_species))
    if extra:
        raise InputError(f"{what} structures hold species {_symbols(extra)} absent from the "
                         f"training set ({_symbols(train_species)})")


def build_splits(data: DataConfig, loss: LossConfig, cutoff: float, seed: int,
                 species: list[int] | None = None) -> DataSplits:
    """Read, split, check and wrap the datasets of a run.

    Args:
        data: the ``data`` config section.
        loss: the ``loss`` section (which labels are required).
        cutoff: neighbor-list cutoff (Å).
        seed: split seed.
        species: the model's species if fixed by the config (else those of the training set).
    """
    if not data.datasets:
        raise InputError("no training data: set data.datasets (e.g. "
                         "data.datasets.0.path=train.xyz)")
    train_parts, val_parts, test_parts = [], [], []
    for k, entry in enumerate(data.datasets):
        ds = _open(entry)
        if len(ds) == 0:
            raise DataFileError(f"dataset {entry.path!r} holds no structure")
        vf = 0.0 if data.val else data.val_fraction
        tf = 0.0 if data.test else data.test_fraction
        tr, va, te = split_indices(len(ds), vf, tf, seed=seed + 7919 * k)
        train_parts.append(Subset(ds, tr))
        val_parts.append(Subset(ds, va))
        test_parts.append(Subset(ds, te))
    val_parts += [_open(e) for e in data.val]
    test_parts += [_open(e) for e in data.test]
    train = _concat(train_parts)
    if data.overfit is not None:
        train = Subset(train, np.arange(min(data.overfit, len(train))))
        val = train
    else:
        val = _concat(val_parts)
    test = _concat(test_parts)
    check_labels(train, loss, "training")
    train_species = train.species()
    if species is not None:
        missing = sorted(set(train_species) - set(species))
        if missing:
            raise InputError(f"training structures hold species {_symbols(missing)} absent from "
                             f"model.species ({_symbols(species)})")
        train_species = sorted(species)
    for ds, what in ((val, "validation"), (test, "test")):
        if ds is not None:
            _check_species(ds, train_species, what)
    cache = data.cache_edges
    return DataSplits(
        train=WithEdges(train, cutoff, cache),
        val=WithEdges(val, cutoff, cache) if val is not None else None,
        test=WithEdges(test, cutoff, cache) if test is not None else None,
        raw_train=train,
        species=train_species,
    )


def structures_for_statistics(dataset, limit: int = 2000) -> list:
    """Up to ``limit`` structures spread evenly over ``dataset`` (for E0/scale/shift)."""
    n = len(dataset)
    idx = np.unique(np.linspace(0, n - 1, min(n, limit)).round().astype(int)) if n else []
    return [dataset[int(i)] for i in idx]




def data_files(data: DataConfig) -> dict[str, str]:
    """``{config key: path}`` of every data file of a run (e.g. ``data.datasets.0.path``),
    for the ranks of a job to check that they read the same data."""
    return {f"data.{part}.{k}.path": entry.path for part in ("datasets", "val", "test")
            for k, entry in enumerate(getattr(data, part))}


__all__ = ["DataSplits", "build_splits", "check_labels", "data_files", "refuse_coincident",
           "structures_for_statistics", "InMemoryDataset"]
