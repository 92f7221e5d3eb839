"""Datasets of labelled structures with their neighbor lists.

:class:`WithEdges` builds a structure's neighbor list at its first use and refuses it there
if two of its atoms are closer than :data:`~xnn.neighbors.coincident.MIN_DISTANCE` (every
such pair is an edge of the model's cutoff, so the check costs no neighbor list): no pass
over the whole data set is needed before training starts.
"""

from __future__ import annotations

import numpy as np

from xnn.data.datasets import (
    ConcatDataset,
    InMemoryDataset,
    LabelledDataset,
    Subset,
    View,
    collate,
    count_labels_by_reading,
    origin_of,
)
from xnn.data.graph import AtomicGraph
from xnn.errors import DataFileError
from xnn.neighbors.api import with_edges
from xnn.neighbors.coincident import (
    MIN_DISTANCE,
    find_close_pair,
    first_close_edge,
    first_close_pair,
)


def coincident_error(path: str, index: int, pair) -> DataFileError:
    """The one-line refusal of structure ``index`` of file ``path`` whose atoms ``pair.i``
    and ``pair.j`` (a :class:`~xnn.neighbors.coincident.ClosePair`) are too close."""
    return DataFileError(
        f"structure {index} of {path!r}: atoms {pair.i} and {pair.j} are "
        f"{pair.distance:.3g} Å apart, closer than {MIN_DISTANCE} Å (coincident atoms: "
        "a duplicated atom?); remove or fix that structure")


#: ``data.cache_edges`` null caches the neighbor lists of a lazy dataset of at most this many
#: atoms (its structures with edges then take ~1 GB at 5 Å in a dense metal): the extxyz file of
#: a typical run is read lazily, but trains as fast as when it was read whole
AUTO_CACHE_ATOMS = 250_000


def cache_by_default(dataset) -> bool:
    """``data.cache_edges`` null: cache the structures with their edges when they are in
    memory already (:func:`in_memory`) or hold at most :data:`AUTO_CACHE_ATOMS` atoms; a
    larger lazy dataset gets its edges built at every use (its memory does not grow)."""
    return in_memory(dataset) or int(np.asarray(dataset.n_atoms).sum()) <= AUTO_CACHE_ATOMS


def in_memory(dataset) -> bool:
    """Whether every structure of ``dataset`` is held in memory already
    (:class:`~xnn.data.datasets.InMemoryDataset`, through subsets and concatenations): its
    neighbor lists are then cached by default (``data.cache_edges`` null). A lazy dataset (an
    HDF5 file, anything read a structure at a time) gets its edges built at every use, so
    that the memory of a run does not grow with its data set."""
    if isinstance(dataset, InMemoryDataset):
        return True
    if isinstance(dataset, (Subset, View, WithEdges)):
        return in_memory(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return all(in_memory(d) for d in dataset.datasets)
    return False


class WithEdges(LabelledDataset):
    """Attach a neighbor list for ``cutoff`` to every structure, cached after the first read,
    and refuse a structure with coincident atoms there.

    Args:
        dataset: the structures.
        cutoff: Å (the model's cutoff).
        cache: keep the graphs with edges in memory (off for datasets larger than memory:
            the default of lazy data, see :func:`in_memory`).

    Raises (on reading a structure):
        DataFileError: two of its atoms are closer than
            :data:`~xnn.neighbors.coincident.MIN_DISTANCE` (:func:`coincident_error`: its
            file and index in it, the atoms and their distance).
    """

    def __init__(self, dataset, cutoff: float, cache: bool = True):
        self.dataset = dataset
        self.cutoff = float(cutoff)
        self.n_atoms = np.asarray(dataset.n_atoms)
        self.name = getattr(dataset, "name", "dataset")
        self._cache: dict[int, AtomicGraph] | None = {} if cache else None
        self._checked: set[int] = set()  # read by without_edges and found sound

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> AtomicGraph:
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        g = with_edges(self.dataset[index], self.cutoff)
        # every pair closer than MIN_DISTANCE is an edge: the check needs no neighbor list
        pair = first_close_edge(g) if self.cutoff >= MIN_DISTANCE else first_close_pair(g)
        if pair is not None:
            raise coincident_error(*self.origin(index), pair)
        if self._cache is not None:
            self._cache[index] = g
        return g

    def read_batch(self, indices) -> AtomicGraph:
        """Structures ``indices`` with their edges as one batched graph, equal field by field
        to :func:`~xnn.data.datasets.collate` of ``self[i]`` each (and refused the same
        way). Without a cache the batch is read at once (``dataset.read_batch``) and its
        neighbor list built in one call (one input check, not one per structure); a batch
        with coincident atoms is read again structure by structure for the refusal."""
        if self._cache is not None or self.cutoff < MIN_DISTANCE or len(indices) == 0:
            return super().read_batch(indices)
        inner = self.dataset  # any dataset: read structure by structure if not labelled
        g = with_edges(inner.read_batch(indices) if isinstance(inner, LabelledDataset) else
                       collate([inner[int(i)] for i in indices]), self.cutoff)
        if first_close_edge(g) is not None:
            return super().read_batch(indices)  # raises for the first such structure
        return g

    def without_edges(self, index: int) -> AtomicGraph:
        """Structure ``index`` without its neighbor list (domain-decomposed training builds
        each rank's own), refused as :meth:`__getitem__` does at its first read here: one
        short-radius neighbor list, the same verdict on every rank that reads it."""
        g = self.dataset[index]
        if index not in self._checked:
            pair = find_close_pair(g)
            if pair is not None:
                raise coincident_error(*self.origin(index), pair)
            self._checked.add(index)
        return g

    def origin(self, index: int) -> tuple[str, int]:
        return origin_of(self.dataset, index)

    def _count_labels(self) -> np.ndarray:
        inner = getattr(self.dataset, "label_counts", None)  # else any dataset, read once
        return inner() if inner is not None else count_labels_by_reading(self.dataset)

    def species(self) -> list[int]:
        return self.dataset.species()
