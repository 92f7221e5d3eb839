"""``xnn run``: multi-stage batched workflows with in-flight refill (issue 21, item 3).

LJ argon clusters (5-12 atoms) through relax -> NVT: 200 of them with 16 slots; a campaign
killed with SIGKILL and resumed gives the uninterrupted run's table, trajectories and final
structures; a batched run equals each system run alone (fp64, <= 1e-10) for relax, Langevin,
CSVR, NVE and NPT stages; the slot primitives keep each system's own trajectory.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from xnn.app.workflow import run_workflow
from xnn.config.loader import ConfigError, load_config
from xnn.config.workflow import WorkflowConfig
from xnn.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "workflow" / "workflow.yaml"
LJ = {"sigma": 3.405, "epsilon": 0.0104, "cutoff": 8.0}
LJ_HP = {k: v for k, v in LJ.items() if k != "cutoff"}  # model.hyperparameters
LJ_MODEL = ["model.name=lj", f"model.hyperparameters={LJ_HP}", f"model.cutoff={LJ['cutoff']}"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _clusters(n: int, seed: int = 0) -> list:
    spec = importlib.util.spec_from_file_location(
        "make_clusters", ROOT / "examples" / "workflow" / "make_clusters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.clusters(n, seed)


def _write(path: Path, frames) -> Path:
    import ase.io

    ase.io.write(path, frames, format="extxyz")
    return path


def _rows(folder: Path) -> dict:
    """``{(id, stage): row}`` of results.csv, without the wall time; refuses duplicates."""
    with open(folder / "results.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = {}
    for r in rows:
        key = (int(r["id"]), r["stage"])
        assert key not in out, f"system {key[0]} ran stage {key[1]} twice"
        out[key] = {k: v for k, v in r.items() if k != "wall_s"}
    return out


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    """The example workflow on 200 clusters, uninterrupted (16 slots)."""
    d = tmp_path_factory.mktemp("wf")
    structure = _write(d / "clusters.xyz", _clusters(200))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        out = run_workflow(str(EXAMPLE), [f"structure={structure}", f"output.dir={d / 'full'}",
                                          "output.progress=false", "output.log_every=10"])
    return structure, out, log.getvalue()


def test_200_structures_relax_then_nvt_with_refill(campaign):
    """Every system relaxes to fmax < 0.01 eV/Å below its starting energy, then runs 40 NVT
    steps at 40 K; finished systems are replaced while others still relax (rows of both
    stages interleave), and each system's trajectory holds both stages."""
    import ase.io

    structure, out, log = campaign
    rows = _rows(out)
    assert len(rows) == 400 and {i for i, _ in rows} == set(range(200))
    order = [(int(r["id"]), r["stage"]) for r in csv.DictReader(open(out / "results.csv"))]
    assert order == [(i, s) for i in range(200) for s in ("relax", "nvt")]  # id order at the end
    # refill: 16 in flight, some in nvt, while fewer than 150 systems had started
    lines = re.findall(r"step \d+: 16 in flight \(relax (\d+), nvt (\d+)\); \d+/400 stages "
                       r"done, (\d+)/200 systems started", log)
    assert any(int(nvt) > 0 and int(started) < 150 for _, nvt, started in lines), log
    start = ase.io.read(structure, index=":")
    e0 = []
    from xnn.data.ase_io import from_ase
    from xnn.models import build
    from xnn.models.potential import Potential

    pot = Potential(build("lj", **LJ).double())
    for atoms in start[:20]:
        e0.append(float(pot(from_ase([atoms], dtype=torch.float64))["energy"][0]))
    for i in range(200):
        relax, nvt = rows[(i, "relax")], rows[(i, "nvt")]
        assert relax["converged"] == "True" and float(relax["fmax_eV_A"]) < 0.01
        assert nvt["steps"] == "40" and nvt["status"] == "ok"
        if i < 20:
            assert float(relax["energy_eV"]) < e0[i]
    temps = [float(rows[(i, "nvt")]["temperature_K"]) for i in range(200)]
    assert 34.0 < np.mean(temps) < 46.0  # Langevin at 40 K, 4 friction times
    frames = ase.io.read(out / "trajectories" / "sys_00007.xyz", index=":")
    stages = [f.info["stage"] for f in frames]
    assert stages[0] == "relax" and stages[-1] == "nvt" and frames[-1].info["step"] == 40
    assert all(f.info["system_id"] == 7 for f in frames)
    final = ase.io.read(out / "final.xyz", index=":")
    assert len(final) == 200 and len(final[7]) == len(start[7])
    np.testing.assert_array_equal(final[7].positions, frames[-1].positions)


def test_kill_9_and_resume_equals_uninterrupted(campaign, tmp_path):
    """SIGKILL mid-campaign (after some stages completed), resume: the same results table
    (bitwise), trajectories and final structures as the uninterrupted run, no stage twice."""
    structure, full, _ = campaign
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "xnn", "run", str(EXAMPLE), f"structure={structure}",
           f"output.dir={out}", "output.progress=false", "output.checkpoint_every=7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None:
            res = out / "results.csv"
            if res.is_file() and res.read_text().count("\n") > 120:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the campaign ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    n_killed = len(_rows(out))
    assert 120 <= n_killed < 400
    done = subprocess.run(cmd + [f"resume={out / 'checkpoint.pt'}"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "resumed at batch step" in done.stdout
    assert _rows(out) == _rows(full)
    for name in ("sys_00000.xyz", "sys_00100.xyz", "sys_00199.xyz"):
        assert (out / "trajectories" / name).read_bytes() == \
            (full / "trajectories" / name).read_bytes()
    assert (out / "final.xyz").read_bytes() == (full / "final.xyz").read_bytes()
    with pytest.raises(InputError, match="other settings"):
        run_workflow(str(EXAMPLE), [f"structure={structure}", f"output.dir={out}",
                                    "seed=1", f"resume={out / 'checkpoint.pt'}"])


def _stage_rows(folder: Path) -> dict:
    return {k: {c: float(v) for c, v in r.items() if c.endswith(("_eV", "_A", "_K", "_A3"))
                or c == "steps"} | {"status": r["status"]} for k, r in _rows(folder).items()}


def _compare(a: Path, b: Path) -> None:
    import ase.io

    ra, rb = _stage_rows(a), _stage_rows(b)
    assert ra.keys() == rb.keys()
    for key in ra:
        assert ra[key]["status"] == rb[key]["status"], key
        for c, v in ra[key].items():
            if c != "status" and np.isfinite(v):
                assert abs(v - rb[key][c]) <= 1e-10 * max(1.0, abs(v)), (key, c, v, rb[key][c])
    fa, fb = ase.io.read(a / "final.xyz", index=":"), ase.io.read(b / "final.xyz", index=":")
    for x, y in zip(fa, fb, strict=True):
        np.testing.assert_allclose(x.positions, y.positions, rtol=0, atol=1e-10)
        np.testing.assert_allclose(x.get_velocities(), y.get_velocities(), rtol=0, atol=1e-10)


def test_batched_equals_each_system_alone(tmp_path):
    """Relax -> Langevin -> CSVR -> NVE -> NHC with 4 slots equals 1 slot (each system alone) to
    1e-10 in fp64: the noise is keyed by system id, not slot. A system with overlapping
    atoms fails its first stage and leaves the campaign without disturbing the others."""
    frames = _clusters(9, seed=3)
    bad = frames[4].copy()
    bad.positions[1] = bad.positions[0] + [0.3, 0.0, 0.0]
    frames[4] = bad
    structure = _write(tmp_path / "c.xyz", frames)
    stages = ["stages.0.type=relax", "stages.0.fmax=0.002", "stages.0.max_steps=150",
              "stages.1.type=nvt", "stages.1.name=langevin", "stages.1.temperature=60",
              "stages.1.steps=25", "stages.1.timestep=4",
              "stages.2.type=nvt", "stages.2.name=csvr", "stages.2.thermostat=csvr",
              "stages.2.temperature=30", "stages.2.tau=50", "stages.2.steps=20",
              "stages.2.timestep=4", "stages.3.type=nve", "stages.3.steps=15",
              "stages.3.timestep=4", "stages.4.type=nvt", "stages.4.name=nhc",
              "stages.4.thermostat=nhc", "stages.4.temperature=30", "stages.4.steps=10",
              "stages.4.timestep=4"]
    common = [f"structure={structure}", *LJ_MODEL,
              "output.progress=false", "output.trajectory_every=0", *stages]
    a = run_workflow(None, common + ["slots=4", f"output.dir={tmp_path / 'a'}"])
    b = run_workflow(None, common + ["slots=1", f"output.dir={tmp_path / 'b'}"])
    _compare(a, b)
    rows = _rows(a)
    assert rows[(4, "relax")]["status"] == "failed" and (4, "langevin") not in rows
    assert "above max_force" in rows[(4, "relax")]["reason"]
    assert len(rows) == 8 * 5 + 1
    assert rows[(0, "csvr")]["energy_eV"] != rows[(1, "csvr")]["energy_eV"]


def test_npt_batched_equals_alone(tmp_path):
    """Periodic argon cells: relax with the cell, then NPT (barostat noise keyed by system
    id), 3 slots vs 1."""
    from ase.build import bulk

    rng = np.random.default_rng(1)
    frames = []
    for k in range(4):
        atoms = bulk("Ar", "fcc", a=5.3 + 0.05 * k, cubic=True)
        atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
        frames.append(atoms)
    structure = _write(tmp_path / "cells.xyz", frames)
    common = [f"structure={structure}", *LJ_MODEL,
              "output.progress=false", "output.trajectory_every=5",
              "stages.0.type=relax", "stages.0.relax_cell=true", "stages.0.fmax=0.005",
              "stages.0.max_steps=60", "stages.1.type=npt", "stages.1.temperature=50",
              "stages.1.pressure=0.1", "stages.1.steps=15", "stages.1.timestep=4",
              "stages.1.tau_p=200"]
    a = run_workflow(None, common + ["slots=3", f"output.dir={tmp_path / 'a'}"])
    b = run_workflow(None, common + ["slots=1", f"output.dir={tmp_path / 'b'}"])
    _compare(a, b)
    vols = [float(r["volume_A3"]) for k, r in _rows(a).items() if k[1] == "npt"]
    assert len(set(vols)) == 4  # the cells moved, each its own way


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_campaign_equals_cpu(tmp_path):
    """The same campaign on the GPU and on the CPU (fp64): the same rows to 1e-10."""
    structure = _write(tmp_path / "c.xyz", _clusters(6, seed=2))
    common = [f"structure={structure}", *LJ_MODEL, "slots=4",
              "output.progress=false", "stages.0.type=relax", "stages.0.fmax=0.005",
              "stages.1.type=nvt", "stages.1.temperature=40", "stages.1.steps=10"]
    a = run_workflow(None, common + ["model.device=cuda", f"output.dir={tmp_path / 'a'}"])
    b = run_workflow(None, common + ["model.device=cpu", f"output.dir={tmp_path / 'b'}"])
    _compare(a, b)


def test_slot_primitives_keep_each_systems_trajectory():
    """A keyed Langevin batch: replacing a system (slots.replace) leaves the others on the
    trajectory they follow undisturbed, and a system's draws do not depend on its slot."""
    from xnn.data.ase_io import from_ase
    from xnn.dynamics import langevin, slots
    from xnn.dynamics.state import maxwell_boltzmann
    from xnn.models import build
    from xnn.models.potential import Potential

    pot = Potential(build("lj", **LJ).double())
    graphs = [maxwell_boltzmann(from_ase([a], dtype=torch.float64), 50.0, seed=i)
              for i, a in enumerate(_clusters(3, seed=5))]

    def start(i):
        return slots.keyed(langevin.init(graphs[i], pot, 50.0, 0.02, seed=9), i)

    def run(state, n):
        for _ in range(n):
            state = langevin.step(state, pot, 4.0)
        return state

    ab = run(slots.concat([start(0), start(1)]), 6)
    ba = run(slots.concat([start(1), start(0)]), 6)
    torch.testing.assert_close(ab.positions, slots.select(ba, [1, 0]).positions,
                               rtol=0, atol=1e-12)
    swapped = run(slots.replace(ab, 0, start(2)), 4)  # system 2 enters at batch step 6
    alone1, alone2 = run(start(1), 10), run(start(2), 4)
    torch.testing.assert_close(slots.select(swapped, [1]).positions, alone1.positions,
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(slots.select(swapped, [0]).positions, alone2.positions,
                               rtol=0, atol=1e-12)
    assert slots.own_steps(swapped).tolist() == [4, 10]


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"stages.0.temperature is not an option of a relax"):
        load_config(WorkflowConfig, None, ["structure=x.xyz", "stages.0.type=relax",
                                           "stages.0.temperature=300"])
    with pytest.raises(ConfigError, match="at least one stage"):
        load_config(WorkflowConfig, None, ["structure=x.xyz"])
    with pytest.raises(ConfigError, match="named 'nvt'"):
        load_config(WorkflowConfig, None, ["stages.0.type=nvt", "stages.1.type=nvt"])


def test_a_stage_the_systems_cannot_take_is_refused_before_running(tmp_path):
    """An npt stage on non-periodic clusters: one clear error, no run folder written."""
    structure = _write(tmp_path / "c.xyz", _clusters(3))
    with pytest.raises(InputError, match="system 0 .* not periodic"):
        run_workflow(None, [f"structure={structure}", *LJ_MODEL,
                            "stages.0.type=npt", f"output.dir={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()


def test_a_system_without_kinetic_degrees_of_freedom_fails_its_thermostat_stage(tmp_path):
    """A lone atom, and a pair whose atoms are all fixed, cannot be given a temperature:
    ``xnn md`` refuses them (naming the system of a batch), and a workflow fails them, with
    the same reason, in the first stage that asks a temperature > 0 (here nvt), after the
    stages that ask none (relax, nve from rest); the other systems run every stage."""
    from ase import Atoms
    from ase.constraints import FixAtoms

    from xnn.app.md import run_md

    pair = Atoms("Ar2", positions=[[0, 0, 0], [3.8, 0, 0]])
    pair.set_constraint(FixAtoms(indices=[0, 1]))
    frames = [*_clusters(2, seed=1), Atoms("Ar", positions=[[0, 0, 0]]), pair]
    structure = _write(tmp_path / "c.xyz", frames)
    common = [f"structure={structure}", *LJ_MODEL]
    with pytest.raises(InputError, match=r"system 2 has no kinetic degrees of freedom "
                                         r"\(1 atom, whose total momentum is kept at zero\)"):
        run_md(None, [*common, "index=:", "ensemble=langevin", "temperature=40", "steps=2",
                      f"output.dir={tmp_path / 'md'}"])
    out = run_workflow(None, [*common, "output.progress=false", f"output.dir={tmp_path / 'w'}",
                              "stages.0.type=relax", "stages.0.max_steps=20",
                              "stages.1.type=nve", "stages.1.steps=3",
                              "stages.2.type=nvt", "stages.2.temperature=40",
                              "stages.2.steps=3"])
    rows = _rows(out)
    for i in (0, 1):
        assert [rows[(i, s)]["status"] for s in ("relax", "nve", "nvt")] == ["ok"] * 3
    for i, why in ((2, "1 atom, whose total momentum is kept at zero"),
                   (3, "all its atoms are fixed")):
        assert rows[(i, "relax")]["status"] == rows[(i, "nve")]["status"] == "ok"
        nvt = rows[(i, "nvt")]
        assert (nvt["status"], nvt["steps"], nvt["converged"]) == ("failed", "0", "False")
        assert nvt["reason"] == (f"no kinetic degrees of freedom ({why}): it cannot be given "
                                 "a temperature of 40 K")
    import json

    assert json.loads((out / "summary.json").read_text())["failed_ids"] == [2, 3]


def test_resuming_a_complete_campaign_says_so_and_keeps_its_files(tmp_path, capsys):
    """Was: the resumed campaign printed its usual start line and said nothing more."""
    structure = _write(tmp_path / "c.xyz", _clusters(3, seed=1))
    common = [f"structure={structure}", *LJ_MODEL,
              "output.progress=false", "stages.0.type=relax", "stages.0.max_steps=5",
              "stages.1.type=nve", "stages.1.steps=3", f"output.dir={tmp_path / 'out'}"]
    out = run_workflow(None, common)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert run_workflow(None, [*common, f"resume={out / 'checkpoint.pt'}"]) == out
    printed = capsys.readouterr().out
    assert "the campaign is already complete, nothing was run" in printed
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
