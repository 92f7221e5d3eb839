"""A committee trains data-parallel like any model: 2 gloo ranks == one process (fp64)."""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import spawn

from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt

pytestmark = pytest.mark.distributed


def _cfg(data, out):
    # 9 training structures in global batches of 4: uneven shards over 2 ranks
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", "model.cutoff=3.0",
        "model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
        "num_basis: 8}", "data.batch_size=4", "data.val_fraction=0.25", "max_epochs=2",
        "precision=fp64", "logging.plots=false", "logging.progress_bar=false",
        "loss.stress.weight=1.0", "optim.lr=1e-2", "optim.grad_clip=0.1", "device=cpu",
        "committee.size=3", "committee.bootstrap=true"])


def _rank_main(rank, world, data, out):
    from xnn.app.train import train
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    return train(_cfg(data, out), parallelize_train(manager).reducer)


def test_committee_on_two_ranks_matches_one_process(tmp_path):
    from xnn.app.train import train
    from xnn.models.serialization import load_model
    from xnn.training.checkpoint import load_checkpoint

    data = tmp_path / "cu.xyz"
    write_emt(data, 12, ["Cu"], seed=2)
    torch.set_num_threads(1)
    train(_cfg(str(data), tmp_path / "single"))
    results = spawn(_rank_main, 2, args=(str(data), str(tmp_path / "ddp")), timeout_s=600)
    assert results[0]["committee"] == results[1]["committee"]
    ref = load_model(tmp_path / "single" / "model.pt")
    got = load_model(tmp_path / "ddp" / "model.pt")
    # as for one model (tests/test_training_distributed.py): Adam turns the 1e-16 summation
    # order differences of a nearly cancelling gradient (the readout bias) into ~1e-9
    # relative differences of that weight after a few steps
    for a, b in zip(ref.members, got.members):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.allclose(p, q, rtol=1e-6, atol=1e-9), name
    hist = [load_checkpoint(tmp_path / run / "checkpoints" / "last.pt")["progress"]["history"]
            for run in ("single", "ddp")]
    assert len(hist[0]) == len(hist[1]) == 2
    for a, b in zip(*hist):
        for key in ("train_loss", "val_loss", "val_forces_mae", "train_forces_mae"):
            assert b[key] == pytest.approx(a[key], rel=1e-9), key
    for prop, c in ref.calibration.items():
        assert got.calibration[prop] == pytest.approx(c, rel=1e-6)
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert single["committee"]["calibrated_on"] == "val"
    for key, value in single["metrics"].items():
        assert results[0]["metrics"][key] == pytest.approx(value, rel=1e-6), key
