"""Neighbor-list build time: xnn backends against ASE, matscipy and vesin, FCC Cu at 5 Å.

Usage (from the repository root)::

    python benchmarks/neighbors.py --json benchmarks/results/neighbors_cpu.json --quick
    python benchmarks/neighbors.py --json neighbors_cuda.json --device cuda

For each size (1k, 10k, 100k, 1M atoms; ``--quick``: 1k, 10k, 100k with fewer peers) every
method builds the full list of rattled FCC Cu; the median wall time per build is reported
with its ratio to vesin on the same device (vesin-torch on CUDA when importable, else
vesin on CPU). Peers too slow for a size are recorded as skipped, as are packages that are
not installed. Every method's edge count is checked against the reference count.

``paired`` (the issue-20 goal, ``xnn:auto`` within 1.05x of vesin): per size, ``xnn:auto``
and vesin itself (vesin-torch on CUDA) are timed alternately, build after build, in the
same process, and the ratios of their median and minimum times are reported; alternating
cancels most of the drift of a shared machine. ``--methods`` limits the table to some
methods (the paired comparison always runs). ``--paired-only --devices cuda cpu`` runs only
the paired comparison, on each device in turn (one structure per size), e.g. the issue-20
check on a GPU machine (about 1-2 minutes on one H200 with 16 CPU cores)::

    python benchmarks/neighbors.py --json benchmarks/results/neighbors_paired_h200.json \
        --paired-only --devices cuda cpu --sizes 100000 1000000

``--phases`` (with ``--paired-only``) adds where ``xnn:auto``'s time goes: input checks,
vesin's compute, our output copies and the rest, host-only and with a device sync at each
phase boundary (the GPU time of each phase).

``--host-overhead CALLS`` times only xnn's wrapper: ``neighbor_list(..., backend="auto")``
repeated with the same cell and pbc tensors while vesin's ``compute`` is stubbed to return
precomputed buffers (8 pairs), in µs per call (``--profile N``: cProfile's top N functions)::

    python benchmarks/neighbors.py --json host.json --host-overhead 2000 --devices cuda cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    fcc_cu,
    peak_memory,
    reset_peak_memory,
    time_fn,
    write_json,
)
from xnn.neighbors import available_backends, neighbor_list  # noqa: E402

FULL_SIZES = [1_000, 10_000, 100_000, 1_000_000]
QUICK_SIZES = [1_000, 10_000, 100_000]
# Largest size each method is run at (larger sizes are recorded as skipped).
MAX_ATOMS = {"ase": 120_000}
QUICK_MAX_ATOMS = {"ase": 12_000, "xnn:torch@cpu": 120_000}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _has_vesin_torch() -> bool:
    return _installed("vesin_torch") or _installed("vesin.torch")


class Case:
    """One structure in the formats every method needs."""

    def __init__(self, n_target: int, device: torch.device, seed: int = 0, atoms=None):
        self.atoms = fcc_cu(n_target, rattle=0.05, seed=seed) if atoms is None else atoms
        self.n_atoms = len(self.atoms)
        self.pos = torch.tensor(self.atoms.positions, dtype=torch.float64, device=device)
        self.cell = torch.tensor(self.atoms.cell.array, dtype=torch.float64, device=device)
        self.pbc = torch.tensor(self.atoms.pbc, device=device)


def _xnn(backend: str, case: Case, cutoff: float) -> Callable[[], int]:
    def run() -> int:
        ei, _ = neighbor_list(case.pos, case.cell, case.pbc, cutoff, backend=backend)
        return ei.shape[1]

    return run


def _ase(case: Case, cutoff: float) -> Callable[[], int]:
    from ase.neighborlist import neighbor_list as ase_nl

    return lambda: len(ase_nl("ijS", case.atoms, cutoff)[0])


def _matscipy(case: Case, cutoff: float) -> Callable[[], int]:
    from matscipy.neighbours import neighbour_list

    return lambda: len(neighbour_list("ijS", case.atoms, cutoff)[0])


def _vesin(case: Case, cutoff: float) -> Callable[[], int]:
    import vesin

    nl = vesin.NeighborList(cutoff=cutoff, full_list=True)
    pos, cell = case.atoms.positions, case.atoms.cell.array
    return lambda: len(nl.compute(pos, cell, True, "ijS")[0])


def _vesin_torch(case: Case, cutoff: float) -> Callable[[], int]:
    try:
        import vesin_torch as vt
    except ImportError:
        import vesin.torch as vt

    nl = vt.NeighborList(cutoff=cutoff, full_list=True)
    return lambda: nl.compute(case.pos, case.cell, case.pbc, "ijS")[0].shape[0]


def methods(device: torch.device) -> dict[str, tuple[str, Callable | None]]:
    """Method name -> (device it runs on, factory(case, cutoff) or None if not installed)."""
    dev = device.type
    out: dict[str, tuple[str, Callable | None]] = {}
    for backend in ("torch", "vesin", "auto"):
        ok = backend == "auto" or backend in available_backends()
        out[f"xnn:{backend}"] = (dev, (lambda c, r, b=backend: _xnn(b, c, r)) if ok else None)
    out["vesin-torch"] = (dev, _vesin_torch if _has_vesin_torch() else None)
    out["vesin"] = ("cpu", _vesin if _installed("vesin") else None)
    out["matscipy"] = ("cpu", _matscipy if _installed("matscipy") else None)
    out["ase"] = ("cpu", _ase)
    return out


def _limit(name: str, run_dev: str, quick: bool) -> int | None:
    table = QUICK_MAX_ATOMS if quick else MAX_ATOMS
    return table.get(f"{name}@{run_dev}", table.get(name))


def bench_one(name, run_dev, factory, case, cutoff, repeat, max_seconds) -> dict:
    """Time one method on one case; return a result row."""
    row = {"method": name, "device": run_dev, "n_atoms": case.n_atoms}
    fn = factory(case, cutoff)
    reset_peak_memory(run_dev)
    first = time_fn(fn, repeat=1, warmup=1, device=run_dev)
    reps = repeat if first["median_s"] * repeat < max_seconds else 1
    t = first if reps == 1 else time_fn(fn, repeat=reps, warmup=0, device=run_dev)
    row.update(t)
    row["n_edges"] = int(fn())
    row["peak_memory_bytes"] = peak_memory(run_dev) if run_dev == "cuda" else None
    row["status"] = "ok"
    return row


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but CUDA is not available")
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    table = methods(device)
    rows: list[dict] = []
    last: dict[str, tuple[int, float]] = {}  # method -> (n_atoms, seconds) at the last size
    paired: list[dict] = []
    if args.methods:
        table = {k: v for k, v in table.items() if k in args.methods}
    for n in sizes:
        case = Case(n, device)
        size_rows = []
        for name, (run_dev, factory) in table.items():
            limit = _limit(name, run_dev, args.quick)
            predicted = last[name][1] * case.n_atoms / last[name][0] if name in last else 0.0
            if factory is None:
                size_rows.append(_skip(name, run_dev, case, "not installed"))
            elif (limit is not None and case.n_atoms > limit) or predicted > args.max_seconds:
                size_rows.append(_skip(name, run_dev, case, "too slow at this size"))
            else:
                row = bench_one(name, run_dev, factory, case, args.cutoff, args.repeat,
                                args.max_seconds)
                last[name] = (case.n_atoms, row["median_s"])
                size_rows.append(row)
            _print(size_rows[-1])
        _add_ratios(size_rows, device)
        rows.extend(size_rows)
        paired.append(bench_paired(case, device, args.cutoff, args.paired_rounds))
        print(f"{case.n_atoms:>9} paired xnn:auto / {paired[-1]['reference']}: "
              f"{paired[-1]['ratio_median']:.3f} (median) {paired[-1]['ratio_min']:.3f} (min)",
              flush=True)
        del case
    return {
        "benchmark": "neighbors",
        "system": "FCC Cu, a = 3.61 Å, rattled 0.05 Å, periodic cubic supercell",
        "cutoff_angstrom": args.cutoff,
        "quick": bool(args.quick),
        "repeat": args.repeat,
        "auto_backend": _auto_name(device),
        "results": rows,
        "paired": paired,
        "goal": "paired ratio_median <= 1.05 (xnn:auto against vesin on the same device)",
    }


def run_paired_only(args: argparse.Namespace) -> dict:
    """Only the paired comparison, per size on every device of ``--devices`` in turn."""
    devices = [torch.device(d) for d in (args.devices or [args.device])]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        raise SystemExit("cuda in --devices but CUDA is not available")
    paired = []
    for n in args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES):
        atoms = None
        for device in devices:
            case = Case(n, device, atoms=atoms)
            atoms = case.atoms
            rounds = args.paired_rounds * (3 if device.type == "cuda" else 1)
            paired.append({"device": device.type,
                           **bench_paired(case, device, args.cutoff, rounds)})
            p = paired[-1]
            if args.phases:
                p["phases"] = bench_phases(case, device, args.cutoff, rounds)
                _print_phases(p["phases"])
            print(f"{p['n_atoms']:>9} {device.type:<4} xnn:auto / {p['reference']}: "
                  f"{p['ratio_median']:.3f} (median) {p['ratio_min']:.3f} (min) "
                  f"{p['xnn_auto_median_s'] * 1e3:.2f} vs {p['reference_median_s'] * 1e3:.2f} ms"
                  f", edges match: {p['edges_match']}", flush=True)
            del case
    batched = []
    for device in devices if args.batched else ():
        batched.append(bench_paired_batched(*args.batched, device, args.cutoff,
                                            args.paired_rounds * 3))
        b = batched[-1]
        print(f"{b['n_systems']} x {b['atoms_per_system']} {device.type:<4} xnn:auto (one "
              f"batched call) / {b['reference']}: {b['ratio_median']:.3f} (median) "
              f"{b['ratio_min']:.3f} (min), edges match: {b['edges_match']}", flush=True)
    return {
        "benchmark": "neighbors (paired only)",
        "batched": batched,
        "system": "FCC Cu, a = 3.61 Å, rattled 0.05 Å, periodic cubic supercell",
        "cutoff_angstrom": args.cutoff,
        "auto_backend": {d.type: _auto_name(d) for d in devices},
        "paired": paired,
        "goal": "paired ratio_median <= 1.05 (xnn:auto against vesin-torch on CUDA, vesin "
                "on CPU, timed alternately in one process)",
    }


def bench_paired(case: Case, device: torch.device, cutoff: float, rounds: int) -> dict:
    """``xnn:auto`` and vesin (vesin-torch on CUDA) timed alternately on ``case``."""
    ref_name, factory = _reference(device)
    ref = factory(case, cutoff)
    ours = _xnn("auto", case, cutoff)
    counts = {"xnn:auto": ours(), ref_name: ref()}  # warm-up (and both edge counts)
    ours(), ref()
    med, low = _alternate([("xnn:auto", ours), (ref_name, ref)], device, rounds)
    return {
        "n_atoms": case.n_atoms, "reference": ref_name, "rounds": rounds,
        "xnn_auto_median_s": med["xnn:auto"], "reference_median_s": med[ref_name],
        "xnn_auto_min_s": low["xnn:auto"], "reference_min_s": low[ref_name],
        "ratio_median": med["xnn:auto"] / med[ref_name],
        "ratio_min": low["xnn:auto"] / low[ref_name],
        "edges_match": counts["xnn:auto"] == counts[ref_name], "n_edges": counts[ref_name],
    }


def _reference(device: torch.device) -> tuple[str, Callable]:
    """The peer of ``xnn:auto`` on ``device`` and its factory: vesin-torch on CUDA when
    installed, else vesin."""
    if device.type == "cuda" and _has_vesin_torch():
        return "vesin-torch", _vesin_torch
    return "vesin", _vesin


def _alternate(pair: list[tuple[str, Callable]], device: torch.device,
               rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """Medians and minima (s) of the two named calls of ``pair``, timed alternately (their
    order swapped every round) for ``rounds`` rounds, the device synced around each."""
    times: dict[str, list[float]] = {name: [] for name, _ in pair}
    for k in range(rounds):
        for name, fn in pair if k % 2 == 0 else pair[::-1]:
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: min(v) for k, v in times.items()})


def bench_paired_batched(n_systems: int, n_atoms: int, device: torch.device, cutoff: float,
                         rounds: int) -> dict:
    """``n_systems`` rattled FCC cells of ~``n_atoms``: one batched ``xnn:auto`` call against
    a loop of vesin (vesin-torch on CUDA) calls over the systems, timed alternately."""
    cases = [Case(n_atoms, device, seed=k) for k in range(n_systems)]
    pos = torch.cat([c.pos for c in cases])
    cell = torch.stack([c.cell for c in cases])
    pbc = torch.stack([c.pbc for c in cases])
    batch = torch.repeat_interleave(torch.arange(n_systems, device=device),
                                    torch.tensor([c.n_atoms for c in cases], device=device))
    ref_name, factory = _reference(device)
    refs = [factory(c, cutoff) for c in cases]

    def ours() -> int:
        return neighbor_list(pos, cell, pbc, cutoff, batch, backend="auto")[0].shape[1]

    def ref() -> int:
        return sum(r() for r in refs)

    counts = (ours(), ref())
    med, low = _alternate([("ours", ours), ("ref", ref)], device, rounds)
    return {"device": device.type, "n_systems": n_systems, "atoms_per_system": cases[0].n_atoms,
            "reference": f"loop of {ref_name}", "rounds": rounds,
            "xnn_auto_median_s": med["ours"], "reference_median_s": med["ref"],
            "ratio_median": med["ours"] / med["ref"], "ratio_min": low["ours"] / low["ref"],
            "edges_match": counts[0] == counts[1], "n_edges": counts[1]}


def bench_after_torch_op(n_atoms: int, cutoff: float, rounds: int) -> dict:
    """vesin's CPU ``compute`` alone and right after a torch reduction over the positions
    (which, above torch's grain size, runs on torch's OpenMP pool, whose workers then
    spin-wait on the cores vesin's threads use): medians over ``rounds``, alternating."""
    import vesin

    case = Case(n_atoms, torch.device("cpu"))
    nl = vesin.NeighborList(cutoff=cutoff, full_list=True)

    def alone() -> None:
        nl.compute(case.pos, case.cell, case.pbc, "PS", copy=False)

    def after_sum() -> None:
        case.pos.sum()
        alone()

    alone(), after_sum()
    times: dict[str, list[float]] = {"alone": [], "after_torch_sum": []}
    for _ in range(rounds):
        for name, fn in (("alone", alone), ("after_torch_sum", after_sum)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"n_atoms": case.n_atoms, "rounds": rounds, "torch_threads": torch.get_num_threads(),
            "alone_median_s": med["alone"], "after_torch_sum_median_s": med["after_torch_sum"],
            "slowdown": med["after_torch_sum"] / med["alone"]}


def bench_phases(case: Case, device: torch.device, cutoff: float, rounds: int) -> dict:
    """Per-phase time of ``xnn:auto`` on ``case``: input checks (``validate``), vesin's
    ``compute`` (with its own count read), our ``outputs`` (edge_index and shifts copies) and
    the rest (``other``: dispatch, Python), as medians over ``rounds`` builds.

    ``host``: host time of each phase without extra syncs (what the caller waits for: on
    CUDA, kernels after vesin's count read run on while the host returns). ``synced``: the
    device synchronised at each phase boundary, so each phase includes its GPU time.
    """
    import xnn.neighbors.api as api
    import xnn.neighbors.vesin_backend as vb

    spent: dict[str, float] = {}
    state = {"sync": False}

    def timed(name, fn):
        def wrapper(*a, **k):
            if state["sync"]:
                _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if state["sync"]:
                    _sync(device)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    class Timed:
        def __init__(self, nl):
            self.compute = timed("vesin_compute", nl.compute)

    real = (api.checked, vb._outputs, vb._calculator)
    api.checked = timed("validate", real[0])
    vb._outputs = timed("outputs", real[1])
    vb._calculator = lambda *a: Timed(real[2](*a))
    ours = _xnn("auto", case, cutoff)
    out: dict[str, dict] = {}
    try:
        ours(), ours()  # warm-up
        for mode in ("host", "synced"):
            state["sync"] = mode == "synced"
            rows: dict[str, list[float]] = {}
            for _ in range(rounds):
                spent.clear()
                _sync(device)
                t0 = time.perf_counter()
                ours()
                _sync(device)
                total = time.perf_counter() - t0
                for k, v in spent.items():
                    rows.setdefault(k, []).append(v)
                rows.setdefault("other", []).append(total - sum(spent.values()))
                rows.setdefault("total", []).append(total)
            out[mode] = {k: statistics.median(v) for k, v in rows.items()}
    finally:
        api.checked, vb._outputs, vb._calculator = real
    return {"n_atoms": case.n_atoms, "device": device.type, "rounds": rounds, **out}


def bench_host_overhead(device: torch.device, calls: int, n_atoms: int = 64,
                        n_edges: int = 8, profile: int = 0, torch_route: bool = False) -> dict:
    """Host time of one repeated ``neighbor_list(..., backend="auto")`` call with vesin's
    ``compute`` stubbed to return precomputed buffers (``n_edges`` pairs): xnn's wrapper
    alone (checks, remembered host values, dispatch, output copies). On CPU the host values
    are remembered as on CUDA (``REMEMBER_ON`` patched) so that the CUDA fast path runs.
    Reports µs per call (median of 5 batches of ``calls``) and, with ``profile`` > 0, the
    top ``profile`` functions by own time from cProfile. ``torch_route``: on CPU, take
    the route of CUDA tensors (``vesin.torch`` and the torch-op output copies), not
    ``vesin``'s numpy one."""
    import cProfile
    import pstats

    import xnn.neighbors.common as common
    import xnn.neighbors.vesin_backend as vb

    g = torch.Generator().manual_seed(0)
    pos = (torch.rand(n_atoms, 3, generator=g, dtype=torch.float64) * 10).to(device)
    cell = (torch.eye(3, dtype=torch.float64) * 10).to(device)
    pbc = torch.tensor([True, True, True], device=device)
    pairs = torch.randint(0, n_atoms, (n_edges, 2), generator=g).to(torch.uint64).to(device)
    shifts = torch.randint(-1, 2, (n_edges, 3), generator=g, dtype=torch.int32).to(device)

    class Stub:
        def compute(self, *a, **k):
            return pairs, shifts

    real = (vb._calculator, common.REMEMBER_ON, vb._vesin, vb._vesin_torch, vb._outputs)
    vb._calculator = lambda *a: Stub()
    common.REMEMBER_ON = {*real[1], device.type}
    if torch_route:
        vb._vesin, vb._vesin_torch, vb._outputs = None, vb._vesin_torch or Stub, vb._outputs_torch
    out: dict = {"device": device.type, "n_atoms": n_atoms, "n_edges": n_edges, "calls": calls,
                 "route": "vesin.torch" if torch_route or device.type != "cpu" else "vesin"}
    try:
        call = lambda: neighbor_list(pos, cell, pbc, 5.0, backend="auto")  # noqa: E731
        ei, sh = call()
        ref = set(zip(*pairs.view(torch.int64).cpu().T.tolist()))
        out["outputs_match"] = set(zip(*ei.cpu().tolist())) == ref and bool(
            (sh.cpu() == -shifts.cpu()).all())
        batches = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            _sync(device)
            batches.append((time.perf_counter() - t0) / calls * 1e6)
        out["us_per_call_median"] = statistics.median(batches)
        out["us_per_call_min"] = min(batches)
        if profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [call() for _ in range(calls)])
            st = pstats.Stats(prof)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:profile]
            out["profile_own_us_per_call"] = {
                f"{Path(f).name}:{line}({fn})": round(v[2] / calls * 1e6, 2)
                for (f, line, fn), v in rows}
    finally:
        vb._calculator, common.REMEMBER_ON, vb._vesin, vb._vesin_torch, vb._outputs = real
    return out


def _print_phases(p: dict) -> None:
    for mode in ("host", "synced"):
        cols = " ".join(f"{k} {v * 1e3:.3f}" for k, v in p[mode].items())
        print(f"{p['n_atoms']:>9} {p['device']:<4} phases ({mode}, ms): {cols}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _skip(name, run_dev, case, why) -> dict:
    return {"method": name, "device": run_dev, "n_atoms": case.n_atoms, "status": f"skipped: {why}"}


def _auto_name(device: torch.device) -> str:
    from xnn.neighbors.api import _auto_backend

    return _auto_backend(device, 0)


def _add_ratios(rows: list[dict], device: torch.device) -> None:
    """Ratio of each time to vesin's on the benchmark device; check edge counts agree."""
    done = {r["method"]: r for r in rows if r["status"] == "ok"}
    ref = done.get("vesin-torch") if device.type == "cuda" else None
    ref = ref or done.get("vesin") or done.get("matscipy") or done.get("ase")
    for r in rows:
        if r["status"] != "ok" or ref is None:
            continue
        r["reference"] = ref["method"]
        r["ratio_vs_reference"] = r["median_s"] / ref["median_s"]
        r["edges_match_reference"] = r["n_edges"] == ref["n_edges"]


def _print(r: dict) -> None:
    if r["status"] != "ok":
        print(f"{r['n_atoms']:>9} {r['method']:<12} {r['device']:<5} {r['status']}", flush=True)
        return
    print(f"{r['n_atoms']:>9} {r['method']:<12} {r['device']:<5} {r['median_s'] * 1e3:10.2f} ms "
          f"{r['n_edges']:>11} edges", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--devices", nargs="*", default=None, choices=["cpu", "cuda"],
                   help="with --paired-only: each of these devices in turn")
    p.add_argument("--paired-only", action="store_true",
                   help="only the paired xnn:auto / vesin comparison (no table of peers)")
    p.add_argument("--quick", action="store_true", help="small sizes, fewer repeats")
    p.add_argument("--sizes", type=int, nargs="*", default=None, help="atom counts (overrides)")
    p.add_argument("--cutoff", type=float, default=5.0, help="Å (default 5.0)")
    p.add_argument("--repeat", type=int, default=None, help="timed builds (default 5, quick 3)")
    p.add_argument("--methods", nargs="*", default=None,
                   help="only these methods in the table (e.g. xnn:auto vesin)")
    p.add_argument("--paired-rounds", type=int, default=9,
                   help="alternating xnn:auto / vesin builds per size (default 9; 3x "
                   "that on CUDA with --paired-only)")
    p.add_argument("--batched", type=int, nargs=2, default=None, metavar=("B", "N"),
                   help="with --paired-only: also B systems of ~N atoms in one batched call "
                   "against a loop of vesin calls (e.g. 64 108)")
    p.add_argument("--phases", action="store_true",
                   help="with --paired-only: also time xnn:auto's phases (validate, vesin "
                   "compute, outputs, other), host-only and with a sync at each boundary")
    p.add_argument("--host-overhead", type=int, default=0, metavar="CALLS",
                   help="only the host time of xnn's wrapper around a stubbed vesin "
                   "(CALLS repeated calls per batch, e.g. 2000) on each of --devices")
    p.add_argument("--after-torch-op", type=int, default=0, metavar="ROUNDS",
                   help="only vesin's CPU compute alone and right after a torch sum over the "
                   "positions (torch's OpenMP workers spin on vesin's cores), at --sizes")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="with --host-overhead: also the N functions with most own time")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-seconds", type=float, default=30.0,
                   help="skip a method at a size where its (linearly extrapolated) time per "
                   "build exceeds this")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = ("neighbors_after_torch_op" if args.after_torch_op
                else "neighbors_paired" if args.paired_only else "neighbors")
        device = "cuda" if "cuda" in (args.devices or [args.device]) else "cpu"
        args.json = results_path(name, device)
    if args.repeat is None:
        args.repeat = 3 if args.quick else 5
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.after_torch_op:
        rows = [bench_after_torch_op(n, args.cutoff, args.after_torch_op)
                for n in (args.sizes or [10_000])]
        for r in rows:
            print(f"{r['n_atoms']:>9} vesin alone {r['alone_median_s'] * 1e3:.2f} ms, after a "
                  f"torch sum {r['after_torch_sum_median_s'] * 1e3:.2f} ms "
                  f"({r['torch_threads']} torch threads)")
        payload = {"benchmark": "vesin compute after a torch CPU reduction", "rows": rows}
    elif args.host_overhead:
        rows = [bench_host_overhead(torch.device(d), args.host_overhead, profile=args.profile,
                                    torch_route=route)
                for d in (args.devices or [args.device]) for route in (False, True)
                if not (route and d != "cpu")]
        for r in rows:
            print(f"{r['device']:<4} {r['route']:<11} host overhead: "
                  f"{r['us_per_call_median']:.1f} us/call "
                  f"(min {r['us_per_call_min']:.1f}), outputs match: {r['outputs_match']}")
            for k, v in r.get("profile_own_us_per_call", {}).items():
                print(f"    {v:8.2f} us  {k}")
        payload = {"benchmark": "neighbors host overhead (vesin compute stubbed)",
                   "host_overhead": rows}
    else:
        payload = run_paired_only(args) if args.paired_only else run(args)
    device = "cuda" if "cuda" in (args.devices or [args.device]) else args.device
    out = write_json(args.json, payload, device=device)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
