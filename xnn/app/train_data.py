"""Training, validation and test sets from the ``data`` section of the config.

Each training file is split on its own by a permutation seeded with ``(seed, file index)``
(see :func:`xnn.data.datasets.split_indices`) unless explicit ``data.val``/``data.test`` files
are given. Labels are checked against the loss weights (missing labels are reported all at
once, per file, with the keys each file holds (:mod:`xnn.data.label_keys`) and the config
keys to set), species of validation/test structures against the training set.

Start-up makes no pass over the data for coincident atoms: neighbor lists of the model's
cutoff are built at a structure's first use, by the rank that uses it, and refuse it there
(:class:`~xnn.neighbors.datasets.WithEdges`). Before anything is written, a bounded sample of each
split is checked (:func:`refuse_coincident_sample`, up to
:data:`~xnn.training.data.STATISTICS_SAMPLE` structures spread over each: every structure of
a small data set) — the training sample by the statistics' own neighbor lists
(:func:`xnn.app.train_model.data_statistics`) unless the run has no statistics.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from xnn.app.train_replay import replay_membership, replay_parts, with_head
from xnn.config.train import DataConfig, DatasetConfig, LossConfig
from xnn.data import keys as K
from xnn.data.datasets import ConcatDataset, Subset, index_dtype, split_indices
from xnn.data.inventory import inventory
from xnn.data.label_keys import describe_keys, suggest_key
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError
from xnn.neighbors.datasets import WithEdges, cache_by_default
from xnn.training.data import (
    DataSplits,
    check_species,
    coincident_error,
    first_coincident,
    sample_indices,
    symbols,
)
from xnn.training.finetune import WithHead
from xnn.training.reducer import LocalReducer

LABELS = (("energy", K.ENERGY), ("forces", K.FORCES), ("stress", K.STRESS))


def _open(entry: DatasetConfig):
    """The dataset of ``entry`` (its ``origin`` names ``entry.path``)."""
    if not entry.path:
        raise DataFileError("a dataset entry has an empty path (set data.datasets.N.path)")
    return read_structures(entry.path, entry.weight, entry.energy_key, entry.forces_key,
                           entry.stress_key, entry.virial_key, entry.format)


def refuse_coincident_sample(parts: list, reducer, limit: int | None = None) -> None:
    """Raise the same :class:`DataFileError` on every rank for the first structure with
    coincident atoms among up to ``limit`` structures spread over each dataset of ``parts``
    (:func:`~xnn.training.data.sample_indices`; the first part first), named by the
    dataset's ``origin``.

    Each rank scans every ``world_size``-th structure of each sample with a short-radius
    neighbor list and stops at the first part where it finds one; one gather of the
    findings follows (collective over ``reducer``'s ranks).
    """
    rank, world = reducer.rank, reducer.world_size
    mine = None
    for k, ds in enumerate(parts):
        sample = sample_indices(len(ds), limit)
        found = first_coincident(ds, sample[rank::world])
        if found is not None:
            mine = (k, int(np.searchsorted(sample, found[0])), found[0], found[1])
            break
    found = [f for f in (reducer.gather_objects(mine) if world > 1 else [mine]) if f]
    if found:
        k, _, index, pair = min(found, key=lambda f: f[:2])
        raise coincident_error(*parts[k].origin(index), pair)


def _concat(parts: list):
    parts = [p for p in parts if p is not None and len(p) > 0]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else ConcatDataset(parts)


def build_splits(data: DataConfig, loss: LossConfig, cutoff: float, seed: int,
                 species: list[int] | None = None, reducer=None,
                 check_train: bool = True, isolated_atoms: bool = False,
                 replay: tuple[float, float | None] = (1.0, None),
                 make_replay=None, bootstrap: tuple[int, int] | None = None,
                 heads: list[str] | None = None) -> DataSplits:
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
        check_train: scan the training sample too (``False`` where the statistics' neighbor
            lists check it: :func:`xnn.app.train_model.data_statistics`); the validation and
            test samples are always scanned (:func:`refuse_coincident_sample`).
        isolated_atoms: take the isolated-atom entries of the ``data.datasets`` files
            (one-atom structures with ``config_type=IsolatedAtom``,
            :func:`~xnn.data.datasets.is_isolated_atom`) out of the files before they are
            split, and return their energy labels as ``isolated_e0`` (``model.e0=isolated``,
            as mace-torch does with its default ``keep_isolated_atoms=False``); the other
            structures are split as a file without them. Explicit ``data.val``/``data.test``
            files are used as they are.
        replay: ``(finetune.replay_weight, finetune.replay_fraction)`` of the
            ``data.replay`` files (:mod:`xnn.app.train_replay`): their training part joins
            ``train`` after the new data, their validation part is ``val_replay``.
        make_replay: ``make_replay(new training structures) -> (entry, dataset)``: replay
            structures made from the training split (``finetune.replay_from_pretrained``,
            :class:`xnn.app.train_replay_gen.PretrainedReplay`), the last replay entry.
        bootstrap: ``(K, seed)``: the training structures carry the per-member bootstrap
            weights of a committee of K (:func:`xnn.training.committee.bootstrap_weights`).
        heads: multi-head fine-tuning (:func:`xnn.app.train_replay.run_heads`): every
            structure carries the index of its entry's head (``head`` field).
    Raises:
        DataFileError: a sampled structure has coincident atoms (among others).
    """
    if not data.datasets:
        raise InputError("no training data: set data.datasets (e.g. "
                         "data.datasets.0.path=train.xyz)")
    train_parts, val_parts, test_parts = [], [], []
    isolated: dict[int, float] | None = {} if isolated_atoms else None
    for k, entry in enumerate(data.datasets):
        ds = _open(entry)
        if len(ds) == 0:
            raise DataFileError(f"dataset {entry.path!r} holds no structure")
        vf = 0.0 if data.val else data.val_fraction
        tf = 0.0 if data.test else data.test_fraction
        if isolated is None:
            tr, va, te = split_indices(len(ds), vf, tf, seed=seed + 7919 * k)
        else:
            rest = _take_isolated(ds, entry.path, isolated)
            tr, va, te = (rest[i] for i in split_indices(len(rest), vf, tf,
                                                         seed=seed + 7919 * k))
        train_parts.append(with_head(Subset(ds, tr), heads, entry))
        val_parts.append(with_head(Subset(ds, va), heads, entry))
        test_parts.append(with_head(Subset(ds, te), heads, entry))
    val_parts += [with_head(_open(e), heads, e) for e in data.val]
    test_parts += [with_head(_open(e), heads, e) for e in data.test]
    n_new = sum(len(t) for t in train_parts)
    generated = None if make_replay is None else make_replay(_concat(train_parts))
    extra = replay_parts(data, _open, seed, replay[0], replay[1], n_new, generated, heads)
    if extra.pool is not None:
        check_training_labels(extra.entries, extra.sizes, extra.pool, loss)
    train = _concat([*train_parts, extra.train])
    if data.overfit is not None:
        train = Subset(train, np.arange(min(data.overfit, len(train))))
        val = train
    else:
        val = _concat(val_parts)
    test = _concat(test_parts)
    check_training_labels(data.datasets, [len(t) for t in train_parts], train, loss)
    val_replay = extra.val
    train_species = train.species()
    if species is not None:
        missing = sorted(set(train_species) - set(species))
        if missing:
            raise InputError(f"training structures hold species {symbols(missing)} absent from "
                             f"model.species ({symbols(species)})")
        train_species = sorted(species)
    for ds, what in ((val, "validation"), (test, "test"), (val_replay, "replay validation")):
        if ds is not None:
            check_species(ds, train_species, what)
    sampled = [train] if check_train else []
    refuse_coincident_sample([*sampled, *(d for d in (val, test, val_replay) if d is not None)],
                             reducer or LocalReducer())

    def edges(ds):  # data.cache_edges null: cached for data in memory or small, else not
        if ds is None:
            return None
        cache = cache_by_default(ds) if data.cache_edges is None else data.cache_edges
        return WithEdges(ds, cutoff, cache)

    weighted = train
    if bootstrap is not None:
        from xnn.training.committee import Bootstrapped, bootstrap_weights

        weighted = Bootstrapped(train, bootstrap_weights(len(train), *bootstrap))
    return DataSplits(
        train=edges(weighted),
        val=edges(val),
        test=edges(test),
        raw_train=train,
        species=train_species,
        membership=split_membership(data, train_parts, val_parts, test_parts, extra),
        isolated_e0=isolated,
        val_replay=edges(val_replay),
    )


def _take_isolated(ds, path: str, table: dict[int, float]) -> np.ndarray:
    """Add the isolated-atom entries of ``ds`` to ``table`` (``{Z: eV}``); return the
    indices of its other structures.

    Raises:
        DataFileError: an isolated-atom entry without an energy label, two of one element
            with different energies, or a file of isolated atoms only.
    """
    found = ds.isolated_atoms()
    for index, (z, energy) in sorted(found.items()):
        where = f"{path!r} structure {index}"
        if not np.isfinite(energy):
            raise DataFileError(f"{where} is an isolated atom (config_type=IsolatedAtom) "
                                "without an energy label: model.e0=isolated takes its E0 "
                                "from it; label it or give model.e0 as a map {element: eV}")
        if z in table and table[z] != energy:
            raise DataFileError(f"{where}: a second isolated atom of {symbols([z])[0]} with "
                                f"energy {energy!r} eV, not {table[z]!r} eV; keep one")
        table[z] = energy
    rest = np.setdiff1d(np.arange(len(ds), dtype=np.int64),
                        np.fromiter(found, dtype=np.int64, count=len(found)))
    if len(rest) == 0:
        raise DataFileError(f"dataset {path!r} holds isolated atoms only; nothing to train on")
    return rest


def split_membership(data: DataConfig, train_parts: list, val_parts: list,
                     test_parts: list, replay=None) -> dict:
    """Which structures of which file each split holds (saved as the run's ``split.json``).

    Returns:
        ``{"files": [{"config_key": "data.datasets.0", **entry}], "train"|"val"|"test":
        [{"file": i, "indices": array}]}``: indices into file ``i`` (its frames in file
        order), in the order the split concatenates them, as integer arrays: a split's own
        :class:`~xnn.data.datasets.Subset` indices (int32 below ``2**31`` structures; the
        same buffer, not a copy), a whole file as an ``arange`` of that type, never a
        Python list (10^8 structures: 0 bytes more than the splits, where lists took
        ~3.6 GB; :mod:`xnn.app.split_record` writes them as an array); with ``replay``
        (:class:`~xnn.app.train_replay.ReplayParts`) the replay entries follow the other
        files, with ``replay_train``, ``replay_val`` and ``replay_selection``
        (:func:`~xnn.app.train_replay.replay_membership`).
    """
    entries = [(f"data.{part}.{k}", e) for part in ("datasets", "val", "test")
               for k, e in enumerate(getattr(data, part))]
    files = [{"config_key": key, **dataclasses.asdict(e)} for key, e in entries]
    n_train = len(data.datasets)
    val_files = range(n_train, n_train + len(data.val))
    test_files = range(n_train + len(data.val), len(entries))

    def rows(parts, file_ids):
        return [{"file": i, "indices": _indices(p)} for i, p in zip(file_ids, parts)
                if len(p) > 0]

    train = rows(train_parts, range(n_train))
    val = rows(val_parts, [*range(n_train), *val_files])
    if data.overfit is not None:
        train = _first(train, data.overfit)
        val = train
    out = {"files": files, "train": train, "val": val,
           "test": rows(test_parts, [*range(n_train), *test_files])}
    if replay is not None and replay.entries:
        more = replay_membership(replay, len(data.replay), len(files))
        out["files"] = files + more.pop("files")
        out.update(more)
    return out


def _indices(part) -> np.ndarray:
    if isinstance(part, WithHead):  # multi-head: the file's structures, marked
        part = part.dataset
    if isinstance(part, Subset):
        return part.indices
    return np.arange(len(part), dtype=index_dtype(len(part)))


def _first(rows: list[dict], n: int) -> list[dict]:
    """The first ``n`` structures of the concatenation of ``rows`` (views of their arrays)."""
    out = []
    for row in rows:
        if n <= 0:
            break
        out.append({"file": row["file"], "indices": row["indices"][:n]})
        n -= len(out[-1]["indices"])
    return out


def check_training_labels(entries: list[DatasetConfig], sizes: list[int], train,
                          loss: LossConfig) -> None:
    """Refuse training structures without the labels the loss weighs, all at once.

    Energy and forces (weight > 0) are needed by every training structure, stress by at least
    one (the others are masked).

    Args:
        entries: the ``data.datasets`` entries; ``sizes``: training structures taken from
            each, in order (``train`` is their concatenation, or its first ``data.overfit``).
        train: the training dataset (``label_masks()``).
        loss: the ``loss`` section (the weights).
    Raises:
        DataFileError: one line naming, per file, each missing label, the keys the file holds
            and the config keys to set.
    """
    weights = {name: getattr(loss, name).weight for name, _ in LABELS}
    masks = train.label_masks()
    bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), len(train))
    no_stress = weights["stress"] > 0 and not masks[K.STRESS].any()
    problems = []
    for k, entry in enumerate(entries):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        lacking = {name: int((~masks[key][lo:hi]).sum()) for name, key in LABELS[:2]
                   if weights[name] > 0}
        lacking = {name: n for name, n in lacking.items() if n}
        if no_stress and hi > lo:
            lacking["stress"] = hi - lo
        if lacking:
            problems.append(_label_problem(k, entry, lacking, hi - lo, weights))
    if problems:
        raise DataFileError("training data lack labels the loss needs: " + "; ".join(problems))


def _label_problem(k: int, entry: DatasetConfig, lacking: dict[str, int], n: int,
                   weights: dict[str, float]) -> str:
    """What file ``k`` lacks, the keys it holds, and the overrides that would fix it."""
    inv = inventory(entry.path, limit=1000)
    missing, fixes = [], []
    for name, bad in lacking.items():
        key = getattr(entry, f"{name}_key")
        where = f"key {key!r}" + (f" or {entry.virial_key!r}" if name == "stress" else "")
        missing.append(f"no {name} label under {where} in {bad} of {n} training structures "
                       f"(loss.{name}.weight={weights[name]})")
        found = suggest_key(inv, name) or (suggest_key(inv, "virial") if name == "stress"
                                           else None)
        if found and found not in (key, entry.virial_key):
            option = "virial" if name == "stress" and found == suggest_key(inv, "virial") \
                else name
            fixes.append(f"data.datasets.{k}.{option}_key={found}")
        else:
            fixes.append(f"loss.{name}.weight=0")
    return (f"{entry.path} (data.datasets.{k}) has {', '.join(missing)}; {describe_keys(inv)}; "
            f"set {' '.join(fixes)} (`xnn data inspect {entry.path}` lists its keys)")


def data_files(data: DataConfig) -> dict[str, str]:
    """``{config key: path}`` of every data file of a run (e.g. ``data.datasets.0.path``),
    for the ranks of a job to check that they read the same data."""
    return {f"data.{part}.{k}.path": entry.path
            for part in ("datasets", "val", "test", "replay")
            for k, entry in enumerate(getattr(data, part))}
