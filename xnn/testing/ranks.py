"""Spawn a set of gloo ranks on this machine, run one function on each, return their results.

Spawning costs seconds per rank on a small machine, so run many cases in ONE set of ranks
(:func:`xnn.testing.check_decomposition` does). The function runs with torchrun-like
variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so
:meth:`xnn.distributed.DistributedManager.initialize` works inside it.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, out_dir, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ.pop("XNN_DISTRIBUTED_INIT_METHOD", None)
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    # the result is on disk (complete: written, then renamed) before the process group is
    # torn down, so that a crash of gloo's teardown is told apart from a failed rank
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)
    from xnn.distributed import collectives as C

    if C.is_active():
        try:  # nobody tears down while a peer still has work in flight (a barrier)
            C.all_reduce_(torch.zeros(1))
        except RuntimeError:
            pass
    # leave without running the process group's C++ destructors: under load gloo's teardown
    # has aborted a rank ("terminate called without an active exception") after its work
    # was done; the result is stored, so there is nothing left to clean up
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 180.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes.

    Args:
        fn: a module-level (importable) function; ``args`` must pickle.
        world_size: number of ranks.
        timeout_s: wall-clock limit for all ranks together.
    Returns:
        the list of per-rank return values (in rank order).
    Raises:
        the failing rank's error (with its traceback) if a rank raised;
        ``TimeoutError`` if the ranks did not finish within ``timeout_s``.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        stored = [os.path.join(out_dir, f"rank{r}.pkl") for r in range(world_size)]
        deadline = time.monotonic() + timeout_s
        # poll the processes ourselves: ProcessContext.join kills every rank as soon as one
        # dies, even a rank that died in teardown after storing its result while the others
        # were still storing theirs
        while any(p.is_alive() for p in ctx.processes):
            failed = [r for r, p in enumerate(ctx.processes)
                      if p.exitcode not in (None, 0) and not os.path.exists(stored[r])]
            if failed:
                ctx.join()  # terminates the others and raises with the rank's traceback
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s} s")
            time.sleep(0.1)
        if not all(os.path.exists(f) for f in stored):
            ctx.join()  # raises: some rank exited without a result
            raise RuntimeError("a rank exited without storing its result")
        for r, p in enumerate(ctx.processes):
            if p.exitcode != 0:
                warnings.warn(f"rank {r} exited with code {p.exitcode} after storing its "
                              "result (a crash in teardown); results kept", stacklevel=2)
        results = []
        for f in stored:
            with open(f, "rb") as fh:
                results.append(pickle.load(fh))
        return results
