"""Small helpers shared by benchmark scripts: timing, peak memory, JSON output, test systems.

Every benchmark script runs unchanged on CPU (``--quick`` for small sizes) and on CUDA
(``--device cuda``). Import as ``from benchmarks.common import time_fn, ...`` (run scripts
as ``python -m benchmarks.<name>`` or ``python benchmarks/<name>.py`` from the repo root).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _as_device(device: str | torch.device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def synchronize(device: str | torch.device) -> None:
    """Wait for queued kernels on ``device`` (no-op on CPU)."""
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    repeat: int = 5,
    warmup: int = 1,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Wall time of ``fn()`` after ``warmup`` untimed calls, synchronizing CUDA around each call.

    Args:
        fn: callable with no arguments.
        repeat: number of timed calls (>= 1).
        warmup: number of untimed calls first (compilation, caches, allocator).
        device: device whose queue is synchronized before and after each call.
    Returns:
        ``{"median_s", "min_s", "mean_s", "repeat"}`` in seconds.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "mean_s": statistics.fmean(times),
        "repeat": repeat,
    }


def reset_peak_memory(device: str | torch.device) -> None:
    """Reset the peak-memory counter of ``device`` (CUDA only; no-op on CPU)."""
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: str | torch.device) -> int | None:
    """Peak bytes allocated on ``device`` since the last reset; on CPU the process peak RSS.

    Returns:
        bytes, or ``None`` where it cannot be measured. On CPU the value is the peak resident
        set size of the whole process since start (``ru_maxrss``), not since the last reset.
    """
    device = _as_device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(kb) * (1 if platform.system() == "Darwin" else 1024)
    except (ImportError, OSError):
        return None


def machine_info(device: str | torch.device = "cpu") -> dict[str, Any]:
    """Torch version, device name, the host's CPU model and count, host, date (UTC, ISO 8601),
    the repository's commit.
    (The CPU model tells machines of one GPU kind apart: a peer bound by the host's CPU runs
    at different rates on them.)"""
    device = _as_device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "device": str(device),
        "device_name": name,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "host": platform.node(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The repository's ``HEAD`` commit (with ``+dirty`` for uncommitted changes), or ``None``."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=9", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "xnn"],
                               cwd=root, text=True, capture_output=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "") if head else None


#: the folder of the current results: one file per benchmark and device
RESULTS = Path(__file__).resolve().parent / "results"


def device_tag(device: str | torch.device | None = None, world_size: int = 1) -> str:
    """The device part of a results file name: ``h100``, ``h200x2`` (GPU model, GPUs),
    ``gloo4`` (CPU ranks), ``cpu`` (up to 4 cores) or ``cpu16`` (cores of a larger host).

    Args:
        device: the benchmark's device (``None`` or ``"auto"``: CUDA when available).
        world_size: ranks of the run (``torchrun``'s ``WORLD_SIZE``).
    """
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = _as_device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        found = re.search(r"\b([A-Z]+[0-9]+[A-Z]?)\b", torch.cuda.get_device_name(device))
        tag = found.group(1).lower() if found else "cuda"
        return tag if world_size == 1 else f"{tag}x{world_size}"
    if world_size > 1:
        return f"gloo{world_size}"
    cores = os.cpu_count() or 1
    return "cpu" if cores <= 4 else f"cpu{cores}"


def results_path(benchmark: str, device: str | torch.device | None = None,
                 world_size: int | None = None) -> Path:
    """``benchmarks/results/<benchmark>_<device tag>.json``: the default ``--json`` of a
    benchmark script, so that a rerun replaces the current file of that benchmark and device
    (then ``python benchmarks/results_tables.py`` rewrites the README's tables).

    Args:
        benchmark: the benchmark's name (script, and model or mode where they differ).
        device: see :func:`device_tag`.
        world_size: ranks (default: ``WORLD_SIZE`` of the environment, else 1).
    """
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return RESULTS / f"{benchmark}_{device_tag(device, world_size)}.json"


def _cpu_model() -> str:
    """The first ``model name`` of ``/proc/cpuinfo`` (else the platform's processor)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str | os.PathLike, payload: dict[str, Any], device: str = "cpu") -> Path:
    """Write ``payload`` plus a ``"machine"`` entry (see :func:`machine_info`) as indented JSON.

    Args:
        path: output file; parent folders are created.
        payload: JSON-serialisable dict (numpy/torch scalars are converted).
        device: device the benchmark ran on, recorded in the machine info.
    Returns:
        the path written.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"machine": machine_info(device), **payload}
    out.write_text(json.dumps(data, indent=2, default=_to_builtin) + "\n")
    return out


def _to_builtin(obj: Any) -> Any:
    if isinstance(obj, (np.generic, torch.Tensor)):
        return obj.item() if getattr(obj, "ndim", 0) == 0 else obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def fcc_cu(n_atoms_target: int, rattle: float = 0.05, seed: int = 0):
    """Periodic FCC copper supercell with about ``n_atoms_target`` atoms (a = 3.61 Å).

    Args:
        n_atoms_target: wanted atom count; the cubic supercell ``k×k×k`` (4 atoms per cubic
            cell) with the closest count is returned (at least 1×1×1).
        rattle: standard deviation (Å) of Gaussian displacements; 0 for a perfect crystal.
        seed: random seed of the rattle.
    Returns:
        ``ase.Atoms`` with ``pbc=True``.
    """
    from ase.build import bulk

    k = max(1, round((n_atoms_target / 4) ** (1 / 3)))
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((k, k, k))
    if rattle > 0:
        rng = np.random.default_rng(seed)
        atoms.positions += rng.normal(scale=rattle, size=atoms.positions.shape)
    return atoms


def write_rank_json(out_dir: str, rank: int, run: Callable[[], dict]) -> None:
    """A spawned rank's side of :func:`spawn_json_ranks`: ``run()``'s result (or its error and
    traceback) into ``out_dir/rank{rank}.json``, replaced atomically."""
    import traceback

    try:
        result = run()
    except Exception as e:  # noqa: BLE001 - reported in the JSON row
        result = {"rank": rank, "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc()}
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def spawn_json_ranks(entry: Callable, world: int, extra: tuple, timeout_s: float) -> list[dict]:
    """Run ``entry(rank, world, port, out_dir, *extra)`` on ``world`` freshly spawned ranks;
    each rank writes ``out_dir/rank{r}.json``. Returns the ranks' results in rank order; a
    rank that wrote none (killed for memory, timed out) gives ``{"rank": r, "error": ...}``."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(entry, nprocs=world, join=False, start_method="spawn",
                                 args=(world, port, out_dir, *extra))
        error, deadline = None, time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    error = f"timed out after {timeout_s:g} s"
                    break
        except mp.ProcessExitedException as e:  # e.g. killed for memory
            error = f"rank {e.error_index} exited ({e.exit_code}, {e.signal_name})"
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world):
            path = Path(out_dir, f"rank{r}.json")
            out.append(json.loads(path.read_text()) if path.exists()
                       else {"rank": r, "error": error or "no result"})
        return out
