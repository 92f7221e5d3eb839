"""Training start-up builds no neighbor list a rank does not need.

A counting hook on the neighbor-list builder (:func:`xnn.neighbors.api._build`) records, per
call, its cutoff and an identity of each structure in it; a second hook tells the lists that
:class:`~xnn.data.datasets.WithEdges` builds for the batches (at their first use) from the
start-up's. Runs ``xnn train`` to its first step: on 2 gloo ranks (data parallel, through the
CLI) each rank scans its own half of the file for coincident atoms and builds its own half of
the statistics' neighbor lists, so no structure's list is built on both ranks, and the
average number of neighbours is that of one process; in one process no model-cutoff list is
built beyond the statistics sample and the first batch.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os

import numpy as np
import pytest
import torch

try:
    from dist_helpers import free_port, spawn
except ImportError:  # tests/ is a package
    from tests.dist_helpers import free_port, spawn

from xnn.data.emt import write_emt

N_STRUCTURES = 40
BATCH = 8
CUTOFF = 4.0
BAD = 5  # the structure given coincident atoms in the refused case


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
    from xnn.data.datasets import read_structures

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
        from xnn.data.datasets import WithEdges
        from xnn.neighbors import api
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


def _cli(port: int, argv: list[str]) -> tuple[int, str]:
    from xnn.cli.main import main

    os.environ["MASTER_PORT"] = str(port)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _rank_main(rank, world, tmp, data, bad, ports):
    rec = Recorder()
    with rec.installed():
        code, err = _cli(ports[0], _args(data, f"{tmp}/run"))
    refused = _cli(ports[1], _args(bad, f"{tmp}/bad"))
    return {"code": code, "err": err, "builds": rec.snapshot, "averages": rec.averages,
            "refused": refused}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from ase.io import read, write

    tmp = tmp_path_factory.mktemp("startup")
    data, bad = tmp / "emt.xyz", tmp / "bad.xyz"
    write_emt(data, N_STRUCTURES, ["Cu"], seed=4)
    frames = read(data, ":")
    frames[BAD].positions[3] = frames[BAD].positions[1]
    write(bad, frames)
    return tmp, data, bad


@pytest.mark.distributed
def test_two_ranks_share_the_startup_neighbor_lists(files):
    from xnn.data.datasets import read_structures, shard_batch
    from xnn.models.statistics import average_num_neighbors
    from xnn.neighbors.coincident import MIN_DISTANCE

    tmp, data, bad = files
    res = spawn(_rank_main, 2, args=(str(tmp), str(data), str(bad),
                                     [free_port(), free_port()]), timeout_s=300)
    keys = keys_of(data)
    for r in res:
        assert r["code"] == 0, r["err"]
    scan = [built(r["builds"], MIN_DISTANCE, "startup") for r in res]
    stats = [built(r["builds"], CUTOFF, "startup") for r in res]
    # the coincident-atom scan: every other structure of the file on each rank
    for rank in range(2):
        assert sorted(scan[rank]) == sorted(keys[rank::2]), rank
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
    # a coincident pair in rank 1's half only: both ranks refuse with the same line
    for r in res:
        code, err = r["refused"]
        assert code == 2 and f"structure {BAD} of {str(bad)!r}: atoms 1 and 3 are 0 Å" in err
        assert len(err.strip().splitlines()) == 1, err
    assert res[0]["refused"] == res[1]["refused"]


def test_one_process_builds_model_lists_for_the_sample_and_the_batch_only(files, tmp_path,
                                                                          monkeypatch):
    """One process, a statistics sample of 12 of the 40 structures: before step 1 the
    model-cutoff lists are those of the sample and of the first batch, no full pass."""
    from xnn.app import train as app_train
    from xnn.training.data import structures_for_statistics

    _, data, _ = files
    monkeypatch.setattr(app_train, "structures_for_statistics",
                        functools.partial(structures_for_statistics, limit=12))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    rec = Recorder()
    with rec.installed():
        code, err = _cli(free_port(), _args(data, tmp_path / "run"))
    assert code == 0, err
    keys = keys_of(data)
    sample = np.unique(np.linspace(0, N_STRUCTURES - 1, 12).round().astype(int))
    assert sorted(rec.structures(CUTOFF, "startup")) == sorted(keys[i] for i in sample)
    assert sorted(rec.structures(CUTOFF, "batch")) == sorted(keys[:BATCH])
    built = set(rec.structures(CUTOFF, "startup")) | set(rec.structures(CUTOFF, "batch"))
    assert len(built) < N_STRUCTURES
