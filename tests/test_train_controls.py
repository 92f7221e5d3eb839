"""Training-loop controls: precision (recorded and checked), random streams keyed by
(seed, rank, epoch, step), samples_per_epoch drawn by dataset weight, every-N-steps logging,
and the checkpoint metric and mode."""

from __future__ import annotations

import csv
import random

import numpy as np
import pytest
import torch

from xnn.config.loader import ConfigError, load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.errors import InputError
from xnn.models.serialization import load_model, model_metadata
from xnn.training.checkpoint import load_checkpoint
from xnn.training.reducer import LocalReducer

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("emt")
    write_emt(d / "cu.xyz", 12, ["Cu"], seed=0)
    write_emt(d / "cu2.xyz", 8, ["Cu"], seed=5)
    return d


def tiny(out, data, *extra) -> TrainConfig:
    """12 structures: 9 training (3 batches of 3 per epoch), 3 validation."""
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data / 'cu.xyz'}", f"output_dir={out}", "model.cutoff=3.0",
        TINY, "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=2", "device=cpu",
        "logging.plots=false", "logging.progress_bar=false", *extra])


def train(cfg, reducer=None):
    from xnn.app.train import train as run

    return run(cfg, reducer)


def weights(path):
    return load_checkpoint(path)["model"]["state_dict"]


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------- precision
@pytest.mark.parametrize("precision", ["fp32", "fp64", "bf16_mixed", "tf32"])
def test_precision_trains_on_cpu_and_is_recorded(tmp_path, data, precision, capsys):
    out = tmp_path / precision
    train(tiny(out, data, f"precision={precision}", "max_steps=1"))
    ck = load_checkpoint(out / "checkpoints/last.pt")
    assert ck["progress"]["step"] == 1 and ck["precision"] == precision
    dtype = torch.float64 if precision == "fp64" else torch.float32
    kept_fp64 = ("scale", "shift", "e0_table")  # output statistics stay float64
    assert all(v.dtype == dtype for k, v in ck["model"]["state_dict"].items()
               if v.is_floating_point() and k.split(".")[-1] not in kept_fp64)
    meta = model_metadata(out / "model.pt")
    assert meta["precision"] == precision and "state_dict" not in meta
    assert next(load_model(out / "model.pt").parameters()).dtype == dtype
    if precision == "tf32":
        assert "on cpu this run trains in fp32" in capsys.readouterr().out


def test_bf16_mixed_changes_the_arithmetic_and_tf32_is_fp32_on_cpu(tmp_path, data):
    """One step from the same weights: bf16 autocast moves the weights differently from
    fp32 (the autocast is in effect); tf32 on a CPU is bitwise fp32."""
    runs = {}
    for p in ("fp32", "tf32", "bf16_mixed"):
        train(tiny(tmp_path / p, data, f"precision={p}", "max_steps=1", "ema.enabled=false"))
        runs[p] = weights(tmp_path / p / "checkpoints/last.pt")
    assert_same(runs["fp32"], runs["tf32"])
    assert not all(torch.equal(runs["fp32"][k], runs["bf16_mixed"][k]) for k in runs["fp32"])
    diff = max(float((runs["fp32"][k] - runs["bf16_mixed"][k]).abs().max()) for k in runs["fp32"])
    assert diff < 1e-2  # the same step, in lower precision


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["tf32", "bf16_mixed"])
def test_gpu_precisions_train_and_are_recorded(tmp_path, data, precision):
    out = tmp_path / precision
    train(tiny(out, data, f"precision={precision}", "max_steps=2", "device=cuda"))
    assert torch.backends.cuda.matmul.allow_tf32 == (precision == "tf32")
    ck = load_checkpoint(out / "checkpoints/last.pt")
    assert ck["precision"] == precision and ck["progress"]["step"] == 2
    assert all(torch.isfinite(v).all() for v in ck["model"]["state_dict"].values())
    assert model_metadata(out / "model.pt")["precision"] == precision


def test_resume_refuses_another_precision_or_checkpoint_criterion(tmp_path, data):
    out = tmp_path / "run"
    train(tiny(out, data, "precision=fp64", "max_steps=1"))
    for extra, match in ((["precision=fp32"], "precision=fp64"),
                         (["precision=fp64", "checkpoint_mode=max"], "checkpoint_mode=min"),
                         (["precision=fp64", "checkpoint_metric=val_forces_mae"],
                          "checkpoint_metric=val_loss")):
        with pytest.raises(InputError, match=match):
            train(tiny(out, data, *extra, "max_steps=2", "resume=auto"))
    # what is refused changed nothing
    assert load_checkpoint(out / "checkpoints/last.pt")["progress"]["step"] == 1


# --------------------------------------------------------------------------- random streams
def test_stream_seed_differs_by_rank_epoch_and_step():
    from xnn.training.loop import seed_streams, stream_seed

    keys = [(0, r, e, s) for r in range(3) for e in range(3) for s in range(4)]
    assert len({stream_seed(*k) for k in keys}) == len(keys)

    def draw(*key):
        seed_streams(*key)
        return (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random())

    base = draw(0, 0, 1, 5)
    assert draw(0, 0, 1, 5) == base
    for other in ((0, 1, 1, 5), (0, 0, 2, 5), (0, 0, 1, 6), (1, 0, 1, 5)):
        a, b = draw(*other), base
        assert all(x != y for x, y in zip(a[0] + a[1] + [a[2]], b[0] + b[1] + [b[2]])), other


class Rank(LocalReducer):
    """One process that seeds its streams as rank ``rank`` would (and still writes files)."""

    def __init__(self, rank):
        self.rank = rank


def _record_draws(monkeypatch):
    """Make every training step record what it draws from the three global generators."""
    from xnn.training.trainer import Trainer

    draws: list = []
    original = Trainer.train_step

    def step(self, graphs, step, *args, **kw):
        draws.append((step, torch.rand(2).tolist(), float(np.random.rand()), random.random()))
        return original(self, graphs, step, *args, **kw)

    monkeypatch.setattr(Trainer, "train_step", step)
    return draws


@pytest.mark.parametrize("rank", [0, 1])
def test_steps_draw_the_stream_of_seed_rank_epoch_step_also_after_resume(
        tmp_path, data, monkeypatch, rank):
    from xnn.training.loop import seed_streams

    draws = _record_draws(monkeypatch)
    common = ("precision=fp64", "max_epochs=3", "seed=4")
    train(tiny(tmp_path / "full", data, *common, "max_steps=7"), Rank(rank))
    full = list(draws)
    draws.clear()
    train(tiny(tmp_path / "part", data, *common, "max_steps=4"), Rank(rank))
    train(tiny(tmp_path / "part", data, *common, "max_steps=7", "resume=auto"), Rank(rank))
    assert draws == full  # a resumed run draws what the uninterrupted one drew
    assert len({d[2] for d in full}) == 7  # no step replays another's numbers
    for step, t, n, p in full:  # 3 steps per epoch: step k runs in epoch k // 3
        seed_streams(4, rank, step // 3, step)
        assert (torch.rand(2).tolist(), float(np.random.rand()), random.random()) == (t, n, p)
    assert_same(weights(tmp_path / "full/checkpoints/last.pt"),
                weights(tmp_path / "part/checkpoints/last.pt"))


# --------------------------------------------------------------------------- samples per epoch
def test_sample_frequencies_follow_dataset_weights():
    from xnn.training.sampling import sample_epoch

    w = np.array([1.0] * 6 + [2.5] * 4 + [0.0] * 2)
    drawn = sample_epoch(w, 40_000, seed=3, epoch=0)
    counts = np.bincount(drawn, minlength=len(w)) / len(drawn)
    np.testing.assert_allclose(counts, w / w.sum(), atol=0.006)  # ~6 standard deviations
    assert np.array_equal(sample_epoch(w, 50, 3, 0), sample_epoch(w, 50, 3, 0))
    assert not np.array_equal(sample_epoch(w, 50, 3, 0), sample_epoch(w, 50, 3, 1))
    with pytest.raises(InputError, match="weight 0"):
        sample_epoch(np.zeros(3), 5, 0, 0)


def test_samples_per_epoch_batches_by_weight_and_resumes_exactly(tmp_path, data):
    from xnn.app.train_data import build_splits
    from xnn.training.sampling import structure_weights

    cfg = tiny(tmp_path, data, f"data.datasets.1={{path: {data / 'cu2.xyz'}, weight: 3.0}}",
               "data.samples_per_epoch=10")
    splits = build_splits(cfg.data, cfg.loss, 3.0, seed=0)
    w = structure_weights(splits.train)
    assert w.tolist() == [float(splits.train[i].weight[0]) for i in range(len(splits.train))]
    assert sorted(set(w.tolist())) == [1.0, 3.0]

    from xnn.app.train import loop_settings
    from xnn.training.loop import TrainingLoop

    loop = TrainingLoop(loop_settings(cfg), _FakeTrainer(), splits, tmp_path, None)
    epochs = [loop.train_batches(e) for e in range(3)]
    assert [len(b) for b in epochs[0]] == [3, 3, 3, 1] and loop.steps_per_epoch() == 4
    assert loop.train_batches(1) == epochs[1] != epochs[0]
    assert all(sum(len(b) for b in e) == 10 for e in epochs)
    # resumed mid-epoch: the same batches, bitwise the same weights
    common = ("precision=fp64", "data.samples_per_epoch=5", "max_epochs=3")
    train(tiny(tmp_path / "full", data, *common, "max_steps=5"))
    train(tiny(tmp_path / "part", data, *common, "max_steps=3"))
    train(tiny(tmp_path / "part", data, *common, "max_steps=5", "resume=auto"))
    ck = load_checkpoint(tmp_path / "full/checkpoints/last.pt")["progress"]
    assert (ck["epoch"], ck["step"]) == (2, 5)  # 2 batches (3 + 2) per epoch
    assert_same(weights(tmp_path / "full/checkpoints/last.pt"),
                weights(tmp_path / "part/checkpoints/last.pt"))


class _FakeTrainer:
    reducer = LocalReducer()


# --------------------------------------------------------------------------- step logging
def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_n_steps_rows_and_resume_drops_rows_after_the_checkpoint(tmp_path, data):
    common = ("precision=fp64", "logging.every_n_steps=2", "max_epochs=3",
              "logging.tensorboard=true")
    train(tiny(tmp_path / "full", data, *common, "max_steps=6"))
    full = _rows(tmp_path / "full/steps.csv")
    assert [(r["epoch"], r["step"]) for r in full] == [("1", "2"), ("2", "4"), ("2", "6")]
    assert all(float(r["loss"]) > 0 and float(r["train_forces_mae"]) > 0 for r in full)
    assert all(float(r["lr"]) == 1e-3 for r in full)
    assert len(_rows(tmp_path / "full/metrics.csv")) == 2  # per epoch as before
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "full/tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("steps/loss")] == [2, 4, 6]
    # a run killed after logging step 6 but before checkpointing it (last.pt at step 4)
    train(tiny(tmp_path / "part", data, *common, "max_steps=4"))
    with open(tmp_path / "part/steps.csv", "a") as f:
        f.write("2,6,0.001,99.0\n")
    train(tiny(tmp_path / "part", data, *common, "max_steps=6", "resume=auto"))
    part = _rows(tmp_path / "part/steps.csv")
    assert [r["step"] for r in part] == ["2", "4", "6"]
    # the same numbers, also for the training metrics of the epoch resumed in its middle
    # (the checkpoint keeps the epoch's metric sums so far)
    epochs = (_rows(tmp_path / "full/metrics.csv"), _rows(tmp_path / "part/metrics.csv"))
    for a, b in [*zip(full, part), *zip(*epochs)]:
        assert {k: v for k, v in a.items() if k != "time_s"} == \
            {k: v for k, v in b.items() if k != "time_s"}


# --------------------------------------------------------------------------- checkpoint metric
def test_checkpoint_metric_and_mode_from_the_command_line(tmp_path, data, monkeypatch):
    from xnn.cli.main import main

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "XNN_DISTRIBUTED_INIT_METHOD"):
        monkeypatch.delenv(k, raising=False)
    yml = tmp_path / "cfg.yaml"
    yml.write_text(f"data: {{datasets: [{{path: {data / 'cu.xyz'}}}], batch_size: 3}}\n"
                   "model: {cutoff: 3.0}\nmax_epochs: 3\n")
    cfg = load_config(TrainConfig, yml, ["checkpoint_metric=val_forces_mae",
                                         "checkpoint_mode=max"])
    assert (cfg.checkpoint_metric, cfg.checkpoint_mode) == ("val_forces_mae", "max")
    with pytest.raises(ConfigError, match="checkpoint_mode"):
        load_config(TrainConfig, yml, ["checkpoint_mode=best"])
    by_mode = {}
    for mode in ("min", "max"):
        out = tmp_path / mode
        assert main(["train", str(yml), TINY, "logging.plots=false", "device=cpu",
                     "optim.lr=2e-2", f"output_dir={out}", "checkpoint_metric=val_forces_mae",
                     f"checkpoint_mode={mode}"]) == 0
        hist = load_checkpoint(out / "checkpoints/last.pt")["progress"]["history"]
        values = [h["val_forces_mae"] for h in hist]
        best = load_checkpoint(out / "checkpoints/best.pt")["progress"]
        pick = np.argmin if mode == "min" else np.argmax
        assert best["epoch"] == best["best_epoch"] == int(pick(values)) + 1
        assert best["best_value"] == pick_value(values, mode)
        by_mode[mode] = (values, best["best_epoch"])
    assert by_mode["min"][0] == by_mode["max"][0]  # the same run, picked two ways
    assert by_mode["min"][1] != by_mode["max"][1]


def pick_value(values, mode):
    return min(values) if mode == "min" else max(values)


def test_max_mode_early_stopping_and_plateau_follow_the_direction():
    """The loop's comparison flips with the mode (a metric that rises is improving)."""
    from xnn.training.loop import LoopSettings, TrainingLoop

    for mode, series, best in (("min", [3.0, 2.0, 2.5], 2), ("max", [3.0, 2.0, 2.5], 1)):
        loop = TrainingLoop(LoopSettings(checkpoint_mode=mode), _FakeTrainer(), None, ".", None)
        for value in series:
            if loop._improved(value):
                loop.progress.best_value = value
                loop.progress.best_epoch = series.index(value) + 1
        assert loop.progress.best_epoch == best
