"""``xnn relax`` checkpoints and exact resume: an interrupted relaxation (stopped by max_steps,
or crashed between checkpoints) continued with ``resume=`` ends bitwise identical to an
uninterrupted one (structures, FIRE state, relax.csv, trajectory); bad resumes fail clearly."""

from __future__ import annotations

import shutil

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.app.relax import run_relax
from xnn.cli.main import main
from xnn.config.loader import load_config
from xnn.config.md import MDConfig, RelaxConfig
from xnn.dynamics import fire
from xnn.errors import DataFileError, InputError
from xnn.io import md_checkpoint as ckpt

LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "model.skin=0.3", "output.progress=false"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def argon_file(tmp_path):
    """Two 32-atom Ar crystals: one barely rattled (converges early), one strongly rattled."""
    frames = []
    for i, amp in enumerate((0.006, 0.08)):
        frames.append(rattled_argon(a=5.25, amp=amp, seed=i))
    path = tmp_path / "ar.xyz"
    ase.io.write(path, frames)
    return path


def relax(tmp_path, argon_file, out, *extra, path=None):
    cfg = load_config(RelaxConfig, None, [f"structure={path or argon_file}", "index=:",
                                          f"output.dir={tmp_path / out}", *LJ, *extra])
    return run_relax(cfg)


def assert_same_run(a_dir, b_dir):
    a, meta_a = ckpt.load_checkpoint(a_dir / "checkpoint.pt", kind="relax")
    b, meta_b = ckpt.load_checkpoint(b_dir / "checkpoint.pt", kind="relax")
    assert a.step == b.step
    for k in a.graph.keys():
        assert torch.equal(a.graph[k], b.graph[k]), k
    for k in a.vars:
        assert torch.equal(a.vars[k], b.vars[k]), k
    assert torch.equal(a.forces, b.forces) and torch.equal(a.stress, b.stress)
    assert meta_a == meta_b
    for name in ("relax.csv", "relax_trajectory.xyz", "relaxed.xyz"):
        assert (a_dir / name).read_bytes() == (b_dir / name).read_bytes(), name
    return a, meta_a


@pytest.mark.parametrize("relax_cell", [False, True])
def test_resume_after_max_steps_is_bitwise(tmp_path, argon_file, relax_cell, monkeypatch):
    common = [f"relax_cell={str(relax_cell).lower()}", "fmax=0.003", "output.checkpoint_every=7",
              "output.trajectory_every=4", "output.log_every=2"]
    if relax_cell:
        common += ["pressure=0.05"]
    full = relax(tmp_path, argon_file, "full", "max_steps=40", *common)
    part = relax(tmp_path, argon_file, "part", "max_steps=28", *common)
    state, meta = ckpt.load_checkpoint(part / "checkpoint.pt", kind="relax")
    assert state.step == 28
    # system 0 converged during the first part (and is frozen since), system 1 did not
    assert meta["converged"] == [True, False]
    first = (part / "relax.csv").read_text().splitlines()[1].split(",")
    assert first[:2] == ["0", "0"] and float(first[3]) > 0.003
    calls, original = [], fire.step
    monkeypatch.setattr(fire, "step", lambda *a, **k: calls.append(1) or original(*a, **k))
    relax(tmp_path, argon_file, "part", "max_steps=40", f"resume={part / 'checkpoint.pt'}",
          *common)
    assert len(calls) == 12  # continued from step 28, not restarted
    final, _ = assert_same_run(full, part)
    assert final.step == 40
    moved = (final.graph.cell - ase_cell(argon_file)).abs().max()
    assert (moved > 1e-3) if relax_cell else (moved == 0)


def ase_cell(path):
    return torch.tensor(np.array([a.cell[:] for a in ase.io.read(path, ":")]))


def test_resume_after_crash_from_periodic_checkpoint(tmp_path, argon_file, monkeypatch):
    """A run killed at step 17 resumes from its step-14 checkpoint: rows and trajectory frames
    written after that checkpoint are cut away and written again."""
    common = ["relax_cell=true", "fmax=0.003", "max_steps=30", "output.checkpoint_every=7",
              "output.trajectory_every=3", "output.log_every=1"]
    full = relax(tmp_path, argon_file, "full", *common)
    original = fire.step

    def crash(state, *a, **k):
        if state.step == 17:
            raise KeyboardInterrupt
        return original(state, *a, **k)

    monkeypatch.setattr(fire, "step", crash)
    with pytest.raises(KeyboardInterrupt):
        relax(tmp_path, argon_file, "part", *common)
    monkeypatch.setattr(fire, "step", original)
    part = tmp_path / "part"
    assert ckpt.load_checkpoint(part / "checkpoint.pt")[0].step == 14
    assert "\n17,1," in (part / "relax.csv").read_text()  # written after the checkpoint
    rc = main(["relax", f"structure={argon_file}", "index=:", f"output.dir={part}", *LJ,
               *common, f"resume={part / 'checkpoint.pt'}"])
    assert rc == 0
    assert_same_run(full, part)


def test_resume_errors(tmp_path, argon_file):
    run = relax(tmp_path, argon_file, "r", "max_steps=3", "relax_cell=true")
    good = run / "checkpoint.pt"
    # an MD checkpoint is not a relax checkpoint, and the other way round
    md_out = run_md(load_config(MDConfig, None, [
        f"structure={argon_file}", f"output.dir={tmp_path / 'md'}", *LJ, "ensemble=nve",
        "temperature=10", "steps=2", "output.plot=false"]))
    with pytest.raises(DataFileError, match="is an xnn md checkpoint, not an xnn relax"):
        relax(tmp_path, argon_file, "r2", f"resume={md_out / 'checkpoint.pt'}")
    with pytest.raises(DataFileError, match="is an xnn relax checkpoint, not an xnn md"):
        run_md(load_config(MDConfig, None, [
            f"structure={argon_file}", f"output.dir={tmp_path / 'md'}", *LJ,
            "ensemble=nve", "steps=4", f"resume={good}"]))
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    with pytest.raises(DataFileError, match="not a readable xnn relax checkpoint"):
        relax(tmp_path, argon_file, "r3", f"resume={junk}")
    # a different number of structures, or different atoms
    with pytest.raises(InputError, match="holds 2 structures .* selects 1"):
        relax(tmp_path, argon_file, "r", "index=0", "relax_cell=true", f"resume={good}")
    other = tmp_path / "other.xyz"
    ase.io.write(other, [bulk("Ar", "fcc", a=5.25, cubic=True)] * 2)
    with pytest.raises(InputError, match="holds 2 structures \\(64 atoms\\).* 2 \\(8 atoms\\)"):
        relax(tmp_path, argon_file, "r", "relax_cell=true", f"resume={good}", path=other)
    # other settings than the checkpointed run
    with pytest.raises(InputError, match="written with relax_cell=True"):
        relax(tmp_path, argon_file, "r", f"resume={good}")
    # the output files the checkpoint refers to are gone
    shutil.copy(good, tmp_path / "moved.pt")
    (run / "relax.csv").unlink()
    with pytest.raises(DataFileError, match="cannot resume: .*relax.csv is missing"):
        relax(tmp_path, argon_file, "r", "relax_cell=true", f"resume={tmp_path / 'moved.pt'}")
