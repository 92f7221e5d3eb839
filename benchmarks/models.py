"""Model throughput: energy + forces of SchNet, PaiNN, the equivariant model and MACE.

For each model and size (FCC Cu, rattled, ~1k / 10k / 100k atoms) the neighbor list is built
once (not timed), then ``energy + forces`` is timed; throughput is ``atoms / median time``
(atom-steps/s). Peak memory per atom is measured on CUDA (``max_memory_allocated`` above the
memory held before the call); on CPU the process peak RSS is recorded instead. An
out-of-memory size is recorded and larger sizes of that model are skipped.

mace-torch's ``ScaleShiftMACE`` (hidden irreps 128x0e+128x1o, l_max 3, correlation 3,
2 interactions, r_c 6 Å, random weights) is timed with its own forward
``model(batch_dict, compute_force=True)`` on the same structures.

Usage::

    python benchmarks/models.py --json /tmp/models_cpu.json --quick
    python benchmarks/models.py --json out.json --device cuda --dtype float32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu, peak_memory, reset_peak_memory, time_fn, write_json
except ImportError:  # run as `python benchmarks/models.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, peak_memory, reset_peak_memory, time_fn, write_json

SIZES = (1_000, 10_000, 100_000)
QUICK_SIZES = (32, 108)
MODELS = ("schnet", "painn", "equivariant", "mace")
CUTOFF = 5.0
MACE_CUTOFF = 6.0


# --------------------------------------------------------------------------- structures
def make_graph(n_atoms: int, cutoff: float, device: str, dtype: torch.dtype):
    """FCC Cu graph of about ``n_atoms`` atoms with edges within ``cutoff``; NL build time."""
    from xnn.data import AtomicGraph
    from xnn.neighbors import with_edges

    atoms = fcc_cu(n_atoms, rattle=0.05, seed=0)
    g = AtomicGraph.from_arrays(
        atoms.positions, atoms.numbers, atoms.cell[:], atoms.pbc, dtype=dtype, device=device
    )
    t0 = time.perf_counter()
    g = with_edges(g, cutoff)
    if g.device.type == "cuda":
        torch.cuda.synchronize(g.device)
    return g, time.perf_counter() - t0


# --------------------------------------------------------------------------- models
def build_xnn(name: str):
    from xnn.models import build

    return build(name, species=[29], cutoff=CUTOFF)


def build_mace(avg_num_neighbors: float):
    """Random-weight ScaleShiftMACE of the reference size (raises ImportError without mace)."""
    import numpy as np
    from e3nn import o3
    from mace import modules

    return modules.ScaleShiftMACE(
        r_max=MACE_CUTOFF,
        num_bessel=8,
        num_polynomial_cutoff=5,
        max_ell=3,
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        num_interactions=2,
        num_elements=1,
        hidden_irreps=o3.Irreps("128x0e+128x1o"),
        MLP_irreps=o3.Irreps("16x0e"),
        atomic_energies=np.array([-3.0]),
        avg_num_neighbors=avg_num_neighbors,
        atomic_numbers=[29],
        correlation=3,
        gate=torch.nn.functional.silu,
        atomic_inter_scale=1.0,
        atomic_inter_shift=0.0,
    )


def mace_batch(graph) -> dict[str, torch.Tensor]:
    """mace-torch's batch dict for ``graph`` (its vectors point sender -> receiver)."""
    cell = graph.cell
    unit_shifts = graph.shifts.to(graph.dtype)
    # xnn: r = pos[j] - pos[i] + s @ cell (j = row 0); MACE: pos[row 1] - pos[row 0] + S
    shifts = -torch.einsum("ek,ekl->el", unit_shifts, cell[graph.batch[graph.edge_index[1]]])
    return {
        "positions": graph.positions.clone(),
        "node_attrs": torch.ones(graph.n_atoms, 1, dtype=graph.dtype, device=graph.device),
        "edge_index": graph.edge_index,
        "shifts": shifts,
        "unit_shifts": -unit_shifts,
        "cell": cell.reshape(-1, 3),
        "batch": graph.batch,
        "ptr": graph.ptr,
        "head": torch.zeros(graph.n_systems, dtype=torch.long, device=graph.device),
    }


# --------------------------------------------------------------------------- measurement
def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def measure(step, n_atoms: int, device: str, repeat: int) -> dict:
    """Time ``step()`` and measure its peak memory; OOM is reported, not raised."""
    dev = torch.device(device)
    try:
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(dev)
            reset_peak_memory(dev)
            step()
            peak = peak_memory(dev) - base
        else:
            step()
            peak = None
        timing = time_fn(step, repeat=repeat, warmup=1, device=dev)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        return {"status": "oom", "error": str(err).splitlines()[0][:200]}
    out = {
        "status": "ok",
        **timing,
        "atom_steps_per_s": n_atoms / timing["median_s"],
        "us_per_atom": 1e6 * timing["median_s"] / n_atoms,
    }
    if peak is not None:
        out["peak_bytes"] = int(peak)
        out["peak_bytes_per_atom"] = peak / n_atoms
    else:
        out["process_peak_rss_bytes"] = peak_memory("cpu")
    return out


def run_model(name: str, sizes, device: str, dtype: torch.dtype, repeat: int) -> dict:
    """All sizes of one model; stops at the first OOM."""
    from xnn.models import compute_properties

    cutoff = MACE_CUTOFF if name == "mace" else CUTOFF
    entry: dict = {"cutoff": cutoff, "sizes": {}, "largest_fitting_n_atoms": None}
    model = None
    for size in sizes:
        g, nl_s = make_graph(size, cutoff, device, dtype)
        if model is None:
            if name == "mace":
                model = build_mace(g.n_edges / g.n_atoms)
            else:
                model = build_xnn(name)
            model = model.to(device=device, dtype=dtype)
            entry["n_parameters"] = sum(p.numel() for p in model.parameters())
        if name == "mace":
            batch = mace_batch(g)

            def step(batch=batch, model=model):
                return model(batch, compute_force=True)["forces"]
        else:

            def step(g=g, model=model):
                return compute_properties(model, g, forces=True, stress=False)

        res = measure(step, g.n_atoms, device, repeat)
        res.update(n_atoms=g.n_atoms, n_edges=g.n_edges, neighbor_list_s=nl_s)
        entry["sizes"][str(size)] = res
        print(f"{name:12s} n={g.n_atoms:7d} {_summary(res)}", flush=True)
        del g
        if res["status"] == "oom":
            break
        entry["largest_fitting_n_atoms"] = res["n_atoms"]
    return entry


def _summary(res: dict) -> str:
    if res["status"] != "ok":
        return res["status"]
    mem = res.get("peak_bytes_per_atom")
    mem_s = f", {mem / 1024:.1f} KiB/atom" if mem is not None else ""
    return f"{res['atom_steps_per_s']:.3g} atom-steps/s ({res['median_s'] * 1e3:.1f} ms){mem_s}"


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--quick", action="store_true", help=f"small sizes {QUICK_SIZES}")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--sizes", nargs="+", type=int, help=f"atom counts (default {SIZES})")
    p.add_argument("--repeat", type=int, default=None, help="timed calls per size")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("models", args.device)
    dtype = getattr(torch, args.dtype)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    repeat = args.repeat or (2 if args.quick else 5)
    torch.manual_seed(0)
    results: dict = {
        "benchmark": "models",
        "description": "energy + forces throughput, FCC Cu rattled 0.05 Å",
        "dtype": args.dtype,
        "quick": args.quick,
        "load_average_1min_at_start": _load_average(),
        "models": {},
    }
    for name in args.models:
        try:
            results["models"][name] = run_model(name, sizes, args.device, dtype, repeat)
        except ImportError as err:
            results["models"][name] = {"status": "skipped", "reason": f"not available: {err}"}
            print(f"{name:12s} skipped ({err})", flush=True)
    _add_ratios(results["models"])
    write_json(args.json, results, device=args.device)
    return results


def _load_average() -> float | None:
    """1-minute load average (CPU timings on a shared machine are only indicative)."""
    try:
        import os

        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _add_ratios(models: dict) -> None:
    """Throughput of each model relative to MACE at the same size (where both ran)."""
    mace = models.get("mace", {}).get("sizes", {})
    for name, entry in models.items():
        if name == "mace" or "sizes" not in entry:
            continue
        for size, res in entry["sizes"].items():
            ref = mace.get(size, {})
            if res.get("status") == "ok" and ref.get("status") == "ok":
                res["speed_vs_mace"] = res["atom_steps_per_s"] / ref["atom_steps_per_s"]


if __name__ == "__main__":
    main()
