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

``finetune.replay_from_pretrained: N`` adds one more replay entry, after the files: ``N``
structures made from the training structures and labelled by the pretrained model itself,
written into the run folder (:mod:`xnn.app.train_replay_gen`); it is split and weighted as
a file. ``split.json`` records every replay entry (``replay_train``, ``replay_val``: indices
per file; ``replay_selection``: the ``replay_fraction`` selection into their concatenated
training parts).

With ``finetune.heads`` every entry trains a readout head (:func:`run_heads`): its own
``head``, else ``default`` (new data) or ``replay`` (replay data); :func:`with_head` marks
its structures with the head's index.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xnn.config.train import DataConfig, DatasetConfig
from xnn.data.datasets import ConcatDataset, Subset, compact_indices, split_indices
from xnn.errors import DataFileError, InputError
from xnn.models.heads import DEFAULT_HEAD, REPLAY_HEAD, check_head_names
from xnn.training.finetune import WithHead

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
    train_indices: list[np.ndarray] = dataclasses.field(default_factory=list)
    val_indices: list[np.ndarray] = dataclasses.field(default_factory=list)
    selection: np.ndarray | None = None


def run_heads(data: DataConfig, generated: bool = False) -> tuple[list[str], list[str]]:
    """``(heads, replay heads)`` of a multi-head run: the heads of the ``data.datasets``
    entries in their order, then those of the replay entries (``data.replay``, then the
    ``finetune.replay_from_pretrained`` structures when ``generated``) not already named.

    Raises:
        InputError: a head name that is not valid, or a ``data.val``/``data.test`` entry
            whose head no training entry trains (one line listing the heads).
    """
    new = [e.head or DEFAULT_HEAD for e in data.datasets]
    replay = [e.head or REPLAY_HEAD for e in data.replay] + ([REPLAY_HEAD] if generated else [])
    heads = list(dict.fromkeys(new + replay))
    check_head_names(heads, "finetune.heads")
    for part, entries in (("val", data.val), ("test", data.test)):
        for k, e in enumerate(entries):
            if (e.head or DEFAULT_HEAD) not in heads:
                raise InputError(f"data.{part}.{k}.head={e.head or DEFAULT_HEAD!r}: no training "
                                 f"entry trains that head; the run's heads are {heads}")
    return heads, list(dict.fromkeys(replay))


def with_head(dataset, heads: list[str] | None, entry: DatasetConfig,
              default: str = DEFAULT_HEAD):
    """``dataset`` whose structures carry the index in ``heads`` of ``entry``'s head
    (``entry.head`` or ``default``); ``dataset`` itself when ``heads`` is ``None``."""
    if heads is None or dataset is None:
        return dataset
    return WithHead(dataset, heads.index(entry.head or default))


def replay_parts(data: DataConfig, open_entry, seed: int, weight: float,
                 fraction: float | None, n_new: int,
                 generated: tuple[DatasetConfig, object] | None = None,
                 heads: list[str] | None = None) -> ReplayParts:
    """Open and split the ``data.replay`` files.

    Args:
        data: the ``data`` section (``replay``, ``val_fraction``).
        open_entry: opens one :class:`DatasetConfig` (``xnn.app.train_data._open``).
        seed: the run's seed.
        weight: ``finetune.replay_weight``.
        fraction: ``finetune.replay_fraction`` (``None``: every replay training structure
            once per epoch).
        n_new: training structures of the new data.
        generated: ``(entry, dataset)`` of the ``finetune.replay_from_pretrained``
            structures (the dataset already weighted ``finetune.replay_weight``), the last
            replay entry.
        heads: the run's heads (:func:`run_heads`; ``None``: one head): every structure
            carries the index of its entry's head (``replay`` by default).
    Raises:
        DataFileError: a replay file holds no structure.
    """
    entries = [dataclasses.replace(e, weight=e.weight * weight) for e in data.replay]
    opened = [None] * len(entries)
    if generated is not None:
        entries.append(dataclasses.replace(generated[0], weight=weight))
        opened.append(generated[1])
    train, val, sizes, tr_idx, va_idx = [], [], [], [], []
    for k, entry in enumerate(entries):
        ds = opened[k] if opened[k] is not None else open_entry(entry)
        if len(ds) == 0:
            raise DataFileError(f"replay dataset {entry.path!r} holds no structure")
        tr, va, _ = split_indices(len(ds), data.val_fraction, 0.0,
                                  seed=seed + REPLAY_SEED + 7919 * k)
        train.append(with_head(Subset(ds, tr), heads, entry, REPLAY_HEAD))
        val.append(with_head(Subset(ds, va), heads, entry, REPLAY_HEAD))
        sizes.append(len(tr))
        tr_idx.append(tr)
        va_idx.append(va)
    pool = chosen = _concat(train)
    selection = None
    if pool is not None and fraction is not None:
        selection = compact_indices(_selection(len(pool), fraction, n_new, seed), len(pool))
        chosen = Subset(pool, selection)  # holds that array: the record's, no copy
    return ReplayParts(chosen, _concat(val), pool, entries, sizes, tr_idx, va_idx, selection)


def replay_membership(parts: ReplayParts, n_replay_files: int, first_file: int) -> dict:
    """The replay part of ``split.json``: ``files`` (``config_key``: ``data.replay.k`` or
    ``finetune.replay_from_pretrained``), ``replay_train``/``replay_val`` rows
    ``{"file": i, "indices": array}`` (file ``i`` counted from ``first_file``) and
    ``replay_selection`` (an int32 array into the pool, ``None``: every replay training
    structure once); arrays, never lists (:func:`xnn.app.train_data.split_membership`)."""
    files = [{"config_key": (f"data.replay.{k}" if k < n_replay_files
                             else "finetune.replay_from_pretrained"), **dataclasses.asdict(e)}
             for k, e in enumerate(parts.entries)]

    def rows(indices):
        return [{"file": first_file + k, "indices": np.asarray(ix)}
                for k, ix in enumerate(indices) if len(ix) > 0]

    return {"files": files, "replay_train": rows(parts.train_indices),
            "replay_val": rows(parts.val_indices), "replay_selection": parts.selection}


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


__all__ = ["ReplayParts", "replay_parts", "replay_membership", "run_heads", "with_head"]
