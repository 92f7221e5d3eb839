"""Runs that used to give silent results, and the files a run writes (issue 15, items 7-8):
unlabelled eval data, coincident atoms, MD without kinetic degrees of freedom, zero-size
models, energy drift; umask, fsync, stale temporaries, atomic log rewrites, metrics rows
after the checkpoint that holds them."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.io import write as ase_write
from error_helpers import raises_one_line

import xnn
from xnn.cli.main import main
from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.errors import DataFileError, InputError
from xnn.models import build
from xnn.models.serialization import save_model

LJ = {"sigma": 3.405, "epsilon": 0.0104, "cutoff": 8.5}
LJ_PARAMS = ["model.hyperparameters={sigma: 3.405, epsilon: 0.0104}", "model.cutoff=8.5"]
TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def run_cli(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def md_args(structure, out, *extra) -> list[str]:
    return [f"structure={structure}", "model.name=lj", *LJ_PARAMS, "model.device=cpu",
            f"output.dir={out}", "output.progress=false", "output.plot=false", *extra]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("emt") / "cu.xyz"
    write_emt(path, 12, ["Cu"], seed=0)
    return path


def tiny(out, data, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", "model.cutoff=3.0", TINY,
        "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=3", "logging.plots=false",
        "logging.progress_bar=false", "device=cpu", *extra])


# =========================================================================== item 7
def test_eval_of_unlabelled_data_fails_with_a_hint(tmp_path, capsys):
    model = save_model(build("schnet", species=[18], cutoff=5.0, num_features=8,
                             num_filters=8, num_interactions=1, num_basis=8), tmp_path / "m.pt")
    atoms = bulk("Ar", "fcc", a=5.3, cubic=True)
    ase_write(tmp_path / "nolabels.xyz", atoms)
    before = sorted(p.name for p in tmp_path.iterdir())
    code, err = run_cli(["eval", model, tmp_path / "nolabels.xyz", "--device", "cpu"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds no energy, forces or stress label" in err and "--energy-key" in err, err
    assert "xnn.Calculator" in err
    after = sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".xnn-index.npz"))
    assert after == before  # no empty parity plot (the source's stored index is a cache)
    # labelled data: a table (a model with buffers only, LJ, once failed with StopIteration)
    from ase.calculators.lj import LennardJones as AseLJ
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.positions += np.random.default_rng(0).normal(0, 0.05, atoms.positions.shape)
    atoms.calc = AseLJ(sigma=LJ["sigma"], epsilon=LJ["epsilon"], rc=LJ["cutoff"])
    e, f = atoms.get_potential_energy(), atoms.get_forces()
    atoms.calc = SinglePointCalculator(atoms, energy=e + 1.0, forces=f)
    ase_write(tmp_path / "labelled.xyz", atoms)
    lj = save_model(build("lj", **LJ), tmp_path / "lj.pt")
    code, _ = run_cli(["eval", lj, tmp_path / "labelled.xyz", "--device", "cpu"])
    table = capsys.readouterr().out
    assert code == 0 and "energy" in table and "forces" in table, table


@pytest.mark.parametrize("name", ["lj", "schnet"])
def test_calculator_refuses_coincident_atoms(name):
    model = build("lj", **LJ) if name == "lj" else build("schnet", species=[18], cutoff=5.0,
                                                          num_features=8, num_filters=8,
                                                          num_interactions=1, num_basis=8)
    calc = xnn.Calculator(model, device="cpu")
    atoms = Atoms("Ar3", positions=[[0, 0, 0], [3.7, 0, 0], [3.7, 0, 0]], cell=[12] * 3,
                  pbc=True)
    atoms.calc = calc
    msg = raises_one_line(InputError, atoms.get_potential_energy, match="atoms 1 and 2 are 0 Å")
    assert "min_distance=0" in msg
    # 0.05 Å from another atom's periodic image
    atoms.positions[2] = [11.95, 0, 0]
    raises_one_line(InputError, atoms.get_potential_energy, match="atoms 0 and 2 are 0.05 Å")
    # physical structures pass; min_distance=0 evaluates anyway
    atoms.positions[2] = [0, 3.7, 0]
    assert np.isfinite(atoms.get_potential_energy())
    far = Atoms("Ar2", positions=[[0, 0, 0], [0.05, 0, 0]], cell=[12] * 3, pbc=True)
    far.calc = xnn.Calculator(model, device="cpu", min_distance=0.0)
    far.get_potential_energy()


def test_training_data_with_coincident_atoms_is_refused(tmp_path, data):
    from ase.io import read

    frames = read(data, ":")
    frames[5].positions[3] = frames[5].positions[1]
    bad = tmp_path / "bad.xyz"
    ase_write(bad, frames)
    from xnn.app.train_data import build_splits

    cfg = tiny(tmp_path / "run", bad)
    msg = raises_one_line(DataFileError, build_splits, cfg.data, cfg.loss, 3.0, 0)
    assert f"structure 5 of {str(bad)!r}: atoms 1 and 3 are 0 Å apart" in msg, msg
    code, err = run_cli(["train", f"data.datasets.0.path={bad}", f"output_dir={tmp_path / 'r'}",
                         "device=cpu"])
    assert code == 2 and "structure 5 of" in err, err


def test_md_without_kinetic_degrees_of_freedom_is_refused(tmp_path):
    from xnn.app.md import run_md

    one = tmp_path / "one.xyz"
    ase_write(one, Atoms("Ar", positions=[[0, 0, 0]], cell=[10] * 3, pbc=True))
    for ensemble in ("langevin", "csvr", "nve"):
        msg = raises_one_line(InputError, run_md, None, md_args(one, tmp_path / ensemble,
                                                         f"ensemble={ensemble}", "steps=2"))
        assert "system 0 has no kinetic degrees of freedom (1 atom" in msg, msg
        assert "300 K" in msg
    # every atom fixed
    from ase.constraints import FixAtoms

    pair = Atoms("Ar2", positions=[[0, 0, 0], [3.8, 0, 0]], cell=[10] * 3, pbc=True)
    pair.set_constraint(FixAtoms(indices=[0, 1]))
    ase_write(tmp_path / "fixed.xyz", pair)
    raises_one_line(InputError, run_md, None, md_args(tmp_path / "fixed.xyz", tmp_path / "f",
                                               "steps=2"), match="all its atoms are fixed")
    # asked for 0 K, it runs (an isolated atom in NVE)
    run_md(None, md_args(one, tmp_path / "ok", "ensemble=nve", "temperature=0", "steps=2"))


@pytest.mark.parametrize("name,hp,key", [
    ("schnet", {"num_features": 0}, "num_features"),
    ("schnet", {"num_features": 1}, "num_features"),  # its readout would be 0 wide
    ("schnet", {"num_filters": 0}, "num_filters"),
    ("schnet", {"num_interactions": 0}, "num_interactions"),
    ("painn", {"num_features": 0}, "num_features"),
    ("painn", {"num_basis": -2}, "num_basis"),
    ("equivariant", {"readout_hidden": -1}, "readout_hidden"),  # 0 is a linear readout
    ("equivariant", {"radial_mlp": [16, 0]}, "radial_mlp"),
    ("equivariant", {"num_bessel": 0}, "num_bessel"),
])
def test_zero_size_models_are_refused(name, hp, key):
    msg = raises_one_line(InputError, build, name, species=[29], **hp)
    assert f"{name}: {key}=" in msg and ">=" in msg, msg


def test_zero_sigma_lj_is_refused():
    raises_one_line(InputError, build, "lj", sigma=0.0, epsilon=0.01, cutoff=5.0, match="sigma > 0")


def test_drift_monitor_measures_per_atom_per_ps():
    from xnn.dynamics.safety import DriftMonitor, DriftWarning

    mon = DriftMonitor(1e-3, torch.tensor([10, 100]))
    assert mon.update(0.0, torch.tensor([-5.0, -50.0])) is None
    # 0.005 eV/atom after 100 fs: judged against max_drift x 1 ps = 0.001 eV/atom -> warns
    with pytest.warns(DriftWarning, match=r"system 0 drifted by 0.005 eV/atom in 0.1 ps"):
        assert mon.update(100.0, torch.tensor([-4.95, -50.0])) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mon.update(200.0, torch.tensor([0.0, 0.0])) is None  # once only
    quiet = DriftMonitor(1e-3, torch.tensor([100]))
    quiet.update(0.0, torch.tensor([1.0]))
    assert quiet.update(500.0, torch.tensor([1.09])) is None  # 0.0009 eV/atom: within bound
    with pytest.warns(DriftWarning, match="0.00125 eV/atom/ps"):  # 0.005 eV/atom in 4 ps
        assert quiet.update(4000.0, torch.tensor([1.5])) is not None


def test_md_warns_once_when_energy_drifts(tmp_path):
    from xnn.app.md import run_md
    from xnn.dynamics.safety import DriftWarning

    ar = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(3)
    ar.positions += np.random.default_rng(0).normal(0, 0.03, ar.positions.shape)
    ase_write(tmp_path / "ar.xyz", ar)
    common = ("ensemble=nve", "temperature=300", "output.trajectory_every=0",
              "output.log_every=1", "safety.max_force=1e6", "safety.min_distance=0")
    with pytest.warns(DriftWarning) as record:
        run_md(None, md_args(tmp_path / "ar.xyz", tmp_path / "bad", "timestep=50",
                             "steps=40", *common))
    drift = [w for w in record if issubclass(w.category, DriftWarning)]
    assert len(drift) == 1, [str(w.message) for w in drift]
    assert "eV/atom/ps, above safety.max_drift=0.001" in str(drift[0].message)
    with warnings.catch_warnings():  # a good time step: no warning
        warnings.simplefilter("error", DriftWarning)
        run_md(None, md_args(tmp_path / "ar.xyz", tmp_path / "good", "timestep=5",
                             "steps=200", *common))


# =========================================================================== item 8
@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _md_state():
    from xnn.data.ase_io import from_ase
    from xnn.dynamics import nve
    from xnn.models import Potential

    g = from_ase(bulk("Ar", "fcc", a=5.3, cubic=True), energy_key=None, forces_key=None,
                 stress_key=None, virial_key=None, dtype=torch.float64)
    pot = Potential(build("lj", **LJ).double())
    return nve.init(g, pot), pot


def _writers(tmp_path):
    from xnn.io.md_checkpoint import save_checkpoint as save_md
    from xnn.io.train_checkpoint import save_checkpoint as save_train

    state, pot = _md_state()
    return {
        "model.pt": lambda p: save_model(build("lj", **LJ), p),
        "checkpoint.pt": lambda p: save_md(p, state, {"kind": "md"}, pot),
        "last.pt": lambda p: save_train({"progress": {"step": 1}}, p),
    }


def test_written_files_follow_the_umask_and_are_fsynced(tmp_path, umask_022, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for name, write in _writers(tmp_path).items():
        synced.clear()
        write(tmp_path / name)
        mode = stat.S_IMODE((tmp_path / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))  # mkstemp made model files 0600
        assert synced == [False, True], (name, synced)  # the file, then its folder
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(_writers(tmp_path))


def test_a_stale_temporary_of_a_killed_write_is_replaced(tmp_path):
    for name, write in _writers(tmp_path).items():
        stale = tmp_path / f".{name}.tmp"
        stale.write_bytes(b"PK\x03\x04 half a file from a write killed by SIGKILL")
        stale.chmod(0o444)
        write(tmp_path / name)
        assert not stale.exists(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(_writers(tmp_path))
    xnn.load_model(tmp_path / "model.pt")


def _disk_full(monkeypatch):
    """Writes of whole files stop half way with ENOSPC."""
    real = Path.write_bytes

    def half(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half)


def test_thermo_log_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    from xnn.io.thermo import ThermoLog

    path = tmp_path / "thermo.csv"
    log = ThermoLog(path)
    for step in range(4):
        log.write(step, 1.0, {k: torch.tensor([float(step)]) for k in (
            "temperature_K", "epot_eV", "ekin_eV", "etot_eV", "pressure_GPa", "volume_A3",
            "conserved_eV")})
    before = sha(path)
    _disk_full(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        ThermoLog(path, truncate_to=2)
    monkeypatch.undo()
    assert sha(path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["thermo.csv"]
    ThermoLog(path, truncate_to=2)
    assert len(path.read_text().splitlines()) == 3


def test_metrics_csv_rewrite_on_resume_is_atomic(tmp_path, monkeypatch):
    from xnn.io.train_log import RunLogger

    logger = RunLogger(tmp_path, True, progress_bar=False, stream=io.StringIO())
    rows = [{"epoch": e, "step": 3 * e, "train_loss": 1.0 / e} for e in (1, 2, 3)]
    for row in rows:
        logger.epoch(row)
    before = sha(tmp_path / "metrics.csv")
    _disk_full(monkeypatch)
    with pytest.raises(OSError, match="No space"):
        RunLogger(tmp_path, True, progress_bar=False).restore_csv(rows[:2])
    monkeypatch.undo()
    assert sha(tmp_path / "metrics.csv") == before
    again = RunLogger(tmp_path, True, progress_bar=False, stream=io.StringIO())
    again.restore_csv(rows[:2])
    again.epoch(rows[2])
    assert sha(tmp_path / "metrics.csv") == before  # the same bytes as the uninterrupted log


def _epochs(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(r["epoch"]) for r in csv.DictReader(f)]


def test_metrics_row_comes_after_its_checkpoint(tmp_path, data, monkeypatch):
    """A run killed while writing the checkpoint of epoch 2, then resumed: metrics.csv holds
    each epoch once, as in an uninterrupted run (the row was written before the checkpoint,
    so the resumed run wrote epoch 2 again)."""
    import xnn.app.train as app_train
    from xnn.app.train import train

    train(tiny(tmp_path / "full", data))
    real = app_train.save_checkpoint

    def killed_at_epoch_2(payload, path):
        if payload["progress"]["epoch"] == 2 and Path(path).name == "last.pt":
            raise KeyboardInterrupt  # SIGKILL during the write: the old checkpoint stays
        return real(payload, path)

    monkeypatch.setattr(app_train, "save_checkpoint", killed_at_epoch_2)
    with pytest.raises(KeyboardInterrupt):
        train(tiny(tmp_path / "part", data))
    monkeypatch.undo()
    assert _epochs(tmp_path / "part/metrics.csv") == [1]
    train(tiny(tmp_path / "part", data, "resume=auto"))
    assert _epochs(tmp_path / "part/metrics.csv") == _epochs(tmp_path / "full/metrics.csv") \
        == [1, 2, 3]
    # and the same numbers (but the wall time)
    full, part = ([{k: v for k, v in r.items() if k != "time_s"}
                   for r in csv.DictReader(open(tmp_path / d / "metrics.csv", newline=""))]
                  for d in ("full", "part"))
    assert full == part
