"""Launch detection and process-group set-up: torchrun, SLURM, or a single process.

``DistributedManager.initialize()`` looks at the environment:

* torchrun (or any ``env://`` launcher): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``;
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``),
  ``SLURM_LOCALID``; the head node (where task 0 runs) is ``MASTER_ADDR`` if set, else the
  first host of the step's node list (``SLURM_STEP_NODELIST``, ``SLURM_NODELIST`` or
  ``SLURM_JOB_NODELIST``, expanded by ``scontrol show hostnames``, or parsed here when
  ``scontrol`` is missing, as inside containers), else ``SLURM_LAUNCH_NODE_IPADDR``; the port
  is ``MASTER_PORT`` or ``15000 + SLURM_JOB_ID % 20000``. A process of a batch script that
  was not started by ``srun`` (no ``SLURM_STEP_ID``) runs alone, with a warning, instead of
  waiting for ranks that will never come;
* otherwise a single process, without initialising ``torch.distributed``.

``XNN_DISTRIBUTED_INIT_METHOD=ENV|SLURM|NONE`` forces one of them. NCCL is used on GPUs and
gloo on CPUs, every collective with ``timeout_s`` (10 minutes by default).
:meth:`DistributedManager.explain` (and :meth:`~DistributedManager.watch`) turn a collective
that timed out (gloo) into a :class:`~xnn.distributed.collectives.CollectiveTimeout` naming
the collective and the ranks that did not arrive (under NCCL, torch's watchdog reports
timeouts itself).

A rank started by torchrun exits when torchrun dies (:func:`exit_with_launcher`): killed
alone (``kill -9`` of the launcher, an OOM kill), torchrun cannot stop its ranks, which would
otherwise run on and write. Under ``srun`` the step daemon stops the tasks itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from xnn.errors import InputError

INIT_METHOD_ENV = "XNN_DISTRIBUTED_INIT_METHOD"
_METHODS = ("ENV", "SLURM", "NONE")
DEFAULT_TIMEOUT_S = 600.0  # 10 minutes: long enough for a slow step, short for a hang
#: what a rank started by torchrun receives when the launcher dies: the default action of
#: SIGTERM ends the process at once, even inside a collective; a handler of the user's runs
LAUNCHER_DEATH_SIGNAL = signal.SIGTERM
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCH_EVERY_S = 0.5
#: (this process, its parent) when this module was imported: a rank's launcher
_IMPORTED_IN = (os.getpid(), os.getppid())


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


_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list, e.g. ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``.

    Each bracket group is replaced by its first entry (zero padding kept), so
    ``"rack[1-2]-n[03-04]"`` -> ``"rack1-n03"``. Used when ``scontrol`` is not available.
    """
    out, depth, group = [], 0, ""
    for ch in nodelist.strip():
        if ch == "[":
            depth, group = depth + 1, ""
        elif ch == "]":
            depth -= 1
            out.append(group.split(",")[0].split("-")[0])
        elif depth:
            group += ch
        elif ch == ",":
            break
        else:
            out.append(ch)
    host = "".join(out)
    if depth or not host:
        raise InputError(f"SLURM launch: cannot read the host list {nodelist!r}")
    return host


def _scontrol_first_host(nodelist: str) -> str | None:
    """``scontrol show hostnames NODELIST``'s first line; ``None`` if scontrol is missing."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=60).stdout.split()
    except FileNotFoundError:
        return None
    except (OSError, subprocess.SubprocessError) as e:
        msg = f"SLURM launch: 'scontrol show hostnames {nodelist}' failed: {e}"
        raise InputError(msg) from None
    if not out:
        raise InputError(f"SLURM launch: no host in the node list {nodelist!r}")
    return out[0]


def _slurm_head_node(env) -> str:
    """The host of task 0: ``MASTER_ADDR``, the step's first node, or the launch node."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    nodelist = next((env[k] for k in _NODELISTS if env.get(k)), None)
    if nodelist:
        return _scontrol_first_host(nodelist) or first_host(nodelist)
    if env.get("SLURM_LAUNCH_NODE_IPADDR"):  # srun's host: right only if task 0 runs there
        return env["SLURM_LAUNCH_NODE_IPADDR"]
    raise InputError("SLURM launch: cannot find the head node (no MASTER_ADDR, "
                     "SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_LAUNCH_NODE_IPADDR)")


def _slurm_world(env) -> int:
    name = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    return _int_env(env, name)


def _auto_method(env) -> str:
    if "RANK" in env and "WORLD_SIZE" in env:
        return "ENV"
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env or _slurm_world(env) <= 1:
        return "NONE"
    if "SLURM_STEP_ID" not in env:  # a batch script's own process, not an srun task
        warnings.warn(f"SLURM_NTASKS={env['SLURM_NTASKS']} but this process was not started "
                      "by srun: running ONE process; launch with 'srun python -m xnn ...' "
                      "for data-parallel ranks", stacklevel=3)
        return "NONE"
    return "SLURM"


def _forced_env_error(env) -> InputError:
    hint = (" (only SLURM variables are set: launch with torchrun, or set "
            f"{INIT_METHOD_ENV}=SLURM or unset it)" if "SLURM_PROCID" in env else "")
    return InputError(f"{INIT_METHOD_ENV}=ENV needs RANK and WORLD_SIZE (set by torchrun) "
                      f"in the environment{hint}")


def detect_launch(env=None) -> LaunchInfo:
    """Read the launcher's variables from ``env`` (default ``os.environ``).

    Raises:
        InputError: an unknown forced method, missing or inconsistent variables.
    """
    env = os.environ if env is None else env
    forced = env.get(INIT_METHOD_ENV, "").strip().upper()
    if forced and forced not in _METHODS:
        raise InputError(f"{INIT_METHOD_ENV}={forced!r} is not one of {list(_METHODS)}")
    method = forced or _auto_method(env)
    if method == "NONE":
        return LaunchInfo("NONE", 0, 1, 0)
    if method == "ENV":
        if "RANK" not in env or "WORLD_SIZE" not in env:
            raise _forced_env_error(env)
        rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
        local = int(env.get("LOCAL_RANK", "0"))
        addr = env.get("MASTER_ADDR")
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else None
    else:
        rank, world = _int_env(env, "SLURM_PROCID"), _slurm_world(env)
        local = int(env.get("SLURM_LOCALID", "0"))
        addr = _slurm_head_node(env)
        job = int(env.get("SLURM_JOB_ID", "0") or 0)
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else 15000 + job % 20000
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"{method} launch: rank {rank} is not in [0, world_size={world})")
    return LaunchInfo(method, rank, world, local, addr, port)


def started_by_torchrun(launch: LaunchInfo, env=None) -> bool:
    """True for a rank that torchrun's agent started (its variables and
    ``TORCHELASTIC_RUN_ID``), not one of a launcher that only sets ``RANK``/``WORLD_SIZE``."""
    env = os.environ if env is None else env
    return launch.method == "ENV" and bool(env.get("TORCHELASTIC_RUN_ID"))


def _parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` (Linux): the kernel sends ``sig`` to this process when
    the thread that started it ends. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _launcher_pid() -> int:
    """The parent this process had when this module was imported (a forked child of that
    process, which inherits the record, gets its own parent)."""
    pid, parent = _IMPORTED_IN
    return parent if os.getpid() == pid else os.getppid()


def _watch_parent(parent: int, sig: int) -> None:
    """Send ``sig`` to this process once its parent is no longer ``parent`` (polled)."""
    while os.getppid() == parent:
        time.sleep(_WATCH_EVERY_S)
    os.kill(os.getpid(), sig)


def exit_with_launcher(launch: LaunchInfo, env=None) -> str | None:
    """Make a rank that torchrun started exit when torchrun dies; nothing for other launches.

    torchrun waits for its ranks before it exits and stops them when one fails, but killed
    itself (``SIGKILL``, out of memory) it leaves them running. Each rank therefore asks the
    kernel for :data:`LAUNCHER_DEATH_SIGNAL` at its parent's death (Linux), else watches its
    parent from a daemon thread (polled every 0.5 s). A launcher already gone by then (the
    rank's parent changed since this module was imported) sends the signal at once. Under
    ``srun`` the step daemon is the parent and stops its tasks itself; a single process, or
    ranks started by other means (``torch.multiprocessing``), are left alone.

    Returns:
        ``"prctl"``, ``"watchdog"``, or ``None`` when not launched by torchrun.
    """
    if not started_by_torchrun(launch, env):
        return None
    sig, launcher = int(LAUNCHER_DEATH_SIGNAL), _launcher_pid()
    how = "prctl" if _parent_death_signal(sig) else "watchdog"
    if how == "watchdog":
        threading.Thread(target=_watch_parent, args=(launcher, sig), daemon=True,
                         name="xnn-launcher-watch").start()
    if os.getppid() != launcher:  # the launcher died before the request
        os.kill(os.getpid(), sig)
    return how


class DistributedManager:
    """This process's rank, device and process group (or a single process).

    Build it with :meth:`initialize`. In a single process ``torch.distributed`` is not
    initialised and every method is a no-op.
    """

    def __init__(self, launch: LaunchInfo, device: torch.device, backend: str | None,
                 owns_group: bool, timeout_s: float = DEFAULT_TIMEOUT_S,
                 timeout_key: str | None = None):
        self.launch = launch
        self._device = device
        self.backend = backend
        self._owns_group = owns_group
        self.timeout_s = float(timeout_s)
        self.timeout_key = timeout_key

    # ------------------------------------------------------------------ construction
    @classmethod
    def initialize(cls, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                   device: str | torch.device | None = None,
                   timeout_key: str | None = None) -> DistributedManager:
        """Detect the launcher and initialise ``torch.distributed`` if there are several ranks.

        Args:
            backend: ``"nccl"``, ``"gloo"`` or ``None`` (NCCL on GPU, gloo on CPU).
            timeout_s: timeout of the rendezvous and of every collective (seconds).
            device: ``"cpu"``/``"cuda"`` or ``None`` (CUDA if available). On CUDA each rank
                takes ``cuda:LOCAL_RANK``.
            timeout_key: the option of the running command that sets ``timeout_s`` (e.g.
                ``"parallel.timeout_s"``), named by the messages of a timeout; ``None``:
                they name none.
        Returns:
            The manager. If ``torch.distributed`` is already initialised it is adopted.
        """
        if timeout_s <= 0:
            raise InputError(f"timeout_s must be > 0, got {timeout_s}")
        if dist.is_available() and dist.is_initialized():
            launch = LaunchInfo("ENV", dist.get_rank(), dist.get_world_size(),
                                int(os.environ.get("LOCAL_RANK", "0")))
            dev = _pick_device(device, launch.local_rank, dist.get_backend())
            return cls(launch, dev, dist.get_backend(), owns_group=False,
                       timeout_key=timeout_key)
        launch = detect_launch()
        dev = _pick_device(device, launch.local_rank, backend)
        if launch.method == "NONE" or launch.world_size == 1 and launch.master_addr is None:
            return cls(launch, dev, None, owns_group=False, timeout_key=timeout_key)
        exit_with_launcher(launch)
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if backend == "nccl" and dev.type != "cuda":
            raise InputError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
        kw = {}
        if launch.method == "SLURM":
            host = launch.master_addr
            host = f"[{host}]" if ":" in host else host  # an IPv6 address
            kw["init_method"] = f"tcp://{host}:{launch.master_port}"
        if backend == "nccl":
            kw["device_id"] = dev
        try:
            dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                    timeout=timedelta(seconds=float(timeout_s)), **kw)
        except RuntimeError as e:  # DistStoreError: the rendezvous timed out
            if "timed out" not in str(e).lower():
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            key = f" ({timeout_key})" if timeout_key else ""
            raise InputError(f"{launch.method} launch: not all {launch.world_size} ranks "
                             f"joined within {timeout_s:g} s{key} ({first}); check that "
                             "every rank was started and reaches the same rendezvous "
                             "address") from None
        return cls(launch, dev, backend, owns_group=True, timeout_s=timeout_s,
                   timeout_key=timeout_key)

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

    def describe(self) -> str:
        """One line for a run's log: how many ranks joined, launcher, backend, rendezvous."""
        if not self.is_distributed:
            return f"single process on {self.device}"
        where = ""
        if self.launch.master_addr:
            where = f", rendezvous {self.launch.master_addr}:{self.launch.master_port}"
        return (f"distributed: {self.world_size} ranks joined one process group (launched by "
                f"{self.launch.method}, backend {self.backend}{where})")

    # ------------------------------------------------------------------ operations
    def explain(self, error: BaseException) -> BaseException:
        """A one-line :class:`~xnn.errors.XnnError` for a ``torch.distributed`` collective
        that timed out or lost its peer (a timeout names the collective, its call site and
        the ranks that did not arrive: :func:`~xnn.distributed.collectives.
        explain_collective_error`); ``error`` itself for anything else."""
        if not self.is_distributed:
            return error
        from xnn.distributed.collectives import explain_collective_error

        clear = explain_collective_error(error, self.timeout_s, self.timeout_key)
        return error if clear is None else clear

    @contextmanager
    def watch(self) -> Iterator[None]:
        """Run a job's work; a collective failure inside raises :meth:`explain`'s error."""
        try:
            yield
        except RuntimeError as e:
            clear = self.explain(e)
            if clear is e:
                raise
            raise clear from None

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
            try:  # no rank tears the group down while a peer still has work in flight
                self.barrier()
            except RuntimeError:
                pass
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
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
            if backend in (None, "nccl") and local_world > n:
                raise InputError(f"{local_world} ranks on this node share {n} CUDA GPU(s), but "
                                 "NCCL needs one GPU per rank: launch at most "
                                 f"--nproc-per-node {n}, or run on CPU (device cpu, gloo)")
            dev = torch.device("cuda", local_rank % max(n, 1))
        torch.cuda.set_device(dev)
    return dev
