"""Bad input gives one clear line of xnn error (library and CLI), and overwrites nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from ase.calculators.lj import LennardJones as AseLJ
from ase.calculators.singlepoint import SinglePointCalculator
from error_helpers import cli_fails, raises_one_line

import xnn
from xnn.cli.main import main
from xnn.data import AtomicGraph, from_ase, read, write
from xnn.errors import DataFileError, InputError, UnknownSpeciesError
from xnn.models import Potential, build
from xnn.models.classical import LennardJones, Morse

SIGMA, EPS, RC = 3.4, 0.0104, 8.5


def test_missing_and_unparseable_files(tmp_path):
    missing = tmp_path / "nope.xyz"
    assert str(missing) in raises_one_line(DataFileError, read, missing, match="does not exist")
    raises_one_line(DataFileError, read, tmp_path, match="directory")
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is\nnot an xyz file\n at all\n")
    raises_one_line(DataFileError, read, garbage, match="cannot parse")
    truncated = tmp_path / "truncated.xyz"
    truncated.write_text('5\nLattice="5 0 0 0 5 0 0 0 5" pbc="T T T"\nAr 0 0 0\nAr 1 1 1\n')
    raises_one_line(DataFileError, read, truncated, match="cannot parse")
    empty = tmp_path / "empty.xyz"
    empty.write_text("")
    raises_one_line(DataFileError, read, empty)


def test_missing_requested_labels(tmp_path, ar_periodic, ar_molecule):
    a = ar_periodic.copy()
    a.calc = SinglePointCalculator(a, energy=1.0, forces=np.zeros((len(a), 3)))
    m = ar_molecule.copy()
    m.calc = SinglePointCalculator(m, energy=2.0)  # no forces
    path = tmp_path / "partial.xyz"
    write(path, [a, m])
    msg = raises_one_line(DataFileError, read, path, require=("energy", "forces"))
    assert "structure 1" in msg and "forces" in msg and str(path) in msg
    raises_one_line(DataFileError, read, path, require=("energy",), energy_key="REF_energy")
    raises_one_line(InputError, from_ase, [a], require=("energie",), match="unknown required")
    assert read(path, require=("energy",), as_graph=True).energy.tolist() == [1.0, 2.0]


def test_malformed_labels(ar_periodic):
    a = ar_periodic.copy()
    a.arrays["forces"] = np.zeros((len(a), 2))
    raises_one_line(DataFileError, from_ase, a, match="forces")
    b = ar_periodic.copy()
    b.info["stress"] = np.zeros(5)
    raises_one_line(DataFileError, from_ase, b, match="6 .Voigt. or 9")


def test_mismatched_array_shapes():
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((4, 3)), [18] * 3)
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((4, 2)), [18] * 4)
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((2, 3)), [18] * 2, np.eye(2))


@pytest.mark.parametrize("where", ["positions", "cell"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_positions_or_cell(ar_periodic, where, value):
    atoms = ar_periodic.copy()
    if where == "positions":
        atoms.positions[3, 1] = value
    else:
        atoms.cell[1, 2] = value
    raises_one_line(
        InputError, from_ase, [ar_periodic, atoms], match=f"structure 1: non-finite {where}"
    )
    atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu")
    raises_one_line(InputError, atoms.get_potential_energy, match="non-finite")
    raises_one_line(
        InputError, AtomicGraph.from_arrays, atoms.positions, atoms.numbers, atoms.cell[:]
    )


def test_singular_cell_only_matters_along_periodic_axes(ar_periodic):
    atoms = ar_periodic.copy()
    atoms.cell[2] = atoms.cell[0] + atoms.cell[1]  # coplanar lattice vectors
    raises_one_line(InputError, from_ase, atoms, match="singular cell")
    flat = ar_periodic.copy()
    flat.cell[2] = 0.0
    raises_one_line(InputError, from_ase, flat, match="singular cell along periodic axis z")
    # a slab: zero third vector, periodic in x and y only -> legal, and equal to ASE's LJ
    flat.pbc = (True, True, False)
    out = Potential(LennardJones(SIGMA, EPS, RC))(from_ase(flat), stress=False)
    flat.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC)
    np.testing.assert_allclose(out["forces"].numpy(), flat.get_forces(), atol=1e-12)
    assert float(out["energy"]) == pytest.approx(flat.get_potential_energy(), rel=1e-10)


def test_left_handed_cells_are_legal(ar_periodic):
    """A left-handed cell (as ASE allows) describes the same crystal as its right-handed twin."""
    right = ar_periodic
    left = right.copy()
    left.set_cell(right.cell[[1, 0, 2]])  # swap two lattice vectors: det < 0, same lattice
    assert np.linalg.det(left.cell[:]) < 0 < np.linalg.det(right.cell[:])
    pot = Potential(LennardJones(SIGMA, EPS, RC))
    out_l, out_r = pot(from_ase(left)), pot(from_ase(right))
    for k in ("energy", "energies", "forces", "stress"):
        torch.testing.assert_close(out_l[k], out_r[k], rtol=1e-12, atol=1e-14)
    left.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC)
    np.testing.assert_allclose(out_l["forces"].numpy(), left.get_forces(), atol=1e-12)
    g = from_ase(left)
    frac = g.wrapped().positions.numpy() @ np.linalg.inv(left.cell[:])
    assert (frac >= 0).all() and (frac < 1).all()
    assert float(g.volume()) == pytest.approx(left.get_volume())


def test_unknown_species_and_bad_parameters(ar_periodic):
    model = build("lj", sigma={"Ar": SIGMA}, epsilon={"Ar": EPS}, cutoff=RC)
    atoms = ar_periodic.copy()
    atoms.numbers[[0, 2]] = [29, 36]
    msg = raises_one_line(UnknownSpeciesError, Potential(model), from_ase(atoms))
    assert "Cu" in msg and "Kr" in msg
    for bad in (0.0, -2.0, float("nan")):
        raises_one_line(InputError, LennardJones, SIGMA, EPS, bad, match="cutoff")
        raises_one_line(InputError, Morse, 0.3, 1.0, 3.0, bad, match="cutoff")
    raises_one_line(InputError, LennardJones, -1.0, EPS, RC, match="sigma")
    raises_one_line(InputError, LennardJones, SIGMA, EPS, RC, species=["Xx"], match="element")
    raises_one_line(InputError, build, "lj", sigma=1.0, epsilon=1.0, cutof=3.0)


def test_species_checked_once_per_numbers_tensor(ar_periodic, monkeypatch):
    """An MD run passes the same ``numbers`` every step: the check (a host sync) runs once,
    and again only for another tensor or one changed in place."""
    model = build("lj", sigma={"Ar": SIGMA}, epsilon={"Ar": EPS}, cutoff=RC)
    calls = []
    original = model.check_species
    monkeypatch.setattr(model, "check_species", lambda z: (calls.append(1), original(z)))
    pot = Potential(model)
    g = from_ase(ar_periodic)
    pot(g), pot(g), pot(g.replace(positions=g.positions + 0.01))
    assert len(calls) == 1
    g.numbers[1] = 29  # in place: version changes, checked again and refused
    raises_one_line(UnknownSpeciesError, pot, g)
    bad = from_ase(ar_periodic)
    bad.numbers[0] = 36
    raises_one_line(UnknownSpeciesError, pot, bad)


def test_failed_write_overwrites_nothing(tmp_path, ar_periodic):
    path = tmp_path / "keep.xyz"
    write(path, ar_periodic)
    before = path.read_bytes()
    raises_one_line(DataFileError, write, path, ["not a structure"])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.xyz"]  # no temporary left
    raises_one_line(DataFileError, write, tmp_path / "no" / "such" / "dir.xyz", ar_periodic)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "xnn", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_errors_are_one_line_and_overwrite_nothing(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("precious\n")
    proc = run_cli("demo", "--out", str(target))  # a real process: exit code and stderr
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and len(err.splitlines()) == 1, proc.stderr
    assert err.startswith("xnn demo: error:") and str(target) in err
    assert target.read_text() == "precious\n"
    # in-process: a bad option is refused before the output folder is created
    assert main(["demo", "--out", str(tmp_path / "new"), "--repeat", "0"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--repeat" in err
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------ issue 15, items 3, 4 and 6
TINY_TRAIN = ["model.cutoff=3.0", "model.hyperparameters={num_features: 8, num_filters: 8, "
              "num_interactions: 1, num_basis: 8}", "data.batch_size=3", "data.val_fraction=0.25",
              "max_epochs=1", "logging.plots=false", "logging.progress_bar=false", "device=cpu"]
LJ_MD = ["model.name=lj", "model.hyperparameters.sigma=3.405",
         "model.hyperparameters.epsilon=0.0104", "model.cutoff=6.5", "output.progress=false",
         "output.plot=false", "ensemble=nve", "temperature=20", "steps=3"]


def tree(folder):
    """``{relative path: sha256}`` of every file under ``folder`` (hidden ones included)."""
    import hashlib
    from pathlib import Path

    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def emt_file(tmp_path_factory):
    from xnn.data.emt import write_emt

    path = tmp_path_factory.mktemp("emt") / "cu.xyz"
    write_emt(path, 8, ["Cu"], seed=0)
    return path


@pytest.fixture(scope="module")
def argon_file(tmp_path_factory):
    from ase.build import bulk

    frames = []
    for seed in range(2):
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(2)
        atoms.positions += np.random.default_rng(seed).normal(0, 0.05, atoms.positions.shape)
        frames.append(atoms)
    path = tmp_path_factory.mktemp("ar") / "ar.xyz"
    write(path, frames)
    return path


def fake_training_run(folder):
    """A previous run's files (a real training checkpoint layout) plus a file of the user's."""
    import torch as T

    from xnn.models.serialization import save_model

    (folder / "checkpoints").mkdir(parents=True)
    payload = {"format": "xnn-checkpoint", "format_version": 1,
               "model": {"name": "lj", "hparams": {}, "state_dict": {}},
               "rng": {"torch": T.get_rng_state(), "numpy": np.random.get_state()}}
    T.save(payload, folder / "checkpoints" / "last.pt")
    save_model(LennardJones(SIGMA, EPS, RC), folder / "model.pt")
    (folder / "config.yaml").write_text("max_epochs: 7\n")
    (folder / "metrics.csv").write_text("epoch,step\n1,3\n")
    (folder / "summary.json").write_text("{}\n")
    (folder / "notes.txt").write_text("mine\n")
    return tree(folder)


def test_overwrite_validates_everything_before_touching_the_previous_run(
        tmp_path, emt_file, capsys):
    run = tmp_path / "run"
    before = fake_training_run(run)
    unlabelled = tmp_path / "unlabelled.xyz"
    write(unlabelled, [a.copy() for a in read(emt_file, index="0:2")])  # no energy/forces
    base = ["train", f"output_dir={run}", "overwrite=true", *TINY_TRAIN]
    cases = [
        ([f"data.datasets.0.path={tmp_path / 'missing.xyz'}"], "does not exist"),
        ([f"data.datasets.0.path={unlabelled}"], "energy"),
        ([f"data.datasets.0.path={emt_file}", "model.name=painn",
          "model.hyperparameters={num_features: abc}"], "num_features"),
        ([f"data.datasets.0.path={emt_file}", "model.hyperparameters={bogus: 1}"], "bogus"),
        ([f"data.datasets.0.path={emt_file}", f"pretrained={tmp_path / 'none.pt'}"],
         "does not exist"),
        ([f"data.datasets.0.path={emt_file}", "optim.lr=nan"], "optim.lr"),
    ]
    for extra, word in cases:
        cli_fails(capsys, base + extra, word)
        assert tree(run) == before, extra  # byte-identical, nothing staged
        assert sorted(p.name for p in run.iterdir()) == sorted(
            ["checkpoints", "model.pt", "config.yaml", "metrics.csv", "summary.json",
             "notes.txt"])


def test_overwrite_swaps_in_the_new_run_only_when_it_completes(
        tmp_path, emt_file, capsys, monkeypatch):
    from xnn.app import train_finish as finish
    from xnn.models.serialization import load_model

    run = tmp_path / "run"
    before = fake_training_run(run)
    args = ["train", f"data.datasets.0.path={emt_file}", f"output_dir={run}",
            "overwrite=true", *TINY_TRAIN]
    original = finish.finish_run

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(finish, "finish_run", killed)
    assert main(args) == 130  # interrupted after its epoch: the previous run is untouched
    now = tree(run)
    assert {k: v for k, v in now.items() if not k.startswith(".xnn-new-run/")} == before
    assert ".xnn-new-run/checkpoints/last.pt" in now
    monkeypatch.setattr(finish, "finish_run", original)
    capsys.readouterr()
    assert main(args + ["resume=auto", "max_epochs=2"]) == 0  # continues the staged run
    assert f"resumed from {run / '.xnn-new-run'}" in capsys.readouterr().out
    names = sorted(p.name for p in run.iterdir())
    assert names == ["checkpoints", "config.yaml", "metrics.csv", "model.pt", "notes.txt",
                     "split.json", "split.npy", "summary.json"]
    assert (run / "notes.txt").read_text() == "mine\n"
    assert tree(run)["model.pt"] != before["model.pt"]
    assert load_model(run / "model.pt").hparams["num_features"] == 8  # the new schnet
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model"] == str(run / "model.pt") and summary["epochs"] == 2
    assert len((run / "metrics.csv").read_text().splitlines()) == 3  # header + 2 epochs


def test_md_and_relax_keep_a_previous_run_unless_asked(tmp_path, argon_file, capsys):
    out = tmp_path / "md"
    args = ["md", f"structure={argon_file}", f"output.dir={out}", *LJ_MD]
    assert main(args) == 0
    before = tree(out)
    cli_fails(capsys, args, "previous run", "output.overwrite=true", "resume=")
    cli_fails(capsys, args[:1] + [f"structure={tmp_path / 'none.xyz'}"] + args[2:]
              + ["output.overwrite=true"], "none.xyz")
    cli_fails(capsys, args + ["output.overwrite=true", "index=99"], "has 2 frame(s)")
    cli_fails(capsys, ["relax", f"structure={argon_file}", f"output.dir={out}", *LJ_MD[:5]],
              "previous run")
    assert tree(out) == before
    assert main(args + ["output.overwrite=true", "steps=6", "output.log_every=1"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(before)  # no staging left
    assert len((out / "thermo.csv").read_text().splitlines()) == 1 + 7


def test_config_numbers_must_be_finite(tmp_path, capsys):
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.md import MDConfig, RelaxConfig, ThermostatConfig
    from xnn.config.train import EarlyStoppingConfig, TrainConfig

    cases = [
        (TrainConfig, ["optim.lr=nan"], "optim.lr"),
        (TrainConfig, ["optim.lr=inf"], "optim.lr"),
        (TrainConfig, ["loss.forces.delta=inf"], "loss delta"),
        (TrainConfig, ["early_stopping.min_delta=nan"], "early_stopping.min_delta"),
        (TrainConfig, ["parallel.timeout_s=-inf"], "parallel.timeout_s"),
        (TrainConfig, ["schedule.min_lr_factor=nan"], "schedule.min_lr_factor"),
        (MDConfig, ["timestep=nan"], "timestep"),
        (MDConfig, ["temperatures=[300,nan]"], "temperatures.1"),
        (MDConfig, ["thermostat.tau=inf"], "thermostat.tau"),
        (MDConfig, ["ensemble=npt", "pressure=nan"], "pressure"),
        (MDConfig, ["safety.max_force=inf"], "safety.max_force"),
        (RelaxConfig, ["fmax=nan"], "fmax"),
    ]
    for schema, override, key in cases:
        msg = raises_one_line(ConfigError, load_config, schema, None, override)
        assert key in msg and "finite" in msg, (override, msg)
    yaml = tmp_path / "nan.yaml"
    yaml.write_text("model:\n  hyperparameters:\n    scale: .nan\n")
    msg = raises_one_line(ConfigError, load_config, TrainConfig, yaml)
    assert "model.hyperparameters.scale" in msg
    yaml.write_text("model:\n  name: lj\n  hyperparameters: {sigma: {Ar: .inf}}\n")
    msg = raises_one_line(ConfigError, load_config, MDConfig, yaml)
    assert "model.hyperparameters.sigma.Ar" in msg
    # configs built in Python are checked too, also fields without a range
    raises_one_line(ConfigError, ThermostatConfig, tau=float("nan"), match="thermostat.tau")
    raises_one_line(ConfigError, MDConfig, ensemble="npt", pressure=float("nan"),
                    match="pressure=nan")
    raises_one_line(ConfigError, TrainConfig, early_stopping=EarlyStoppingConfig(
        min_delta=float("inf")), match="early_stopping.min_delta")
    out = tmp_path / "never"
    cli_fails(capsys, ["train", f"output_dir={out}", "optim.lr=nan"], "optim.lr=nan")
    assert not out.exists()


def test_output_location_errors(tmp_path, emt_file, argon_file, capsys):
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.data.emt import write_emt
    from xnn.models.serialization import save_model

    afile = tmp_path / "afile"
    afile.write_text("keep\n")
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={emt_file}",
                                          f"output_dir={afile}", *TINY_TRAIN])
    raises_one_line(InputError, train, cfg, match="is a file")
    cli_fails(capsys, ["train", f"data.datasets.0.path={emt_file}", f"output_dir={afile}",
                       *TINY_TRAIN], "output_dir", "is a file")
    cli_fails(capsys, ["md", f"structure={argon_file}", f"output.dir={afile}", *LJ_MD],
              "output.dir", "is a file")
    cli_fails(capsys, ["relax", f"structure={argon_file}", f"output.dir={afile / 'sub'}",
                       *LJ_MD[:5]], "is a file, not a folder")
    folder = tmp_path / "folder"
    folder.mkdir()
    cli_fails(capsys, ["data", "emt", "--out", str(folder), "--n", "2"], "--out", "folder")
    raises_one_line(InputError, write_emt, folder, 2, match="is a folder")
    raises_one_line(InputError, save_model, LennardJones(SIGMA, EPS, RC), folder,
                    match="is a folder")
    raises_one_line(InputError, save_model, LennardJones(SIGMA, EPS, RC), afile / "m.pt",
                    match="is a file")
    assert afile.read_text() == "keep\n" and list(folder.iterdir()) == []


def test_yaml_top_level_list(tmp_path, capsys):
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.md import MDConfig

    path = tmp_path / "list.yaml"
    path.write_text("- max_epochs: 3\n- seed: 1\n")
    assert "holds a list" in raises_one_line(ConfigError, load_config, MDConfig, path)
    cli_fails(capsys, ["train", str(path)], "list.yaml", "holds a list", "mapping")
    cli_fails(capsys, ["md", str(path)], "holds a list")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_gpu():
    model = LennardJones(SIGMA, EPS, RC)
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        msg = raises_one_line(InputError, xnn.Calculator, model, device=device)
        assert "no CUDA GPU" in msg and "cpu" in msg


def test_hyperparameter_types_are_checked(tmp_path, emt_file, capsys):
    msg = raises_one_line(InputError, build, "schnet", species=[29], cutoff=4.0,
                          num_features="abc")
    assert "num_features='abc'" in msg and "integer" in msg
    msg = raises_one_line(InputError, build, "painn", species="Cu", cutoff=4.0)
    assert "species" in msg and "list of integers" in msg
    msg = raises_one_line(InputError, build, "lj", sigma="big", epsilon=EPS, cutoff=RC)
    assert "sigma" in msg and "number" in msg
    raises_one_line(InputError, build, "schnet", species=[29], num_interactions=2.5,
                    match="num_interactions")
    assert build("lj", sigma={"Ar": np.float64(SIGMA)}, epsilon=EPS, cutoff=8).cutoff == 8.0
    out = tmp_path / "run"
    cli_fails(capsys, ["train", f"data.datasets.0.path={emt_file}", f"output_dir={out}",
                       *TINY_TRAIN, "model.hyperparameters={num_basis: many}"],
              "num_basis='many'", "integer")
    assert not out.exists()


def test_frame_index_past_the_end(tmp_path, argon_file, capsys):
    for index in (99, "99", -3):
        msg = raises_one_line(DataFileError, read, argon_file, index=index)
        assert "has 2 frame(s)" in msg and str(index) in msg and str(argon_file) in msg
    msg = raises_one_line(DataFileError, read, argon_file, index="5:9")
    assert "which has 2 frame(s)" in msg
    assert len(read(argon_file, index=-2)) == 1
    out = tmp_path / "md"
    cli_fails(capsys, ["md", f"structure={argon_file}", "index=99", f"output.dir={out}",
                       *LJ_MD], "has 2 frame(s)", "index 99")
    assert not out.exists()


def test_truncated_checkpoints_and_model_files(tmp_path, emt_file, argon_file, capsys):
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.errors import ModelFileError
    from xnn.models.serialization import save_model

    run = tmp_path / "run"
    fake_training_run(run)
    cut = tmp_path / "cut.pt"
    cut.write_bytes((run / "checkpoints" / "last.pt").read_bytes()[:3000])
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={emt_file}",
                                          f"output_dir={tmp_path / 'new'}", f"resume={cut}",
                                          *TINY_TRAIN])
    msg = raises_one_line(ModelFileError, train, cfg)
    assert "truncated or corrupt" in msg and str(cut) in msg and "Errno" not in msg
    for key in ("resume", "pretrained"):
        cli_fails(capsys, ["train", f"data.datasets.0.path={emt_file}",
                           f"output_dir={tmp_path / 'new'}", f"{key}={cut}", *TINY_TRAIN],
                  str(cut), "truncated")
    md_out = tmp_path / "md"
    assert main(["md", f"structure={argon_file}", f"output.dir={md_out}", *LJ_MD]) == 0
    before = tree(md_out)
    (tmp_path / "md_cut.pt").write_bytes((md_out / "checkpoint.pt").read_bytes()[:2000])
    cli_fails(capsys, ["md", f"structure={argon_file}", f"output.dir={md_out}", *LJ_MD,
                       "steps=6", f"resume={tmp_path / 'md_cut.pt'}"], "md_cut.pt", "truncated")
    model = save_model(LennardJones(SIGMA, EPS, RC), tmp_path / "lj.pt")
    (tmp_path / "lj_cut.pt").write_bytes(model.read_bytes()[:1500])
    cli_fails(capsys, ["md", f"structure={argon_file}", f"model.file={tmp_path / 'lj_cut.pt'}",
                       f"output.dir={tmp_path / 'md2'}", *LJ_MD[4:]], "lj_cut.pt", "truncated")
    (tmp_path / "empty.pt").write_bytes(b"")
    cli_fails(capsys, ["eval", str(tmp_path / "empty.pt"), str(emt_file)], "empty")
    assert tree(md_out) == before and not (tmp_path / "md2").exists()
    assert not (tmp_path / "new").exists()


def test_training_checkpoint_given_as_model_file(tmp_path, argon_file, emt_file, capsys):
    run = tmp_path / "run"
    fake_training_run(run)
    ckpt = run / "checkpoints" / "last.pt"
    args = ["md", f"structure={argon_file}", f"model.file={ckpt}",
            f"output.dir={tmp_path / 'md'}", *LJ_MD[4:]]
    line = cli_fails(capsys, args, "training checkpoint", f"use {run / 'model.pt'}")
    assert "corrupt" not in line
    cli_fails(capsys, ["eval", str(ckpt), str(emt_file)], "training checkpoint", "model.pt")
    proc = run_cli(*args)  # a real process: exit code, one line, no escape codes
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "\x1b" not in proc.stderr
    assert not (tmp_path / "md").exists()


def test_cli_messages_are_one_plain_line(monkeypatch, capsys):
    from xnn.app import md as runner
    from xnn.errors import ModelFileError

    def fail(cfg):
        raise ModelFileError("torch says \x1b[1mdo not\x1b[0m\ntrust it")

    monkeypatch.setattr(runner, "run_md", fail)
    assert cli_fails(capsys, ["md", "model.name=lj"], "torch says") == \
        "xnn md: error: torch says do not trust it"
