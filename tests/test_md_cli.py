"""``xnn md`` / ``xnn relax``: outputs, bitwise-exact resume, safety stops, clear errors."""

from __future__ import annotations

import csv

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.app.relax import run_relax
from xnn.cli.main import main
from xnn.config.loader import ConfigError, load_config
from xnn.config.md import MDConfig
from xnn.dynamics.safety import SimulationError
from xnn.errors import InputError, ModelFileError, UnknownSpeciesError
from xnn.io import md_checkpoint as ckpt
from xnn.io.trajectory import read_hdf5_trajectory

LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "output.progress=false"]


# small MD systems: one thread avoids thread overhead on small CPU tensors
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def argon_file(tmp_path):
    frames = []
    for i in range(2):
        frames.append(rattled_argon(seed=i))
    path = tmp_path / "ar.xyz"
    ase.io.write(path, frames)
    return path


def md(tmp_path, argon_file, out, *extra):
    cfg = load_config(MDConfig, None, [f"structure={argon_file}", "index=:",
                                       f"output.dir={tmp_path / out}", *LJ, *extra])
    return run_md(cfg)


@pytest.mark.parametrize("ensemble,fmt", [("langevin", "extxyz"), ("npt", "hdf5")])
def test_resume_is_bitwise_identical(tmp_path, argon_file, ensemble, fmt, monkeypatch):
    """A resumed run writes the files of an uninterrupted one, also after a torn last frame
    and log row (cut back to the sizes the checkpoint recorded)."""
    common = [f"ensemble={ensemble}", "temperature=40", "temperatures=[30,50]", "timestep=5",
              "output.trajectory_every=5", "output.log_every=5", "output.checkpoint_every=10",
              f"output.trajectory_format={fmt}", "output.plot=false"]
    if ensemble == "npt":
        common += ["pressure=0.05", "barostat.tau_p=200", "barostat.anisotropic=true"]
    full = md(tmp_path, argon_file, "full", "steps=30", *common)
    part = md(tmp_path, argon_file, "part", "steps=20", *common)
    from xnn.dynamics.registry import get_integrator

    if fmt == "extxyz":  # killed after the checkpoint, while writing step 25: torn tails
        text = (part / "trajectory.xyz").read_text()
        with open(part / "trajectory.xyz", "a") as fh:
            fh.write(text[: len(text) // 3])
        with open(part / "thermo.csv", "a") as fh:
            fh.write("25,0,-1.2")
    mod, calls = get_integrator(ensemble), []
    original = mod.step
    monkeypatch.setattr(mod, "step", lambda *a, **k: calls.append(1) or original(*a, **k))
    md(tmp_path, argon_file, "part", "steps=30", f"resume={part / 'checkpoint.pt'}", *common)
    assert len(calls) == 10  # continued from step 20, not restarted
    a, meta_a = ckpt.load_checkpoint(full / "checkpoint.pt")
    b, meta_b = ckpt.load_checkpoint(part / "checkpoint.pt")
    assert a.step == b.step == 30
    for k in a.graph.keys():
        assert torch.equal(a.graph[k], b.graph[k]), k
    for k in a.vars:
        assert torch.equal(a.vars[k], b.vars[k]), k
    assert torch.equal(a.forces, b.forces) and torch.equal(a.rng, b.rng)
    assert (full / "thermo.csv").read_bytes() == (part / "thermo.csv").read_bytes()
    if fmt == "extxyz":
        assert (full / "trajectory.xyz").read_bytes() == (part / "trajectory.xyz").read_bytes()
        frames = ase.io.read(full / "trajectory.xyz", ":")
        assert len(frames) == 2 * 7 and frames[-1].info["step"] == 30
    else:
        ta = read_hdf5_trajectory(full / "trajectory.h5")
        tb = read_hdf5_trajectory(part / "trajectory.h5")
        assert ta["positions"].shape == (7, 64, 3)
        for k in ta:
            np.testing.assert_array_equal(ta[k], tb[k])
    rows = list(csv.DictReader(open(full / "thermo.csv")))
    assert len(rows) == 2 * 7 and rows[-1]["step"] == "30"


def test_outputs_and_thermo_log(tmp_path, argon_file):
    out = md(tmp_path, argon_file, "o", "ensemble=csvr", "temperature=40", "steps=20",
             "timestep=5", "output.trajectory_every=10", "output.log_every=10")
    for name in ("config.yaml", "thermo.csv", "thermo.png", "trajectory.xyz", "checkpoint.pt"):
        assert (out / name).is_file(), name
    rows = list(csv.DictReader(open(out / "thermo.csv")))
    assert [r["step"] for r in rows] == ["0", "0", "10", "10", "20", "20"]
    r = rows[-1]
    assert abs(float(r["etot_eV"]) - float(r["epot_eV"]) - float(r["ekin_eV"])) < 1e-12
    assert float(r["volume_A3"]) == pytest.approx(10.6**3)
    assert float(r["time_fs"]) == 100.0


def test_cli_md_and_relax(tmp_path, argon_file, capsys):
    rc = main(["md", f"structure={argon_file}", f"output.dir={tmp_path / 'cli'}", *LJ,
               "ensemble=nve", "steps=5", "output.plot=false", "temperature=20"])
    assert rc == 0 and (tmp_path / "cli" / "thermo.csv").is_file()
    rc = main(["relax", f"structure={argon_file}", "index=:", f"output.dir={tmp_path / 'rx'}",
               *LJ, "fmax=0.002", "relax_cell=true", "pressure=0.1"])
    assert rc == 0
    relaxed = ase.io.read(tmp_path / "rx" / "relaxed.xyz", ":")
    assert len(relaxed) == 2
    for a in relaxed:
        assert np.abs(a.get_forces()).max() < 0.002
        # cell forces V (σ + P₀) / N_atoms < fmax: |σ + P₀| < 0.002 * 32 / 1190 eV/Å³ = 0.009 GPa
        stress_gpa = a.get_stress(voigt=False).diagonal() * 160.21766
        assert stress_gpa == pytest.approx([-0.1] * 3, abs=0.01)


def test_run_relax_api(tmp_path, argon_file):
    out = run_relax(load_config(__import__("xnn.config.md", fromlist=["RelaxConfig"]).RelaxConfig,
                                None, [f"structure={argon_file}", f"output.dir={tmp_path / 'r'}",
                                       *LJ, "fmax=0.005"]))
    a = ase.io.read(out / "relaxed.xyz")
    assert np.abs(a.get_forces()).max() < 0.005


def test_safety_atoms_too_close(tmp_path):
    """Two atoms fly at each other through a very weak LJ: stopped when closer than 1 Å."""
    from ase import Atoms, units

    a = Atoms("Ar4", positions=[[0, 0, 0], [2.5, 0, 0], [0, 5, 0], [0, 0, 5]],
              cell=[10, 10, 10], pbc=True)
    a.set_velocities(np.array([[0.05, 0, 0], [-0.05, 0, 0], [0, 0, 0], [0, 0, 0]]) / units.fs)
    path = tmp_path / "close.xyz"
    ase.io.write(path, a)
    cfg = load_config(MDConfig, None, [f"structure={path}", f"output.dir={tmp_path / 's'}", *LJ,
                                       "model.hyperparameters.epsilon=1e-6", "ensemble=nve",
                                       "temperature=10", "steps=50", "timestep=2",
                                       "safety.min_distance=1.0", "safety.max_temperature=1e9",
                                       "output.checkpoint_every=0"])
    with pytest.raises(SimulationError, match=r"step (\d+): atoms \(atom_id\) \[[01], [01]\]") as e:
        run_md(cfg)
    step = int(str(e.value).split(":")[0].split()[1])
    assert 7 <= step <= 9  # 1.5 Å to close at a relative speed of 0.1 Å/fs: 15 fs = 7.5 steps
    assert "last_good.xyz" in str(e.value)
    assert (tmp_path / "s" / "last_good.xyz").is_file()
    state, _ = ckpt.load_checkpoint(tmp_path / "s" / "checkpoint_last_good.pt")
    assert state.step == step - 1


def test_safety_initial_structure(tmp_path):
    a = bulk("Ar", "fcc", a=5.3, cubic=True)
    a.positions[1] = a.positions[0] + [0.6, 0, 0]
    path = tmp_path / "bad.xyz"
    ase.io.write(path, a)
    cfg = load_config(MDConfig, None, [f"structure={path}", f"output.dir={tmp_path / 'b'}", *LJ,
                                       "ensemble=nve", "temperature=10", "steps=5"])
    msg = r"initial structure is unsafe: step 0: force above .* \[0, 1\]"
    with pytest.raises(SimulationError, match=msg):
        run_md(cfg)


def test_safety_temperature_blowup_and_cli_message(tmp_path, argon_file, capsys):
    rc = main(["md", f"structure={argon_file}", f"output.dir={tmp_path / 'hot'}", *LJ,
               "ensemble=nve", "steps=20", "temperature=10", "initial_temperature=3000"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "step 1: temperature of system 0" in err and "Traceback" not in err
    assert (tmp_path / "hot" / "last_good.xyz").is_file()


@pytest.mark.parametrize("override,error,match", [
    ("ensemble=nvt_magic", ConfigError, "not a valid choice"),
    ("temperature=-5", ConfigError, "temperature"),
    ("timestep=-1", ConfigError, "timestep"),
    ("timestep=0", ConfigError, "timestep"),
])
def test_bad_config(tmp_path, argon_file, override, error, match):
    with pytest.raises(error, match=match):
        md(tmp_path, argon_file, "bad", override)


def test_pressure_without_periodic_cell(tmp_path):
    path = tmp_path / "h2o.xyz"
    ase.io.write(path, molecule("H2O"))
    with pytest.raises(InputError, match="periodic"):
        run_md(load_config(MDConfig, None, [f"structure={path}", f"output.dir={tmp_path / 'p'}",
                                            *LJ, "ensemble=npt", "pressure=1"]))
    with pytest.raises(ConfigError, match="needs a target pressure"):
        load_config(MDConfig, None, ["ensemble=npt"])


def test_model_file_that_is_not_a_model(tmp_path, argon_file):
    bad = tmp_path / "model.pt"
    bad.write_text("this is not a model")
    with pytest.raises(ModelFileError):
        run_md(load_config(MDConfig, None, [f"structure={argon_file}", f"model.file={bad}",
                                            f"output.dir={tmp_path / 'm'}"]))
    with pytest.raises(ModelFileError, match="does not exist"):
        run_md(load_config(MDConfig, None, [f"structure={argon_file}",
                                            f"model.file={tmp_path / 'missing.pt'}"]))


def test_unknown_species(tmp_path):
    path = tmp_path / "cu.xyz"
    ase.io.write(path, bulk("Cu", "fcc", a=3.6, cubic=True))
    with pytest.raises(UnknownSpeciesError, match="Cu"):
        run_md(load_config(MDConfig, None, [f"structure={path}", f"output.dir={tmp_path / 'u'}",
                                            *LJ, "model.species=[Ar]"]))


def test_missing_masses():
    from xnn.data import AtomicGraph
    from xnn.dynamics import nve
    from xnn.models import Potential, build

    g = AtomicGraph.from_arrays(np.eye(3) * 3, [18] * 3, masses=[39.9, 0.0, 39.9])
    with pytest.raises(InputError, match="mass"):
        nve.init(g, Potential(build("lj", sigma=3.4, epsilon=0.01, cutoff=6.0)))


@pytest.mark.parametrize("name", ["md_nvt.yaml", "md_npt_lj_argon.yaml", "md_relax.yaml"])
def test_examples_load_and_run(tmp_path, argon_file, name):
    from pathlib import Path

    from xnn.config.md import RelaxConfig

    path = Path(__file__).resolve().parents[1] / "examples" / name
    over = [f"structure={argon_file}", f"output.dir={tmp_path / 'ex'}", "output.progress=false"]
    if name in ("md_nvt.yaml", "md_relax.yaml"):  # they name a model file: use LJ instead
        over += ["model.file=null", *LJ[:4]]
    if name == "md_relax.yaml":
        out = run_relax(load_config(RelaxConfig, path, over + ["max_steps=3"]))
        assert (out / "relaxed.xyz").is_file()
        return
    out = run_md(load_config(MDConfig, path, over + ["steps=3", "output.plot=false"]))
    assert (out / "thermo.csv").is_file()


def test_demo_md_with_a_model_file(tmp_path, argon_file):
    from xnn.app.demo import demo_md
    from xnn.models.serialization import save_model

    model_file = tmp_path / "lj.pt"
    save_model(build_lj(), model_file)
    out = demo_md(model_file, argon_file, tmp_path / "demo", temperature=40, steps=20,
                  timestep=5, device="cpu")
    assert (out / "thermo.png").is_file() and (out / "trajectory.xyz").is_file()
    rows = list(csv.DictReader(open(out / "thermo.csv")))
    assert rows[-1]["step"] == "20"
    # a second `make demo` into the same folder replaces the MD run, as it does the training
    again = demo_md(model_file, argon_file, tmp_path / "demo", temperature=40, steps=10,
                    timestep=5, device="cpu")
    rows = list(csv.DictReader(open(again / "thermo.csv")))
    assert rows[-1]["step"] == "10"


def build_lj():
    from xnn.models import build

    return build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5)


def test_fixed_atoms_from_structure_file(tmp_path):
    from ase.constraints import FixAtoms

    a = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(2)
    a.set_constraint(FixAtoms(indices=[0, 3]))
    path = tmp_path / "fixed.xyz"
    ase.io.write(path, a)
    out = md(tmp_path, path, "fx", "ensemble=langevin", "temperature=50", "steps=10",
             "output.plot=false")
    state, _ = ckpt.load_checkpoint(out / "checkpoint.pt")
    assert state.graph.fixed.nonzero().flatten().tolist() == [0, 3]
    assert np.allclose(state.positions[[0, 3]].numpy(), a.positions[[0, 3]], atol=0)
    assert not np.allclose(state.positions[1].numpy(), a.positions[1])
