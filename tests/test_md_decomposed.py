"""``xnn md`` and ``xnn relax`` under torchrun: each rank owns the atoms of its box (gloo, 2
ranks, fp64). Trajectories equal one process by atom id; checkpoints hold the global state
and resume on 1 or 2 ranks like the uninterrupted run; ``summary.json`` reports the split.

One set of ranks is spawned for the module; it runs every decomposed case."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from ase.io import read
from dist_helpers import spawn
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.app.relax import run_relax
from xnn.config.loader import load_config
from xnn.config.md import MDConfig, RelaxConfig
from xnn.io import md_checkpoint as ckpt

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

CASES = {  # ensemble -> extra overrides (Langevin/CSVR: random numbers by atom id; NPT: cell)
    "nve": [],
    "langevin": ["temperature=150", "thermostat.friction=0.02"],
    "csvr": ["temperature=150", "thermostat.tau=40"],
    "npt": ["temperature=150", "pressure=0.1", "barostat.tau_p=200", "thermostat.tau=50"],
}
LJ = ["model.device=cpu", "model.name=lj", "model.hyperparameters.sigma=3.405",
      "model.hyperparameters.epsilon=0.0104",
      "output.progress=false"]
BIG = ["model.cutoff=5.0", "model.skin=0.3", "steps=12", "timestep=5.0",
       "initial_temperature=400", "output.log_every=6", "output.trajectory_every=0"]


def overrides(structure, out_dir, ensemble, *extra):
    return [f"structure={structure}", f"output.dir={out_dir}", f"ensemble={ensemble}", *LJ,
            "model.cutoff=6.5", "model.skin=0.3", "steps=40", "timestep=4.0",
            "initial_temperature=150", "output.log_every=5", "output.trajectory_every=20",
            "output.checkpoint_every=20", "output.plot=false", "seed=3", *CASES[ensemble],
            *extra]


def relax_overrides(structure, out_dir):
    return [f"structure={structure}", f"output.dir={out_dir}", *LJ, "model.cutoff=6.5",
            "model.skin=0.3", "relax_cell=true", "fmax=0.005", "max_steps=60",
            "output.trajectory_every=10"]


def md(*args, steps=None, resume=None):
    extra = [] if steps is None else [f"steps={steps}"]
    extra += [] if resume is None else [f"resume={resume}"]
    return run_md(load_config(MDConfig, None, overrides(*args, *extra)))


def auto_runs(tmp):
    """``dd.mode=auto`` for md and relax: graph mode for 108 atoms in a small periodic cell
    (a halo would hold most of the system), spatial halos for the 500-atom cluster. Returns
    the error of the first run that failed (``None``: all ran)."""
    s = f"{tmp}/ar108.xyz"
    try:
        md(s, f"{tmp}/auto_nve", "nve", "parallel.mode=auto")
        run_relax(load_config(RelaxConfig, None, [*relax_overrides(s, f"{tmp}/auto_relax"),
                                                  "parallel.mode=auto"]))
        run_md(load_config(MDConfig, None, [f"structure={tmp}/ar500.xyz", "ensemble=nve",
                                            f"output.dir={tmp}/auto_big", "parallel.mode=auto",
                                            *LJ, *BIG]))
    except Exception as err:  # noqa: BLE001 - reported by the test, the other cases go on
        return f"{type(err).__name__}: {err}"
    return None


def worker(rank, world, tmp):
    s = f"{tmp}/ar108.xyz"
    for ensemble in CASES:
        md(s, f"{tmp}/dd_{ensemble}", ensemble)
    md(s, f"{tmp}/dd_langevin_60", "langevin", steps=60)  # uninterrupted, 2 ranks
    md(s, f"{tmp}/from_single", "langevin", steps=60, resume=f"{tmp}/from_single/checkpoint.pt")
    md(s, f"{tmp}/dd_again", "langevin")  # 40 steps, then resumed on 2 ranks
    md(s, f"{tmp}/dd_again", "langevin", steps=60, resume=f"{tmp}/dd_again/checkpoint.pt")
    run_relax(load_config(RelaxConfig, None, relax_overrides(s, f"{tmp}/dd_relax")))
    run_md(load_config(MDConfig, None, [f"structure={tmp}/ar500.xyz", "ensemble=nve",
                                        f"output.dir={tmp}/dd_big", *LJ, *BIG]))
    return rank, auto_runs(tmp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("md_dd")
    s = tmp / "ar108.xyz"
    rattled_argon(rep=3, amp=0.05).write(s)
    cluster = rattled_argon(rep=5, amp=0.05)  # a 500-atom cube in vacuum: no image ghosts
    cluster.pbc = False
    cluster.write(tmp / "ar500.xyz")
    for ensemble in CASES:
        md(s, tmp / f"single_{ensemble}", ensemble)
    md(s, tmp / "single_langevin_60", "langevin", steps=60)
    shutil.copytree(tmp / "single_langevin", tmp / "from_single")  # 1 -> 2 ranks
    run_relax(load_config(RelaxConfig, None, relax_overrides(s, tmp / "single_relax")))
    ranks = spawn(worker, 2, args=(str(tmp),), timeout_s=300)
    assert [r for r, _ in ranks] == [0, 1]
    (tmp / "auto_errors.json").write_text(json.dumps([err for _, err in ranks]))
    shutil.copytree(tmp / "dd_langevin", tmp / "from_dd")  # 2 ranks -> 1 process
    md(s, tmp / "from_dd", "langevin", steps=60, resume=tmp / "from_dd" / "checkpoint.pt")
    return tmp


def thermo(path):
    return np.genfromtxt(path, delimiter=",", names=True)


def state(path):
    return ckpt.load_checkpoint(path / "checkpoint.pt", torch.device("cpu"))


def assert_same_state(a, b, tol):
    assert a.step == b.step
    torch.testing.assert_close(a.graph.atom_id, b.graph.atom_id, rtol=0, atol=0)
    for x, y in ((a.positions, b.positions), (a.graph.velocities, b.graph.velocities),
                 (a.graph.cell, b.graph.cell), (a.forces, b.forces)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


@pytest.mark.parametrize("ensemble", list(CASES))
def test_decomposed_md_matches_one_process(runs, ensemble):
    dd, single = runs / f"dd_{ensemble}", runs / f"single_{ensemble}"
    a, b = thermo(dd / "thermo.csv"), thermo(single / "thermo.csv")
    assert a.shape == b.shape and len(a) == 9
    for name in b.dtype.names:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-9, atol=1e-12, err_msg=name)
    (s_dd, meta), (s_1, _) = state(dd), state(single)
    assert s_dd.step == 40 and meta["domain"]["ranks"] == 2
    assert_same_state(s_dd, s_1, 1e-9)
    frames_dd, frames_1 = read(dd / "trajectory.xyz", ":"), read(single / "trajectory.xyz", ":")
    assert len(frames_dd) == len(frames_1) == 3
    np.testing.assert_allclose(frames_dd[-1].positions, frames_1[-1].positions, atol=1e-9)
    summary = json.loads((dd / "summary.json").read_text())
    assert summary["ranks"] == 2 and summary["owned"]["per_rank"][0] > 0
    assert sum(summary["owned"]["per_rank"]) == 108
    assert summary["migrations"] > 0  # atoms moved beyond skin / 2: ownership re-assigned
    # one process writes the same summary (one rank), with the same run figures
    one = json.loads((single / "summary.json").read_text())
    assert set(one) == set(summary) and one["ranks"] == 1 and one["ghost"]["max"] == 0
    assert summary["steps_run"] == one["steps_run"] == 40 and summary["thermo_rows"] == 9
    assert summary["mean_temperature_K"] == pytest.approx(one["mean_temperature_K"], rel=1e-9)
    assert summary["mean_pressure_GPa"] == pytest.approx(one["mean_pressure_GPa"], rel=1e-9)


def test_checkpoints_resume_on_another_rank_count(runs):
    """2 ranks -> 1 process and 1 process -> 2 ranks continue like the uninterrupted run."""
    ref, _ = state(runs / "single_langevin_60")
    for name in ("from_dd", "from_single", "dd_langevin_60"):
        assert_same_state(state(runs / name)[0], ref, 1e-10)
    a, b = thermo(runs / "from_dd" / "thermo.csv"), thermo(runs / "single_langevin_60" /
                                                           "thermo.csv")
    assert a.shape == b.shape
    np.testing.assert_allclose(a["etot_eV"], b["etot_eV"], rtol=1e-10)


def test_checkpoint_resumes_on_the_same_rank_count(runs):
    """2 ranks -> 2 ranks: the continuation equals the uninterrupted 2-rank run."""
    assert_same_state(state(runs / "dd_again")[0], state(runs / "dd_langevin_60")[0], 0.0)
    assert ((runs / "dd_again" / "thermo.csv").read_bytes()
            == (runs / "dd_langevin_60" / "thermo.csv").read_bytes())


def test_decomposed_relax_matches_one_process(runs):
    dd, single = runs / "dd_relax", runs / "single_relax"
    a, b = read(dd / "relaxed.xyz"), read(single / "relaxed.xyz")
    np.testing.assert_allclose(a.positions, b.positions, atol=1e-9)
    np.testing.assert_allclose(a.cell.array, b.cell.array, atol=1e-9)
    rows_dd, rows_1 = (dd / "relax.csv").read_text(), (single / "relax.csv").read_text()
    assert rows_dd.splitlines()[-1].split(",")[0] == rows_1.splitlines()[-1].split(",")[0]
    assert len(rows_dd.splitlines()) == len(rows_1.splitlines()) > 5
    assert state(dd)[0].step == state(single)[0].step
    s_dd, s_1 = (json.loads((d / "summary.json").read_text()) for d in (dd, single))
    assert s_dd["converged"] == s_1["converged"] and s_dd["ranks"] == 2
    assert s_dd["max_force_eV_A"] == pytest.approx(s_1["max_force_eV_A"], rel=1e-6)


def test_big_system_ranks_hold_less_than_the_whole(runs):
    summary = json.loads((runs / "dd_big" / "summary.json").read_text())
    assert summary["n_atoms"] == 500 and sum(summary["owned"]["per_rank"]) == 500
    assert (summary["balance"], summary["exchange"]) == ("none", "direct")  # the defaults
    assert summary["owned"]["max"] < 300
    held = [o + g for o, g in zip(summary["owned"]["per_rank"], summary["ghost"]["per_rank"])]
    assert summary["held"]["per_rank"] == held
    assert summary["held"]["max"] < 450  # owned + ghosts: the replicated state is gone
    assert summary["migrations"] > 0 and summary["peak_memory_MiB"]["min"] > 0


def test_dd_mode_auto_md_and_relax_equal_one_process(runs):
    """``dd.mode=auto`` under torchrun (2 ranks) runs md and relax, choosing graph mode for
    the small dense cell and spatial halos for the cluster, and equals one process (the
    cluster: the explicit halo run)."""
    assert json.loads((runs / "auto_errors.json").read_text()) == [None, None]
    auto, single = runs / "auto_nve", runs / "single_nve"
    a, b = thermo(auto / "thermo.csv"), thermo(single / "thermo.csv")
    assert a.shape == b.shape and len(a) == 9
    for name in b.dtype.names:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-9, atol=1e-12, err_msg=name)
    assert_same_state(state(auto)[0], state(single)[0], 1e-9)
    assert json.loads((auto / "summary.json").read_text())["grid"] is None  # graph mode
    relaxed, want = read(runs / "auto_relax" / "relaxed.xyz"), read(runs / "single_relax" /
                                                                      "relaxed.xyz")
    np.testing.assert_allclose(relaxed.positions, want.positions, atol=1e-9)
    np.testing.assert_allclose(relaxed.cell.array, want.cell.array, atol=1e-9)
    assert state(runs / "auto_relax")[0].step == state(runs / "single_relax")[0].step
    big = json.loads((runs / "auto_big" / "summary.json").read_text())
    assert big["grid"] == json.loads((runs / "dd_big" / "summary.json").read_text())["grid"]
    assert_same_state(state(runs / "auto_big")[0], state(runs / "dd_big")[0], 0.0)
