"""``srun ... python -m xnn train`` without SLURM: ranks started as plain processes with only
the variables srun sets (head node through a fake ``scontrol`` first on ``PATH``) join one
process group and train exactly as the same ranks launched torchrun-style."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from xnn.data.emt import write_emt
from xnn.distributed.manager import detect_launch, first_host
from xnn.errors import InputError

REPO = Path(__file__).resolve().parents[1]
# launcher variables of the caller's environment that must not leak into the ranks
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "XNN_DISTRIBUTED_INIT_METHOD")

CONFIG = """\
model:
  name: schnet
  cutoff: 3.0
  hyperparameters: {num_features: 8, num_filters: 8, num_interactions: 1, num_basis: 8}
data:
  datasets:
    - {path: cu.xyz}
  val_fraction: 0.25
  batch_size: 4
optim: {lr: 0.01}
max_epochs: 2
precision: fp64
device: cpu
logging: {plots: false, progress_bar: false}
parallel: {timeout_s: 60}
"""


def _free_port(lo: int = 0, hi: int = 0) -> int:
    """A port free now: any (``lo == hi == 0``) or one in ``[lo, hi)``."""
    for _ in range(200):
        port = random.randrange(lo, hi) if hi else 0
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{lo}, {hi})")


def _base_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _srun_env(base: dict, rank: int, host: str, job_id: int) -> dict:
    """What ``srun -N1 -n2`` sets for task ``rank`` on one node (no MASTER_*, no RANK)."""
    return {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": "2", "SLURM_NPROCS": "2", "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_JOB_ID": str(job_id), "SLURM_JOBID": str(job_id), "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": host, "SLURM_NODELIST": host, "SLURM_STEP_NODELIST": host,
            "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": host}


def _torchrun_env(base: dict, rank: int, port: int) -> dict:
    return {**base, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _start(env: dict, cwd: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "xnn", "train", "cfg.yaml", *overrides]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(procs: dict, timeout_s: float) -> dict:
    """``{name: (returncode, stdout, stderr)}``; kills every process past the deadline."""
    deadline, done = time.monotonic() + timeout_s, {}
    try:
        for name, p in procs.items():
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            done[name] = (p.returncode, out, err)
    except subprocess.TimeoutExpired:
        for p in procs.values():
            p.kill()
        raise AssertionError(f"ranks did not finish within {timeout_s} s: "
                             f"{ {n: r[0] for n, r in done.items()} }") from None
    return done


def _state(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)["model"]["state_dict"]


@pytest.mark.distributed
def test_srun_launch_matches_torchrun(tmp_path):
    write_emt(tmp_path / "cu.xyz", 12, ["Cu"], seed=2)
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        host = "localhost"
    # real SLURM expands the node list with scontrol; this one logs its call and answers
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "scontrol_calls.txt"
    scontrol = fake_bin / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\necho "{host}"\n')
    scontrol.chmod(0o755)
    base = _base_env()
    srun_base = {**base, "PATH": f"{fake_bin}{os.pathsep}{base.get('PATH', '')}"}
    # without MASTER_PORT the port is 15000 + SLURM_JOB_ID % 20000: pick a job id giving a free one
    job_id = 7 * 20000 + _free_port(15000, 35000) - 15000
    port = 15000 + job_id % 20000

    procs = {f"srun{r}": _start(_srun_env(srun_base, r, host, job_id), tmp_path,
                                "output_dir=srun") for r in range(2)}
    torchrun_port = _free_port()
    procs.update({f"torchrun{r}": _start(_torchrun_env(base, r, torchrun_port), tmp_path,
                                         "output_dir=torchrun") for r in range(2)})
    procs["forced_env"] = _start({**_srun_env(srun_base, 0, host, job_id + 1),
                                  "XNN_DISTRIBUTED_INIT_METHOD": "ENV"}, tmp_path,
                                 "output_dir=forced")
    res = _wait(procs, timeout_s=150)

    for name in ("srun0", "srun1", "torchrun0", "torchrun1"):
        assert res[name][0] == 0, f"{name} failed:\n{res[name][2][-3000:]}"
    # (a) both srun tasks joined ONE group of 2 at the head node found through scontrol
    joined = [ln for ln in res["srun0"][1].splitlines() if ln.startswith("distributed:")]
    assert joined == [f"distributed: 2 ranks joined one process group (launched by SLURM, "
                      f"backend gloo, rendezvous {host}:{port})"]
    assert "launched by ENV" in res["torchrun0"][1]
    assert not res["srun1"][1].strip() and not res["torchrun1"][1].strip()  # rank 0 logs
    assert calls.read_text().splitlines() == [f"show hostnames {host}"] * 2
    # (b) the same training as the torchrun-style launch
    a, b = _state(tmp_path / "srun/checkpoints/last.pt"), \
        _state(tmp_path / "torchrun/checkpoints/last.pt")
    assert a.keys() == b.keys()
    for k in a:
        scale = max(b[k].abs().max().item(), 1e-300)
        assert (a[k] - b[k]).abs().max().item() <= 1e-10 * scale, k
    for name in ("srun", "torchrun"):
        assert "stopped by max_epochs after 2 epochs, 6 steps" in res[f"{name}0"][1]
    # (c) ENV forced with only SLURM variables: one clear line, no rendezvous attempt
    rc, out, err = res["forced_env"]
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "xnn train: error: XNN_DISTRIBUTED_INIT_METHOD=ENV needs RANK and WORLD_SIZE (set by "
        "torchrun) in the environment (only SLURM variables are set: launch with torchrun, or "
        "set XNN_DISTRIBUTED_INIT_METHOD=SLURM or unset it)"]
    assert not (tmp_path / "forced").exists()


def test_first_host_of_nodelists():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("rack[1-2]-n[03-04]") == "rack1-n03"
    assert first_host("nodeA,nodeB") == "nodeA"
    assert first_host("n[5]") == "n5"
    assert first_host("localhost") == "localhost"
    with pytest.raises(InputError, match="host list"):
        first_host("n[1-2")


def test_detect_slurm_paths(tmp_path, monkeypatch):
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_LOCALID": "1", "SLURM_STEP_ID": "2", "SLURM_JOB_ID": "40001",
           "SLURM_JOB_NODELIST": "n[01-08]", "SLURM_STEP_NODELIST": "n[05-06]",
           "SLURM_LAUNCH_NODE_IPADDR": "10.9.9.9"}
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol (as inside a container): parsed
    info = detect_launch(env)
    # a step smaller than the job: its own task count and first node, not the launch host
    assert (info.method, info.rank, info.world_size, info.local_rank) == ("SLURM", 3, 4, 1)
    assert (info.master_addr, info.master_port) == ("n05", 15000 + 40001 % 20000)
    assert detect_launch({**env, "MASTER_ADDR": "h", "MASTER_PORT": "123"}).master_port == 123
    nolist = {k: v for k, v in env.items() if not k.endswith("NODELIST")}
    assert detect_launch(nolist).master_addr == "10.9.9.9"
    # a batch script's own process (no srun step) runs alone instead of waiting for 15 ranks
    batch = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP")}
    with pytest.warns(UserWarning, match="not started by srun"):
        assert detect_launch(batch).method == "NONE"
    forced = detect_launch({**batch, "XNN_DISTRIBUTED_INIT_METHOD": "slurm"})
    assert (forced.world_size, forced.master_addr) == (16, "n01")
    # a one-task step (an interactive shell's step inside a bigger job) is one process
    assert detect_launch({**env, "SLURM_STEP_NUM_TASKS": "1"}).method == "NONE"
    with pytest.raises(InputError, match="only SLURM variables are set"):
        detect_launch({**env, "XNN_DISTRIBUTED_INIT_METHOD": "env"})
    scontrol = tmp_path / "scontrol"  # a failing scontrol is reported, not ignored
    scontrol.write_text("#!/bin/sh\nexit 1\n")
    scontrol.chmod(0o755)
    with pytest.raises(InputError, match="scontrol show hostnames n\\[05-06\\]"):
        detect_launch(env)
