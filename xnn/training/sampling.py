"""Epochs of a fixed number of structures drawn by dataset weight (``data.samples_per_epoch``).

Each of the ``samples_per_epoch`` draws of an epoch picks training structure ``i`` with
probability ``w_i / Σ w``, ``w_i`` the ``weight`` of the dataset it comes from
(``data.datasets.N.weight``), independently and **with replacement**: a structure can appear
twice in an epoch (or a batch), and an epoch may be longer than the training set. The draws
come from a generator seeded with ``(seed, epoch)`` only, so the batches of an epoch stay a
pure function of ``(seed, epoch)`` (the same on every rank, and after a resume).

The dataset weight also stays the structure's loss weight: a dataset of weight 2 is drawn
twice as often *and* counts twice per structure in the loss.
"""

from __future__ import annotations

import numpy as np

from xnn.data import keys as K
from xnn.errors import InputError


def structure_weights(dataset) -> np.ndarray:
    """``[len(dataset)]`` float64 dataset weight of every structure of a training set.

    Read from the wrappers' metadata where they carry it (:class:`~xnn.data.datasets.
    HDF5Source`'s ``weight``, :class:`~xnn.data.datasets.Subset` indices,
    :class:`~xnn.data.datasets.ConcatDataset` parts, :class:`~xnn.neighbors.datasets.WithEdges`);
    any other dataset is read once (each structure's ``weight [1]`` field).
    """
    from xnn.data.datasets import ConcatDataset, HDF5Source, InMemoryDataset, Subset
    from xnn.neighbors.datasets import WithEdges

    if isinstance(dataset, WithEdges):
        return structure_weights(dataset.dataset)
    if isinstance(dataset, Subset):
        return structure_weights(dataset.dataset)[dataset.indices]
    if isinstance(dataset, ConcatDataset):
        parts = [structure_weights(d) for d in dataset.datasets]
        return np.concatenate(parts) if parts else np.zeros(0)
    if isinstance(dataset, HDF5Source):
        return np.full(len(dataset), dataset.weight, dtype=np.float64)
    if isinstance(dataset, InMemoryDataset):
        graphs = dataset.graphs
    else:
        graphs = (dataset[i] for i in range(len(dataset)))
    return np.asarray([float(g[K.WEIGHT].reshape(-1)[0]) if K.WEIGHT in g else 1.0
                       for g in graphs], dtype=np.float64)


def sample_epoch(weights: np.ndarray, n_samples: int, seed: int, epoch: int) -> np.ndarray:
    """``[n_samples]`` structure indices of one epoch, drawn with replacement with
    probabilities ``weights / weights.sum()`` by a generator seeded with ``(seed, epoch)``.

    Raises:
        InputError: every weight is 0 (nothing can be drawn).
    """
    w = np.asarray(weights, dtype=np.float64)
    total = float(w.sum())
    if not total > 0:
        raise InputError("data.samples_per_epoch draws structures by dataset weight, but every "
                         "training dataset has weight 0; give one a weight > 0")
    rng = np.random.default_rng([int(seed) % 2**63, int(epoch)])
    return rng.choice(len(w), size=int(n_samples), replace=True, p=w / total)
