"""Replay data of a fine-tuning run (``data.replay``): structures from the pretraining
distribution trained alongside the new data so that the fine-tuned model keeps its
pretrained accuracy.

Each replay file is split like a training file (``data.val_fraction``, seeded by the file's
place); its training part joins the training set with loss weight
``finetune.replay_weight`` (times the entry's own ``weight``), its validation part is
validated on its own (``val_replay_*`` metrics in ``metrics.csv``), so the run shows
forgetting as it happens. With ``finetune.replay_fraction`` = ``f`` the training set takes
``round(f / (1 - f) × n_new)`` replay structures, a seeded selection (repeated when the
replay files have fewer), so that replay is the share ``f`` of every epoch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xnn.config.train import DataConfig, DatasetConfig
from xnn.data.datasets import ConcatDataset, Subset, split_indices
from xnn.errors import DataFileError

#: seeds the replay files' splits apart from the training files' (seed + 7919 k)
REPLAY_SEED = 104729


@dataclasses.dataclass
class ReplayParts:
    """Replay structures of a run: ``train`` joins the training set, ``val`` is validated on
    its own; ``pool``: every replay training structure once, in entry order, and
    ``entries``/``sizes``: the replay entries (with their replay weight) and how many
    training structures each gave (for the label check)."""

    train: object | None
    val: object | None
    pool: object | None
    entries: list[DatasetConfig]
    sizes: list[int]


def replay_parts(data: DataConfig, open_entry, seed: int, weight: float,
                 fraction: float | None, n_new: int) -> ReplayParts:
    """Open and split the ``data.replay`` files.

    Args:
        data: the ``data`` section (``replay``, ``val_fraction``).
        open_entry: opens one :class:`DatasetConfig` (``xnn.app.train_data._open``).
        seed: the run's seed.
        weight: ``finetune.replay_weight``.
        fraction: ``finetune.replay_fraction`` (``None``: every replay training structure
            once per epoch).
        n_new: training structures of the new data.
    Raises:
        DataFileError: a replay file holds no structure.
    """
    entries = [dataclasses.replace(e, weight=e.weight * weight) for e in data.replay]
    train, val, sizes = [], [], []
    for k, entry in enumerate(entries):
        ds = open_entry(entry)
        if len(ds) == 0:
            raise DataFileError(f"replay dataset {entry.path!r} holds no structure")
        tr, va, _ = split_indices(len(ds), data.val_fraction, 0.0,
                                  seed=seed + REPLAY_SEED + 7919 * k)
        train.append(Subset(ds, tr))
        val.append(Subset(ds, va))
        sizes.append(len(tr))
    pool = chosen = _concat(train)
    if pool is not None and fraction is not None:
        chosen = Subset(pool, _selection(len(pool), fraction, n_new, seed))
    return ReplayParts(chosen, _concat(val), pool, entries, sizes)


def _selection(n_pool: int, fraction: float, n_new: int, seed: int) -> np.ndarray:
    """``round(f / (1 - f) × n_new)`` indices into ``range(n_pool)``: a seeded permutation,
    repeated as often as needed."""
    want = max(int(round(fraction / (1.0 - fraction) * n_new)), 1)
    order = np.random.default_rng([seed, REPLAY_SEED]).permutation(n_pool)
    return np.resize(order, want)


def _concat(parts: list):
    parts = [p for p in parts if len(p) > 0]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


__all__ = ["ReplayParts", "replay_parts"]
