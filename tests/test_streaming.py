"""Streaming training (issue 45): lazy data without an edge cache under a cap on the
structures held at once equals the in-memory run; DataLoader workers give the same batches
and losses as none; shares balanced by atoms over ranks; a run killed by SIGKILL mid-epoch
resumes bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from streaming_helpers import (
    assert_same_weights,
    cfg_of,
    cli_args,
    small_cu,
    step_losses,
    write_h5,
)

from xnn.config.loader import ConfigError
from xnn.data.datasets import HDF5Source, InMemoryDataset, LabelledDataset, make_batches
from xnn.training.balance import balanced_batches, greedy_steps, imbalance
from xnn.training.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- data
def write_aselmdb(path: Path, atoms: list) -> Path:
    import ase.db

    with ase.db.connect(str(path)) as db:
        for a in atoms:
            db.write(a)
    return path


def _open_hdf5(path):
    return HDF5Source(path)


def _open_aselmdb(path):
    sources = pytest.importorskip("xnn.data.sources")  # slice A's lazy readers
    return sources.open_source(path)


#: the lazy sources the streaming run is checked on: (suffix, writer, opener)
SOURCES = {"hdf5": (".h5", write_h5, _open_hdf5),
           "aselmdb": (".aselmdb", write_aselmdb, _open_aselmdb)}


class Counted(LabelledDataset):
    """A lazy dataset that counts the structures it handed out that are still alive (their
    positions tensor not yet freed): ``live`` now, ``peak`` the most at once."""

    def __init__(self, inner):
        self.inner = inner
        self.n_atoms = np.asarray(inner.n_atoms)
        self.name = inner.name
        self.live = 0
        self.peak = 0
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int):
        g = self.inner[index]
        self.live += 1
        self.reads += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(g.positions, self._freed)
        return g

    def _freed(self) -> None:
        self.live -= 1

    def _count_labels(self) -> np.ndarray:
        return self.inner.label_counts()

    def origin(self, index: int):
        return self.inner.origin(index)

    def species(self) -> list[int]:
        return self.inner.species()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny model file: the runs start from it (no statistics pass over the data)."""
    from xnn.models import build
    from xnn.models.serialization import save_model

    torch.manual_seed(0)
    model = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8).double()
    path = tmp_path_factory.mktemp("model") / "model.pt"
    save_model(model, path)
    return path


def run_with(monkeypatch, cfg, dataset) -> dict:
    """``xnn train`` of ``cfg`` whose data file opens as ``dataset``."""
    from xnn.app import train_data
    from xnn.app.train import train

    monkeypatch.setattr(train_data, "_open", lambda entry: dataset)
    return train(cfg)


# --------------------------------------------------------------------------- memory cap
@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_streaming_under_a_memory_cap_equals_in_memory(tmp_path, monkeypatch, pretrained,
                                                       source):
    """2,000 structures from a lazy file, edges built at use (no cache), at most 1/10 of the
    structures alive at once over 2 epochs and the validation: the same per-step losses
    and final weights as the run on the same structures held in memory (cache on)."""
    suffix, write, open_ = SOURCES[source]
    if source == "aselmdb":
        pytest.importorskip("xnn.data.sources")  # slice A's lazy readers
    n = 2000
    path = write(tmp_path / f"cu{suffix}", small_cu(n))
    lazy = Counted(open_(path))
    assert len(lazy) == n
    args = (f"pretrained={pretrained}", "data.batch_size=80", "data.val_fraction=0.05",
            "max_epochs=2")
    import xnn.neighbors.datasets as nd

    # data.cache_edges null, as for a lazy data set above the automatic cache's size
    monkeypatch.setattr(nd, "AUTO_CACHE_ATOMS", 0)
    run_with(monkeypatch, cfg_of(tmp_path / "lazy", *args), lazy)
    assert lazy.reads > 2 * 0.95 * n  # every training structure read in every epoch
    print(f"structures alive at once: at most {lazy.peak} of {n}")
    # a step's structures and the next step's being read: two batches, not the data set
    assert 80 <= lazy.peak <= 2 * 80 <= n // 10, lazy.peak
    assert lazy.live == 0

    held = InMemoryDataset([lazy.inner[i] for i in range(n)], name=lazy.name)
    run_with(monkeypatch, cfg_of(tmp_path / "mem", *args), held)
    ref, got = step_losses(tmp_path / "mem"), step_losses(tmp_path / "lazy")
    assert len(ref) == len(got) == 2 * 24
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
    assert_same_weights(tmp_path / "mem", tmp_path / "lazy")


def test_lazy_data_has_no_edge_cache_by_default(tmp_path, monkeypatch):
    import xnn.neighbors.datasets as nd
    from xnn.app.train_data import build_splits

    path = write_h5(tmp_path / "cu.h5", small_cu(12))
    xyz = tmp_path / "cu.xyz"
    import ase.io

    ase.io.write(xyz, small_cu(12), format="extxyz")
    for source in (path, xyz):
        # a small lazy file is cached by default (it fits); above the limit it is not
        for limit, cache, cached in ((nd.AUTO_CACHE_ATOMS, None, True), (0, None, False),
                                     (0, True, True), (nd.AUTO_CACHE_ATOMS, False, False)):
            monkeypatch.setattr(nd, "AUTO_CACHE_ATOMS", limit)
            cfg = cfg_of(tmp_path, f"data.datasets.0.path={source}", f"data.cache_edges={cache}"
                         if cache is not None else "data.cache_edges=null")
            splits = build_splits(cfg.data, cfg.loss, 3.0, 0)
            splits.train[0]
            assert (len(splits.train._cache or {}) == 1) is cached, (source, limit, cache)
    monkeypatch.setattr(nd, "AUTO_CACHE_ATOMS", 0)
    cfg = cfg_of(tmp_path, f"data.datasets.0.path={xyz}", "data.datasets.0.format=ase")
    splits = build_splits(cfg.data, cfg.loss, 3.0, 0)
    splits.train[0]
    assert len(splits.train._cache) == 1  # data in memory: cached as before


# --------------------------------------------------------------------------- workers
@pytest.fixture(scope="module")
def mixed_h5(tmp_path_factory):
    return write_h5(tmp_path_factory.mktemp("mixed") / "cu.h5", small_cu(120, seed=3))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 4 workers on 2 cores
@pytest.mark.parametrize("balance, workers", [
    ("atoms", (0, 2)),
    pytest.param("atoms", (0, 4), marks=pytest.mark.slow),
    pytest.param("none", (0, 2), marks=pytest.mark.slow),
])
def test_workers_give_the_same_batches_and_losses(tmp_path, mixed_h5, balance, workers):
    """0, 2 and 4 DataLoader workers: bitwise the same losses and weights."""
    from xnn.app.train import train

    extra = [f"data.datasets.0.path={mixed_h5}", "max_epochs=2", "data.val_fraction=0.1",
             "data.max_atoms_per_batch=40", f"data.balance={balance}",
             "accumulate_grad_batches=2"]
    if balance == "atoms":
        extra.append("data.balance_bins=2")
    for w in workers:
        train(cfg_of(tmp_path / f"w{w}", *extra, f"data.num_workers={w}"))
    ref = step_losses(tmp_path / "w0")
    assert len(ref) > 4
    for w in workers[1:]:
        assert step_losses(tmp_path / f"w{w}") == ref
        assert_same_weights(tmp_path / "w0", tmp_path / f"w{w}")


def test_a_refused_structure_stops_the_run_the_same_with_workers(tmp_path):
    """Coincident atoms met by a worker: the same one-line DataFileError as without."""
    from xnn.app.train import train
    from xnn.errors import DataFileError

    atoms = small_cu(30)
    from ase.calculators.singlepoint import SinglePointCalculator

    bad, labels = atoms[17].copy(), atoms[17].calc.results
    bad.positions[1] = bad.positions[0] + 0.01
    bad.calc = SinglePointCalculator(bad, **labels)
    atoms[17] = bad
    path = write_h5(tmp_path / "bad.h5", atoms)
    messages = []
    for w in (0, 2):
        with pytest.raises(DataFileError) as e:
            train(cfg_of(tmp_path / f"w{w}", f"data.datasets.0.path={path}",
                         "data.val_fraction=0.0", "data.batch_size=4", "model.e0=zero",
                         f"data.num_workers={w}", "max_epochs=1"))
        messages.append(str(e.value))
    assert "coincident" in messages[0]
    assert messages[0] == messages[1]


# --------------------------------------------------------------------------- balance
def mixed_sizes(n: int = 5000, seed: int = 0) -> np.ndarray:
    """Atoms per structure, 8 to 500, log-uniform."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(8), np.log(500), n)).round().astype(np.int64)


@pytest.mark.parametrize("bins", [2, 4, 8])
@pytest.mark.parametrize("per_rank", [250, 500, 1000])
def test_balanced_shares_are_within_ten_percent(bins, per_rank):
    n_atoms = mixed_sizes()
    order = np.random.default_rng([0, 1]).permutation(len(n_atoms))
    steps = balanced_batches(n_atoms, order, bins, per_rank)
    # a partition of the epoch: every structure once, in one share
    flat = sorted(i for step in steps for share in step for i in share)
    assert flat == list(range(len(n_atoms)))
    assert all(len(step) == bins for step in steps)
    assert imbalance(steps, n_atoms).max() <= 1.10
    # a pure function of its inputs
    assert balanced_batches(n_atoms, order, bins, per_rank) == steps
    # today's greedy shares of batches cut in order are not balanced when a share's budget
    # is comparable to the largest structures
    if per_rank <= 500:
        batches = make_batches(n_atoms, None, per_rank * bins, shuffle=True, seed=0, epoch=1)
        assert imbalance(greedy_steps(batches, n_atoms, bins), n_atoms).max() > 1.10


def loop_of(settings, dataset, rank: int, dp: int, out):
    """A training loop of ``dp`` replicas as rank ``rank`` sees it, to plan batches only
    (its trainer is the reducer's rank and size)."""
    from types import SimpleNamespace

    from xnn.training.loop import TrainingLoop
    from xnn.training.sharding import BatchSharding

    trainer = SimpleNamespace(reducer=SimpleNamespace(rank=rank, world_size=dp))
    return TrainingLoop(settings, trainer, SimpleNamespace(train=dataset), out, None,
                        BatchSharding(rank, dp))


def test_balanced_loop_batches_are_pure_and_shared(tmp_path, mixed_h5):
    """The loop's global batches are the union of the ranks' shares, the same on every rank
    and a function of (seed, epoch) only (also when drawn by weight)."""
    from xnn.errors import InputError
    from xnn.training.loop import LoopSettings

    data = HDF5Source(mixed_h5)
    for draws in (None, 90):
        settings = LoopSettings(batch_size=None, max_atoms_per_batch=30, balance_bins=3,
                                samples_per_epoch=draws)
        one = loop_of(settings, data, 0, 1, tmp_path)
        batches, mine = one.train_shares(1)
        assert mine == batches and batches != one.train_shares(0)[0]
        assert one.train_batches(1) == batches
        shares = [loop_of(settings, data, r, 3, tmp_path).train_shares(1) for r in range(3)]
        assert all(b == batches for b, _ in shares)
        for step, batch in enumerate(batches):
            assert sorted(sum((s[1][step] for s in shares), [])) == sorted(batch)
        with pytest.raises(InputError, match="balance_bins=3"):
            loop_of(settings, data, 0, 2, tmp_path).train_shares(0)


def test_balance_needs_an_atom_budget():
    with pytest.raises(ConfigError, match="max_atoms_per_batch"):
        cfg_of("x", "data.balance=atoms")


# --------------------------------------------------------------------------- kill -9
@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise(tmp_path, mixed_h5):
    """``xnn train`` (2 workers, balanced shares, a checkpoint every 3 steps) killed by
    SIGKILL after a mid-epoch checkpoint, then resumed: the uninterrupted run's steps and
    final weights, bitwise."""
    from xnn.app.train import train

    args = [f"data.datasets.0.path={mixed_h5}", "max_epochs=2", "data.val_fraction=0.1",
            "data.max_atoms_per_batch=12", "data.balance=atoms", "data.balance_bins=2",
            "data.num_workers=2", "checkpoint_every_steps=3"]
    train(cfg_of(tmp_path / "ref", *args))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "xnn", "train", *cli_args(out, *args)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = out / "checkpoints/last.pt"
    seen = None
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if last.is_file():
                p = load_checkpoint(last)["progress"]
                if p["batch_in_epoch"] > 0:
                    os.kill(proc.pid, signal.SIGKILL)
                    seen = p
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None and seen is None:
            proc.kill()
        proc.wait(60)
    assert seen is not None, proc.stderr.read().decode()[-2000:]
    assert proc.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(last)["progress"]
    assert killed_at["batch_in_epoch"] > 0 and killed_at["step"] < len(step_losses(
        tmp_path / "ref"))
    train(cfg_of(out, *args, "resume=auto"))
    assert step_losses(out) == step_losses(tmp_path / "ref")
    assert_same_weights(tmp_path / "ref", out)

