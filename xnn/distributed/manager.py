"""Launch detection and process-group set-up: torchrun, SLURM, or a single process.

``DistributedManager.initialize()`` looks at the environment:

* torchrun (or any ``env://`` launcher): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the head node is
  ``MASTER_ADDR`` if set, else ``SLURM_LAUNCH_NODE_IPADDR``, else the first host of
  ``scontrol show hostnames $SLURM_JOB_NODELIST``; the port is ``MASTER_PORT`` or derived from
  the job id;
* otherwise a single process, without initialising ``torch.distributed``.

``XNN_DISTRIBUTED_INIT_METHOD=ENV|SLURM|NONE`` forces one of them. NCCL is used on GPUs and
gloo on CPUs, every collective with ``timeout_s``.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from xnn.errors import InputError

INIT_METHOD_ENV = "XNN_DISTRIBUTED_INIT_METHOD"
_METHODS = ("ENV", "SLURM", "NONE")
DEFAULT_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as read from the environment."""

    method: str  # "ENV", "SLURM" or "NONE"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None = None
    master_port: int | None = None


def _int_env(env, name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise InputError(f"environment variable {name} is required by the launcher") from None
    except ValueError:
        raise InputError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_head_node(env) -> str:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise InputError("SLURM launch: cannot find the head node (no MASTER_ADDR, "
                         "SLURM_LAUNCH_NODE_IPADDR or SLURM_JOB_NODELIST)")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        msg = f"SLURM launch: 'scontrol show hostnames {nodelist}' failed: {e}"
        raise InputError(msg) from None
    if not out:
        raise InputError(f"SLURM launch: no host in SLURM_JOB_NODELIST={nodelist!r}")
    return out[0]


def detect_launch(env=None) -> LaunchInfo:
    """Read the launcher's variables from ``env`` (default ``os.environ``).

    Raises:
        InputError: an unknown forced method, missing or inconsistent variables.
    """
    env = os.environ if env is None else env
    forced = env.get(INIT_METHOD_ENV, "").strip().upper()
    if forced and forced not in _METHODS:
        raise InputError(f"{INIT_METHOD_ENV}={forced!r} is not one of {list(_METHODS)}")
    method = forced or (
        "ENV" if "RANK" in env and "WORLD_SIZE" in env
        else "SLURM" if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1
        else "NONE"
    )
    if method == "NONE":
        return LaunchInfo("NONE", 0, 1, 0)
    if method == "ENV":
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = int(env.get("LOCAL_RANK", "0"))
        addr = env.get("MASTER_ADDR")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    else:
        rank, world = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS")
        local = int(env.get("SLURM_LOCALID", "0"))
        addr = _slurm_head_node(env)
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 15000 + job % 20000
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"{method} launch: rank {rank} is not in [0, world_size={world})")
    return LaunchInfo(method, rank, world, local, addr, port)


class DistributedManager:
    """This process's rank, device and process group (or a single process).

    Build it with :meth:`initialize`. In a single process ``torch.distributed`` is not
    initialised and every method is a no-op.
    """

    def __init__(self, launch: LaunchInfo, device: torch.device, backend: str | None,
                 owns_group: bool):
        self.launch = launch
        self._device = device
        self.backend = backend
        self._owns_group = owns_group

    # ------------------------------------------------------------------ construction
    @classmethod
    def initialize(cls, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                   device: str | torch.device | None = None) -> DistributedManager:
        """Detect the launcher and initialise ``torch.distributed`` if there are several ranks.

        Args:
            backend: ``"nccl"``, ``"gloo"`` or ``None`` (NCCL on GPU, gloo on CPU).
            timeout_s: timeout of every collective (seconds).
            device: ``"cpu"``/``"cuda"`` or ``None`` (CUDA if available). On CUDA each rank
                takes ``cuda:LOCAL_RANK``.
        Returns:
            The manager. If ``torch.distributed`` is already initialised it is adopted.
        """
        if timeout_s <= 0:
            raise InputError(f"timeout_s must be > 0, got {timeout_s}")
        if dist.is_available() and dist.is_initialized():
            launch = LaunchInfo("ENV", dist.get_rank(), dist.get_world_size(),
                                int(os.environ.get("LOCAL_RANK", "0")))
            dev = _pick_device(device, launch.local_rank, dist.get_backend())
            return cls(launch, dev, dist.get_backend(), owns_group=False)
        launch = detect_launch()
        dev = _pick_device(device, launch.local_rank, backend)
        if launch.method == "NONE" or launch.world_size == 1 and launch.master_addr is None:
            return cls(launch, dev, None, owns_group=False)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type != "cuda":
            raise InputError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
        kw = {}
        if launch.method == "SLURM":
            kw["init_method"] = f"tcp://{launch.master_addr}:{launch.master_port}"
        if backend == "nccl":
            kw["device_id"] = dev
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=timedelta(seconds=float(timeout_s)), **kw)
        return cls(launch, dev, backend, owns_group=True)

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_main(self) -> bool:
        return self.launch.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when ``torch.distributed`` is initialised with this manager's ranks."""
        return dist.is_available() and dist.is_initialized() and self.world_size > 1

    def __repr__(self) -> str:
        return (f"DistributedManager(method={self.launch.method}, rank={self.rank}, "
                f"world_size={self.world_size}, device={self.device}, backend={self.backend})")

    # ------------------------------------------------------------------ operations
    def barrier(self) -> None:
        """Wait for every rank (no-op in a single process)."""
        if self.is_distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()

    def mesh(self, dp: int = -1, dd: int = 1):
        """A :class:`~xnn.distributed.mesh.ParallelDims` over this job's ranks, mesh built."""
        from xnn.distributed.mesh import ParallelDims

        dims = ParallelDims(dp=dp, dd=dd, world_size=self.world_size)
        dims.build_mesh(self.device.type)
        return dims

    def cleanup(self) -> None:
        """Destroy the process group if this manager created it."""
        if self._owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False


def _pick_device(device, local_rank: int, backend: str | None) -> torch.device:
    if device is None:
        want_cuda = torch.cuda.is_available() and backend != "gloo"
        device = "cuda" if want_cuda else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError("device 'cuda' requested but CUDA is not available")
        if dev.index is None:
            n = torch.cuda.device_count()
            dev = torch.device("cuda", local_rank % max(n, 1))
        torch.cuda.set_device(dev)
    return dev
