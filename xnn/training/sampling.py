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
    """``[len(dataset)]`` float32 dataset weight of every structure of a training set (4
    bytes a structure, held by the planner for the run; :func:`sample_epoch` draws from
    their float64 values, so a weight exact in float32 (1, 2, 0.5, 0.25, ...) draws what its
    float64 did, bit for bit; any other weight is rounded to float32 first, a relative change
    of its probability below 6e-8).

    Read from the wrappers' metadata where they carry it (the ``weight`` of an
    :class:`~xnn.data.datasets.HDF5Source`, a lazy :class:`~xnn.data.sources.frames.
    AtomsSource` (extxyz, ASE-LMDB, ASE SQLite: no structure is read) or a
    :class:`~xnn.data.prepared.PreparedDataset`, :class:`~xnn.data.datasets.Subset` indices,
    :class:`~xnn.data.datasets.ConcatDataset` parts, :class:`~xnn.neighbors.datasets.WithEdges`
    and :class:`~xnn.data.datasets.View` (multi-head, bootstrap) wrappers);
    any other dataset is read once (each structure's ``weight [1]`` field).
    """
    from xnn.data.datasets import ConcatDataset, HDF5Source, InMemoryDataset, Subset, View
    from xnn.data.prepared import PreparedDataset
    from xnn.data.sources.frames import AtomsSource
    from xnn.neighbors.datasets import WithEdges

    if isinstance(dataset, (WithEdges, View)):
        return structure_weights(dataset.dataset)
    if isinstance(dataset, Subset):
        return structure_weights(dataset.dataset)[dataset.indices]
    if isinstance(dataset, ConcatDataset):
        parts = [structure_weights(d) for d in dataset.datasets]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)
    if isinstance(dataset, (HDF5Source, AtomsSource, PreparedDataset)):  # one weight a file
        return np.full(len(dataset), dataset.weight, dtype=np.float32)
    if isinstance(dataset, InMemoryDataset):
        graphs = dataset.graphs
    else:
        graphs = (dataset[i] for i in range(len(dataset)))
    return np.asarray([float(g[K.WEIGHT].reshape(-1)[0]) if K.WEIGHT in g else 1.0
                       for g in graphs], dtype=np.float32)


def sample_epoch(weights: np.ndarray, n_samples: int, seed: int, epoch: int,
                 block: int = 1 << 20) -> np.ndarray:
    """``[n_samples]`` structure indices of one epoch, drawn with replacement with
    probabilities ``weights / weights.sum()`` by a generator seeded with ``(seed, epoch)``.

    The draws of ``rng.choice(len(weights), n_samples, p=weights / weights.sum())``, bit for
    bit (its cumulative distribution, then one uniform number a draw, looked up in it), made
    ``block`` draws at a time and returned as int32 below ``2**31`` structures
    (:func:`~xnn.data.datasets.index_dtype`): the cumulative distribution (8 bytes a
    structure, made in place from the weights' float64 values) and 4 bytes a draw, where
    ``choice`` held four float64/int64 arrays of the whole epoch besides it. Given float32
    weights (:func:`structure_weights`), the draws are those of their float64 values.

    Raises:
        InputError: every weight is 0 (nothing can be drawn), or one is negative or not
            finite.
    """
    from xnn.data.datasets import index_dtype

    cdf = np.array(weights, dtype=np.float64)  # the one float64 array (a copy: float32 in)
    total = float(cdf.sum())
    if not total > 0 or not np.isfinite(total) or bool((cdf < 0).any()):
        raise InputError("data.samples_per_epoch draws structures by dataset weight, but every "
                         "training dataset has weight 0 (or one is negative or not finite); "
                         "give one a weight > 0")
    rng = np.random.default_rng([int(seed) % 2**63, int(epoch)])
    cdf /= total  # the probabilities ``choice`` is given
    np.cumsum(cdf, out=cdf)
    cdf /= cdf[-1]
    n_samples = int(n_samples)
    out = np.empty(n_samples, dtype=index_dtype(len(cdf)))
    for a in range(0, n_samples, block):
        out[a:a + block] = cdf.searchsorted(rng.random(min(block, n_samples - a)), side="right")
    return out
