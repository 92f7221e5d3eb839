"""Datasets of a training run as library functions: the split container, label and
species checks, coincident atoms in a sample of structures, and the structures used for
statistics (a bounded sample: nothing here reads a whole data set).

Reading the ``data`` section of a config into splits is the application's
(:func:`xnn.app.train_data.build_splits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ase.data import chemical_symbols

from xnn.data.datasets import Subset
from xnn.errors import InputError
from xnn.neighbors.coincident import ClosePair
from xnn.neighbors.datasets import WithEdges, coincident_error

#: structures of the statistics sample (E0, shift, scale, average number of neighbours)
STATISTICS_SAMPLE = 2000


@dataclass
class DataSplits:
    """Datasets (with neighbor lists) of one run; ``raw_train`` has no edges (for statistics);
    ``membership``: which structures of which file each split holds (the run's
    ``split.json``), when the application recorded it; ``isolated_e0``: ``{Z: eV}`` energy
    labels of the training files' isolated-atom entries, left out of every split, where they
    were asked for (``model.e0=isolated``; ``None`` otherwise); ``val_replay``: the
    validation part of the fine-tuning replay data (validated on its own), if any."""

    train: WithEdges
    val: WithEdges | None
    test: WithEdges | None
    raw_train: object
    species: list[int]
    membership: dict | None = None
    isolated_e0: dict[int, float] | None = None
    val_replay: WithEdges | None = None


def first_coincident(dataset, indices: Sequence[int], chunk: int = 64
                     ) -> tuple[int, ClosePair] | None:
    """The first of ``indices`` (in their order) whose structure holds two atoms closer than
    :data:`~xnn.neighbors.coincident.MIN_DISTANCE`, with that pair; ``None`` if none does.
    One short-radius neighbor list per ``chunk`` structures."""
    from xnn.data.graph import AtomicGraph
    from xnn.neighbors.coincident import first_close_pair

    indices = [int(i) for i in indices]
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        pair = first_close_pair(AtomicGraph.concat([dataset[i] for i in part]))
        if pair is not None:
            return part[pair.system], pair
    return None


def symbols(zs) -> list[str]:
    """Chemical symbols of atomic numbers ``zs``."""
    return [chemical_symbols[int(z)] for z in zs]


def check_species(dataset, train_species: list[int], what: str) -> None:
    """Raise when ``dataset`` holds species absent from ``train_species``."""
    extra = sorted(set(dataset.species()) - set(train_species))
    if extra:
        raise InputError(f"{what} structures hold species {symbols(extra)} absent from the "
                         f"training set ({symbols(train_species)})")


def sample_indices(n: int, limit: int | None = None) -> np.ndarray:
    """Up to ``limit`` (default :data:`STATISTICS_SAMPLE`) indices spread evenly over
    ``range(n)``, ascending."""
    limit = STATISTICS_SAMPLE if limit is None else limit
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, min(n, limit)).round().astype(np.int64))


def structures_for_statistics(dataset, limit: int | None = None) -> Subset:
    """Up to ``limit`` (default :data:`STATISTICS_SAMPLE`) structures spread evenly over
    ``dataset`` (for E0/scale/shift and the average number of neighbours), as a
    :class:`~xnn.data.datasets.Subset`: its ``origin`` names each one's file and index."""
    return Subset(dataset, sample_indices(len(dataset), limit))


__all__ = ["STATISTICS_SAMPLE", "DataSplits", "check_species",
           "coincident_error", "first_coincident", "sample_indices",
           "structures_for_statistics"]
