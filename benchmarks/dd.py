"""Domain-decomposition scaling: energy + forces on 1 rank vs decomposed over N ranks.

Launch with torchrun (the same command at 1, 2, 4 or 8 ranks)::

    torchrun --nproc-per-node 8 benchmarks/dd.py \
        --device cuda --models painn,equivariant,sevenn --scaling both
    torchrun --nproc-per-node 2 benchmarks/dd.py --json /tmp/dd.json --quick   # CPU, gloo

For every model:

* strong scaling: FCC Cu of each ``--sizes`` (default 100k and 400k atoms) on 1 rank and on
  N ranks; efficiency ``t_1 / (N t_N)``;
* weak scaling: ``--atoms-per-rank`` atoms on 1 rank vs ``N x`` that on N ranks; efficiency
  ``t_1 / t_N``.

Timed: one decomposed energy + forces evaluation of the already partitioned system
(:meth:`DecomposedPotential.__call__`: model on owned + ghost atoms, halo exchanges,
energy all-reduce, backward through the exchange), as in an MD step between neighbor-list
rebuilds. The single-rank baseline is the same model with a prebuilt periodic neighbor list
(:func:`compute_properties`). Reported per point: median time per step, efficiency, halo
fraction (ghost / owned atoms, mean and max over ranks) and the compute-bound efficiency it
predicts, ``1 / (1 + max halo fraction)``, the edge-bound prediction (ideal share of the
baseline's edges / busiest rank's local edges), atoms exchanged, peak memory per
rank (CUDA ``max_memory_allocated``; process peak RSS on CPU), and the one-off cost of the
partition and of a full call (scatter + gather).

``--modes halo,graph`` (graph parallelism, :mod:`xnn.distributed.graph`) times each mode on
each ``--sizes`` point instead and records the crossover: per size the time per step of
each mode (``halo``: the spatial mode of the model, sync where it has sync points), which
is faster, and what ``mode=auto``'s cost model picks (with its reason)::

    torchrun --nproc-per-node 4 benchmarks/dd.py --json /tmp/x.json --quick \
        --modes halo,graph --sizes 32,108,256,500 --scaling none
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu, peak_memory, reset_peak_memory, time_fn, write_json
except ImportError:  # run as `python benchmarks/dd.py` / `torchrun benchmarks/dd.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, peak_memory, reset_peak_memory, time_fn, write_json

from xnn.data.graph import AtomicGraph
from xnn.distributed import DistributedManager, parallelize
from xnn.distributed import collectives as C
from xnn.distributed.parallelize import resolve_mode


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--models", default="painn,equivariant",
                   help="comma list of painn, equivariant, schnet, sevenn, lj")
    p.add_argument("--sizes", default=None, help="strong-scaling sizes (atoms), comma list")
    p.add_argument("--atoms-per-rank", type=int, default=None, help="weak-scaling atoms per rank")
    p.add_argument("--scaling", default="both", choices=["strong", "weak", "both", "none"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--mode", default="spatial", choices=["spatial", "halo", "sync"],
                   help="spatial: sync for models with sync points, else halo "
                   "(xnn.distributed.modes.MODES)")
    p.add_argument("--modes", default=None,
                   help="comma list of halo, sync, graph: time each on every --sizes point and "
                   "record the crossover (halo: sync for models with sync points)")
    p.add_argument("--order", default="morton", choices=["morton", "index"],
                   help="atom order of mode graph")
    p.add_argument("--cutoff", type=float, default=5.0, help="cutoff of native models (Å)")
    p.add_argument("--skin", type=float, default=0.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and models (CPU smoke test; sevenn: mode sync, 5 Å halo)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--find-max", type=int, default=None, metavar="ATOMS_PER_RANK",
                   help="largest system that fits, 1 rank vs N ranks: peak memory at "
                        "ATOMS_PER_RANK and twice that per rank, linear extrapolation to the "
                        "device memory, then a verified evaluation at 0.96x the prediction")
    p.add_argument("--capacity-gb", type=float, default=None,
                   help="find-max: memory to fill (default: the CUDA device's, less 3 GiB)")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = ("dd_find_max" if args.find_max else "dd_halo_graph" if args.modes
                else "dd_" + args.models.replace(",", "_"))
        args.json = results_path(name, args.device)
    quick = args.quick
    args.sizes = [int(s) for s in (args.sizes or ("500" if quick else "100000,400000")).split(",")]
    args.atoms_per_rank = args.atoms_per_rank or (256 if quick else 100_000)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes else None
    if quick:
        args.repeat = min(args.repeat, 2)
    return args


def build_model(name: str, args):
    from xnn.models import build

    torch.manual_seed(0)
    small = {"num_features": 16} if args.quick else {}
    if name == "lj":
        return build("lj", sigma=2.3, epsilon=0.4, cutoff=args.cutoff)
    if name in ("painn", "schnet"):
        return build(name, species=[29], cutoff=args.cutoff, **small)
    if name == "equivariant":
        kw = dict(channels=8, radial_mlp=(16,)) if args.quick else {}
        return build("equivariant", species=[29], cutoff=args.cutoff, **kw)
    if name == "sevenn":
        from xnn.models.external.sevenn import SevenNetWrapper

        return SevenNetWrapper("7net-0")
    raise SystemExit(f"unknown model {name!r}")


def structure(n_atoms: int, dtype) -> AtomicGraph:
    atoms = fcc_cu(n_atoms)
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   dtype=dtype)


def single_rank(model, graph, device, repeat):
    """Median time (s) and peak memory of energy + forces on this rank alone."""
    from xnn.models import compute_properties
    from xnn.neighbors import with_edges

    g = with_edges(graph.to(device), float(model.cutoff))
    reset_peak_memory(device)
    t = time_fn(lambda: compute_properties(model, g, forces=True, stress=False), repeat=repeat,
                device=device)
    return {"time_s": t["median_s"], "peak_memory_bytes": peak_memory(device),
            "n_atoms": g.n_atoms, "n_edges": g.n_edges}


def decomposed(model, graph, manager, args, mode):
    """Time of a decomposed step on all ranks, with halo and memory statistics."""
    device = manager.device
    dd = parallelize(model, manager, mode, skin=args.skin, order=args.order)
    t0 = time.perf_counter()
    g = dd.scatter(graph)  # this rank's owned atoms; the ghost plan is built
    setup_s = time.perf_counter() - t0
    reset_peak_memory(device)
    t = time_fn(lambda: dd(g, forces=True, stress=False), repeat=args.repeat,
                device=device)
    t0 = time.perf_counter()
    dd.single_point(graph, stress=False)
    call_s = time.perf_counter() - t0
    st = dd.stats()
    row = torch.tensor([[st["n_owned"], st["n_ghost"], st["n_recv"], st["n_peers"],
                         peak_memory(device) or 0, st["n_edges"]]], dtype=torch.float64,
                       device=device)
    rows = C.gather_rows(row).cpu()
    owned = rows[:, 0].clamp_min(1)
    return {"time_s": t["median_s"], "setup_s": setup_s, "call_s": call_s, "grid": st["grid"],
            "halo_width": dd.halo_width, "mode": mode,
            "halo_fraction_mean": float((rows[:, 1] / owned).mean()),
            # compute-bound estimate: each rank evaluates owned + ghost atoms
            "predicted_weak_efficiency": float(1.0 / (1.0 + (rows[:, 1] / owned).max())),
            "halo_fraction_max": float((rows[:, 1] / owned).max()),
            "ghost_atoms_max": int(rows[:, 1].max()), "recv_atoms_max": int(rows[:, 2].max()),
            "peers_max": int(rows[:, 3].max()), "owned_min": int(rows[:, 0].min()),
            "owned_max": int(rows[:, 0].max()), "peak_memory_bytes_max": int(rows[:, 4].max()),
            "edges_max": int(rows[:, 5].max())}


def point(model, n_atoms, manager, args, mode, baseline_atoms=None):
    """One scaling point: baseline on rank 0 (others wait), then decomposed on all ranks."""
    dtype = getattr(torch, args.dtype)
    base = None
    with C.guarded(None, "single-rank baseline"):
        if manager.is_main:
            try:
                base = single_rank(model, structure(baseline_atoms or n_atoms, dtype),
                                   manager.device, args.repeat)
            except torch.cuda.OutOfMemoryError:
                base = {"time_s": None, "error": "out of memory"}
                torch.cuda.empty_cache()
    graph = structure(n_atoms, dtype) if manager.is_main else None
    try:  # ranks hold equal shares, so they run out of memory together
        dec = decomposed(model, graph, manager, args, mode)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        dec = {"time_s": None, "error": "out of memory"}
    if dec.get("time_s") is None:
        return {"n_atoms": n_atoms, "ranks": manager.world_size, "single": base,
                "decomposed": dec}
    out = {"n_atoms": graph.n_atoms if graph is not None else None, "ranks": manager.world_size,
           "single": base, "decomposed": dec}
    if manager.is_main and base.get("time_s"):
        ratio = base["time_s"] / dec["time_s"]
        out["speedup"] = ratio
        out["efficiency"] = ratio if baseline_atoms else ratio / manager.world_size
        # edge-bound estimate: the busiest rank's edges vs an ideal share of the baseline's
        share = base["n_edges"] * (1 if baseline_atoms else 1 / manager.world_size)
        out["predicted_efficiency_edges"] = share / max(dec["edges_max"], 1)
    return out


def _fits(fn) -> tuple[bool, int | None]:
    """``(ok, peak bytes)`` of ``fn()`` (``ok`` False on CUDA out of memory)."""
    try:
        return True, fn()
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return False, None


def _single_peak(model, n, args, device) -> int:
    if device.type == "cuda":  # vesin allocates outside torch's cache
        torch.cuda.empty_cache()
    r = single_rank(model, structure(n, getattr(torch, args.dtype)), device, 1)
    return int(r["peak_memory_bytes"])


def _dd_peak(model, n, manager, args, mode) -> int:
    if manager.device.type == "cuda":
        torch.cuda.empty_cache()
    graph = structure(n, getattr(torch, args.dtype)) if manager.is_main else None
    sub = argparse.Namespace(**{**vars(args), "repeat": 1})
    return int(decomposed(model, graph, manager, sub, mode)["peak_memory_bytes_max"])


def _check(peak_at, pred: int) -> dict:
    """Evaluate at 0.96, 0.92, ... 0.72 of ``pred`` atoms until one fits (collective when
    ``peak_at`` is)."""
    tried = []
    for frac in (0.96, 0.92, 0.88, 0.84, 0.80, 0.76, 0.72):
        n = int(frac * pred)
        ok, peak = _fits(lambda n=n: peak_at(n))
        tried.append([n, ok])
        if ok:
            return {"predicted_max": pred, "checked_atoms": n, "peak_bytes": peak,
                    "tried": tried}
    return {"predicted_max": pred, "checked_atoms": None, "peak_bytes": None, "tried": tried}


def find_max(model, manager, args, mode) -> dict:
    """Largest FCC Cu system that fits on rank 0 alone and decomposed over all ranks.

    Peak memory (CUDA ``max_memory_allocated``) is measured at ``n0`` and ``2 n0`` atoms per
    rank and extrapolated linearly to the device's memory less 3 GiB (context, allocator
    slack); the prediction is then checked by evaluations at 0.96x, 0.92x, ... of it, down to
    0.72x, until one fits. ``checked_atoms`` is the largest checked size that fit.
    """
    device = manager.device
    cap = (int(args.capacity_gb * 2**30) if args.capacity_gb
           else torch.cuda.get_device_properties(device).total_memory - (3 << 30))
    n0, world = args.find_max, manager.world_size
    out = {"capacity_bytes": cap}

    def predict(n1, p1, n2, p2):
        slope = max(p2 - p1, 1) / (n2 - n1)
        return int(min(n2 + (cap - p2) / slope, 16 * n2)), slope  # clamp: CPU RSS is flat

    single = None
    with C.guarded(None, "find-max on one rank"):
        if manager.is_main:
            p1 = _single_peak(model, n0, args, device)
            p2 = _single_peak(model, 2 * n0, args, device)
            pred, slope = predict(n0, p1, 2 * n0, p2)
            single = _check(lambda n: _single_peak(model, n, args, device), pred)
            single.update(peaks=[[n0, p1], [2 * n0, p2]], bytes_per_atom=slope)
            print(f"find-max 1 rank: {slope / 1024:.1f} KiB/atom, predicted {pred}, "
                  f"checked {single['tried']}", flush=True)
    p1 = _dd_peak(model, n0 * world, manager, args, mode)
    p2 = _dd_peak(model, 2 * n0 * world, manager, args, mode)
    pred, slope = predict(n0 * world, p1, 2 * n0 * world, p2)
    multi = _check(lambda n: _dd_peak(model, n, manager, args, mode), pred)
    multi.update(peaks=[[n0 * world, p1], [2 * n0 * world, p2]], bytes_per_atom=slope)
    if manager.is_main:
        print(f"find-max {world} ranks: {slope / 1024:.1f} KiB/atom (per rank, of the total), "
              f"predicted {pred}, checked {multi['tried']}", flush=True)
        both = single["checked_atoms"] and multi["checked_atoms"]
        out.update(single=single, decomposed=multi,
                   ratio_predicted=pred / single["predicted_max"],
                   ratio_verified=multi["checked_atoms"] / single["checked_atoms"] if both
                   else None)
    return out


def crossover(name, model, manager, args) -> dict:
    """``--modes``: every mode on every size (the same partitioned system per mode), the
    single-rank baseline once per size, the faster mode and ``mode=auto``'s choice."""
    from xnn.distributed.graph.auto import choose_mode

    dtype, modes = getattr(torch, args.dtype), args.modes
    res = {"modes": modes, "cutoff": float(model.cutoff),
           "num_interactions": int(getattr(model, "num_interactions", 1)), "points": []}
    for n in args.sizes:
        graph = structure(n, dtype) if manager.is_main else None
        base = auto = None
        with C.guarded(None, "single-rank baseline and auto choice"):
            if manager.is_main:
                base = single_rank(model, graph, manager.device, args.repeat)
                auto = choose_mode(model, graph, manager.world_size, skin=args.skin)
        pt = {"n_atoms": graph.n_atoms if graph is not None else None,
              "ranks": manager.world_size, "single": base, "by_mode": {}}
        for m in modes:
            mode = "spatial" if m == "halo" else m  # the library's spatial choice
            pt["by_mode"][m] = decomposed(model, graph, manager, args, mode)
        if manager.is_main:
            times = {m: d["time_s"] for m, d in pt["by_mode"].items()}
            pt["faster"] = min(times, key=times.get)
            pt["auto"] = {"mode": "graph" if auto[0] == "graph" else "halo",
                          "reason": auto[1]}
            print(f"{name:>12} {pt['n_atoms']:>7} atoms on {manager.world_size} ranks: "
                  + "  ".join(f"{m} {t:.4g} s" for m, t in times.items())
                  + f"  faster {pt['faster']}, auto {pt['auto']['mode']}", flush=True)
        res["points"].append(pt)
    return res


def run_model(name, model, manager, args):
    if args.modes:
        return crossover(name, model, manager, args)
    mode = resolve_mode(model, args.mode)[0]
    res = {"mode": mode, "cutoff": float(model.cutoff),
           "num_interactions": int(getattr(model, "num_interactions", 1)),
           "strong": [], "weak": []}
    if args.scaling in ("strong", "both"):
        for n in args.sizes:
            res["strong"].append(point(model, n, manager, args, mode))
            log(manager, name, "strong", res["strong"][-1])
    if args.scaling in ("weak", "both"):
        n0 = args.atoms_per_rank
        res["weak"].append(point(model, n0 * manager.world_size, manager, args, mode,
                                 baseline_atoms=n0))
        log(manager, name, "weak", res["weak"][-1])
    if args.find_max and (manager.device.type == "cuda" or args.capacity_gb):
        res["largest"] = find_max(model, manager, args, mode)
    return res


def log(manager, name, kind, p):
    if manager.is_main:
        d = p["decomposed"]
        t1 = (p["single"] or {}).get("time_s")
        eff = p.get("efficiency", float("nan"))
        if d.get("time_s") is None:
            print(f"{name:>12} {kind:>6} {p['n_atoms']} atoms: decomposed {d.get('error')}, "
                  f"1 rank {t1}", flush=True)
            return
        print(f"{name:>12} {kind:>6} {p['n_atoms']:>9} atoms  1 rank {t1 or float('nan'):.4g} s"
              f"  {p['ranks']} ranks {d['time_s']:.4g} s  eff {eff:.2f}"
              f"  halo {d['halo_fraction_mean']:.2f}  grid {d['grid']}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    manager = DistributedManager.initialize(timeout_s=args.timeout, device=args.device)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, manager.world_size))
                          if manager.device.type == "cpu" else torch.get_num_threads())
    results = {}
    try:
        for name in args.models:
            try:  # a model that cannot be built (e.g. sevenn not installed) is recorded
                with C.guarded(None, f"building {name}"):
                    model = build_model(name, args).to(manager.device, getattr(torch, args.dtype))
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                if manager.is_main:
                    traceback.print_exc()
                continue
            results[name] = run_model(name, model, manager, args)
        if manager.is_main:
            write_json(args.json, {"benchmark": "dd", "world_size": manager.world_size,
                                   "args": {k: v for k, v in vars(args).items()},
                                   "results": results}, device=str(manager.device))
            print(f"wrote {args.json}")
    finally:
        manager.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
