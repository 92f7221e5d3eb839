"""Two gloo ranks under ``torchrun`` (lazy HDF5, one DataLoader worker per rank, shares
balanced by atoms, a checkpoint every 3 steps) killed together by SIGKILL right after a
mid-epoch checkpoint, then resumed with ``resume=auto``: the step losses and final weights of
the uninterrupted 2-rank run, bitwise."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from streaming_helpers import cli_args, small_cu, step_losses, write_h5

from xnn.training.checkpoint import load_checkpoint

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ARGS = ("max_epochs=2", "data.val_fraction=0.1", "data.max_atoms_per_batch=24",
        "data.balance=atoms", "data.num_workers=1", "checkpoint_every_steps=3")


def _torchrun(out: Path, data: Path, *extra: str) -> subprocess.Popen:
    import sys

    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [exe, "--standalone", "--nproc_per_node=2", "-m", "xnn", "train",
           *cli_args(out, f"data.datasets.0.path={data}", *ARGS, *extra)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (torchrun starts its ranks in sessions of their own,
    so a process group does not hold them)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank and loader worker under it, at once."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]


def test_two_ranks_sigkilled_mid_epoch_resume_bitwise(tmp_path):
    from streaming_helpers import assert_same_weights

    data = write_h5(tmp_path / "cu.h5", small_cu(120, seed=3))
    _finish(_torchrun(tmp_path / "ref", data))
    ref = step_losses(tmp_path / "ref")

    out = tmp_path / "killed"
    proc = _torchrun(out, data)
    last, seen = out / "checkpoints/last.pt", None
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if last.is_file():
                try:
                    p = load_checkpoint(last)["progress"]
                except Exception:  # noqa: BLE001 - being replaced right now: look again
                    p = None
                if p is not None and p["batch_in_epoch"] > 0:
                    _kill_all(proc)
                    seen = p
                    break
            time.sleep(0.02)
    finally:
        if seen is None:
            _kill_all(proc)
        proc.wait(60)
    assert seen is not None, proc.stderr.read().decode()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    killed_at = load_checkpoint(last)["progress"]
    assert 0 < killed_at["batch_in_epoch"] and killed_at["step"] < len(ref)
    assert len(step_losses(out)) < len(ref)  # the run was cut short

    _finish(_torchrun(out, data, "resume=auto"))
    assert step_losses(out) == ref
    assert_same_weights(tmp_path / "ref", out)
