"""What a new user meets on the first day: ``--help`` lists each key under its own section,
the model type can be switched from the command line, E0s are printed by element, and a
dataset without the labels the loss needs is refused in one line listing the file's keys."""

from __future__ import annotations

import re

import pytest
from error_helpers import cli_fails

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
    build(cfg.model.name, species=[29], cutoff=cfg.model.cutoff, **cfg.model.hyperparameters)
    cfg = load_config(TrainConfig, yaml, ["model.hyperparameters=null",
                                          "model.hyperparameters.num_features=8"])
    assert cfg.model.hyperparameters == {"num_features": 8}
    relax = tmp_path / "relax.yaml"
    relax.write_text("model:\n  name: lj\n  hyperparameters: {sigma: 3.4}\n")
    cfg = load_config(RelaxConfig, relax, ["model.name=null", "model.hyperparameters=null",
                                           "model.file=m.pt"])
    assert cfg.model.name is None and cfg.model.hyperparameters == {}
    assert cfg.model.file == "m.pt"


@pytest.fixture(scope="module")
def ref_file(tmp_path_factory):
    """6 EMT structures whose labels live under the keys of another code: info REF_energy,
    REF_stress, arrays REF_forces (no calculator results)."""
    import ase.io

    from xnn.data.emt import generate_emt

    frames = generate_emt(6, ["Cu"], seed=1)
    for a in frames:
        a.info["REF_energy"] = a.get_potential_energy()
        a.info["REF_stress"] = a.get_stress()
        a.arrays["REF_forces"] = a.get_forces()
        a.calc = None
    path = tmp_path_factory.mktemp("ref") / "ref.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


TINY = ["model.cutoff=3.0", "data.batch_size=2", "data.val_fraction=0.2",
        "model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}", "logging.progress_bar=false", "loss.stress.weight=1"]


def test_missing_labels_are_reported_at_once_with_the_keys_of_the_file(
        ref_file, tmp_path, capsys):
    out = tmp_path / "run"
    line = cli_fails(capsys, ["train", f"data.datasets.0.path={ref_file}",
                              f"output_dir={out}", "max_epochs=0", *TINY])
    for word in ("no energy label under key 'energy'", "no forces label under key 'forces'",
                 "no stress label", "'REF_energy'", "'REF_forces' [n, 3]", "'REF_stress' [6]",
                 "calculator results none", "data.datasets.0.energy_key=REF_energy",
                 "data.datasets.0.forces_key=REF_forces",
                 "data.datasets.0.stress_key=REF_stress", "xnn data inspect"):
        assert word in line, (word, line)
    assert not out.exists()
    # the keys it suggests train; E0s are printed by element symbol
    keys = ["data.datasets.0.energy_key=REF_energy", "data.datasets.0.forces_key=REF_forces",
            "data.datasets.0.stress_key=REF_stress"]
    assert main(["train", f"data.datasets.0.path={ref_file}", f"output_dir={out}",
                 "max_epochs=0", *TINY, *keys]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"E0 \(fit\) Cu -?\d+\.\d{4} eV", printed), printed
    assert "{29:" not in printed
    # xnn eval of the same file names the flags
    line = cli_fails(capsys, ["eval", out / "model.pt", ref_file, "--device", "cpu"])
    assert "--energy-key REF_energy" in line and "--forces-key REF_forces" in line


def test_data_inspect_lists_keys_and_where_labels_are_found(ref_file, capsys):
    assert main(["data", "inspect", str(ref_file)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"REF_forces\s+\[n, 3\]\s+in 6 of 6", out), out
    assert re.search(r"REF_energy\s+\(number\)\s+in 6 of 6", out), out
    assert "energy_key=energy: in 0 of 6; try energy_key=REF_energy" in out
    assert main(["data", "inspect", str(ref_file), "--energy-key", "REF_energy"]) == 0
    assert "energy_key=REF_energy: in 6 of 6" in capsys.readouterr().out


def test_demo_trains_by_epochs_and_warns_when_the_time_cap_binds(tmp_path, capsys):
    """The demo trains a fixed number of epochs; a wall-clock cap that stops it earlier is
    reported on stderr (and in summary.json), since the result then depends on the load.
    Its last lines tell how to get ``xnn`` on PATH when the environment is not active."""
    import json
    import os
    import sys

    from xnn.app.demo import time_cap_warning

    out = tmp_path / "demo"
    path = os.environ["PATH"]
    os.environ["PATH"] = os.pathsep.join(p for p in path.split(os.pathsep)
                                         if p != os.path.dirname(sys.executable))
    try:
        assert main(["demo", "--out", str(out), "--n-structures", "10", "--epochs", "3",
                     "--max-minutes", "1e-6", "--md-steps", "2", "--repeat", "1",
                     "--fmax", "1e-2"]) == 0
    finally:
        os.environ["PATH"] = path
    captured = capsys.readouterr()
    assert "WARNING: the training stopped at the --max-minutes 1e-06 cap" in captured.err
    assert "of 3 epochs" in captured.err
    train = json.loads((out / "summary.json").read_text())["train"]
    assert train["stopped_by"] == "time_limit" and train["epochs"] < 3
    assert train["epochs_planned"] == 3 and "WARNING" in train["warning"]
    activate = os.path.join(os.path.dirname(sys.executable), "activate")
    if os.path.isfile(activate):
        assert f"source {activate}" in captured.out.strip().splitlines()[-1]
    assert time_cap_warning({"stopped_by": "max_epochs", "epochs": 3}, 3, 15.0) is None


def test_data_bulk_writes_a_rattled_supercell(tmp_path, capsys):
    import ase.io
    import numpy as np

    out = tmp_path / "big.xyz"
    assert main(["data", "bulk", "--out", str(out), "--element", "Cu", "--repeat", "3"]) == 0
    atoms = ase.io.read(out)
    assert len(atoms) == 108 and atoms.pbc.all() and set(atoms.get_chemical_symbols()) == {"Cu"}
    assert np.allclose(atoms.cell.lengths(), 3 * 3.61) and np.allclose(atoms.cell.angles(), 90)
    from ase.build import bulk

    ideal = bulk("Cu", cubic=True).repeat(3)
    d = atoms.get_scaled_positions() - ideal.get_scaled_positions()
    shift = (d - np.round(d)) @ atoms.cell.array  # displacement from each lattice site, Å
    assert 0.03 < shift.std() < 0.07  # --rattle 0.05 by default
    line = cli_fails(capsys, ["data", "bulk", "--out", str(tmp_path / "z.xyz"),
                              "--element", "Zn"])
    assert "hcp, not cubic" in line


def test_another_model_with_the_yamls_hyperparameters_is_refused_with_the_fix(
        tmp_path, capsys):
    """Switching ``model.name`` alone keeps the YAML's SchNet settings: refused before the
    data are read (the data file does not even exist), naming ``model.hyperparameters=null``."""
    yaml = tmp_path / "cfg.yaml"
    yaml.write_text("model:\n  name: schnet\n  hyperparameters: {num_filters: 16}\n")
    line = cli_fails(capsys, ["train", str(yaml), "model.name=painn",
                              f"data.datasets.0.path={tmp_path / 'none.xyz'}",
                              f"output_dir={tmp_path / 'run'}"])
    assert "['num_filters']" in line and "model.name=painn model.hyperparameters=null" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("temperature", ["-1", "nan", "inf"])
def test_demo_refuses_a_bad_temperature_before_writing(tmp_path, capsys, temperature):
    """Was refused by the MD config after the data, the LJ relaxation and the training had
    been written (12 files)."""
    out = tmp_path / "demo"
    cli_fails(capsys, ["demo", "--out", out, "--temperature", temperature], "--temperature")
    assert not out.exists()
