"""Speed and memory per atom of the ``equivariant`` model vs mace-torch's MACE of similar size.

Energy + forces (inference, ``create_graph=False``) and, with ``--train``, energy + forces with
``create_graph=True`` plus a backward of a force loss (training step), on rattled FCC Cu.

Measured per model and size:
  * ``atom_steps_per_s``: atoms / median wall time of one evaluation;
  * ``saved_bytes_per_atom``: bytes of the tensors autograd keeps for backward (the retained
    graph; counted once per storage), measured with ``saved_tensors_hooks`` on any device;
  * ``peak_bytes_per_atom``: CUDA ``max_memory_allocated`` above the pre-evaluation level
    (CUDA only; on CPU ``None``);
  * with ``--find-max`` (CUDA): the largest atom count that evaluates without running out of
    memory (grown by 1.25x).

Usage::

    python -m benchmarks.bench_equivariant --quick --chunks 0 4096     # CPU, small sizes
    python -m benchmarks.bench_equivariant --device cuda --find-max --json out.json
    python -m benchmarks.bench_equivariant --device cuda --train --channels 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fcc_cu, reset_peak_memory, synchronize, time_fn, write_json  # noqa: E402
from xnn.data import keys as K  # noqa: E402
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.models import build, compute_properties  # noqa: E402
from xnn.neighbors import with_edges  # noqa: E402


def xnn_model(
    channels: int, hidden_l_max: int, cutoff: float, chunk: int | str | None = None
) -> torch.nn.Module:
    return build(
        "equivariant", species=[29], cutoff=cutoff, channels=channels, l_max=2,
        hidden_l_max=hidden_l_max, num_interactions=2, correlation=3, num_bessel=8,
        avg_num_neighbors=40.0, edge_chunk_size=chunk,
    )


def mace_model(channels: int, hidden_l_max: int, cutoff: float) -> torch.nn.Module | None:
    """mace-torch MACE (max_ell 2, correlation 3, 2 layers) wrapped as an xnn model, or None."""
    try:
        from e3nn import o3
        from mace import modules

        from xnn.models.external.mace import MACEWrapper
    except Exception as err:  # mace-torch not installed / wrapper missing
        print(f"MACE comparison skipped: {type(err).__name__}: {err}")
        return None
    hidden = f"{channels}x0e" + (f" + {channels}x1o" if hidden_l_max >= 1 else "")
    mace = modules.MACE(
        r_max=cutoff, num_bessel=8, num_polynomial_cutoff=5, max_ell=2,
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        num_interactions=2, num_elements=1, hidden_irreps=o3.Irreps(hidden),
        MLP_irreps=o3.Irreps("16x0e"), atomic_energies=np.zeros(1), avg_num_neighbors=40.0,
        atomic_numbers=[29], correlation=3, gate=torch.nn.functional.silu,
        radial_MLP=[64, 64, 64],
    )
    return MACEWrapper(mace)


def saved_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves for backward while ``fn()`` runs."""
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def make_step(model, graph: AtomicGraph, train: bool):
    def step():
        out = compute_properties(model, graph, forces=True, stress=False, training=train)
        if train:
            (out[K.FORCES] ** 2).sum().backward()
        return out

    return step


def measure(model, n_atoms: int, device: str, dtype, train: bool, repeat: int) -> dict:
    atoms = fcc_cu(n_atoms)
    g = AtomicGraph.from_arrays(
        atoms.positions, atoms.numbers, atoms.cell.array, True, dtype=dtype, device=device
    )
    # the torch cell list allocates through torch's caching allocator (vesin's raw cudaMalloc
    # can fail while torch's cache holds the memory, and leaves a CUDA error behind)
    g = with_edges(g, float(model.cutoff), backend="torch" if device.startswith("cuda") else "auto")
    step = make_step(model, g, train)
    n = g.n_atoms
    # retained autograd graph (forward only: what the force backward needs)
    fwd = saved_bytes(lambda: model(g.replace(positions=g.positions.requires_grad_(True))))
    synchronize(device)
    reset_peak_memory(device)
    base = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    t = time_fn(step, repeat=repeat, warmup=1, device=device)
    peak = None
    if device.startswith("cuda"):
        peak = (torch.cuda.max_memory_allocated() - base) / n
    model.zero_grad(set_to_none=True)
    return {
        "n_atoms": n, "n_edges": g.n_edges, "median_s": t["median_s"],
        "atom_steps_per_s": n / t["median_s"], "atom_steps_per_s_best": n / t["min_s"],
        "saved_bytes_per_atom": fwd / n,
        "peak_bytes_per_atom": peak,
    }


def compiled_error(compiled, eager, n_atoms: int, device: str, dtype) -> float:
    """``max |F_compiled - F_eager| / max |F_eager|`` on one FCC Cu system."""
    atoms = fcc_cu(n_atoms)
    g = AtomicGraph.from_arrays(
        atoms.positions, atoms.numbers, atoms.cell.array, True, dtype=dtype, device=device
    )
    g = with_edges(g, float(eager.cutoff))
    f1 = compute_properties(compiled, g, forces=True, stress=False)[K.FORCES]
    f0 = compute_properties(eager, g, forces=True, stress=False)[K.FORCES]
    return float((f1 - f0).abs().max() / f0.abs().max())


def find_max(model, device: str, dtype, train: bool, start: int) -> int:
    """Largest FCC Cu size (grown by 1.25x) whose evaluation fits in device memory."""
    n, best = start, 0
    while True:
        try:
            measure(model, n, device, dtype, train, repeat=1)
            best = n
            n = int(n * 1.25) + 1
        except (torch.cuda.OutOfMemoryError, torch.AcceleratorError) as err:
            if "out of memory" not in str(err):
                raise
            torch.cuda.empty_cache()
            return best


def build_models(a: argparse.Namespace) -> dict[str, torch.nn.Module]:
    models = {}
    for chunk in a.chunks:
        chunk = chunk if chunk == "auto" else (int(chunk) or None)
        torch.manual_seed(0)
        models[f"xnn_equivariant_chunk{chunk}"] = xnn_model(
            a.channels, a.hidden_l_max, a.cutoff, chunk
        )
        if a.compile:
            torch.manual_seed(0)
            model = xnn_model(a.channels, a.hidden_l_max, a.cutoff, chunk)
            model.compile_for_inference()
            models[f"xnn_equivariant_chunk{chunk}_compiled"] = model
    if not a.no_mace:
        mace = mace_model(a.channels, a.hidden_l_max, a.cutoff)
        if mace is not None:
            models["mace"] = mace
    return models


def rss_child(a: argparse.Namespace, dtype) -> dict:
    """Run one evaluation of one model in this (fresh) process; print its peak RSS growth."""
    import resource

    name, n = a.rss_child[0], int(a.rss_child[1])
    model = build_models(a)[name].to(dtype=dtype)
    atoms = fcc_cu(n)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True, dtype=dtype)
    g = with_edges(g, float(model.cutoff))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    make_step(model, g, a.train)()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"RSS {g.n_atoms} {before} {after}")
    return {}


def rss_per_atom(name: str, n1: int, n2: int, argv: list[str] | None) -> float:
    """``(peak(n2) - peak(n1)) / (atoms2 - atoms1)`` KiB/atom from two fresh processes (Linux)."""
    import subprocess

    argv = [x for x in (sys.argv[1:] if argv is None else argv) if x != "--rss"]
    peaks = []
    for n in (n1, n2):
        cmd = [sys.executable, "-m", "benchmarks.bench_equivariant", *argv]
        cmd += ["--rss-child", name, str(n)]
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=root)
        line = [x for x in out.stdout.splitlines() if x.startswith("RSS ")][-1].split()
        peaks.append((int(line[1]), int(line[3])))
    (a1, p1), (a2, p2) = peaks
    return (p2 - p1) / max(a2 - a1, 1)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--hidden-l-max", type=int, default=1)
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--sizes", type=int, nargs="+", default=None)
    p.add_argument("--train", action="store_true", help="force-loss backward (double backward)")
    p.add_argument("--chunks", nargs="+", default=["auto"],
                   help="edge_chunk_size values to run (0: never chunk, auto: when memory "
                        "needs it); one model each")
    p.add_argument("--compile", action="store_true",
                   help="also run each xnn model with compile_for_inference (same weights)")
    p.add_argument("--no-mace", action="store_true")
    p.add_argument("--find-max", action="store_true", help="CUDA: largest size that fits")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    p.add_argument("--rss", action="store_true",
                   help="CPU: peak resident KiB/atom from subprocesses at the first and last size")
    p.add_argument("--rss-child", nargs=2, default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    a = p.parse_args(argv)
    if a.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        a.json = results_path("bench_equivariant", a.device)
    dtype = getattr(torch, a.dtype)
    sizes = a.sizes or ([108, 256] if a.quick else [2048, 16384, 65536])
    if a.rss_child:
        return rss_child(a, dtype)
    models = build_models(a)
    results: dict = {"config": vars(a), "models": {}}
    if a.rss:
        results["rss_kib_per_atom"] = {
            name: rss_per_atom(name, sizes[0], sizes[-1], argv) for name in models
        }
        print("peak RSS KiB/atom:", results["rss_kib_per_atom"])
    for name, model in models.items():
        model = model.to(device=a.device, dtype=dtype)
        params = sum(q.numel() for q in model.parameters())
        rows = [measure(model, n, a.device, dtype, a.train, a.repeat) for n in sizes]
        entry = {"parameters": params, "runs": rows}
        if name.endswith("_compiled"):
            eager = models[name.removesuffix("_compiled")].to(device=a.device, dtype=dtype)
            entry["max_rel_force_error_vs_eager"] = compiled_error(model, eager, sizes[0],
                                                                   a.device, dtype)
        if a.find_max and a.device.startswith("cuda") and not name.endswith("_compiled"):
            entry["max_atoms"] = find_max(model, a.device, dtype, a.train, sizes[-1])
            print(f"{name}: largest size that fits: {entry['max_atoms']} atoms")
        results["models"][name] = entry
        for r in rows:
            print(
                f"{name:16s} params={params:8d} n={r['n_atoms']:7d} edges/atom="
                f"{r['n_edges'] / r['n_atoms']:.1f} {r['atom_steps_per_s']:10.1f} atom-steps/s "
                f"saved={r['saved_bytes_per_atom'] / 1024:.1f} KiB/atom"
                + (f" peak={r['peak_bytes_per_atom'] / 1024:.1f} KiB/atom"
                   if r["peak_bytes_per_atom"] else "")
            )
    ours_names = [k for k in results["models"] if k.startswith("xnn")]
    if "mace" in results["models"]:
        ref = results["models"]["mace"]["runs"]
        results["ratios"] = [
            {
                "model": name,
                "n_atoms": o["n_atoms"],
                "speed_vs_mace": o["atom_steps_per_s"] / m["atom_steps_per_s"],
                "speed_vs_mace_best": o["atom_steps_per_s_best"] / m["atom_steps_per_s_best"],
                "saved_memory_mace_over_ours": (
                    m["saved_bytes_per_atom"] / o["saved_bytes_per_atom"]
                ),
            }
            for name in ours_names
            for o, m in zip(results["models"][name]["runs"], ref)
        ]
        for r in results["ratios"]:
            print(f"{r['model']} n={r['n_atoms']}: speed x{r['speed_vs_mace']:.2f} "
                  f"(best-of x{r['speed_vs_mace_best']:.2f}) vs MACE, "
                  f"MACE keeps x{r['saved_memory_mace_over_ours']:.2f} more bytes/atom")
    if a.json:
        write_json(a.json, results, device=a.device)
    return results


if __name__ == "__main__":
    main()
