"""Which structures of a global batch a rank's data-parallel replica takes.

Pure index arithmetic (no collective): the parallelization layer
(:func:`xnn.distributed.entries.parallelize_train`) builds the :class:`BatchSharding` of
each rank; a single process takes every structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from xnn.data.datasets import LabelledDataset, atom_chunks, shard_batch
from xnn.data.graph import AtomicGraph


@dataclass(frozen=True)
class BatchSharding:
    """The share of a global batch that this rank's ``dd`` group takes.

    Attributes:
        dp_rank: this rank's data-parallel replica.
        dp: number of replicas (``dd`` groups).
        groups: ``dp`` when ``data.max_atoms_per_batch`` is a per-group budget (``dd > 1``;
            batches are then made by ``make_batches(..., groups=dp)``), else ``None``.
        without_edges: :meth:`load` reads the structures without the neighbor list of the
            whole structure (``dd > 1``: each rank builds the edges of its own atoms).
    """

    dp_rank: int = 0
    dp: int = 1
    groups: int | None = None
    without_edges: bool = False

    def load(self, dataset, indices: Sequence[int]) -> list[AtomicGraph]:
        """The structures ``indices`` of ``dataset`` as this rank's predictor takes them: one
        batched graph (:meth:`~xnn.data.datasets.LabelledDataset.read_batch`), or one graph
        per structure where each is a piece of its own (``without_edges``)."""
        from xnn.neighbors.datasets import WithEdges

        if self.without_edges and isinstance(dataset, WithEdges):
            # the same structures and labels, no edges (checked for coincident atoms)
            return [dataset.without_edges(i) for i in indices]
        if self.without_edges or len(indices) == 0 or not isinstance(dataset, LabelledDataset):
            return [dataset[i] for i in indices]
        # one batched graph read at once: what the predictor's collate makes of the list
        return [dataset.read_batch(indices)]

    def __call__(self, batch: Sequence[int], n_atoms: np.ndarray,
                 max_atoms: int | None = None) -> list[int]:
        """This group's indices of ``batch`` (made with ``max_atoms`` if not ``None``)."""
        if self.dp == 1:
            return list(batch)
        if self.groups is not None and max_atoms is not None:
            chunks = atom_chunks(list(batch), n_atoms, max_atoms)
            return chunks[self.dp_rank] if self.dp_rank < len(chunks) else []
        return shard_batch(batch, n_atoms, self.dp_rank, self.dp)
