"""Fine-tuning a pretrained model: named parts, frozen parts (bitwise unchanged), per-part
learning rates as optimizer groups, and replay data with its own metrics."""

from __future__ import annotations

import pytest
import torch

from xnn.config.loader import ConfigError, load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.errors import InputError
from xnn.models import build
from xnn.models.serialization import load_model
from xnn.training.finetune import freeze, param_groups, part_parameters
from xnn.training.schedule import LRSchedule, build_optimizer

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
        "num_basis: 8}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("ft")
    write_emt(d / "cu.xyz", 12, ["Cu"], seed=0)
    write_emt(d / "cu_new.xyz", 9, ["Cu"], seed=5)
    return d


def cfg_for(out, train, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={train}", f"output_dir={out}", "model.cutoff=3.0", TINY,
        "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=2", "logging.plots=false",
        "logging.progress_bar=false", "ema.enabled=false", *extra,
    ])


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    from xnn.app.train import train

    out = tmp_path_factory.mktemp("pre") / "run"
    train(cfg_for(out, data / "cu.xyz", "max_epochs=1"))
    return out / "model.pt"


def _finetuned_config(out, data, pretrained, *extra) -> TrainConfig:
    # model.hyperparameters comes from the pretrained file: the config leaves it unset
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data / 'cu_new.xyz'}", f"output_dir={out}", "model.cutoff=3.0",
        f"pretrained={pretrained}", "data.batch_size=3", "data.val_fraction=0.25",
        "max_epochs=2", "logging.plots=false", "logging.progress_bar=false",
        "ema.enabled=false", *extra])


# --------------------------------------------------------------------------- parts
@pytest.mark.parametrize("name,expected", [
    ("schnet", {"embedding", "interactions", "interactions.0", "interactions.1", "readout"}),
    ("painn", {"embedding", "interactions", "interactions.0", "interactions.1", "readout"}),
    ("equivariant", {"embedding", "interactions", "interactions.0", "interactions.1",
                     "readout", "readout.0", "readout.1"}),
])
def test_models_declare_common_part_names(name, expected):
    """Every native model names embedding, interactions (each block) and readout; the parts
    together cover every parameter, and a block's parameters are inside ``interactions``."""
    model = build(name, species=[29, 79], cutoff=3.0, num_interactions=2)
    parts = model.parts()
    assert set(parts) == expected
    covered = {n for p in ("embedding", "interactions", "readout")
               for n in part_parameters(model, p)}
    assert covered == {n for n, _ in model.named_parameters()}
    assert set(part_parameters(model, "interactions.1")) < set(
        part_parameters(model, "interactions"))
    assert not set(part_parameters(model, "embedding")) & set(
        part_parameters(model, "readout"))


def test_sevenn_parts_cover_the_network():
    pytest.importorskip("sevenn")
    from xnn.models.external.sevenn import SevenNetWrapper

    model = SevenNetWrapper("7net-0")
    parts = model.parts()
    assert {"embedding", "interactions", "readout"} <= set(parts)
    assert {f"interactions.{k}" for k in range(5)} <= set(parts)
    covered = {n for p in ("embedding", "interactions", "readout")
               for n in part_parameters(model, p)}
    assert covered == {n for n, _ in model.named_parameters()}


def test_unknown_part_lists_the_models_parts():
    model = build("schnet", species=[29], cutoff=3.0, num_interactions=2)
    with pytest.raises(InputError, match=r"no part 'blocks'; its parts are \['embedding', "
                                         r"'interactions', 'interactions.0'"):
        freeze(model, ["blocks"])
    with pytest.raises(InputError, match="finetune.lr: the model has no part 'x'"):
        param_groups(model, {"x": 0.1})
    with pytest.raises(InputError, match="nothing is left to train"):
        freeze(model, ["embedding", "interactions", "readout"])


def test_param_groups_scale_the_schedule_per_part():
    """Each listed part is one optimizer group whose lr is the schedule's lr times its
    factor (the most specific part wins); frozen parameters are in no group."""
    model = build("schnet", species=[29], cutoff=3.0, num_interactions=2)
    freeze(model, ["embedding"])
    groups = param_groups(model, {"interactions": 0.1, "interactions.1": 0.5, "embedding": 3})
    opt = build_optimizer(model, "adam", 1e-3, 0.0, groups=groups)
    schedule = LRSchedule(opt, "cosine", 1e-3, warmup_steps=2, total_steps=10)
    for step in (0, 5):
        base = schedule.apply(step)
        lrs = {g["part"]: g["lr"] for g in opt.param_groups}
        assert lrs == {"rest": base, "interactions": 0.1 * base, "interactions.1": 0.5 * base}
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert ids == {id(p) for p in named.values() if p.requires_grad}
    inter1 = {id(named[n]) for n in part_parameters(model, "interactions.1")}
    group = next(g for g in opt.param_groups if g["part"] == "interactions.1")
    assert {id(p) for p in group["params"]} == inter1


# --------------------------------------------------------------------------- training
def test_frozen_parts_are_bitwise_unchanged_after_training(tmp_path, data, pretrained):
    """Frozen parts and a part with lr factor 0 leave training bitwise as loaded (EMA on);
    every other parameter moves."""
    from xnn.app.train import train

    out = tmp_path / "ft"
    train(_finetuned_config(out, data, pretrained, "finetune.freeze=[embedding, "
                                                   "interactions.0]",
                            "finetune.lr={readout: 0.0}", "ema.enabled=true"))
    before = load_model(pretrained).state_dict()
    after = load_model(out / "model.pt")
    frozen = {*part_parameters(after, "embedding"), *part_parameters(after, "interactions.0")}
    zero_lr = set(part_parameters(after, "readout"))
    state = after.state_dict()
    for name, _ in after.named_parameters():
        same = torch.equal(before[name], state[name])
        assert same == (name in frozen or name in zero_lr), name
    # (every other parameter moved: the loop checks `same` is False for them)


def test_finetune_options_need_a_pretrained_model(tmp_path, data):
    with pytest.raises(ConfigError, match="set pretrained=PATH"):
        cfg_for(tmp_path, data / "cu.xyz", "finetune.freeze=[embedding]")
    with pytest.raises(ConfigError, match="finetune.replay_fraction needs data.replay"):
        _finetuned_config(tmp_path, data, "x.pt", "finetune.replay_fraction=0.3")


def test_unknown_freeze_part_is_refused_before_training(tmp_path, data, pretrained):
    from xnn.app.train import train

    out = tmp_path / "bad"
    with pytest.raises(InputError, match=r"finetune.freeze: the model has no part 'body'; "
                                         r"its parts are \["):
        train(_finetuned_config(out, data, pretrained, "finetune.freeze=[body]"))
    assert not out.exists()


# --------------------------------------------------------------------------- replay
def _errors(model, dataset, indices) -> dict[str, float]:
    """Energy MAE (meV/atom) and force MAE (meV/Å, per component) of ``model``."""
    from xnn.data.graph import AtomicGraph
    from xnn.models.derivatives import compute_properties

    e, f, n_comp = 0.0, 0.0, 0
    for i in indices:
        g = dataset[int(i)]
        out = compute_properties(model, AtomicGraph.concat([g]), True, False)
        e += float((out["energy"] - g.energy).abs().sum()) / g.n_atoms
        f += float((out["forces"] - g.forces).abs().sum())
        n_comp += g.forces.numel()
    return {"energy_mae": 1000 * e / len(indices), "forces_mae": 1000 * f / n_comp}


def test_replay_is_trained_and_validated_on_its_own(tmp_path, data, pretrained, capsys):
    """data.replay joins training with its share (finetune.replay_fraction) and its
    validation part gives val_replay_* columns equal to an independent evaluation of the
    final model on those structures."""
    import csv
    import json

    from xnn.app.train import train
    from xnn.app.train_replay import REPLAY_SEED
    from xnn.data.datasets import split_indices
    from xnn.data.sources import read_structures
    from xnn.neighbors.datasets import WithEdges

    out = tmp_path / "replay"
    summary = train(_finetuned_config(
        out, data, pretrained, f"data.replay.0.path={data / 'cu.xyz'}",
        "finetune.replay_weight=0.5", "finetune.replay_fraction=0.5", "precision=fp64",
        "data.val_fraction=0.25"))
    log = capsys.readouterr().out
    # 9 new structures, 25% validation: 7 training + 7 replay (f = 0.5), 3 replay validation
    assert "data: 14 training, 2 validation, 0 test structures (replay: 3 validation)" in log
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert len(rows) == 2 and float(rows[-1]["val_replay_forces_mae"]) > 0
    replay = WithEdges(read_structures(str(data / "cu.xyz")), 3.0)
    _, val, _ = split_indices(len(replay), 0.25, 0.0, seed=0 + REPLAY_SEED)
    expected = _errors(load_model(out / "model.pt"), replay, val)
    got = json.loads((out / "summary.json").read_text())["metrics"]
    for key in ("energy_mae", "forces_mae"):
        assert got[f"val_replay_{key}"] == pytest.approx(expected[key], rel=1e-9)
    assert summary["metrics"]["val_replay_forces_mae"] == got["val_replay_forces_mae"]


def test_replay_structures_carry_the_replay_weight(data):
    """The replay share of the training set comes after the new data, with
    finetune.replay_weight × the entry's weight as every structure's loss weight."""
    from xnn.app.train_data import build_splits

    cfg = _finetuned_config("unused", data, "x.pt", f"data.replay.0.path={data / 'cu.xyz'}",
                            "data.replay.0.weight=2.0", "finetune.replay_weight=0.25",
                            "finetune.replay_fraction=0.25")
    splits = build_splits(cfg.data, cfg.loss, 3.0, 0, replay=(0.25, 0.25))
    train = splits.train
    assert len(train) == 7 + 2  # round(0.25 / 0.75 × 7) replay structures
    weights = [float(train[i].weight) for i in range(len(train))]
    assert weights == [1.0] * 7 + [0.5] * 2
    assert len(splits.val_replay) == 3


# --------------------------------------------------------------------------- external
def test_mace_model_file_is_finetuned_under_the_trust_rules(tmp_path, data):
    """A mace-torch .model file (a pickle) is refused without trust, and with
    model.trust_file=true it is fine-tuned with frozen parts (bitwise unchanged) and saved
    as an xnn model file that loads as data."""
    pytest.importorskip("mace")
    from helpers.models import small_mace

    from xnn.app.train import train
    from xnn.errors import TrustError

    wrapper = small_mace()
    src = tmp_path / "cu.model"
    torch.save(wrapper.model, src)
    args = ["model.cutoff=3.0", "precision=fp64", "max_epochs=1"]
    out = tmp_path / "mace"
    with pytest.raises(TrustError, match="model.trust_file=true"):
        train(_finetuned_config(out, data, src, *args))
    train(_finetuned_config(out, data, src, *args, "model.trust_file=true",
                            "finetune.freeze=[embedding, interactions.0]"))
    tuned = load_model(out / "model.pt")
    before, after = wrapper.state_dict(), tuned.state_dict()
    frozen = {*part_parameters(tuned, "embedding"), *part_parameters(tuned, "interactions.0")}
    for name, _ in tuned.named_parameters():
        assert torch.equal(before[name], after[name]) == (name in frozen), name
    covered = {n for p in ("embedding", "interactions", "readout")
               for n in part_parameters(tuned, p)}
    assert covered == {n for n, _ in tuned.named_parameters()}


@pytest.mark.slow
def test_sevenn_0_by_name_is_finetuned(tmp_path, data):
    """pretrained=7net-0 loads SevenNet-0 from the sevenn wheel (no file, no trust) and
    fine-tunes it: one step with all but the readout frozen moves the readout only."""
    pytest.importorskip("sevenn")
    from xnn.app.train import train
    from xnn.models.external.sevenn import SevenNetWrapper

    out = tmp_path / "7net"
    train(load_config(TrainConfig, None, [
        f"data.datasets.0.path={data / 'cu_new.xyz'}", f"output_dir={out}",
        "pretrained=7net-0", "data.batch_size=1", "data.val_fraction=0.12", "max_steps=1",
        "max_epochs=1", "logging.plots=false", "logging.progress_bar=false",
        "ema.enabled=false", "finetune.freeze=[embedding, interactions]"]))
    tuned = load_model(out / "model.pt")
    assert isinstance(tuned, SevenNetWrapper)
    before, after = SevenNetWrapper("7net-0").state_dict(), tuned.state_dict()
    readout = set(part_parameters(tuned, "readout"))
    moved = {n for n, _ in tuned.named_parameters() if not torch.equal(before[n], after[n])}
    assert moved and moved <= readout


def test_example_config_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "finetune" / "sevenn_cuau.yaml"
    cfg = load_config(TrainConfig, str(path), [])
    assert cfg.pretrained == "7net-0" and cfg.finetune.replay_fraction == 0.5
    assert [e.path for e in cfg.data.replay] == ["replay.xyz"]


@pytest.mark.slow
def test_replay_keeps_the_pretrained_force_accuracy(tmp_path):
    """The replay report at a small scale (benchmarks/finetune_replay.py, stand-in: an xnn
    SchNet pretrained here on EMT, fine-tuned on EMT + a pair term): with replay the force
    error on held-back pretraining-like data stays within 1.2x the pretrained model's and
    below the error without replay, while the new-data force error falls."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, str(root / "benchmarks" / "finetune_replay.py"),
                    "--work", str(tmp_path / "w"), "--pretrain-n", "40",
                    "--pretrain-epochs", "12", "--n-new", "16", "--n-replay", "16",
                    "--n-held", "8", "--epochs", "8", "--json", str(out)],
                   check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    check = json.loads(out.read_text())["check"]
    assert check["new_forces_fell"]
    assert check["held_back_forces_ratio_replay"] <= 1.2
    assert check["held_back_forces_ratio_replay"] < check["held_back_forces_ratio_no_replay"]
