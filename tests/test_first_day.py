"""What a new user meets on the first day: ``--help`` lists each key under its own section,
the model type can be switched from the command line, E0s are printed by element, and a
dataset without the labels the loss needs is refused in one line listing the file's keys."""

from __future__ import annotations

import re

import pytest

from xnn.cli.main import main
from xnn.config.loader import describe, load_config


def _schemas():
    from xnn.config.md import MDConfig, RelaxConfig
    from xnn.config.train import TrainConfig
    from xnn.config.workflow import WorkflowConfig

    return [TrainConfig, MDConfig, RelaxConfig, WorkflowConfig]


@pytest.mark.parametrize("schema", _schemas(), ids=lambda s: s.__name__)
def test_help_prints_each_key_under_its_own_section(schema):
    """A key is printed under the heading of its own section (``memory.x`` under
    ``memory:``), and a top-level key under ``top-level keys:``, never under the heading
    of the section printed before it."""
    heading, seen = None, 0
    for line in describe(schema).splitlines():
        if not line.startswith(" "):
            assert line.endswith(":") or ":  " in line, line
            heading = line.split(":")[0]
            continue
        key = line.split()[0]
        seen += 1
        if heading in (None, "top-level keys"):
            assert "." not in key, f"{key} printed under {heading!r}"
        else:
            assert key.rpartition(".")[0] == heading, f"{key} printed under {heading!r}:"
    assert seen > 10


def test_train_help_says_how_to_name_label_keys(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "data.datasets.0.energy_key=" in out and "xnn data inspect" in out


def test_hyperparameters_null_switches_the_model_type(tmp_path):
    """``model.name=painn model.hyperparameters=null`` drops the YAML's SchNet
    hyperparameters (which PaiNN would refuse); other dict keys clear the same way."""
    from xnn.config.md import RelaxConfig
    from xnn.config.train import TrainConfig
    from xnn.models import build

    yaml = tmp_path / "cfg.yaml"
    yaml.write_text("model:\n  name: schnet\n  hyperparameters: {num_filters: 16, "
                    "num_features: 16}\n")
    cfg = load_config(TrainConfig, yaml, ["model.name=painn", "model.hyperparameters=null"])
    assert cfg.model.name == "painn" and cfg.model.hyperparameters == {}
    build(cfg.model.name, cutoff=cfg.model.cutoff, **cfg.model.hyperparameters)
    cfg = load_config(TrainConfig, yaml, ["model.hyperparameters=null",
                                          "model.hyperparameters.num_features=8"])
    assert cfg.model.hyperparameters == {"num_features": 8}
    relax = tmp_path / "relax.yaml"
    relax.write_text("model:\n  name: lj\n  params: {sigma: 3.4}\n")
    cfg = load_config(RelaxConfig, relax, ["model.name=null", "model.params=null",
                                           "model.file=m.pt"])
    assert cfg.model.name is None and cfg.model.params == {} and cfg.model.file == "m.pt"
