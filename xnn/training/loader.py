"""This rank's shares of the training batches read by DataLoader workers (``data.num_workers``).

A share (the structure indices this rank trains in one global batch) is one item of a
:class:`torch.utils.data.DataLoader` without automatic batching: a worker reads its
structures and builds their neighbor lists (:class:`~xnn.neighbors.datasets.WithEdges`),
for a one-process predictor as one batch graph read at once
(:meth:`~xnn.data.datasets.LabelledDataset.read_batch`, equal to the concatenation the
predictor does).
A read share crosses to the training process packed into one byte buffer
(:func:`~xnn.data.packed.pack`: one shared-memory file a share, not one a field; the same
bits, dtypes and shapes once viewed apart).
The shares come in order, so the batches and the loss are bitwise those of reading them in
the training process (``num_workers=0``, which reads them there without any DataLoader).

A structure refused when it is read (coincident atoms, :class:`~xnn.errors.DataFileError`)
comes back as a value, not raised in the worker: the loop hands it to the step, which stops
every rank the same way as without workers. Workers persist across epochs; on Linux they are
forked (an HDF5 handle is reopened in each worker, see :class:`~xnn.data.hdf5.HDF5Dataset`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from torch.utils.data import DataLoader, Dataset, Sampler

from xnn.data.graph import AtomicGraph
from xnn.data.packed import Packed, pack
from xnn.errors import DataFileError

#: what a read share is: its graphs (one batch graph when collated) and the refusal, if any
Read = tuple[list[AtomicGraph], DataFileError | None]
#: what crosses from a worker: the graphs' fields, each graph's packed in one buffer (in
#: shared memory)
Sent = tuple[list[Packed], DataFileError | None]


class ShareReader(Dataset):
    """Map-style dataset whose keys are shares: ``reader[share] -> (graphs' packed fields,
    refusal)`` (:class:`ShareLoader` views the fields apart and rebuilds the graphs).

    Args:
        dataset: the training structures (with neighbor lists).
        load: ``load(dataset, indices) -> graphs`` (the sharding's, see
            :class:`~xnn.training.sharding.BatchSharding`).
        collate: concatenate a share's graphs into one batch graph.
    """

    def __init__(self, dataset, load: Callable, collate: bool):
        self.dataset = dataset
        self.load = load
        self.collate = collate

    def __getitem__(self, share: tuple[int, ...]) -> Sent:
        try:
            graphs = self.load(self.dataset, list(share))
        except DataFileError as e:
            return [], e
        if self.collate and graphs:
            graphs = [AtomicGraph.concat(graphs)]
        return [pack(g.fields) for g in graphs], None


class _Shares(Sampler):
    """The shares of the current epoch, set before each pass (the workers persist); read
    as the DataLoader asks for them (an epoch's shares are never all held as tuples)."""

    def __init__(self):
        self.items: Sequence[Sequence[int]] = []

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (tuple(int(i) for i in s) for s in self.items)

    def __len__(self) -> int:
        return len(self.items)


def _keep(item: Sent) -> Sent:
    return item


class ShareLoader:
    """Read shares in order through ``num_workers`` DataLoader workers.

    Args:
        dataset: the training structures (with neighbor lists).
        load: ``load(dataset, indices) -> graphs``.
        num_workers: worker processes (at least 1; 0 is the loop's own read).
        collate: the workers concatenate each share into one batch graph.
        prefetch_factor: shares each worker reads ahead.
    """

    def __init__(self, dataset, load: Callable, num_workers: int, collate: bool,
                 prefetch_factor: int = 2):
        self.sampler = _Shares()
        self.loader = DataLoader(
            ShareReader(dataset, load, collate), batch_size=None, sampler=self.sampler,
            num_workers=num_workers, collate_fn=_keep, persistent_workers=True,
            prefetch_factor=prefetch_factor, multiprocessing_context=_context())

    def read(self, shares: Sequence[Sequence[int]]) -> Iterator[Read]:
        """``(graphs, refusal)`` of each of ``shares``, in order."""
        self.sampler.items = shares
        for packed, refused in self.loader:  # checked where they were built
            yield [AtomicGraph(p.unpack(), validate=False) for p in packed], refused


def _context():
    """``fork`` where the platform has it (workers start in milliseconds and share the
    dataset's index arrays), else the platform's default (``spawn``: the reader pickles)."""
    import multiprocessing

    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


__all__ = ["ShareLoader", "ShareReader", "Read"]
