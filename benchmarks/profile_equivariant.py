"""Where the time goes: torch.profiler tables for the ``equivariant`` model and mace-torch's MACE.

Prints, for each model, the top CUDA (or CPU) kernels of one energy+forces evaluation on
rattled FCC Cu, and with ``--train`` of one training step (force loss, double backward) on a
batch of small structures. A diagnostic, not a benchmark: it writes no JSON.

Usage::

    python -m benchmarks.profile_equivariant --device cuda --channels 128 --cutoff 6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_equivariant import mace_model, make_step, xnn_model  # noqa: E402
from benchmarks.common import fcc_cu, synchronize, time_fn  # noqa: E402
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.neighbors import with_edges  # noqa: E402


def graph_for(n_atoms: int, cutoff: float, device: str, dtype, copies: int = 1) -> AtomicGraph:
    graphs = []
    for k in range(copies):
        atoms = fcc_cu(n_atoms)
        atoms.rattle(0.05, seed=k)
        graphs.append(AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array,
                                              True, dtype=dtype, device=device))
    g = graphs[0] if copies == 1 else AtomicGraph.concat(graphs)
    return with_edges(g, cutoff)


def run(name: str, model, g: AtomicGraph, device: str, train: bool, rows: int) -> None:
    step = make_step(model, g, train)
    t = time_fn(step, repeat=5, warmup=2, device=device)
    print(f"\n##### {name} train={train} atoms={g.n_atoms} edges={g.n_edges} "
          f"median {t['median_s'] * 1e3:.2f} ms  ({g.n_atoms / t['median_s']:.3g} atom-steps/s)")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        step()
        synchronize(device)
    key = "cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    if device.startswith("cuda"):
        key = "self_cuda_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))
    model.zero_grad(set_to_none=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--channels", type=int, default=128)
    p.add_argument("--cutoff", type=float, default=6.0)
    p.add_argument("--atoms", type=int, default=10976)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 131072])
    p.add_argument("--train", action="store_true")
    p.add_argument("--train-atoms", type=int, default=108)
    p.add_argument("--train-copies", type=int, default=8)
    p.add_argument("--rows", type=int, default=22)
    p.add_argument("--no-mace", action="store_true")
    a = p.parse_args(argv)
    dtype = torch.float32
    models = {}
    for c in a.chunks:
        torch.manual_seed(0)
        models[f"xnn_chunk{c}"] = xnn_model(a.channels, 1, a.cutoff, c or None)
    if not a.no_mace:
        m = mace_model(a.channels, 1, a.cutoff)
        if m is not None:
            models["mace"] = m
    g = graph_for(a.atoms, a.cutoff, a.device, dtype)
    for name, model in models.items():
        model = model.to(device=a.device, dtype=dtype)
        run(name, model, g, a.device, False, a.rows)
    if a.train:
        gt = graph_for(a.train_atoms, a.cutoff, a.device, dtype, a.train_copies)
        for name, model in models.items():
            run(name, model.to(device=a.device, dtype=dtype), gt, a.device, True, a.rows)


if __name__ == "__main__":
    main()
