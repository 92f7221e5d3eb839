"""One user vocabulary (issue 43 item 4): one ``model`` and one ``parallel`` section for
``xnn train``, ``md``, ``relax`` and ``run``; every old spelling refused with one line naming
the new one (from a YAML file and from an override, for every command); the decomposition
words of ``xnn.distributed.modes.MODES`` everywhere; one override splitter."""

from __future__ import annotations

import pytest
from error_helpers import raises_one_line

from xnn.config.loader import ConfigError, load_config, split_config_args
from xnn.config.md import MDConfig, RelaxConfig
from xnn.config.train import TrainConfig
from xnn.config.workflow import WorkflowConfig

STAGES = ["stages=[{type: relax}]"]  # a workflow needs one
COMMANDS = {"md": (MDConfig, []), "relax": (RelaxConfig, []), "run": (WorkflowConfig, STAGES),
            "train": (TrainConfig, [])}

#: old override -> the new spelling its refusal must name
OLD = {
    "model.params.sigma=3.4": "model.hyperparameters",
    "model.params={sigma: 3.4}": "model.hyperparameters",
    "model.backend=cueq": "model.kernel_backend",
    "model.add=[{name: d3}]": "model.hyperparameters.terms",
    "dd.mode=graph": "parallel.mode=graph",
    "dd.mode=auto": "parallel.mode=auto",
    "dd.mode=halo": "parallel.mode=spatial",
    "dd.order=index": "parallel.order",
    "dd={mode: graph}": "parallel.mode=graph",
}

#: the same old keys in a YAML file
OLD_YAML = {
    "model:\n  name: lj\n  params: {sigma: 3.4}\n": "model.hyperparameters",
    "model:\n  backend: cueq\n": "model.kernel_backend",
    "model:\n  name: lj\n  add:\n    - {name: d3}\n": "model.hyperparameters.terms",
    "dd:\n  mode: halo\n": "parallel.mode=spatial",
    "dd:\n  order: index\n": "parallel.order",
    "dd: {}\n": "parallel",
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("old,new", OLD.items(), ids=list(OLD))
def test_old_override_is_refused_naming_the_new_key(command, old, new):
    schema, extra = COMMANDS[command]
    msg = raises_one_line(ConfigError, load_config, schema, None, [*extra, old])
    assert new in msg, msg


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("text,new", OLD_YAML.items(), ids=list(OLD_YAML))
def test_old_yaml_key_is_refused_naming_the_new_key(tmp_path, command, text, new):
    schema, extra = COMMANDS[command]
    path = tmp_path / "old.yaml"
    path.write_text(text)
    msg = raises_one_line(ConfigError, load_config, schema, path, extra)
    assert new in msg, msg


def test_old_halo_meaning_is_named():
    """``dd.mode=halo`` was the spatial mode (sync where the model has sync points); the
    word ``halo`` now means pure halo, so the refusal says both."""
    msg = raises_one_line(ConfigError, load_config, MDConfig, None, ["dd.mode=halo"])
    assert "parallel.mode=spatial" in msg and "pure halo" in msg


def test_one_model_section_for_every_command():
    """The same keys build the same model section in md, relax, run and train."""
    keys = ["model.name=lj", "model.cutoff=6.5", "model.hyperparameters={sigma: 3.4, "
            "epsilon: 0.01}", "model.kernel_backend=reference", "model.trust_file=true"]
    sections = {name: load_config(schema, None, [*extra, *keys]).model
                for name, (schema, extra) in COMMANDS.items()}
    assert len({type(s) for s in sections.values()}) == 1
    shared = {(s.name, s.cutoff, tuple(sorted(s.hyperparameters.items())), s.kernel_backend,
               s.trust_file) for s in sections.values()}
    assert shared == {("lj", 6.5, (("epsilon", 0.01), ("sigma", 3.4)), "reference", True)}
    assert sections["md"].build_kwargs() == {"sigma": 3.4, "epsilon": 0.01, "cutoff": 6.5}


def test_defaults_per_command():
    """train builds a SchNet of 5 Å with reference kernels; the runs need a model and keep a
    file's kernels; every command's decomposition is spatial."""
    train, md = load_config(TrainConfig), load_config(MDConfig)
    assert (train.model.name, train.model.cutoff, train.model.kernel_backend) == \
        ("schnet", 5.0, "reference")
    assert (md.model.name, md.model.cutoff, md.model.kernel_backend) == (None, None, "saved")
    assert train.parallel.mode == md.parallel.mode == "spatial"
    assert (train.parallel.dp, train.parallel.dd) == (-1, 1)
    assert (md.parallel.dp, md.parallel.dd) == (1, -1)


@pytest.mark.parametrize("command,override,named", [
    ("md", "model.scale_shift=false", "model.scale_shift is a setting of xnn train"),
    ("relax", "model.e0=zero", "model.e0 is a setting of xnn train"),
    ("md", "model.e0={Cu: -0.0052}", "model.e0 is a setting of xnn train"),
    ("run", "model.activation_checkpointing=true", "model.activation_checkpointing"),
    ("train", "model.device=cpu", "model.device is a setting of xnn md"),
    ("train", "model.skin=0.3", "model.skin is a setting of xnn md"),
    ("train", "model.file=m.pt", "pretrained=PATH"),
    ("md", "parallel.dp=2", "set parallel.dp: 1"),
    ("run", "parallel.dd=2", "set parallel.dd: 1"),
    ("run", "parallel.mode=graph", "parallel.mode is a setting of a decomposition"),
    ("run", "parallel.balance=shift", "parallel.balance is a setting of a decomposition"),
    ("run", "parallel.exchange=staged", "parallel.exchange is a setting of a decomposition"),
    ("md", "model.hyperparameters.cutoff=5", "set model.cutoff"),
    ("train", "model.hyperparameters.species=[29]", "set model.species"),
])
def test_key_meaningless_for_the_command_is_refused(command, override, named):
    schema, extra = COMMANDS[command]
    msg = raises_one_line(ConfigError, load_config, schema, None, [*extra, override])
    assert named in msg, msg


def test_model_file_takes_no_build_settings():
    cfg = load_config(MDConfig, None, ["model.file=m.pt", "model.cutoff=5.0"])
    raises_one_line(ConfigError, cfg.model.check_source, match="keeps its own")


def test_every_mode_word_is_accepted_by_every_command():
    """``parallel.mode`` takes the words of MODES in every command and passes them to the
    library unchanged (``parallelize`` resolves them: tests/test_graph_parallel.py);
    another word is refused with the list."""
    from xnn.distributed.modes import MODES

    for word in MODES:
        for schema, extra in COMMANDS.values():
            if schema is WorkflowConfig:
                continue
            assert load_config(schema, None, [*extra, f"parallel.mode={word}"]).parallel.mode \
                == word
    raises_one_line(ConfigError, load_config, MDConfig, None, ["parallel.mode=box"],
                    match="choose one of")


def test_every_balance_word_is_accepted_by_every_decomposing_command():
    """``parallel.balance`` takes the words of BALANCE (default none) in train, md and relax,
    the words of ``xnn validate --balance``; another word is refused with the list."""
    from xnn.distributed.domain.balance import BALANCE

    for schema, extra in COMMANDS.values():
        if schema is WorkflowConfig:
            continue
        assert load_config(schema, None, list(extra)).parallel.balance == "none"
        for word in BALANCE:
            assert load_config(schema, None, [*extra, f"parallel.balance={word}"]
                               ).parallel.balance == word
    raises_one_line(ConfigError, load_config, MDConfig, None, ["parallel.balance=rcb"],
                    match="choose one of")


def test_every_exchange_word_is_accepted_by_every_decomposing_command():
    """``parallel.exchange`` takes the words of EXCHANGES (default direct) in train, md and
    relax, the words of ``xnn validate --exchange``; another word is refused with the list."""
    from xnn.distributed.domain.staged import EXCHANGES

    for schema, extra in COMMANDS.values():
        if schema is WorkflowConfig:
            continue
        assert load_config(schema, None, list(extra)).parallel.exchange == "direct"
        for word in EXCHANGES:
            assert load_config(schema, None, [*extra, f"parallel.exchange={word}"]
                               ).parallel.exchange == word
    raises_one_line(ConfigError, load_config, MDConfig, None, ["parallel.exchange=ring"],
                    match="choose one of")


def test_one_override_splitter():
    """Every config command reads ``xnn CMD key=value ...`` without a file and refuses a
    first argument that is neither an override nor a YAML file."""
    assert split_config_args("steps=3", ["seed=1"]) == (None, ["steps=3", "seed=1"])
    assert split_config_args("cfg.yaml", ["seed=1"]) == ("cfg.yaml", ["seed=1"])
    assert split_config_args(None, []) == (None, [])
    raises_one_line(ConfigError, split_config_args, "structure.xyz", [], match="key=value")


@pytest.mark.parametrize("command", ["train", "md", "relax", "run"])
def test_help_shows_only_the_new_spellings(capsys, command):
    from xnn.cli.main import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    for old in ("model.params", "model.add", "model.backend ", "dd.mode", "dd.order"):
        assert old not in text, (old, text)
    for new in ("model.hyperparameters", "model.kernel_backend", "parallel.mode",
                "parallel.timeout_s"):
        assert new in text


def test_cli_refuses_an_old_key_with_one_line(capsys, tmp_path):
    from xnn.cli.main import main

    assert main(["md", f"structure={tmp_path / 'x.xyz'}", "dd.mode=graph"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parallel.mode=graph" in err
    assert main(["validate", "--model", "lj", "--structure", "x.xyz", "--timeout", "5"]) == 2
    assert "--parallel.timeout_s 5" in capsys.readouterr().err


def test_model_spec_parser_outside_distributed():
    """``xnn validate --model`` specs are parsed by the application layer."""
    import xnn.distributed.validate as dv
    from xnn.app.model_spec import build_from_spec, parse_spec

    assert parse_spec("lj:sigma=2.3,epsilon=0.4,cutoff=5.0") == \
        ("lj", {"sigma": 2.3, "epsilon": 0.4, "cutoff": 5.0})
    assert float(build_from_spec("lj", [18]).cutoff) == 5.0
    assert not hasattr(dv, "parse_spec") and not hasattr(dv, "build_from_spec")
