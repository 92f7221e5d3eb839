"""Training, validation and test sets from the ``data`` section of the config.

Each training file is split on its own by a permutation seeded with ``(seed, file index)``
(see :func:`xnn.data.datasets.split_indices`) unless explicit ``data.val``/``data.test`` files
are given. Labels are checked against the loss weights, species of validation/test
structures against the training set, and every structure for coincident atoms: the ranks of
a job share that scan (each takes every ``world_size``-th structure of each file) and raise
the same error. Neighbor lists of the model's cutoff are built later, at a structure's first
use, by the rank that uses it (:class:`~xnn.data.datasets.WithEdges`).
"""

from __future__ import annotations

import numpy as np

from xnn.config.train import DataConfig, DatasetConfig, LossConfig
from xnn.data.datasets import ConcatDataset, Subset, WithEdges, read_structures, split_indices
from xnn.errors import DataFileError, InputError
from xnn.training.data import (
    DataSplits,
    check_labels,
    check_species,
    coincident_error,
    first_coincident,
    symbols,
)
from xnn.training.reducer import LocalReducer


def _open(entry: DatasetConfig, opened: list):
    """The dataset of ``entry``, appended with its path to ``opened``."""
    if not entry.path:
        raise DataFileError("a dataset entry has an empty path (set data.datasets.N.path)")
    ds = read_structures(entry.path, entry.weight, entry.energy_key, entry.forces_key,
                         entry.stress_key, entry.virial_key)
    opened.append((ds, entry.path))
    return ds


def refuse_coincident_shared(opened: list, reducer) -> None:
    """Raise the same :class:`DataFileError` on every rank for the first structure (first
    file, then index in it) of ``opened`` (``(dataset, path)`` pairs) with coincident atoms.

    Each rank scans every ``world_size``-th structure of each file, from its rank on, and
    stops at the first file where it finds one; one gather of the findings follows
    (collective over ``reducer``'s ranks).
    """
    rank, world = reducer.rank, reducer.world_size
    mine = None
    for k, (ds, _) in enumerate(opened):
        found = first_coincident(ds, range(rank, len(ds), world))
        if found is not None:
            mine = (k, *found)
            break
    found = [f for f in (reducer.gather_objects(mine) if world > 1 else [mine]) if f]
    if found:
        k, index, pair = min(found, key=lambda f: f[:2])
        raise coincident_error(opened[k][1], index, pair)


def _concat(parts: list):
    parts = [p for p in parts if p is not None and len(p) > 0]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def build_splits(data: DataConfig, loss: LossConfig, cutoff: float, seed: int,
                 species: list[int] | None = None, reducer=None) -> DataSplits:
    """Read, split, check and wrap the datasets of a run.

    Args:
        data: the ``data`` config section.
        loss: the ``loss`` section (which labels are required).
        cutoff: neighbor-list cutoff (Å).
        seed: split seed.
        species: the model's species if fixed by the config (else those of the training set).
        reducer: the ranks that share the scan for coincident atoms (``rank``,
            ``world_size``, ``gather_objects``; default: one process). Every rank of it must
            call this function.
    """
    if not data.datasets:
        raise InputError("no training data: set data.datasets (e.g. "
                         "data.datasets.0.path=train.xyz)")
    train_parts, val_parts, test_parts, opened = [], [], [], []
    for k, entry in enumerate(data.datasets):
        ds = _open(entry, opened)
        if len(ds) == 0:
            raise DataFileError(f"dataset {entry.path!r} holds no structure")
        vf = 0.0 if data.val else data.val_fraction
        tf = 0.0 if data.test else data.test_fraction
        tr, va, te = split_indices(len(ds), vf, tf, seed=seed + 7919 * k)
        train_parts.append(Subset(ds, tr))
        val_parts.append(Subset(ds, va))
        test_parts.append(Subset(ds, te))
    val_parts += [_open(e, opened) for e in data.val]
    test_parts += [_open(e, opened) for e in data.test]
    refuse_coincident_shared(opened, reducer or LocalReducer())
    train = _concat(train_parts)
    if data.overfit is not None:
        train = Subset(train, np.arange(min(data.overfit, len(train))))
        val = train
    else:
        val = _concat(val_parts)
    test = _concat(test_parts)
    check_labels(train, {name: getattr(loss, name).weight
                         for name in ("energy", "forces", "stress")}, "training")
    train_species = train.species()
    if species is not None:
        missing = sorted(set(train_species) - set(species))
        if missing:
            raise InputError(f"training structures hold species {symbols(missing)} absent from "
                             f"model.species ({symbols(species)})")
        train_species = sorted(species)
    for ds, what in ((val, "validation"), (test, "test")):
        if ds is not None:
            check_species(ds, train_species, what)
    cache = data.cache_edges
    return DataSplits(
        train=WithEdges(train, cutoff, cache),
        val=WithEdges(val, cutoff, cache) if val is not None else None,
        test=WithEdges(test, cutoff, cache) if test is not None else None,
        raw_train=train,
        species=train_species,
    )


def data_files(data: DataConfig) -> dict[str, str]:
    """``{config key: path}`` of every data file of a run (e.g. ``data.datasets.0.path``),
    for the ranks of a job to check that they read the same data."""
    return {f"data.{part}.{k}.path": entry.path for part in ("datasets", "val", "test")
            for k, entry in enumerate(getattr(data, part))}
