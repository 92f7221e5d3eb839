"""Training start-up builds no neighbor list a rank does not need, and makes no pass over the
data: coincident atoms are found in the lists built anyway (issue 42, item 3).

A counting hook on the neighbor-list builder (:func:`xnn.neighbors.api._build`) records, per
call, its cutoff and an identity of each structure in it; a second hook tells the lists that
:class:`~xnn.neighbors.datasets.WithEdges` builds for the batches (at their first use) from the
start-up's. Runs ``xnn train`` to its first step: on 2 gloo ranks (data parallel, through the
CLI) each rank builds its own half of the statistics' neighbor lists and nothing else, so no
structure's list is built on both ranks, and the average number of neighbours is that of one
process; in one process no list is built beyond the statistics sample and the first batch.
A structure with coincident atoms is refused where its model-cutoff list is first built: at
start-up when it is in the statistics sample (before anything is written), else by the rank
that meets it mid-epoch, in data-parallel training, in validation and in context-parallel
training; both ranks then stop with the same line and the bad step changes no weight.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch
from dist_helpers import cli_on_port as _cli
from dist_helpers import free_port, spawn

from xnn.data.emt import write_emt

N_STRUCTURES = 40
BATCH = 8
CUTOFF = 4.0
BAD = 5  # the structure given coincident atoms in the refused case
SAMPLE = 12  # the statistics sample of the mid-epoch cases (xnn.training.data)
LATE = 22  # a structure outside that sample (of the third batch) given coincident atoms


def _args(data, out, *extra):
    return ["train", f"data.datasets.0.path={data}", f"output_dir={out}",
            f"model.cutoff={CUTOFF}", "model.hyperparameters.num_features=4",
            "model.hyperparameters.num_filters=4", "model.hyperparameters.num_interactions=1",
            "model.hyperparameters.num_basis=4", "max_steps=1", f"data.batch_size={BATCH}",
            "data.val_fraction=0.0", "data.shuffle=false", "device=cpu",
            "logging.plots=false", "logging.progress_bar=false", *extra]


def identity(positions: torch.Tensor, batch: torch.Tensor, n_systems: int) -> list[tuple]:
    """A key per system: its atom count and the sum of its coordinates (µÅ)."""
    pos = positions.detach().double().sum(-1)
    total = torch.zeros(n_systems, dtype=torch.float64).index_add(0, batch, pos)
    count = torch.bincount(batch, minlength=n_systems)
    return [(int(c), round(float(t), 6)) for c, t in zip(count, total)]


def keys_of(path) -> list[tuple]:
    """The identity of every structure of a file, in file order."""
    from xnn.data.sources import read_structures

    ds = read_structures(path)
    return [identity(g.positions, g.batch, 1)[0] for g in (ds[i] for i in range(len(ds)))]


class Recorder:
    """Hooks on the neighbor-list builder, the batches' lazy edges, the first training step
    and the average number of neighbours; ``snapshot`` holds what was built before step 1."""

    def __init__(self):
        self.builds: list[tuple[float, str, list]] = []  # (cutoff, "startup"/"batch", keys)
        self.averages: list[float] = []
        self.snapshot: list | None = None
        self._in_batch = False

    @contextlib.contextmanager
    def installed(self):
        from xnn.app import train as app_train
        from xnn.neighbors import api
        from xnn.neighbors.datasets import WithEdges
        from xnn.training.trainer import Trainer

        build, getitem = api._build, WithEdges.__getitem__
        step, statistics = Trainer.train_step, app_train.data_statistics

        def counting_build(positions, cell, pbc, cutoff, batch, backend):
            n = cell.shape[0] if cell.dim() == 3 else 1
            b = batch if batch is not None else torch.zeros(len(positions), dtype=torch.long)
            self.builds.append((float(cutoff), "batch" if self._in_batch else "startup",
                                identity(positions, b, n)))
            return build(positions, cell, pbc, cutoff, batch, backend)

        def lazy_edges(ds, index):
            self._in_batch = True
            try:
                return getitem(ds, index)
            finally:
                self._in_batch = False

        def first_step(trainer, *a, **kw):
            if self.snapshot is None:
                self.snapshot = list(self.builds)
            return step(trainer, *a, **kw)

        def recorded_statistics(*a, **kw):
            out = statistics(*a, **kw)
            self.averages.append(out["avg_num_neighbors"])
            return out

        saved = [(api, "_build", build), (WithEdges, "__getitem__", getitem),
                 (Trainer, "train_step", step),
                 (app_train, "data_statistics", statistics)]
        api._build, WithEdges.__getitem__ = counting_build, lazy_edges
        Trainer.train_step, app_train.data_statistics = first_step, recorded_statistics
        try:
            yield self
        finally:
            for owner, name, value in saved:
                setattr(owner, name, value)

    def structures(self, cutoff: float, phase: str) -> list[tuple]:
        """Identities of the structures built with ``cutoff`` in ``phase`` before step 1."""
        return built(self.snapshot, cutoff, phase)


def built(snapshot: list, cutoff: float, phase: str) -> list[tuple]:
    """Identities of the structures of ``snapshot`` built with ``cutoff`` in ``phase``."""
    return [k for c, p, keys in snapshot if c == cutoff and p == phase for k in keys]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class StepWatch:
    """Hooks the training step: the weights before the first step, after each step that
    returned, and the trainer (whose model a failed step must leave unchanged)."""

    def __init__(self):
        self.first: dict | None = None
        self.after: dict | None = None
        self.steps = 0
        self.trainer = None

    @contextlib.contextmanager
    def installed(self):
        from xnn.training.trainer import Trainer

        step = Trainer.train_step

        def watched(trainer, *a, **kw):
            self.trainer = trainer
            if self.first is None:
                self.first = weights(trainer.model)
            loss = step(trainer, *a, **kw)
            self.steps += 1
            self.after = weights(trainer.model)
            return loss

        Trainer.train_step = watched
        try:
            yield self
        finally:
            Trainer.train_step = step


def _refused_mid_run(port: int, argv: list[str], out) -> dict:
    """Run ``argv`` with a statistics sample of :data:`SAMPLE` structures; what the rank
    saw: exit code, stderr, steps made, whether the failed step left the weights as the
    last good step did, and (rank 0) whether ``last.pt`` holds the initial weights."""
    from xnn.training import data as training_data
    from xnn.training.checkpoint import load_checkpoint

    watch, saved = StepWatch(), training_data.STATISTICS_SAMPLE
    training_data.STATISTICS_SAMPLE = SAMPLE
    try:
        with watch.installed():
            code, err = _cli(port, argv)
    finally:
        training_data.STATISTICS_SAMPLE = saved
    res = {"code": code, "err": err, "steps": watch.steps,
           "unchanged": watch.trainer is not None
           and same(weights(watch.trainer.model), watch.after or watch.first)}
    last = out / "checkpoints" / "last.pt"
    if last.is_file():
        payload = load_checkpoint(last)
        res["last"] = (payload["progress"]["step"],
                       same(payload["model"]["state_dict"], watch.first))
    return res


def _rank_main(rank, world, tmp, data, bad, late, ports):
    from pathlib import Path

    tmp = Path(tmp)
    rec = Recorder()
    with rec.installed():
        code, err = _cli(ports[0], _args(data, tmp / "run"))
    refused = _cli(ports[1], _args(bad, tmp / "bad"))
    short = ("parallel.timeout_s=60", "max_epochs=1", "max_steps=null")
    cases = {
        "train": (late, data, ()),  # data parallel: one rank meets LATE at step 3
        "val": (data, data, (f"data.val.0.path={late}",)),  # at the first validation
        "cp": (late, data, ("parallel.dd=2",)),  # context parallel: both ranks of the group
    }
    mid = {name: _refused_mid_run(ports[2 + k], _args(train, tmp / name, *short, *extra),
                                  tmp / name)
           for k, (name, (train, _, extra)) in enumerate(cases.items())}
    return {"code": code, "err": err, "builds": rec.snapshot, "averages": rec.averages,
            "refused": refused, "bad_dir": (tmp / "bad").exists(), "mid": mid}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from ase.io import read, write

    tmp = tmp_path_factory.mktemp("startup")
    data, bad, late = tmp / "emt.xyz", tmp / "bad.xyz", tmp / "late.xyz"
    write_emt(data, N_STRUCTURES, ["Cu"], seed=4)
    for path, k in ((bad, BAD), (late, LATE)):
        frames = read(data, ":")  # with their labels (a copy would drop them)
        frames[k].positions[3] = frames[k].positions[1]
        write(path, frames)
    return tmp, data, bad, late


def _line(path, index: int) -> str:
    return f"structure {index} of {str(path)!r}: atoms 1 and 3 are 0 Å apart"


@pytest.mark.distributed
def test_two_ranks_share_the_startup_neighbor_lists_and_stop_together(files):
    from xnn.data.datasets import shard_batch
    from xnn.data.sources import read_structures
    from xnn.models.statistics import average_num_neighbors
    from xnn.training.data import sample_indices

    tmp, data, bad, late = files
    res = spawn(_rank_main, 2, args=(str(tmp), str(data), str(bad), str(late),
                                     [free_port() for _ in range(5)]), timeout_s=400)
    keys = keys_of(data)
    for r in res:
        assert r["code"] == 0, r["err"]
    # before step 1 every list is of the model's cutoff: no scan of the data
    for r in res:
        assert {c for c, _, _ in r["builds"]} == {CUTOFF}
    stats = [built(r["builds"], CUTOFF, "startup") for r in res]
    # the statistics' lists: disjoint halves of the sample (here every structure)
    assert not set(stats[0]) & set(stats[1])
    assert sorted(stats[0] + stats[1]) == sorted(keys)
    assert all(abs(len(s) - N_STRUCTURES / 2) <= 1 for s in stats)
    # the batch lists before step 1: this rank's share of the first batch, nothing else
    ds = read_structures(data)
    for rank, r in enumerate(res):
        mine = shard_batch(list(range(BATCH)), ds.n_atoms, rank, 2)
        assert sorted(built(r["builds"], CUTOFF, "batch")) == sorted(keys[i] for i in mine)
    # the same average on both ranks as in one process
    one = average_num_neighbors([ds[i] for i in range(len(ds))], CUTOFF)
    assert [r["averages"] for r in res] == [[one], [one]]
    # a coincident pair in the statistics sample (rank 1's half of it): both ranks refuse
    # with the same line before anything is written
    assert BAD % 2 == 1
    for r in res:
        code, err = r["refused"]
        assert code == 2 and _line(bad, BAD) in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert not r["bad_dir"]
    assert res[0]["refused"] == res[1]["refused"]
    # outside the sample: met mid-epoch by the rank whose share holds it (data parallel),
    # in validation, and by both ranks of a dd group (context parallel)
    assert LATE not in sample_indices(N_STRUCTURES, SAMPLE)
    holder = [rank for rank in range(2) if LATE in shard_batch(
        list(range(2 * BATCH, 3 * BATCH)), ds.n_atoms, rank, 2)]
    assert len(holder) == 1
    for name, steps in (("train", 2), ("val", N_STRUCTURES // BATCH), ("cp", 2)):
        mid = [r["mid"][name] for r in res]
        for m in mid:
            assert m["code"] == 2 and _line(late, LATE) in m["err"], (name, m["err"])
            assert len(m["err"].strip().splitlines()) == 1, m["err"]
            assert m["steps"] == steps, (name, m)
            # the bad step (or validation) changed no weight
            assert m["unchanged"], name
        assert mid[0]["err"] == mid[1]["err"], name
        # the last checkpoint is the intact one of the run's start
        assert mid[0]["last"] == (0, True), name
    for name in ("train", "cp"):
        assert "met at step 3, epoch 1" in res[0]["mid"][name]["err"]


def test_one_process_builds_model_lists_for_the_sample_and_the_batch_only(files, tmp_path,
                                                                          monkeypatch):
    """One process, a statistics sample of 12 of the 40 structures: before step 1 the
    neighbor lists are those of the sample and of the first batch, no pass over the data."""
    from xnn.training import data as training_data

    _, data, _, _ = files
    monkeypatch.setattr(training_data, "STATISTICS_SAMPLE", SAMPLE)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    rec = Recorder()
    with rec.installed():
        code, err = _cli(free_port(), _args(data, tmp_path / "run"))
    assert code == 0, err
    keys = keys_of(data)
    sample = np.unique(np.linspace(0, N_STRUCTURES - 1, SAMPLE).round().astype(int))
    assert sorted(rec.structures(CUTOFF, "startup")) == sorted(keys[i] for i in sample)
    assert sorted(rec.structures(CUTOFF, "batch")) == sorted(keys[:BATCH])
    every = [k for _, _, ks in rec.snapshot for k in ks]
    assert len(every) == len(sample) + BATCH


def test_fine_tuning_refuses_coincident_atoms_before_anything_is_written(files, tmp_path,
                                                                        monkeypatch):
    """A fine-tuned model has no statistics, whose lists would check the training sample:
    the sample is scanned on its own, before the run folder exists."""
    _, data, bad, _ = files
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    code, err = _cli(free_port(), _args(data, tmp_path / "base"))
    assert code == 0, err
    out = tmp_path / "tuned"
    code, err = _cli(free_port(), _args(bad, out, f"pretrained={tmp_path / 'base/model.pt'}"))
    assert code == 2 and _line(bad, BAD) in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_structure_is_refused_where_its_edges_are_built_naming_its_file(files, tmp_path):
    """``WithEdges`` refuses a structure with coincident atoms at its first read (its edges,
    or without edges for context parallelism), naming the file and the index IN THAT FILE
    through ``Subset`` and ``ConcatDataset``, for extxyz and HDF5; so does ``xnn eval``."""
    from error_helpers import raises_one_line

    from xnn.data.datasets import ConcatDataset, HDF5Source, Subset
    from xnn.data.hdf5 import write_hdf5
    from xnn.data.sources import read_structures
    from xnn.errors import DataFileError
    from xnn.models import build
    from xnn.neighbors.datasets import WithEdges
    from xnn.training.evaluate import evaluate_model

    _, data, bad, _ = files
    good = read_structures(data)
    graphs = [good[i] for i in range(4)]
    pos = graphs[2].positions.clone()
    pos[0] = pos[2] + torch.tensor([0.05, 0.0, 0.0], dtype=pos.dtype)
    graphs[2] = graphs[2].replace(positions=pos)
    h5 = tmp_path / "part.h5"
    write_hdf5(h5, graphs)
    ds = WithEdges(ConcatDataset([Subset(read_structures(bad), [7, BAD, 1]), HDF5Source(h5)]),
                   CUTOFF)
    assert ds.origin(1) == (str(bad), BAD) and ds.origin(5) == (str(h5), 2)
    assert ds[0].n_edges > 0 and ds[4].n_edges > 0
    for index, line in ((1, _line(bad, BAD)),
                        (5, f"structure 2 of {str(h5)!r}: atoms 0 and 2 are 0.05 Å apart")):
        for read in (ds.__getitem__, ds.without_edges):
            raises_one_line(DataFileError, read, index, match=re.escape(line))
    assert ds.without_edges(4).n_edges == 0
    lj = build("lj", sigma=2.3, epsilon=0.4, cutoff=CUTOFF)
    raises_one_line(DataFileError, evaluate_model, lj, bad, match=re.escape(_line(bad, BAD)))
