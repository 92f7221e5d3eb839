"""Bad input of the data, labels, structures and config values that used to be accepted or
blamed on something else (issue 42, the bad-input sweep's remaining findings): one line,
exit status 2, nothing written."""

from __future__ import annotations

import ase.io
import h5py
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from error_helpers import cli_fails, raises_one_line

from xnn.config.loader import ConfigError, load_config
from xnn.config.md import MDConfig
from xnn.config.train import TrainConfig
from xnn.config.workflow import WorkflowConfig
from xnn.data.ase_io import parse_index
from xnn.data.emt import write_emt
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError

LJ = ["model.name=lj", "model.hyperparameters={sigma: 3.405, epsilon: 0.0104}", "model.cutoff=6.0"]
TINY = ["model.cutoff=4.0", "model.hyperparameters={num_features: 8, num_filters: 8, "
        "num_interactions: 1, num_basis: 8}", "max_epochs=1", "data.batch_size=4",
        "logging.plots=false", "logging.progress_bar=false", "device=cpu"]


@pytest.fixture(scope="module")
def cu_frames(tmp_path_factory):
    path = tmp_path_factory.mktemp("cu") / "cu.xyz"
    write_emt(path, 8, ["Cu"], seed=0)
    return ase.io.read(path, ":")


@pytest.fixture(scope="module")
def lj_model(tmp_path_factory):
    from xnn.models.classical import LennardJones
    from xnn.models.serialization import save_model

    path = tmp_path_factory.mktemp("lj") / "lj.pt"
    save_model(LennardJones(2.3, 0.4, 5.0), path)
    return path


def _labelled(frames):
    """Copies of ``frames`` with their single-point labels (``Atoms.copy`` drops them)."""
    out = []
    for a in frames:
        b = a.copy()
        r = a.calc.results
        b.calc = SinglePointCalculator(b, energy=r["energy"], forces=r["forces"].copy(),
                                       stress=r["stress"].copy())
        out.append(b)
    return out


def _set_label(name, value, atom=0):
    def edit(frames):
        r = frames[2].calc.results
        if name == "energy":
            r["energy"] = value
        elif name == "forces":
            r["forces"][atom, 1] = value
        else:
            r["stress"][3] = value
    return edit


# --------------------------------------------------------------------------- labels
@pytest.mark.parametrize("name,value,words", [
    ("energy", np.nan, ["energy label 'energy'", "nan"]),
    ("energy", np.inf, ["energy label 'energy'", "inf"]),
    ("forces", np.nan, ["forces label 'forces' of atom [3]", "nan"]),
    ("stress", -np.inf, ["stress label 'stress'", "-inf"]),
])
def test_non_finite_label_refused_naming_file_structure_and_label(tmp_path, cu_frames, name,
                                                                  value, words):
    frames = _labelled(cu_frames)
    _set_label(name, value, atom=3)(frames)
    path = tmp_path / "d.xyz"
    ase.io.write(path, frames, format="extxyz")
    msg = raises_one_line(DataFileError, read_structures, path)
    for w in [str(path), "structure 2", *words]:
        assert w in msg, (w, msg)


def test_train_and_eval_refuse_a_nan_label_before_writing(tmp_path, cu_frames, lj_model,
                                                          capsys):
    frames = _labelled(cu_frames)
    _set_label("energy", np.nan)(frames)
    data = tmp_path / "d.xyz"
    ase.io.write(data, frames, format="extxyz")
    cli_fails(capsys, ["train", f"data.datasets.0.path={data}", f"output_dir={tmp_path / 'o'}",
                       *TINY], "structure 2", "energy", "nan")
    cli_fails(capsys, ["eval", lj_model, data, "--plot", tmp_path / "p.png", "--device", "cpu"],
              "structure 2", "energy", "nan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.xyz"]


def test_a_missing_label_is_still_accepted(tmp_path, cu_frames):
    """A structure without forces (the key left out) is read, its forces NaN (masked)."""
    frames = _labelled(cu_frames)
    r = frames[2].calc.results
    frames[2].calc = SinglePointCalculator(frames[2], energy=r["energy"])
    path = tmp_path / "d.xyz"
    ase.io.write(path, frames, format="extxyz")
    ds = read_structures(path)
    assert ds.label_masks()["forces"].tolist() == [i != 2 for i in range(8)]


def _h5(tmp_path, frames, edit=None):
    from xnn.data.ase_io import from_ase
    from xnn.data.hdf5 import write_hdf5

    path = tmp_path / "d.h5"
    write_hdf5(path, (from_ase([a]) for a in frames))
    if edit is not None:
        with h5py.File(path, "r+") as f:
            edit(f)
    return path


def test_hdf5_infinite_or_partly_nan_label_refused_nan_row_is_missing(tmp_path, cu_frames):
    frames = _labelled(cu_frames)

    def inf_energy(f):
        f["energy"][3] = np.inf

    def half_nan_force(f):
        f["forces"][5, 0] = np.nan

    def nan_energy(f):
        f["energy"][3] = np.nan

    msg = raises_one_line(DataFileError, read_structures(_h5(tmp_path, frames, inf_energy))
                          .label_counts)
    assert "/energy" in msg and "row 3" in msg
    msg = raises_one_line(DataFileError, read_structures(_h5(tmp_path, frames, half_nan_force))
                          .label_counts)
    assert "/forces" in msg and "row 5" in msg
    ds = read_structures(_h5(tmp_path, frames, nan_energy))
    assert ds.label_masks()["energy"].tolist() == [i != 3 for i in range(8)]


# --------------------------------------------------------------------------- empty structures
def _empty_third(frames):
    empty = Atoms(cell=frames[2].cell, pbc=True)
    empty.calc = SinglePointCalculator(empty, energy=0.0)
    frames[2] = empty


def test_structure_without_atoms_refused_in_data(tmp_path, cu_frames, lj_model, capsys):
    frames = _labelled(cu_frames)
    _empty_third(frames)
    path = tmp_path / "d.xyz"
    ase.io.write(path, frames, format="extxyz")
    msg = raises_one_line(DataFileError, read_structures, path)
    assert "structure 2 has no atoms" in msg and str(path) in msg
    # eval names the empty structure (was: 'the errors ... are not finite')
    cli_fails(capsys, ["eval", lj_model, path, "--plot", tmp_path / "p.png", "--device", "cpu"],
              "structure 2 has no atoms")
    h5 = _h5(tmp_path, [a for i, a in enumerate(frames) if i != 2] + [frames[2]])
    msg = raises_one_line(DataFileError, read_structures, h5)
    assert "structure 7 has no atoms" in msg


# --------------------------------------------------------------------------- eval label keys
def test_eval_named_key_that_no_structure_holds(tmp_path, cu_frames, lj_model, capsys):
    path = tmp_path / "d.xyz"
    ase.io.write(path, _labelled(cu_frames), format="extxyz")
    base = ["eval", lj_model, path, "--plot", tmp_path / "p.png", "--device", "cpu"]
    line = cli_fails(capsys, [*base, "--energy-key", "REF_energy"], "--energy-key 'REF_energy'",
                     "no structure", "energy")
    assert "calculator results" in line  # what the file holds
    cli_fails(capsys, [*base, "--stress-key", "REF_stress"], "--stress-key 'REF_stress'")
    assert not (tmp_path / "p.png").exists()


# --------------------------------------------------------------------------- structures
def _argon():
    return bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)


def _zero_atoms():
    return Atoms(cell=[10.0, 10.0, 10.0], pbc=True)


def _coincident():
    atoms = _argon()
    atoms.positions[5] = atoms.positions[3] + [0.03, 0.0, 0.0]
    return atoms


def _nan_velocity():
    atoms = _argon()
    v = np.full((len(atoms), 3), 0.01)
    v[4, 2] = np.nan
    atoms.set_velocities(v)
    return atoms


STRUCTURES = {
    "zero-atoms": (_zero_atoms, ["system 0 has no atoms"]),
    "coincident": (_coincident, ["system 0: atoms 3 and 5 are 0.03 Å apart", "coincident"]),
    "nan-velocity": (_nan_velocity, ["system 0: the velocities of atom [4]", "not finite"]),
}
COMMANDS = {
    "md": lambda s, o: ["md", f"structure={s}", *LJ, "steps=2", f"output.dir={o}",
                        "velocities=file", "output.progress=false", "output.plot=false"],
    "relax": lambda s, o: ["relax", f"structure={s}", *LJ, "max_steps=2", f"output.dir={o}",
                           "output.progress=false", "output.plot=false"],
    "run": lambda s, o: ["run", f"structure={s}", *LJ, "stages=[{type: relax, max_steps: 2}]",
                         f"output.dir={o}", "output.progress=false"],
    "validate": lambda s, o: ["validate", "--model", "lj:sigma=3.405,epsilon=0.0104,cutoff=6.0",
                              "--structure", s, "--device", "cpu"],
}


@pytest.mark.parametrize("kind", list(STRUCTURES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_structure_start_check_shared_by_md_relax_run_validate(tmp_path, capsys, command, kind):
    make, words = STRUCTURES[kind]
    path = tmp_path / "s.xyz"
    ase.io.write(path, make(), format="extxyz")
    cli_fails(capsys, COMMANDS[command](path, tmp_path / "out"), str(path), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.xyz"]


def test_start_check_names_the_system_of_a_batch(tmp_path, capsys):
    path = tmp_path / "s.xyz"
    ase.io.write(path, [_argon(), _argon(), _coincident()], format="extxyz")
    cli_fails(capsys, COMMANDS["relax"](path, tmp_path / "out") + ["index=:"],
              "system 2: atoms 3 and 5")


# --------------------------------------------------------------------------- index strings
@pytest.mark.parametrize("text,want", [("-1", -1), ("0", 0), (":", slice(None)),
                                       ("1:3", slice(1, 3)), ("::2", slice(None, None, 2)),
                                       ("-3:", slice(-3, None)), (" 1 : 3 ", slice(1, 3))])
def test_parse_index_valid(text, want):
    assert parse_index(text) == want


@pytest.mark.parametrize("text,words", [("1:3:0", "slice step of 0"), ("abc", "not a frame"),
                                        ("1:2:3:4", "not a frame"), ("", "not a frame"),
                                        ("1.5", "not a frame")])
def test_parse_index_invalid(text, words):
    assert words in raises_one_line(InputError, parse_index, text, match="index")


@pytest.mark.parametrize("command", ["md", "relax", "run"])
def test_index_step_zero_names_the_index(tmp_path, capsys, command):
    path = tmp_path / "s.xyz"
    ase.io.write(path, [_argon(), _argon()], format="extxyz")
    cli_fails(capsys, COMMANDS[command](path, tmp_path / "out") + ["index=1:3:0"],
              "index '1:3:0'", "step of 0")


# --------------------------------------------------------------------------- config values
@pytest.mark.parametrize("schema,overrides,key", [
    (MDConfig, ["safety.max_temperature=-1"], "safety.max_temperature"),
    (MDConfig, ["safety.max_temperature=0"], "safety.max_temperature"),
    (TrainConfig, ["data.val_batch_size=0"], "data.val_batch_size"),
    (TrainConfig, ["early_stopping.patience=-1"], "early_stopping.patience"),
    (TrainConfig, ["seed=-1"], "seed=-1 must be >= 0"),
    (MDConfig, ["seed=-3"], "seed=-3 must be >= 0"),
    (WorkflowConfig, ["seed=-1", "stages=[{type: relax}]"], "seed=-1 must be >= 0"),
])
def test_config_values_refused(schema, overrides, key):
    msg = raises_one_line(ConfigError, load_config, schema, None, overrides)
    assert key in msg


def test_config_values_at_their_bounds_accepted():
    assert load_config(TrainConfig, None, ["seed=0", "early_stopping.patience=0",
                                           "data.val_batch_size=1"]).seed == 0
    assert load_config(MDConfig, None, ["safety.max_temperature=1"]).safety.max_temperature == 1


# --------------------------------------------------------------------------- models to train
def test_train_d3_says_there_is_nothing_to_train(tmp_path, cu_frames, capsys):
    data = tmp_path / "d.xyz"
    ase.io.write(data, _labelled(cu_frames), format="extxyz")
    cli_fails(capsys, ["train", f"data.datasets.0.path={data}", f"output_dir={tmp_path / 'o'}",
                       "model.name=d3", "model.hyperparameters={functional: pbe}",
                       *TINY[2:]], "model.name=d3 has no trainable parameters")
    assert not (tmp_path / "o").exists()


def test_model_hyperparameters_only_what_the_class_takes():
    from xnn.app.train_model import model_hyperparameters
    from xnn.config.train import ModelConfig

    hp = model_hyperparameters(ModelConfig(name="d3", cutoff=5.0,
                                           hyperparameters={"functional": "pbe"}), [29])
    assert "species" not in hp and hp["cutoff"] == 5.0
    hp = model_hyperparameters(ModelConfig(name="schnet", cutoff=5.0), [29])
    assert hp["species"] == [29]


def test_train_fine_tunes_an_external_wrapper_and_saves_it(tmp_path, cu_frames, capsys):
    """A SevenNet wrapper (SevenNet-0's weights) trains like a native model since fine-tuning
    landed: its checkpoints and model file hold its own state (it once failed at the first
    checkpoint, then was refused up front); the saved model loads as the wrapper."""
    pytest.importorskip("sevenn")
    from xnn.cli.main import main
    from xnn.models.serialization import load_model

    data = tmp_path / "d.xyz"
    ase.io.write(data, _labelled(cu_frames), format="extxyz")
    out = tmp_path / "o"
    assert main(["train", f"data.datasets.0.path={data}", f"output_dir={out}",
                 "model.name=sevenn", "model.cutoff=5.0", *TINY[2:], "max_steps=1"]) == 0
    model = load_model(out / "model.pt")
    assert type(model).__name__ == "SevenNetWrapper"


# --------------------------------------------------------------------------- xnn data --out
@pytest.mark.parametrize("argv,words", [
    (["emt", "--n", "2", "--out", "o.txt"], ["--out", "o.txt", ".xyz, .extxyz, .h5, .hdf5"]),
    (["bulk", "--out", "o.cif"], ["--out", "o.cif", ".xyz, .extxyz"]),
    (["bulk", "--out", "o.h5"], ["--out", "o.h5"]),
])
def test_data_out_suffix_refused_before_writing(tmp_path, capsys, argv, words):
    argv = [a if not a.startswith("o.") else str(tmp_path / a) for a in argv]
    cli_fails(capsys, ["data", *argv], *words)
    assert list(tmp_path.iterdir()) == []


def test_data_emt_extxyz_suffix_reads_back(tmp_path, capsys):
    from xnn.cli.main import main

    out = tmp_path / "o.extxyz"
    assert main(["data", "emt", "--n", "2", "--out", str(out)]) == 0
    assert len(read_structures(out)) == 2
