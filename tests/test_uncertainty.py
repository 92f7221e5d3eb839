"""A committee's uncertainty in ``xnn md``: thermo columns equal the committee's own spread,
``safety.max_force_uncertainty`` stops at the first step above it (that frame written) or
warns once per excursion, and the refusal of a single model (compiled runs:
tests/test_committee_compiled.py)."""

from __future__ import annotations

import warnings

import ase.io
import numpy as np
import pytest
import torch
from helpers.structures import fcc
from helpers.uncertainty import (
    STEPS,
    committee,
    committee_files,
    first_record,
    md_args,
    read_columns,
    relax_args,
)

from xnn.app.md import run_md
from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.safety import SimulationError, UncertaintyGuard, UncertaintyWarning
from xnn.errors import InputError
from xnn.io.thermo import read_log
from xnn.models import Potential
from xnn.models.serialization import load_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

@pytest.fixture(scope="module")
def free_run(tmp_path_factory):
    """One unguarded run: the committee file, the structure and the thermo log."""
    tmp = tmp_path_factory.mktemp("uq")
    model, _ = committee_files(tmp)
    out = run_md(load_config(MDConfig, None, md_args(tmp / "cu.xyz", model, tmp / "free")))
    return tmp, model, read_log(out / "thermo.csv")


def test_thermo_columns_are_the_committees_spread(free_run):
    tmp, model, log = free_run
    assert len(log["max_force_std_eV_A"]) == STEPS + 1
    # step 0 against the committee evaluated directly on the structure as read
    atoms = ase.io.read(tmp / "cu.xyz")
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=torch.float64)
    out = Potential(load_model(model))(g)
    std = out[K.FORCES_STD].numpy()
    assert log["max_force_std_eV_A"][0] == pytest.approx(std.max(), rel=1e-12)
    assert log["mean_force_std_eV_A"][0] == pytest.approx(std.mean(), rel=1e-12)
    assert log["energy_std_eV"][0] == pytest.approx(float(out[K.ENERGY_STD][0]), rel=1e-12)
    assert std.max() > 1.5 * std.min() > 0  # per-atom values, not one number
    # and later steps against the members' forces of the last checkpoint's state
    from xnn.io import md_checkpoint as ckpt

    state, _ = ckpt.load_checkpoint(tmp / "free" / "checkpoint.pt")
    last = Potential(load_model(model))(state.graph.without_edges())
    assert log["max_force_std_eV_A"][-1] == pytest.approx(
        float(last[K.FORCES_STD].max()), rel=1e-10)
    assert np.ptp(log["max_force_std_eV_A"]) > 0  # it moves with the atoms


def test_guard_stops_at_the_first_step_above_with_the_frame_written(free_run):
    tmp, model, log = free_run
    k, threshold = first_record(log["max_force_std_eV_A"])
    out = tmp / "stop"
    with pytest.raises(SimulationError) as err:
        run_md(load_config(MDConfig, None, md_args(
            tmp / "cu.xyz", model, out, f"safety.max_force_uncertainty={threshold!r}")))
    msg = str(err.value)
    assert err.value.step == k and msg.startswith(f"step {k}: force uncertainty")
    assert "above safety.max_force_uncertainty" in msg and "atom_id" in msg
    assert "stopped" in msg and "\n" not in msg
    frames = ase.io.read(out / "trajectory.xyz", ":")
    assert frames[-1].info["step"] == k  # the uncertain frame is the trajectory's last
    assert ase.io.read(out / "uncertain.xyz").info["step"] == k
    stopped = read_log(out / "thermo.csv")
    assert stopped["step"][-1] == k
    np.testing.assert_allclose(stopped["max_force_std_eV_A"],
                               log["max_force_std_eV_A"][: k + 1], rtol=0, atol=0)
    from xnn.io import md_checkpoint as ckpt

    assert ckpt.load_checkpoint(out / "checkpoint.pt")[0].step == k


def test_guard_warns_once_per_excursion(free_run):
    tmp, model, log = free_run
    k, threshold = first_record(log["max_force_std_eV_A"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_md(load_config(MDConfig, None, md_args(
            tmp / "cu.xyz", model, tmp / "warn", f"safety.max_force_uncertainty={threshold!r}",
            "safety.on_uncertainty=warn")))
    above = [u > threshold for u in log["max_force_std_eV_A"]]
    excursions = sum(1 for i, a in enumerate(above) if a and (i == 0 or not above[i - 1]))
    got = [w for w in caught if issubclass(w.category, UncertaintyWarning)]
    assert len(got) == excursions >= 1
    assert str(got[0].message).startswith(f"step {k}: force uncertainty")
    assert read_log(tmp / "warn" / "thermo.csv")["step"][-1] == STEPS  # the run went on
    import json

    summary = json.loads((tmp / "warn" / "summary.json").read_text())
    assert summary["uncertainty_warnings"] == excursions
    assert summary["max_force_std_eV_A"] == max(log["max_force_std_eV_A"])


def test_guard_excursions_on_a_series():
    """Warn: once per excursion above the threshold; stop: at the first value above."""
    from xnn.dynamics.state import MDState

    g = AtomicGraph.from_arrays(np.zeros((2, 3)), [29, 29], np.eye(3) * 5, [True] * 3,
                                dtype=torch.float64)
    warn, stop = UncertaintyGuard(0.5, "warn"), UncertaintyGuard(0.5, "stop")
    fired = []
    for step, top in enumerate([0.1, 0.6, 0.7, 0.2, 0.8, 0.4]):
        s = MDState(g.replace({K.FORCES_STD: torch.tensor([0.0, top], dtype=torch.float64),
                               K.ENERGY_STD: torch.zeros(1, dtype=torch.float64)}),
                    torch.zeros(2, 3), torch.zeros(1), torch.zeros(1, 3, 3), step)
        fired.append(warn.check(s) is not None)
    assert fired == [False, True, False, False, True, False] and warn.excursions == 2
    s = MDState(g.replace({K.FORCES_STD: torch.tensor([0.0, 0.6], dtype=torch.float64)}),
                torch.zeros(2, 3), torch.zeros(1), torch.zeros(1, 3, 3), 7)
    with pytest.raises(SimulationError, match=r"step 7: .* on atoms \(atom_id\) \[1\]"):
        stop.check(s)
    assert UncertaintyGuard(None).check(s) is None  # disabled
    two = AtomicGraph.concat([g, g.replace(atom_id=torch.tensor([2, 3]))])
    s = MDState(two.replace({K.FORCES_STD: torch.tensor([0.0, 0.6, 0.9, 0.1],
                                                        dtype=torch.float64)}),
                torch.zeros(4, 3), torch.zeros(2), torch.zeros(2, 3, 3), 3)
    with pytest.raises(SimulationError, match=r"0.9 eV/Å .* on atoms \(atom_id\) \[2\] of "
                                              r"system 1"):
        stop.check(s)


def test_refusals(free_run, tmp_path):
    tmp, model, _ = free_run
    one = save_model(committee().members[0], tmp_path / "one.pt")
    with pytest.raises(InputError, match="needs a committee model"):
        run_md(load_config(MDConfig, None, md_args(
            tmp / "cu.xyz", one, tmp_path / "a", "safety.max_force_uncertainty=0.1")))
    from xnn.config.loader import ConfigError

    with pytest.raises(ConfigError, match="max_force_uncertainty"):
        load_config(MDConfig, None, ["safety.max_force_uncertainty=-1"])


def test_relax_log_has_the_uncertainty_columns(free_run, tmp_path):
    from xnn.app.relax import run_relax
    from xnn.config.md import RelaxConfig

    tmp, model, log = free_run
    out = run_relax(load_config(RelaxConfig, None, relax_args(
        tmp / "cu.xyz", model, tmp_path / "relax", steps=3)))
    rows = read_columns(out / "relax.csv")
    assert rows["step"] == [0, 1, 2, 3]
    # step 0 is the MD run's step 0: the same structure and committee
    for col in ("max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV"):
        assert rows[col][0] == log[col][0]
    assert rows["max_force_std_eV_A"][-1] != rows["max_force_std_eV_A"][0]


def test_torchsim_adapter_returns_the_spreads():
    ts = pytest.importorskip("torch_sim")
    from xnn.interop.torchsim import XnnTorchSimModel

    c = committee()
    systems = [fcc((1, 1, 2), a=3.3, rattle=0.15, seed=2), fcc((1, 1, 1), rattle=0.1, seed=3)]
    cpu, f64 = torch.device("cpu"), torch.float64
    out = XnnTorchSimModel(c, device="cpu", dtype=f64)(ts.io.atoms_to_state(systems, cpu, f64))
    graphs = [AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc, dtype=f64)
              for a in systems]
    start = 0
    for s, g in enumerate(graphs):  # each system alone through xnn's own Potential
        ref = Potential(c)(g)
        n = g.n_atoms
        np.testing.assert_allclose(out[K.FORCES_STD][start:start + n].numpy(),
                                   ref[K.FORCES_STD].numpy(), rtol=1e-10, atol=1e-14)
        assert float(out[K.ENERGY_STD][s]) == pytest.approx(float(ref[K.ENERGY_STD][0]),
                                                            rel=1e-10)
        np.testing.assert_allclose(out[K.STRESS_STD][s].numpy(), ref[K.STRESS_STD][0].numpy(),
                                   rtol=1e-9, atol=1e-14)
        start += n
    assert out[K.FORCES_STD].shape == (sum(len(a) for a in systems),)
    assert float(out[K.FORCES_STD].min()) > 0


def test_workflow_results_have_each_systems_uncertainty(free_run, tmp_path):
    """``xnn run``: each (system, stage) row holds the committee's spread at the stage's last
    step, equal to the committee evaluated on that system alone (the final structures)."""
    import csv

    from xnn.app.workflow import run_workflow
    from xnn.config.workflow import WorkflowConfig

    tmp, model, _ = free_run
    frames = [fcc((1, 1, 2), a=a, rattle=0.1, seed=s) for s, a in enumerate((3.3, 3.5, 3.6))]
    ase.io.write(tmp_path / "three.xyz", frames)
    out = run_workflow(load_config(WorkflowConfig, None, [
        f"structure={tmp_path / 'three.xyz'}", "index=:", f"model.file={model}",
        "model.dtype=float64", "model.device=cpu", "slots=2", f"output.dir={tmp_path / 'wf'}",
        "output.progress=false", "stages=[{name: md, type: nve, timestep: 2, steps: 3, "
        "initial_temperature: 300}]"]))
    with open(out / "results.csv", newline="") as fh:
        rows = sorted(csv.DictReader(fh), key=lambda r: int(r["id"]))
    final = ase.io.read(out / "final.xyz", ":")
    assert len(rows) == len(final) == 3
    c = load_model(model)
    for row, atoms in zip(rows, final):
        g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array,
                                    atoms.pbc, dtype=torch.float64)
        ref = Potential(c)(g)
        # final.xyz stores positions to 1e-8 Å: relative agreement to 1e-5
        assert float(row["max_force_std_eV_A"]) == pytest.approx(
            float(ref[K.FORCES_STD].max()), rel=1e-5)
        assert float(row["mean_force_std_eV_A"]) == pytest.approx(
            float(ref[K.FORCES_STD].mean()), rel=1e-5)
        assert float(row["energy_std_eV"]) == pytest.approx(float(ref[K.ENERGY_STD][0]),
                                                            rel=1e-5)
    assert len({r["max_force_std_eV_A"] for r in rows}) == 3


def test_resumed_run_logs_the_uninterrupted_uncertainty(free_run, tmp_path):
    """A checkpoint holds the state's spread fields; resuming gives the same columns."""
    tmp, model, log = free_run
    half = run_md(load_config(MDConfig, None, md_args(tmp / "cu.xyz", model, tmp_path / "r",
                                                      f"steps={STEPS // 2}")))
    assert read_log(half / "thermo.csv")["step"][-1] == STEPS // 2
    run_md(load_config(MDConfig, None, md_args(tmp / "cu.xyz", model, tmp_path / "r",
                                               f"resume={half / 'checkpoint.pt'}")))
    resumed = read_log(tmp_path / "r" / "thermo.csv")
    for col in ("max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV"):
        assert resumed[col] == log[col], col


def test_guard_stops_at_step_zero(free_run, tmp_path):
    tmp, model, log = free_run
    below = 0.5 * min(log["max_force_std_eV_A"])
    with pytest.raises(SimulationError, match=r"^step 0: force uncertainty") as err:
        run_md(load_config(MDConfig, None, md_args(
            tmp / "cu.xyz", model, tmp_path / "s0", f"safety.max_force_uncertainty={below!r}")))
    assert err.value.step == 0
    assert ase.io.read(tmp_path / "s0" / "trajectory.xyz", ":")[-1].info["step"] == 0
    assert read_log(tmp_path / "s0" / "thermo.csv")["step"] == [0]


def test_cli_stop_is_one_line_with_the_safety_exit_code(free_run, tmp_path, capsys):
    from xnn.cli.main import main

    tmp, model, log = free_run
    k, threshold = first_record(log["max_force_std_eV_A"])
    rc = main(["md", *md_args(tmp / "cu.xyz", model, tmp_path / "cli",
                              f"safety.max_force_uncertainty={threshold!r}")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1  # as the other safety stops (xnn.cli.main)
    assert err[0].startswith(f"xnn md: error: step {k}: force uncertainty")
