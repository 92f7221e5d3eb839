"""The training config: YAML + dotlist overrides (lists included), validation, --help, printing."""

from __future__ import annotations

import textwrap

import pytest

from xnn.config.loader import ConfigError, describe, load_config, to_yaml
from xnn.config.train import TrainConfig

YAML = textwrap.dedent("""
    model:
      name: painn
      cutoff: 4.5
      hyperparameters: {num_features: 32}
    data:
      datasets:
        - {path: a.xyz, weight: 1.0}
        - {path: b.xyz, weight: 2.0, energy_key: E}
      batch_size: 4
    loss:
      forces: {weight: 5.0, type: huber, delta: 0.05}
    max_epochs: 7
""")


@pytest.fixture
def cfg_file(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(YAML)
    return p


def test_yaml_and_defaults(cfg_file):
    cfg = load_config(TrainConfig, cfg_file)
    assert cfg.model.name == "painn" and cfg.model.cutoff == 4.5
    assert cfg.model.hyperparameters == {"num_features": 32}
    assert [d.path for d in cfg.data.datasets] == ["a.xyz", "b.xyz"]
    assert cfg.data.datasets[1].energy_key == "E" and cfg.data.datasets[1].weight == 2.0
    assert cfg.data.datasets[0].forces_key == "forces"  # default filled in
    assert (cfg.loss.forces.type, cfg.loss.forces.delta) == ("huber", 0.05)
    assert cfg.loss.energy.type == "mse" and cfg.max_epochs == 7 and cfg.precision == "fp32"


def test_list_overrides(cfg_file):
    cfg = load_config(TrainConfig, cfg_file, ["data.datasets.0.path=c.xyz",
                                              "data.datasets.1.weight=0.5"])
    assert [(d.path, d.weight) for d in cfg.data.datasets] == [("c.xyz", 1.0), ("b.xyz", 0.5)]
    cfg = load_config(TrainConfig, cfg_file, ["data.datasets.1=null"])
    assert [d.path for d in cfg.data.datasets] == ["a.xyz"]
    cfg = load_config(TrainConfig, cfg_file, ["data.datasets.0=null"])
    assert [d.path for d in cfg.data.datasets] == ["b.xyz"]
    assert cfg.data.datasets[0].energy_key == "E"
    # appending entries: a whole entry, or one field of entry N == len
    cfg = load_config(TrainConfig, cfg_file, ["data.datasets.2={path: d.xyz, weight: 3}",
                                              "data.val.0.path=v.xyz"])
    assert cfg.data.datasets[2].path == "d.xyz" and cfg.data.datasets[2].weight == 3.0
    assert cfg.data.datasets[2].stress_key == "stress"
    assert [v.path for v in cfg.data.val] == ["v.xyz"]


def test_scalar_overrides_and_max_atoms(cfg_file):
    cfg = load_config(TrainConfig, cfg_file, ["optim.lr=3e-4", "precision=fp64",
                                              "data.max_atoms_per_batch=100", "ema.enabled=false"])
    assert cfg.optim.lr == 3e-4 and cfg.precision == "fp64" and cfg.ema.enabled is False
    assert cfg.data.batch_size is None and cfg.data.max_atoms_per_batch == 100


@pytest.mark.parametrize(
    "override, words",
    [
        (["optim.lrr=1"], ["optim.lrr", "'lr'", "'grad_clip'"]),
        (["optim.name=sgd"], ["optim.name", "adam", "adamw"]),
        (["precision=fp16"], ["precision", "bf16_mixed", "fp64"]),
        (["loss.forces.type=l1"], ["loss.forces.type", "huber"]),
        (["schedule.name=step"], ["schedule.name", "cosine", "plateau"]),
        (["optim.lr=fast"], ["optim.lr"]),
        (["max_epochs=-1"], ["max_epochs"]),
        (["data.datasets.0.pth=x.xyz"], ["pth", "'path'", "'energy_key'"]),
        (["data.datasets.2={path: x, wieght: 1}"], ["wieght", "'weight'"]),
        (["checkpoint_metric=val_acc"], ["checkpoint_metric", "val_forces_mae"]),
        (["validation_only=true"], ["validation_only", "pretrained"]),
        (["loss.energy.weight=0", "loss.forces.weight=0"], ["loss.forces.weight", "> 0"]),
    ],
)
def test_errors_name_the_key_and_choices(cfg_file, override, words):
    with pytest.raises(ConfigError) as err:
        load_config(TrainConfig, cfg_file, override)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate.*'lr'"):
        load_config(TrainConfig, p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")


def test_yaml_round_trip(cfg_file, tmp_path):
    cfg = load_config(TrainConfig, cfg_file, ["data.datasets.1=null", "seed=5"])
    p = tmp_path / "resolved.yaml"
    p.write_text(to_yaml(cfg))
    assert load_config(TrainConfig, p) == cfg


def test_describe_lists_every_option_with_default():
    text = describe(TrainConfig)
    for key in ("model.name", "data.datasets", "data.val_fraction", "data.max_atoms_per_batch",
                "data.overfit", "loss.forces.type", "loss.stress.delta", "optim.grad_clip",
                "schedule.warmup_steps", "ema.decay", "early_stopping.patience", "max_steps",
                "precision", "resume", "pretrained", "validation_only", "checkpoint_metric",
                "parallel.dp", "parallel.dd", "logging.tensorboard", "overwrite"):
        assert f"  {key} (" in text, key
    assert "precision (str, default='fp32')" in text and "bf16_mixed" in text


def test_cli_help_and_print_config(cfg_file, capsys):
    from xnn.cli.main import main

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "data.datasets.0.path" in out and "schedule.name (str, default='none')" in out
    assert main(["train", str(cfg_file), "optim.lr=0.005", "data.datasets.1=null",
                 "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.005" in out and "b.xyz" not in out and "a.xyz" in out
    assert main(["train", str(cfg_file), "optim.nam=adam"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "optim.nam" in lines[0] and "'name'" in lines[0]


def test_example_config_is_the_demo_config():
    from pathlib import Path

    from xnn.app.demo import DEMO_YAML

    path = Path(__file__).resolve().parents[1] / "examples" / "train_emt.yaml"
    assert path.read_text() == DEMO_YAML
    cfg = load_config(TrainConfig, path)
    assert cfg.model.name == "schnet" and cfg.data.datasets[0].path == "emt_cu.xyz"
