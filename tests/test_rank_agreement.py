"""Ranks that disagree (xnn train, md, validate) stop at once with one clear error on every
rank; a collective that times out names itself and the ranks that did not arrive (2 gloo
ranks, one spawn)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import cli_on_port as _cli
from dist_helpers import free_port, spawn

from xnn.data.emt import write_emt

pytestmark = pytest.mark.distributed

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


def _train_args(data: str, out: str, *extra: str) -> list[str]:
    return ["train", f"data.datasets.0.path={data}", f"output_dir={out}", "model.cutoff=3.0",
            TINY, "max_steps=1", "device=cpu", "logging.plots=false",
            "logging.progress_bar=false", *extra]


def _md_args(structure: str, out: str, *extra: str) -> list[str]:
    return ["md", f"structure={structure}", "model.name=lj",
            "model.hyperparameters={sigma: 2.3, epsilon: 0.4}", "model.cutoff=5.0",
            "model.device=cpu",
            "steps=2", f"output.dir={out}", "output.progress=false", "output.plot=false",
            *extra]


def _busy_until(flag: Path, cap_s: float) -> None:
    """Rank-local work until rank 0 has written ``flag`` (it has its error: its timeout and
    its wait for answers are over), at most ``cap_s``: no answer from this rank in between,
    however loaded the machine, and no longer than needed."""
    deadline = time.monotonic() + cap_s
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _timeout(port: int, rank: int, other: str, flag: Path) -> str | None:
    """Rank 0 all-reduces; rank 1 does ``other`` ("sleep": rank-local work past the timeout
    and the wait for answers, "barrier": another collective). Returns the error message."""
    from xnn.distributed import collectives as C
    from xnn.distributed.manager import DistributedManager

    os.environ["MASTER_PORT"] = str(port)
    manager = DistributedManager.initialize(timeout_s=2.0, device="cpu")
    # start the timed collectives together: a rank that started > 2 s after the other (a
    # loaded CI machine) found it already torn down after its wait for answers (the test
    # then saw "lost the connection" instead of the timeout it checks)
    manager.barrier()
    try:
        with manager.watch():
            if rank == 0:
                C.all_reduce_(torch.ones(1))
            elif other == "sleep":
                _busy_until(flag, 30.0)
            else:
                manager.barrier()
    except (C.CollectiveTimeout, C.RemoteRankError) as e:
        return str(e)
    finally:
        if rank == 0:
            flag.touch()
        manager.cleanup()
    return None


def _stalled_md(port: int, rank: int, structure: str, out: str,
                flag: Path) -> tuple[int, str]:
    """``xnn md parallel.timeout_s=2`` in which rank 1 is busy in step 1's safety checks
    (rank-local work) until rank 0, waiting in the step's next collective, has stopped."""
    import xnn.app.md as md_app

    checks = md_app._check

    def slow_check(state, *args):
        if rank == 1 and state.step == 1:
            _busy_until(flag, 30.0)
        return checks(state, *args)

    md_app._check = slow_check
    try:
        return _cli(port, _md_args(structure, out, "parallel.timeout_s=2"))
    finally:
        md_app._check = checks
        if rank == 0:
            flag.touch()


def _rank_main(rank, world, tmp, data, data_copy, data_other, ports):
    from xnn.app.train_data import data_files
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.distributed.agreement import check_ranks_agree, run_fingerprint
    from xnn.distributed.manager import DistributedManager

    out = {}
    # 1. one rank given another override: both stop before the first training collective
    lr = ["optim.lr=0.01"] if rank == 1 else []
    out["lr"] = _cli(ports[0], _train_args(data, f"{tmp}/lr", *lr))
    # 2. a data file whose content differs on rank 1
    out["data"] = _cli(ports[1], _train_args(data_other if rank else data, f"{tmp}/data"))
    # 3. xnn md: another temperature on rank 1
    t = ["temperature=310"] if rank == 1 else []
    out["md"] = _cli(ports[2], _md_args(f"{tmp}/ar.xyz", f"{tmp}/md", *t))
    # 4. the same data under another path (a node-local copy) agrees
    os.environ["MASTER_PORT"] = str(ports[3])
    manager = DistributedManager.initialize(device="cpu")
    try:
        mine = data_copy if rank else data
        cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={mine}"])
        check_ranks_agree(run_fingerprint(cfg, data_files(cfg.data)))
        out["copy"] = "agreed"
    finally:
        manager.cleanup()
    # 5. timeouts: rank 1 in another collective; then rank 1 busy (no answer)
    out["barrier"] = _timeout(ports[4], rank, "barrier", Path(tmp) / "barrier_done")
    out["sleep"] = _timeout(ports[5], rank, "sleep", Path(tmp) / "sleep_done")
    # 6. xnn validate: another tolerance on rank 1
    tol = ["--tol", "1e-6"] if rank == 1 else []
    out["validate"] = _cli(ports[6], ["validate", "--model", "lj:sigma=2.3,epsilon=0.4,cutoff=5.0",
                                      "--structure", f"{tmp}/ar.xyz", "--device", "cpu",
                                      "--parallel.timeout_s", "60", "--json",
                                      f"{tmp}/validate.json", *tol])
    # 7. xnn md with a stalled rank: the run's own parallel.timeout_s, named in the message
    out["md_stall"] = _stalled_md(ports[7], rank, f"{tmp}/ar.xyz", f"{tmp}/stall",
                                  Path(tmp) / "stall_done")
    return out


def test_disagreeing_ranks_and_timeouts(tmp_path):
    from ase.build import bulk
    from ase.io import write

    data, other = tmp_path / "cu.xyz", tmp_path / "cu_other.xyz"
    write_emt(data, 6, ["Cu"], seed=2)
    write_emt(other, 6, ["Cu"], seed=3)
    copy = tmp_path / "node2" / "cu.xyz"
    copy.parent.mkdir()
    copy.write_bytes(data.read_bytes())
    write(tmp_path / "ar.xyz", bulk("Ar", "fcc", a=5.3, cubic=True))
    ports = [free_port() for _ in range(8)]
    results = spawn(_rank_main, 2, args=(str(tmp_path), str(data), str(copy), str(other),
                                         ports), timeout_s=300)
    for r in results:
        code, err = r["lr"]
        assert code == 2 and len(err.strip().splitlines()) == 1, err  # one line, no traceback
        assert "not started with the same config" in err and "rank 1 in optim.lr" in err, err
        assert "0.001 on rank 0, 0.01 on rank 1" in err, err
        code, err = r["data"]
        assert code == 2 and "rank 1 in data.datasets.0.path (file:" in err, err
        code, err = r["md"]
        assert code == 2 and "rank 1 in temperature (300.0 on rank 0, 310.0 on rank 1)" in err
        assert r["copy"] == "agreed"
        code, err = r["validate"]
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "rank 1 in tol (1e-10 on rank 0, 1e-06 on rank 1)" in err, err
    # nothing was written by the refused runs
    assert not any((tmp_path / d).exists() for d in ("lr", "data", "md", "validate.json"))
    # rank 0 waited in all_reduce, rank 1 in a barrier: each names the other's collective
    a, b = results[0]["barrier"], results[1]["barrier"]
    assert "collective all_reduce in all_reduce_ (xnn/distributed/collectives.py:" in a, a
    if "lost the connection" in a:  # rank 0's own 2 s ended after rank 1 had stopped (a
        # loaded machine starts the two clocks apart): rank 0 then says that rank 1 stopped
        assert "that rank stopped (its own message says why)" in a, a
    else:
        assert "timed out after 2 s on rank 0" in a and "rank 1 waits in barrier in barrier" in a
    assert "timed out after 2 s on rank 1" in b and "rank 0 waits in all_reduce" in b, b
    # rank 1 never came: named as not arrived
    assert "rank(s) [1] did not arrive" in results[0]["sleep"], results[0]["sleep"]
    assert results[1]["sleep"] is None
    # xnn md: rank 0 stops after md's parallel.timeout_s (2 s, not 600) and names that key
    code, err = results[0]["md_stall"]
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "timed out after 2 s on rank 0" in err and "rank(s) [1] did not arrive" in err, err
    assert "raise parallel.timeout_s (e.g. parallel.timeout_s=4)" in err, err
    assert "xnn train" not in err, err
    assert results[1]["md_stall"][0] != 0
