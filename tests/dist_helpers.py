"""Helpers of the multi-rank tests; :func:`spawn` is :func:`xnn.testing.ranks.spawn`.

Spawning costs seconds per rank on a small machine, so a test module should spawn ONE set of
ranks per world size and run many cases inside it (see ``tests/test_distributed_dd.py``).
The function runs with torchrun-like variables set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), so ``DistributedManager.initialize()`` works inside it.
"""

from __future__ import annotations

import os
import socket

from xnn.testing.ranks import free_port, spawn  # noqa: F401 - the one spawn, re-exported


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class FreshPorts:
    """Destroy ``manager``'s process group; hand out one new ``MASTER_PORT`` per later group.

    A worker that brings up more process groups (e.g. by running ``xnn md`` in-process after
    its own cases, once or several times) must not reuse a port: a rank that re-initialises
    quickly can reach the old store before rank 0 has released it, and rank 0 then hangs in
    ``init_process_group``. Rank 0 picks ``n`` ports and broadcasts them over the old group;
    call :meth:`next` before each new group.
    """

    def __init__(self, manager, n: int):
        import torch.distributed as dist

        box = [free_ports(n) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        manager.cleanup()
        self._ports = list(box[0])

    def next(self) -> None:
        os.environ["MASTER_PORT"] = str(self._ports.pop(0))


def cli_on_port(port: int, argv: list[str]) -> tuple[int, str]:
    """``xnn ARGV`` in this rank on a fresh process group (rendezvous port ``port``): its
    exit code and what it wrote to stderr."""
    import contextlib
    import io

    from xnn.cli.main import main

    os.environ["MASTER_PORT"] = str(port)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()
