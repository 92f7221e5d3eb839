"""``xnn run`` under torchrun: the systems of a campaign shared among the ranks (issue 42,
item 2).

Two ranks of ``python -m xnn run`` with torchrun's variables (gloo on CPU) run a campaign of
LJ clusters through relax -> NVT: every system is run by one rank, and the folder holds one
``results.csv`` equal to one process's (same rows in the same order, numbers to 1e-10 in
fp64: a system's numbers do not depend on its batch), the same trajectories and final
structures. A campaign killed with SIGKILL on both ranks resumes on two ranks to the
uninterrupted campaign's files; resumed in one process, or a killed one-process campaign
resumed on two ranks, it gives one process's results.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest

from xnn.app import workflow_files as wf
from xnn.app.workflow import run_workflow

ROOT = Path(__file__).resolve().parents[1]
LJ = {"sigma": 3.405, "epsilon": 0.0104, "cutoff": 8.0}
LJ_HP = {k: v for k, v in LJ.items() if k != "cutoff"}  # model.hyperparameters
LJ_MODEL = ["model.name=lj", f"model.hyperparameters={LJ_HP}", f"model.cutoff={LJ['cutoff']}"]
N = 9  # clusters of 5-12 atoms
STAGES = ["stages.0.type=relax", "stages.0.fmax=0.01", "stages.0.max_steps=150",
          "stages.1.type=nvt", "stages.1.temperature=40", "stages.1.steps=20",
          "stages.1.timestep=4", "stages.1.friction=0.02"]

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]


def _clusters(n: int, seed: int) -> list:
    spec = importlib.util.spec_from_file_location(
        "make_clusters", ROOT / "examples" / "workflow" / "make_clusters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.clusters(n, seed)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: list[str], world: int = 2) -> list[subprocess.Popen]:
    """``python -m xnn run ARGS`` on ``world`` ranks, as torchrun starts them."""
    port = _port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return [subprocess.Popen([sys.executable, "-m", "xnn", "run", *args],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world)]


def _wait(procs: list[subprocess.Popen], timeout_s: float = 240.0) -> list[tuple]:
    """``(returncode, stdout, stderr)`` of each rank; kills them all past the deadline."""
    deadline, out = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            o, e = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("the ranks did not finish in time") from None
    return out


def _table(folder: Path) -> list[dict]:
    with open(folder / "results.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _same_rows(a: Path, b: Path, tol: float) -> None:
    """The same rows in the same order; numbers equal to ``tol`` (relative), timing aside."""
    ra, rb = _table(a), _table(b)
    assert [(r["id"], r["stage"]) for r in ra] == [(r["id"], r["stage"]) for r in rb]
    for x, y in zip(ra, rb):
        for c in x:
            if c == "wall_s":
                continue
            try:
                u, v = float(x[c]), float(y[c])
            except ValueError:
                assert x[c] == y[c], (x["id"], x["stage"], c)
                continue
            if np.isfinite(u) or np.isfinite(v):
                assert abs(u - v) <= tol * max(1.0, abs(u)), (x["id"], x["stage"], c, u, v)


def _same_frames(a: Path, b: Path, tol: float) -> None:
    fa, fb = ase.io.read(a, index=":"), ase.io.read(b, index=":")
    assert [f.info.get("stage") for f in fa] == [f.info.get("stage") for f in fb]
    for x, y in zip(fa, fb, strict=True):
        np.testing.assert_allclose(x.positions, y.positions, rtol=0, atol=tol)
        np.testing.assert_allclose(x.get_velocities(), y.get_velocities(), rtol=0, atol=tol)


@pytest.fixture(scope="module")
def campaigns(tmp_path_factory):
    """The same campaign (9 clusters, 2 slots per process) in one process and on 2 ranks
    (launched as torchrun launches them: the door users take, worth its ~10 s)."""
    d = tmp_path_factory.mktemp("ranks")
    frames = _clusters(N, seed=4)
    ase.io.write(d / "c.xyz", frames, format="extxyz")
    common = [f"structure={d / 'c.xyz'}", *LJ_MODEL, "slots=2",
              "output.progress=false", "output.trajectory_every=10", *STAGES]
    one = run_workflow(None, [*common, f"output.dir={d / 'one'}"])
    runs = _wait(_launch([*common, f"output.dir={d / 'two'}"]))
    for code, _, err in runs:
        assert code == 0, err
    return common, one, d / "two", runs


def test_two_ranks_share_the_systems_and_write_one_process_files(campaigns):
    """Each system is run by one rank (its rows in that rank's table, each stage once); the
    merged results.csv, trajectories and final.xyz equal one process's; rank 0 alone logs."""
    _, one, two, runs = campaigns
    parts = [_table_rows(two / "ranks" / f"g000_results_{r:05d}.csv") for r in range(2)]
    ids = [{int(r["id"]) for r in p} for p in parts]
    assert ids[0] and ids[1] and not ids[0] & ids[1] and ids[0] | ids[1] == set(range(N))
    rows = _table(two)
    assert len(rows) == len({(r["id"], r["stage"]) for r in rows}) == 2 * N  # no row twice
    _same_rows(one, two, 1e-10)
    for i in range(N):
        name = f"sys_{i:05d}.xyz"
        _same_frames(one / "trajectories" / name, two / "trajectories" / name, 1e-10)
    _same_frames(one / "final.xyz", two / "final.xyz", 1e-10)
    s1, s2 = (json.loads((f / "summary.json").read_text()) for f in (one, two))
    assert s1["stages"] == s2["stages"] and s2["systems"] == N
    assert f"{N} systems through relax -> nvt, 2 slots on each of 2 ranks" in runs[0][1]
    assert "done; results in" in runs[0][1] and "systems through" not in runs[1][1]


def _table_rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _kill_when(procs: list[subprocess.Popen], tables, rows: int) -> None:
    """SIGKILL every process once the tables ``tables()`` hold ``rows`` rows."""
    try:
        while all(p.poll() is None for p in procs):
            if sum(t.read_text().count("\n") - 1 for t in tables() if t.is_file()) >= rows:
                break
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), "the campaign ended before the kill"
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


@pytest.mark.slow  # two launches of two ranks
def test_kill_9_on_both_ranks_and_resume_on_two_ranks_or_one_process(campaigns, tmp_path):
    """SIGKILL both ranks once some stages are done. Resumed on two ranks: the uninterrupted
    campaign's results.csv (bitwise but the timing), trajectories and final structures.
    A copy resumed in one process takes over both ranks' systems: one process's results
    (to 1e-10: other batches), no stage run twice."""
    common, one, full, _ = campaigns
    out = tmp_path / "killed"
    procs = _launch([*common, f"output.dir={out}", "output.checkpoint_every=5"])
    _kill_when(procs, lambda: list((out / "ranks").glob("g000_results_*.csv")), 4)
    assert not (out / "results.csv").exists()  # merged only when the campaign completes
    done = sum(len(_table_rows(out / "ranks" / f"g000_results_{r:05d}.csv")) for r in range(2))
    assert 4 <= done < 2 * N
    in_flight = [i for r in range(2) for pool in wf.load_campaign(
        out / "ranks" / f"g000_checkpoint_{r:05d}.pt", "cpu")[0] if pool for i in pool[1]]
    assert in_flight  # systems in the middle of a stage are taken over
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    runs = _wait(_launch([*common, f"output.dir={out}", "output.checkpoint_every=5",
                          f"resume={out / 'checkpoint.pt'}"]))
    for code, _, err in runs:
        assert code == 0, err
    assert "resumed at batch step" in runs[0][1]
    _same_rows(full, out, 0.0)
    for i in range(N):
        name = f"sys_{i:05d}.xyz"
        assert (out / "trajectories" / name).read_bytes() == \
            (full / "trajectories" / name).read_bytes()
    assert (out / "final.xyz").read_bytes() == (full / "final.xyz").read_bytes()
    run_workflow(None, [*common, f"output.dir={copy}", f"resume={copy / 'checkpoint.pt'}"])
    manifest = wf.read_checkpoint(copy / "checkpoint.pt")
    assert (manifest["world_size"], manifest["generation"]) == (1, 1)
    assert 0 < len(_table_rows(copy / "ranks" / "g001_done.csv")) <= done  # checkpointed
    _same_rows(one, copy, 1e-10)
    _same_frames(one / "final.xyz", copy / "final.xyz", 1e-10)
    for i in range(N):
        name = f"sys_{i:05d}.xyz"
        _same_frames(one / "trajectories" / name, copy / "trajectories" / name, 1e-10)


@pytest.mark.slow  # a launch of one process, then of two ranks
def test_a_killed_one_process_campaign_resumes_on_two_ranks(campaigns, tmp_path):
    """A one-process campaign killed with SIGKILL, resumed on two ranks: the ranks share its
    in-flight and queued systems; one process's results to 1e-10, no stage run twice."""
    common, one, _, _ = campaigns
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "xnn", "run", *common,
                             f"output.dir={out}", "output.checkpoint_every=5"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _kill_when([proc], lambda: [out / "results.csv"], 4)
    assert wf.load_campaign(out / "checkpoint.pt", "cpu")[0][0] is not None  # relaxing
    runs = _wait(_launch([*common, f"output.dir={out}", f"resume={out / 'checkpoint.pt'}"]))
    for code, _, err in runs:
        assert code == 0, err
    manifest = wf.read_checkpoint(out / "checkpoint.pt")
    assert (manifest["world_size"], manifest["generation"]) == (2, 1)
    _same_rows(one, out, 1e-10)
    _same_frames(one / "final.xyz", out / "final.xyz", 1e-10)
    for i in range(N):
        name = f"sys_{i:05d}.xyz"
        _same_frames(one / "trajectories" / name, out / "trajectories" / name, 1e-10)
