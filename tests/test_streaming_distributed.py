"""Streaming data-parallel training on 2 gloo ranks (lazy HDF5 without an edge cache, one
DataLoader worker per rank, global batches packed as shares balanced by atoms) == one
process over the same global batches (fp64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from streaming_helpers import cfg_of, small_cu, step_losses, write_h5

from xnn.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed

ARGS = ("max_epochs=2", "data.val_fraction=0.1", "data.max_atoms_per_batch=24",
        "data.balance=atoms", "schedule.name=cosine", "data.cache_edges=false")


def _rank_main(rank, world, data, out):
    from xnn.app.train import train
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    parallel = parallelize_train(manager)
    cfg = cfg_of(out, f"data.datasets.0.path={data}", *ARGS, "data.num_workers=1")
    summary = train(cfg, parallel=parallel)
    from xnn.app.train_data import build_splits

    splits = build_splits(cfg.data, cfg.loss, 3.0, cfg.seed)
    assert splits.train._cache is None  # lazy data: no edge cache
    splits_n_atoms = np.asarray(splits.train.n_atoms)
    from xnn.app.train import loop_settings
    from xnn.training.loop import TrainingLoop

    loop = TrainingLoop(loop_settings(cfg, world), _Stub(parallel.reducer), splits, out,
                        None, parallel.sharding)
    batches, mine = loop.train_shares(0)
    parallel.reducer.barrier()
    return {"summary": summary, "mine": mine, "batches": batches,
            "n_atoms": splits_n_atoms}


class _Stub:
    """What the loop reads of a trainer to plan its batches: the reducer."""

    def __init__(self, reducer):
        self.reducer = reducer


def test_two_streaming_ranks_match_one_process(tmp_path):
    from xnn.app.train import train

    data = write_h5(tmp_path / "cu.h5", small_cu(60, seed=4))
    torch.set_num_threads(1)
    train(cfg_of(tmp_path / "single", f"data.datasets.0.path={data}", *ARGS,
                 "data.balance_bins=2"))
    results = spawn(_rank_main, 2, args=(str(data), str(tmp_path / "ddp")), timeout_s=600)
    # the ranks' shares are disjoint, cover each global batch and hold equal atoms +-10%
    batches, n_atoms = results[0]["batches"], results[0]["n_atoms"]
    assert results[1]["batches"] == batches
    for step, batch in enumerate(batches):
        shares = [r["mine"][step] for r in results]
        assert sorted(shares[0] + shares[1]) == sorted(batch)
    loads = np.array([[n_atoms[s].sum() for s in (r["mine"][k] for r in results)]
                      for k in range(len(batches))], dtype=float)
    assert (loads.max(1) / loads.mean(1))[:-1].max() <= 1.10
    # the same per-step losses (all-reduced) and validation as one process
    ref, got = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert len(ref) == len(got) > 4
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=0)
    hist = [load_checkpoint(p / "checkpoints/last.pt")["progress"]["history"]
            for p in (tmp_path / "single", tmp_path / "ddp")]
    for a, b in zip(*hist):
        for key in ("train_loss", "val_loss", "val_forces_mae"):
            assert a[key] == pytest.approx(b[key], rel=1e-9), key
    a, b = (load_checkpoint(p / "checkpoints/last.pt")["model"]["state_dict"]
            for p in (tmp_path / "single", tmp_path / "ddp"))
    for k in a:  # Adam turns summation-order differences into ~1e-9 (see test_training_
        assert torch.allclose(a[k], b[k], rtol=1e-6, atol=1e-9), k  # distributed)
