"""Spawn a set of gloo ranks on CPU, run one function on each, and return their results.

Spawning costs seconds per rank on a small machine, so a test module should spawn ONE set of
ranks per world size and run many cases inside it (see ``tests/test_distributed_dd.py``).
The function runs with torchrun-like variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so ``DistributedManager.initialize()`` works inside it.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import warnings

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, out_dir, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("XNN_DISTRIBUTED_INIT_METHOD", None)
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        # the result is on disk (complete: written, then renamed) before the process group
        # is torn down, so that a crash of gloo's teardown is told apart from a failed rank
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, args: tuple = (), timeout_s: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    ``fn`` must be importable (module level). Returns the list of per-rank return values;
    raises if a rank raised or if the ranks did not finish within ``timeout_s``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if ctx.join(timeout=0.5):
                    break
            except mp.ProcessExitedException as err:
                # a rank killed by a signal AFTER every rank stored its result died in the
                # process group's teardown (seen: gloo's "terminate called without an active
                # exception" under load); any other death is a failure
                done = all(os.path.exists(os.path.join(out_dir, f"rank{r}.pkl"))
                           for r in range(world_size))
                if err.signal_name is None or not done:
                    raise
                warnings.warn(f"rank {err.error_index} crashed in teardown ({err.signal_name}) "
                              "after every rank had finished; results kept", stacklevel=2)
                break
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
        results = []
        for r in range(world_size):
            with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
