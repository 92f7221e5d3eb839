"""``xnn md`` / ``xnn relax`` as a user meets them: a resume checks the model and the physics
against the checkpoint (and never takes the checkpoint's neighbor-list cutoff), a complete run
says so, ``compile=true`` refuses what it cannot compile before anything is written, batch
jobs get progress lines and every run a summary line and ``summary.json``, and the help and
the collective timeout name the right keys."""

from __future__ import annotations

import csv
import json
import math

import ase.io
import numpy as np
import pytest
import torch
from ase.build import molecule
from error_helpers import raises_one_line
from helpers import rattled_argon

from xnn.app import md_progress
from xnn.app.md import run_md
from xnn.app.relax import run_relax
from xnn.cli.main import main
from xnn.config.loader import ConfigError, load_config
from xnn.config.md import MDConfig, RelaxConfig
from xnn.config.train import TrainConfig
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.io import md_checkpoint as ckpt
from xnn.models import Potential, build
from xnn.models.serialization import read_as_data, save_model

pytestmark = pytest.mark.usefixtures("one_thread")

LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405",
      "model.hyperparameters.epsilon=0.0104", "model.cutoff=6.5", "output.progress=false",
      "output.plot=false"]


@pytest.fixture
def argon_file(tmp_path):
    path = tmp_path / "ar.xyz"
    ase.io.write(path, [rattled_argon(seed=0), rattled_argon(seed=1)])
    return path


def md(argon_file, out, *extra):
    return run_md(load_config(MDConfig, None, [f"structure={argon_file}", "index=:",
                                               f"output.dir={out}", *LJ, *extra]))


def relax(argon_file, out, *extra):
    return run_relax(load_config(RelaxConfig, None, [f"structure={argon_file}", "index=:",
                                                     f"output.dir={out}", *LJ, *extra]))


def files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------ resume
def test_resume_refuses_another_model_or_physics(tmp_path, argon_file):
    """Each refusal is one line naming what differs, before anything is written; the run
    length, outputs, safety checks and the skin may change."""
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    save_model(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5), a)
    save_model(build("lj", sigma=3.3, epsilon=0.0104, cutoff=6.5), b)
    common = ["ensemble=langevin", "temperature=40", "timestep=5", "steps=4",
              "output.log_every=2", "output.trajectory_every=2", "model.name=null",
              "model.hyperparameters=null", "model.cutoff=null"]
    run = md(argon_file, tmp_path / "run", *common, f"model.file={a}")
    before = files(run)
    resume = [*common, f"resume={run / 'checkpoint.pt'}", "steps=6"]

    def refused(extra, *parts):
        msg = raises_one_line(InputError, md, argon_file, run, *resume, *extra)
        for part in parts:
            assert part in msg, (part, msg)
        assert "resume with the model and settings of that run" in msg
        assert files(run) == before

    refused([f"model.file={b}"], f"another model (model.file={a}, fingerprint",
            f"now model.file={b}, fingerprint")
    refused(["model.name=lj", "model.hyperparameters={sigma: 3.3, epsilon: 0.0104}",
             "model.cutoff=6.5"], "now model.name=lj, fingerprint")
    refused([f"model.file={a}", "temperatures=[40,60]"],
            "temperature=[40.0, 40.0] (now [40.0, 60.0])")
    refused([f"model.file={a}", "thermostat.friction=0.1"], "thermostat.friction=0.01 (now 0.1)")
    refused([f"model.file={a}", "timestep=2", "model.dtype=float32"],
            "timestep=5.0 (now 2.0)", "model.dtype='float64' (now 'float32')")
    refused([f"model.file={a}", "ensemble=csvr"], "ensemble='langevin' (now 'csvr')")
    # the same file, written again with another cutoff
    save_model(build("lj", sigma=3.405, epsilon=0.0104, cutoff=5.0), a)
    refused([f"model.file={a}"], f"another model (model.file={a}, fingerprint", "now the "
            "same source with other weights or hyperparameters, fingerprint")
    save_model(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5), a)
    # xnn relax checks its model too
    rx = relax(argon_file, tmp_path / "rx", "max_steps=2")
    msg = raises_one_line(InputError, relax, argon_file, rx, "max_steps=4",
                          "model.hyperparameters.epsilon=0.02", f"resume={rx / 'checkpoint.pt'}")
    assert "written with another model (model.name=lj" in msg
    # what does not change the physics may change: the run continues
    # (and the same model from another source is the same model)
    md(argon_file, run, *resume, *LJ[:4], "model.skin=0.5", "output.log_every=1",
       "safety.max_force=50")
    assert ckpt.load_checkpoint(run / "checkpoint.pt")[0].step == 6


def test_old_checkpoint_resumes_with_a_warning_and_the_models_own_cutoff(tmp_path,
                                                                        argon_file):
    """A checkpoint without a fingerprint (written before them) cannot be checked: one
    warning, and the run goes on with the new model's cutoff, not the checkpoint's list's
    (which missed the pairs between 5.3 and 6.5 Å: the energy was off by a tenth)."""
    common = ["ensemble=nve", "temperature=20", "model.skin=0.3", "index=0"]
    run = md(argon_file, tmp_path / "run", *common, "steps=2", "model.cutoff=5.0")
    path = run / "checkpoint.pt"
    payload = read_as_data(path)
    payload["meta"].pop("resume_check", None)  # as written before fingerprints existed
    torch.save(payload, path)
    with pytest.warns(UserWarning, match="without a model fingerprint"):
        md(argon_file, run, *common, "steps=3", f"resume={path}", "output.log_every=1")
    state, _ = ckpt.load_checkpoint(path)
    fresh = Potential(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5).double())
    ref = fresh(AtomicGraph(dict(state.graph.fields)))["energy"]
    assert state.step == 3
    torch.testing.assert_close(state.energy, ref, rtol=1e-12, atol=0)
    rows = list(csv.DictReader(open(run / "thermo.csv")))
    assert float(rows[-1]["epot_eV"]) == pytest.approx(float(ref), rel=1e-12)


def test_resuming_a_complete_run_says_so(tmp_path, argon_file, capsys):
    run = md(argon_file, tmp_path / "run", "steps=3", "ensemble=nve", "temperature=20")
    before = files(run)
    capsys.readouterr()
    args = [f"structure={argon_file}", "index=:", f"output.dir={run}", *LJ, "steps=3",
            "ensemble=nve", "temperature=20", f"resume={run / 'checkpoint.pt'}"]
    assert main(["md", *args]) == 0
    out = capsys.readouterr().out
    assert (f"xnn md: checkpoint {run / 'checkpoint.pt'}: it is at step 3 and steps=3: the "
            "run is already complete, nothing was run; to extend it, resume with a larger "
            "steps (e.g. steps=6)") in out, out
    assert files(run) == before
    # relax: converged, or stopped by max_steps
    rx = relax(argon_file, tmp_path / "rx", "fmax=0.5")
    before = files(rx)
    capsys.readouterr()
    relax(argon_file, rx, "fmax=0.5", f"resume={rx / 'checkpoint.pt'}")
    assert "every system is below fmax=0.5 eV/Å at step 0: the run is already complete" \
        in capsys.readouterr().out
    rx2 = relax(argon_file, tmp_path / "rx2", "fmax=0.0001", "max_steps=3")
    capsys.readouterr()
    relax(argon_file, rx2, "fmax=0.0001", "max_steps=3", f"resume={rx2 / 'checkpoint.pt'}")
    out = capsys.readouterr().out
    assert "it is at step 3 and max_steps=3 (0 of 2 systems converged)" in out, out
    assert "resume with a larger max_steps (e.g. max_steps=6)" in out
    assert files(rx) == before


# ----------------------------------------------------------------------- compile=true
LJ_TERM = "{name: lj, sigma: 2.5, epsilon: 0.01, cutoff: 5.0}"
NACL = ["model.name=lj", "model.hyperparameters={sigma: 2.5, epsilon: 0.01}", "model.cutoff=5.0",
        "output.progress=false", "ensemble=nve", "steps=2", "compile=true"]


@pytest.fixture
def nacl_file(tmp_path):
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    atoms.set_initial_charges([1.0 if z == 11 else -1.0 for z in atoms.numbers])
    path = tmp_path / "nacl.xyz"
    ase.io.write(path, atoms)
    return path


@pytest.mark.parametrize("extra,named", [
    (["model.name=sum", f"model.hyperparameters={{terms: [{LJ_TERM}, {{name: pme, "
      "cutoff: 5.0}]}"], "the term(s) ['pme']"),
    (["model.name=sum", f"model.hyperparameters={{terms: [{LJ_TERM}, {{name: pme, "
      "cutoff: 5.0, charges: {Na: 1, Cl: -1}}]}"], "the term(s) ['pme']"),
    (["model.name=sum", f"model.hyperparameters={{terms: [{LJ_TERM}, {{name: ewald, "
      "cutoff: 5.0}, {name: d3, s9: 0.0}]}"], "the term(s) ['ewald', 'd3']"),
    (["model.name=ewald", "model.hyperparameters={charges: {Na: 1, Cl: -1}}",
      "model.cutoff=5.0"], "the term(s) ['ewald']"),
    (["ensemble=npt", "pressure=0", "model.name=sum",
      f"model.hyperparameters={{terms: [{LJ_TERM}, {{name: d3}}]}}"],
     "ensemble=npt (it compiles ensembles nve, langevin, csvr, nhc; npt moves the cell); nor "
     "the term(s) ['d3']"),
    (["model.compile=true"], "model.compile=true (compile=true compiles the whole step"),
    (["cuda_graph=true", "model.device=cpu"], "cuda_graph=true on device cpu"),
])
def test_compile_refuses_what_it_cannot_compile(tmp_path, nacl_file, extra, named):
    """Before anything is written, one line names every part it does not support (long-range
    terms with data or table charges, alone or inside a sum; NPT; model.compile; CUDA graphs
    on a CPU); the eager run of the same config works."""
    out = tmp_path / "out"
    own_model = any(x.startswith("model.name=") for x in extra)
    base = [x for x in NACL if not (own_model and x.startswith("model."))]
    cfg = load_config(MDConfig, None, [f"structure={nacl_file}", f"output.dir={out}", *base,
                                       *extra])
    msg = raises_one_line(InputError, run_md, cfg)
    assert msg.startswith("compile=true does not support ") and named in msg, msg
    assert "set compile: false" in msg
    assert not out.exists()


def test_compile_refusals_on_several_ranks(nacl_file):
    """Under torchrun the same check runs on every rank before the run layer is built (the
    decomposed compiled step: parallel.mode spatial, no CUDA graphs, no long-range terms, D3
    too)."""
    from xnn.app.md_setup import check_compile

    cfg = load_config(MDConfig, None, [f"structure={nacl_file}", *NACL, "parallel.mode=graph",
                                       "cuda_graph=true"])
    model = build("sum", terms=[{"name": "lj", "sigma": 2.5, "epsilon": 0.01, "cutoff": 5.0},
                                {"name": "d3"}])
    msg = raises_one_line(InputError, check_compile, cfg, model, torch.device("cpu"), True)
    for part in ("the term(s) ['d3']", "cuda_graph=true on device cpu",
                 "cuda_graph=true on several ranks", "parallel.mode=graph (on several ranks"):
        assert part in msg, (part, msg)
    lj = build("lj", sigma=2.5, epsilon=0.01, cutoff=5.0)
    check_compile(load_config(MDConfig, None, NACL), lj, torch.device("cpu"), True)  # compiles


def test_compile_refuses_a_cluster_without_a_cell(tmp_path):
    path = tmp_path / "h2o.xyz"
    ase.io.write(path, molecule("H2O"))
    cfg = load_config(MDConfig, None, [f"structure={path}", f"output.dir={tmp_path / 'o'}",
                                       *NACL, "temperature=0"])
    msg = raises_one_line(InputError, run_md, cfg)
    assert "system 0 has none: give it a box" in msg
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ progress and summary
class FakeClock:
    """Wall clock of the progress lines: one second per reading."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_md_progress_lines_and_summary(tmp_path, argon_file, capsys, monkeypatch):
    """Not on a terminal: a progress line every progress_every_s seconds; at the end a
    summary line and summary.json whose mean temperature and pressure are those of
    thermo.csv's rows, with the fields of a decomposed run's summary (one rank)."""
    monkeypatch.setattr(md_progress, "wall_clock", FakeClock())
    monkeypatch.setattr(md_progress, "on_terminal", lambda: False)
    out = md(argon_file, tmp_path / "run", "ensemble=csvr", "temperature=40", "steps=20",
             "timestep=5", "output.log_every=5", "output.progress=true",
             "output.progress_every_s=6")
    lines = capsys.readouterr().out.splitlines()
    progress = [ln for ln in lines if ln.startswith("xnn md: step ")]
    assert 3 <= len(progress) <= 10, lines
    steps = [int(ln.split()[3].split("/")[0]) for ln in progress]
    assert steps == sorted(steps) and steps[-1] <= 20
    first = progress[0]
    for part in ("/20 (", " ps, T ", " K, Epot ", " eV/atom, ", " steps/s, ", " ns/day"):
        assert part in first, first
    rows = list(csv.DictReader(open(out / "thermo.csv")))
    t = np.mean([float(r["temperature_K"]) for r in rows])
    p = np.mean([float(r["pressure_GPa"]) for r in rows])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_temperature_K"] == pytest.approx(t, rel=1e-12)
    assert summary["mean_pressure_GPa"] == pytest.approx(p, rel=1e-12)
    assert summary["thermo_rows"] == len(rows) // 2 == 5
    assert summary["start_step"] == 0 and summary["step"] == summary["steps_run"] == 20
    assert summary["ns_per_day"] == pytest.approx(
        summary["steps_per_s"] * 5e-6 * 86400, rel=1e-12)
    assert summary["ranks"] == 1 and summary["owned"]["per_rank"] == [64]
    assert {"grid", "ghost", "held", "migrations", "rebuilds", "peak_memory_MiB"} <= set(summary)
    last = lines[-1]
    assert last.startswith("xnn md: steps 0-20 in ") and " ns/day, " in last, last
    assert f"mean T {t:.4g} K, mean P {p:.4g} GPa over 5 thermo rows (2 systems)" in last


def test_relax_progress_lines_and_summary(tmp_path, argon_file, capsys, monkeypatch):
    monkeypatch.setattr(md_progress, "wall_clock", FakeClock())
    monkeypatch.setattr(md_progress, "on_terminal", lambda: False)
    out = relax(argon_file, tmp_path / "rx", "fmax=0.01", "output.progress=true",
                "output.progress_every_s=3")
    lines = capsys.readouterr().out.splitlines()
    progress = [ln for ln in lines if ln.startswith("xnn relax: step ")]
    assert progress and "systems converged, largest force " in progress[0], lines
    summary = json.loads((out / "summary.json").read_text())
    forces = [np.linalg.norm(a.get_forces(), axis=1).max()  # |F| of the atoms
              for a in ase.io.read(out / "relaxed.xyz", ":")]
    assert summary["converged"] == 2 and summary["converged_per_system"] == [True, True]
    assert summary["max_force_eV_A_per_system"] == pytest.approx(forces, rel=1e-6)
    assert summary["ranks"] == 1
    assert lines[-1].startswith(f"xnn relax: 2 of 2 systems converged to fmax=0.01 eV/Å "
                                f"(largest force {max(forces):.3g} eV/Å at step "
                                f"{summary['step']}); steps 0-{summary['step']} in ")


def test_no_progress_lines_when_off(tmp_path, argon_file, capsys, monkeypatch):
    monkeypatch.setattr(md_progress, "wall_clock", FakeClock())
    monkeypatch.setattr(md_progress, "on_terminal", lambda: False)
    md(argon_file, tmp_path / "run", "steps=10", "output.progress_every_s=1")
    lines = capsys.readouterr().out.splitlines()
    assert not [ln for ln in lines if ln.startswith("xnn md: step ")]
    assert lines[-1].startswith("xnn md: steps 0-10 in ")


# ------------------------------------------------------------------ help and timeouts
def test_relax_help_and_the_timeout_key(capsys):
    with pytest.raises(SystemExit):
        main(["relax", "--help"])
    text = capsys.readouterr().out
    assert "e.g. max_steps=500" in text and "e.g. steps=" not in text
    assert "parallel.timeout_s" in text
    for schema in (MDConfig, RelaxConfig):
        assert load_config(schema, None, []).parallel.timeout_s == \
            load_config(TrainConfig, None, []).parallel.timeout_s == 600.0
        assert load_config(schema, None, ["parallel.timeout_s=30"]).parallel.timeout_s == 30
        raises_one_line(ConfigError, load_config, schema, None, ["parallel.timeout_s=0"],
                        match=r"parallel.timeout_s=0.0 must be > 0")
    assert math.isfinite(md_progress.ns_per_day(10, 2.0, 1.0))
