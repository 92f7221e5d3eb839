"""benchmarks/peers.py on a tiny system: the xnn part runs and is recorded, failures of a
framework are recorded instead of ending the run, and the force check keeps a speed-up of
a wrong computation out of the goals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: benchmarks/
from benchmarks import peers, peers_frameworks  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "peers.json"
    peers.main(["--json", str(out), "--device", "cpu", "--dtype", "float64", "--sizes", "32",
                "--batched", "2x32", "--small-models", "--steps", "1", "--warmup", "0",
                "--blocks", "1", *extra])
    return json.loads(out.read_text())


def test_xnn_rows_and_recorded_failures(tmp_path, one_thread):
    """xnn's equivariant model, one system and a batch of two: measured rows with a time to
    first step; an unknown-to-this-venv peer is 'skipped'/'error', never a crash."""
    data = _run(tmp_path, "--models", "equivariant", "--frameworks", "xnn")
    rows = data["results"]
    assert [(r["model"], r["n_systems"], r["n_atoms"]) for r in rows] == [
        ("equivariant", 1, 32), ("equivariant", 2, 64)]
    for r in rows:
        x = r["frameworks"]["xnn"]
        assert x["ensemble"] == peers_frameworks.LANGEVIN
        assert x["atom_steps_per_s"] > 0 and x["time_to_first_step_s"] > 0
    assert data["temperature_K"] == 300.0 and data["dt_fs"] == 1.0


def test_budget_and_peer_failures_are_recorded(tmp_path, one_thread):
    data = _run(tmp_path, "--models", "equivariant", "--frameworks", "xnn", "--batched", "none",
                "--budget-s", "0.001")
    assert data["results"][0]["frameworks"]["xnn"] == {"error": "over budget (0.001 s, "
                                                                 "--budget-s)"}
    pytest.importorskip("mace.modules")
    data = _run(tmp_path, "--models", "mace", "--frameworks", "xnn,nvalchemi,torch_sim",
                "--batched", "none")
    fw = data["results"][0]["frameworks"]
    assert fw["xnn"]["atom_steps_per_s"] > 0
    for peer in ("nvalchemi", "torch_sim"):  # measured where installed, else recorded
        r = fw[peer]
        assert ("atom_steps_per_s" in r) + ("skipped" in r) + ("error" in r) == 1, r
        if "atom_steps_per_s" in r:  # same weights, same structure: same forces
            assert r["forces_match"], r


def test_wrong_forces_do_not_count_towards_goals():
    ref = torch.randn(10, 3, dtype=torch.float64)
    good, bad = {"atom_steps_per_s": 1.0}, {"atom_steps_per_s": 1.0}
    peers.force_check(good, ref + 1e-12, ref, torch.float64)
    peers.force_check(bad, ref * 1.01, ref, torch.float64)
    assert good["forces_match"] and not bad["forces_match"]
    row = {"model": "mace", "n_systems": 1, "n_atoms": 10_000,
           "frameworks": {"xnn": {"atom_steps_per_s": 3.0}, "torch_sim": good,
                          "nvalchemi": bad}}
    goal = {g["measure"]: g for g in peers.goals([row])}
    ts = goal["MACE MD vs torch-sim newest, 10k atoms"]
    assert ts["ratio"] == 3.0 and ts["met"] is True
    assert goal["MACE MD vs nvalchemi 0.2, 10k atoms, 1 GPU"]["ratio"] is None


def test_compiled_step_forces_are_checked(tmp_path, one_thread, monkeypatch):
    """The compiled Langevin step's row carries its own forces at the start (a step from
    rest at 0 K), checked against the eager ones; recorded as Langevin."""
    import xnn.dynamics.compiled as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")  # no C++ compile in tests
    data = _run(tmp_path, "--models", "equivariant", "--frameworks", "xnn,xnn_step_compiled",
                "--batched", "none")
    r = data["results"][0]["frameworks"]["xnn_step_compiled"]
    assert r["ensemble"].startswith("Langevin") and "compiled MD step" in r["ensemble"]
    assert r["atom_steps_per_s"] > 0
    assert r["forces_match"] and r["force_max_abs_ref_eV_A"] > 0


def test_the_eager_force_reference_always_runs_first():
    """Without xnn's eager run no peer's forces are checked and no goal counts, so a
    framework list that leaves it out gets it back, first."""
    a = peers.parse(["--json", "x.json", "--frameworks", "xnn_step_graph,torch_sim"])
    assert a.frameworks == ["xnn", "xnn_step_graph", "torch_sim"]
