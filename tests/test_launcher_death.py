"""Ranks started by torchrun exit when the launcher is killed alone; other launches are left
alone. Real torchrun, real ranks: the ranks write their pids and heartbeats, the test kills
only the launcher (SIGKILL) and waits for the ranks to be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

RANK_SCRIPT = textwrap.dedent("""
    import ctypes, os, sys, time
    from xnn.distributed.manager import DistributedManager

    out, mode = sys.argv[1], sys.argv[2]
    manager = DistributedManager.initialize(backend="gloo", device="cpu", timeout_s=60)
    got = ctypes.c_int(0)
    if sys.platform.startswith("linux"):  # PR_GET_PDEATHSIG
        ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)
    path = os.path.join(out, f"rank{manager.rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {got.value}")
    os.replace(path + ".tmp", path)
    manager.barrier()
    if mode == "run":  # a long run that writes
        for _ in range(600):
            with open(path + ".beat", "a") as f:
                f.write("x")
            time.sleep(0.1)
    manager.cleanup()
    open(path + ".done", "w").close()
""")


def _gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its new parent counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def _torchrun(tmp: Path, mode: str) -> subprocess.Popen:
    script = tmp / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                              "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]),
                                         env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "0", "--standalone", str(script), str(tmp), mode]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_for(paths, launcher, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if launcher.poll() is not None:
            out = launcher.stdout.read().decode(errors="replace")
            raise AssertionError(f"torchrun exited with {launcher.returncode}:\n{out}")
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)


def test_ranks_exit_when_torchrun_is_killed(tmp_path):
    launcher = _torchrun(tmp_path, "run")
    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    pids = []
    try:
        _wait_for(ranks, launcher)
        pids, sigs = zip(*[map(int, p.read_text().split()) for p in ranks])
        time.sleep(1.0)  # alive and writing under a live launcher
        assert not any(_gone(pid) for pid in pids)
        launcher.kill()  # SIGKILL: torchrun cannot stop its ranks
        launcher.wait()
        deadline = time.monotonic() + 5.0
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [pid for pid in pids if not _gone(pid)]
        assert not alive, f"ranks {alive} still run after the launcher was killed"
        beats = [(tmp_path / f"rank{r}.beat").stat().st_size for r in range(2)]
        time.sleep(0.5)
        assert beats == [(tmp_path / f"rank{r}.beat").stat().st_size for r in range(2)]
        if sys.platform.startswith("linux"):  # the kernel's parent-death signal
            assert sigs == (signal.SIGTERM, signal.SIGTERM), sigs
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # a second torchrun launch (~15 s on 2 busy cores)
def test_ranks_finish_normally_under_torchrun(tmp_path):
    launcher = _torchrun(tmp_path, "exit")
    try:
        out, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, out.decode(errors="replace")
    assert all((tmp_path / f"rank{r}.done").exists() for r in range(2))


def test_only_torchrun_ranks_are_watched():
    from xnn.distributed.manager import LaunchInfo, exit_with_launcher, started_by_torchrun

    env = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
    torchrun = LaunchInfo("ENV", 0, 2, 0, "127.0.0.1", 29500)
    assert started_by_torchrun(torchrun, env)
    # RANK/WORLD_SIZE from another launcher (torch.multiprocessing, a script), srun, alone
    assert not started_by_torchrun(torchrun, {"RANK": "0", "WORLD_SIZE": "2"})
    for launch in (LaunchInfo("SLURM", 0, 2, 0, "node1", 15000), LaunchInfo("NONE", 0, 1, 0)):
        assert not started_by_torchrun(launch, env)
        assert exit_with_launcher(launch, env) is None


WATCHED = textwrap.dedent("""
    import os, sys, threading, time
    from xnn.distributed import manager

    threading.Thread(target=manager._watch_parent, daemon=True,
                     args=(os.getppid(), int(manager.LAUNCHER_DEATH_SIGNAL))).start()
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(60)
""")


def test_watchdog_fallback_ends_a_process_whose_parent_died(tmp_path):
    """Where the kernel offers no parent-death signal, a thread polls the parent's pid."""
    script, ready = tmp_path / "watched.py", tmp_path / "pid"
    script.write_text(WATCHED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" "{script}" "{ready}"; true'],
                              env=env)
    pid = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() or not ready.read_text():
            assert parent.poll() is None and time.monotonic() < deadline, "did not start"
            time.sleep(0.05)
        pid = int(ready.read_text())
        assert not _gone(pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5.0
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), "the watched process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)
