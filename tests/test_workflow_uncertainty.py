"""The committee's uncertainty guard in ``xnn run`` (``safety.max_force_uncertainty``,
``safety.on_uncertainty``), per system in relax and MD stages: a system stops at the step
``xnn relax`` stops it at (same message), fails its stage with its frame in
``uncertain.xyz``, and the others go on; ``warn`` warns once per excursion per system and
stage and says so in the row; refused for a single model."""

from __future__ import annotations

import csv
import json
import warnings

import ase.io
import numpy as np
import pytest
import torch
from helpers.structures import fcc
from helpers.uncertainty import committee, first_record, read_columns, relax_args

from xnn.app.relax import run_relax
from xnn.app.workflow import run_workflow
from xnn.config.loader import load_config
from xnn.config.md import RelaxConfig
from xnn.config.workflow import WorkflowConfig
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.safety import SimulationError, UncertaintyWarning
from xnn.errors import InputError
from xnn.models import Potential
from xnn.models.serialization import load_model, save_model

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 12
RELAX = f"{{type: relax, fmax: 1e-6, max_steps: {STEPS}}}"


@pytest.fixture(scope="module")
def relaxed(tmp_path_factory):
    """Three structures (the first compressed, far from any training), the committee, and
    each system's largest force spread at every step of one unguarded ``xnn relax``."""
    tmp = tmp_path_factory.mktemp("wf_uq")
    model = save_model(committee(), tmp / "committee.pt")
    frames = [fcc((1, 2, 2), a=3.3, rattle=0.15, seed=1), fcc((1, 1, 2), a=3.5, rattle=0.1,
                                                               seed=2),
              fcc((1, 1, 2), a=3.6, rattle=0.05, seed=3)]
    ase.io.write(tmp / "three.xyz", frames)
    out = run_relax(load_config(RelaxConfig, None, relax_args(
        tmp / "three.xyz", model, tmp / "free", "index=:")))
    log = read_columns(out / "relax.csv")
    system = np.array(log["system"])
    spread = [np.array(log["max_force_std_eV_A"])[system == s].tolist() for s in range(3)]
    return tmp, model, spread, log


def workflow(tmp, model, out, stages, *extra):
    return run_workflow(load_config(WorkflowConfig, None, [
        f"structure={tmp / 'three.xyz'}", f"model.file={model}", "model.dtype=float64",
        "model.device=cpu", f"output.dir={out}", "output.progress=false", f"stages={stages}",
        *extra]))


def rows_of(folder) -> dict[tuple[int, str], dict]:
    with open(folder / "results.csv", newline="") as fh:
        return {(int(r["id"]), r["stage"]): r for r in csv.DictReader(fh)}


def first_above(u: list[float], threshold: float) -> int | None:
    return next((k for k, v in enumerate(u) if v > threshold), None)


def excursions(u: list[float], threshold: float) -> int:
    above = [v > threshold for v in u]
    return sum(1 for k, a in enumerate(above) if a and (k == 0 or not above[k - 1]))


def test_relax_stage_stops_each_system_where_xnn_relax_stops_it(relaxed, tmp_path):
    tmp, model, spread, _ = relaxed
    k, threshold = first_record(spread[0], after=2)
    stops = [first_above(u, threshold) for u in spread]
    assert stops[0] == k and None in stops  # one system stops, another goes on
    out = workflow(tmp, model, tmp_path / "wf", f"[{RELAX}, {{type: nve, steps: 2}}]",
                   f"safety.max_force_uncertainty={threshold!r}")
    rows = rows_of(out)
    # xnn relax of the first system alone, with the guard: the same step, the same message
    with pytest.raises(SimulationError) as err:
        run_relax(load_config(RelaxConfig, None, relax_args(
            tmp / "three.xyz", model, tmp_path / "alone", "index=0",
            f"safety.max_force_uncertainty={threshold!r}")))
    alone = str(err.value).split("; stopped")[0]
    for s, stop in enumerate(stops):
        row = rows[(s, "relax")]
        if stop is None:
            assert row["status"] == "ok" and int(row["steps"]) == STEPS and not row["reason"]
            assert rows[(s, "nve")]["status"] == "ok"
            continue
        assert row["status"] == "failed" and int(row["steps"]) == stop
        assert row["reason"].startswith(f"stage relax, step {stop}: force uncertainty")
        assert (s, "nve") not in rows  # it left the campaign
        if s == 0:
            assert row["reason"] == f"stage relax, {alone}; stopped (frame in uncertain.xyz)"
    uncertain = ase.io.read(out / "uncertain.xyz", ":")
    stopped = [s for s, stop in enumerate(stops) if stop is not None]
    assert [a.info["system_id"] for a in uncertain] == stopped
    for a in uncertain:
        s = a.info["system_id"]
        traj = ase.io.read(out / "trajectories" / f"sys_{s:05d}.xyz", ":")
        assert a.info["step"] == traj[-1].info["step"] == stops[s]
        np.testing.assert_array_equal(a.positions, traj[-1].positions)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["uncertain_ids"] == summary["failed_ids"] == stopped


def test_warn_once_per_excursion_per_system_and_the_run_unchanged(relaxed, tmp_path):
    tmp, model, spread, log = relaxed
    _, threshold = first_record(spread[1], after=2)  # crossed by system 1 (and 0)
    want = [excursions(u, threshold) for u in spread]
    assert want[1] >= 1 and 0 in want
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = workflow(tmp, model, tmp_path / "warn", f"[{RELAX}]",
                       f"safety.max_force_uncertainty={threshold!r}",
                       "safety.on_uncertainty=warn")
    got = [str(w.message) for w in caught if issubclass(w.category, UncertaintyWarning)]
    assert len(got) == sum(want)
    rows = rows_of(out)
    last = np.array(log["step"]) == STEPS
    for s, n in enumerate(want):
        row = rows[(s, "relax")]
        assert row["status"] == "ok" and int(row["steps"]) == STEPS  # the run went on
        assert float(row["energy_eV"]) == pytest.approx(float(np.array(log["energy_eV"])[last][s]),
                                                        rel=1e-10)
        if n:
            assert row["reason"].startswith(f"warned: {n} excursion(s)")
            first = f"system {s}, stage relax, step {first_above(spread[s], threshold)}: "
            assert first in row["reason"] and any(m.startswith(first) for m in got)
        else:
            assert not row["reason"]
    assert json.loads((out / "summary.json").read_text())["warned_ids"] == \
        [s for s, n in enumerate(want) if n]
    assert not (out / "uncertain.xyz").exists()


def test_md_stage_stops_at_the_first_step_above(relaxed, tmp_path):
    """An nve stage: the spread of the unguarded trajectory's frames (evaluated again) says
    where the guard must stop each system."""
    tmp, model, _, _ = relaxed
    md = "[{type: nve, steps: 8, timestep: 2, initial_temperature: 800}]"
    free = workflow(tmp, model, tmp_path / "free", md, "output.trajectory_every=1")
    pot = Potential(load_model(model))
    spread = []
    for s in range(3):
        frames = ase.io.read(free / "trajectories" / f"sys_{s:05d}.xyz", ":")
        spread.append([float(pot(AtomicGraph.from_arrays(
            a.positions, a.numbers, a.cell.array, a.pbc, dtype=torch.float64))[K.FORCES_STD]
            .max()) for a in frames])
    k, threshold = first_record(spread[0], after=2)
    # frames hold positions to 1e-8 Å: the threshold must be clear of every value
    assert min(abs(v - threshold) for u in spread for v in u) > 1e-6 * threshold
    stops = [first_above(u, threshold) for u in spread]
    out = workflow(tmp, model, tmp_path / "stop", md,
                   f"safety.max_force_uncertainty={threshold!r}")
    rows = rows_of(out)
    for s, stop in enumerate(stops):
        row = rows[(s, "nve")]
        if stop is None:
            assert row["status"] == "ok" and int(row["steps"]) == 8
        else:
            assert row["status"] == "failed" and int(row["steps"]) == stop
            assert row["reason"].startswith(f"stage nve, step {stop}: force uncertainty")
    assert stops[0] == k
    assert [a.info["system_id"] for a in ase.io.read(out / "uncertain.xyz", ":")] == \
        [s for s, stop in enumerate(stops) if stop is not None]


def test_workflow_guard_refused_for_a_single_model(relaxed, tmp_path):
    tmp, _, _, _ = relaxed
    one = save_model(committee().members[0], tmp_path / "one.pt")
    with pytest.raises(InputError, match="needs a committee model"):
        workflow(tmp, one, tmp_path / "a", f"[{RELAX}]", "safety.max_force_uncertainty=0.1")


def test_resumed_campaign_keeps_each_systems_guard(relaxed, tmp_path, monkeypatch):
    """A campaign resumed from a checkpoint taken after systems were warned does not warn
    them again, and its rows (excursion counts, first messages) are the uninterrupted ones."""
    import shutil

    from xnn.app import workflow_files as wf

    tmp, model, spread, _ = relaxed
    _, threshold = first_record(spread[1], after=2)
    firsts = [first_above(u, threshold) for u in spread]
    mid = max(f for f in firsts if f is not None) + 1  # every warning before it
    assert mid < STEPS and spread[1][mid] > threshold  # above when checkpointed
    assert all(excursions(u, threshold) == excursions(u[:mid], threshold) for u in spread)
    save = wf.save_campaign

    def keep_mid(path, pools, meta):
        save(path, pools, meta)
        if meta["iteration"] == mid:
            shutil.copy(path, tmp_path / "mid.pt")

    monkeypatch.setattr(wf, "save_campaign", keep_mid)
    args = (f"[{RELAX}]", f"safety.max_force_uncertainty={threshold!r}",
            "safety.on_uncertainty=warn", "output.checkpoint_every=1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = workflow(tmp, model, tmp_path / "run", *args)
    assert sum(issubclass(w.category, UncertaintyWarning) for w in caught) >= 2
    whole = without_wall(rows_of(out))
    assert any(r["reason"].startswith("warned") for r in whole.values())
    shutil.copy(tmp_path / "mid.pt", out / "checkpoint.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        workflow(tmp, model, tmp_path / "run", *args, f"resume={out / 'checkpoint.pt'}")
    assert not [w for w in caught if issubclass(w.category, UncertaintyWarning)]
    assert without_wall(rows_of(out)) == whole  # every cell but the wall time


def without_wall(rows: dict) -> dict:
    return {k: {c: v for c, v in r.items() if c != "wall_s"} for k, r in rows.items()}
