"""Compiled MD step (``md.compile=true``, :mod:`xnn.dynamics.compiled`) against the eager
velocity-Verlet step, same model, same start, same run (called by ``benchmarks/md.py
--only compiled``; also runnable alone).

For each model (SchNet and the equivariant model, random weights; FCC Cu ``n_atoms``) the
eager and the compiled NVE steps are timed alternately in blocks after warm-up; the row
gives seconds per step of each, their ratio (``speedup`` = eager / compiled), the time to
the first compiled step (tracing and inductor compilation), the compiles and rebuilds
during the timed steps (``recompiles_timed`` must be 0) and the largest position and force
differences from the eager trajectory (checked in the same run).

Usage::

    python benchmarks/md_compiled.py --json benchmarks/results/md_compiled_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu, synchronize, write_json
except ImportError:  # run as `python benchmarks/md_compiled.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, synchronize, write_json

from xnn.data import AtomicGraph
from xnn.dynamics import maxwell_boltzmann, nve
from xnn.dynamics.compiled import CompiledVerlet
from xnn.models import Potential, build

DT = 2.0
MODELS = {
    "schnet": lambda: build("schnet", species=[29], cutoff=5.0),
    "equivariant": lambda: build("equivariant", species=[29], cutoff=5.0),
}


def bench_compiled(name: str, n_atoms: int, steps: int, device, dtype, blocks: int = 3,
                   backend: str = "inductor") -> dict:
    """One row: eager and compiled NVE of ``name`` on ~``n_atoms`` Cu atoms."""
    torch.manual_seed(0)
    model = MODELS[name]().to(device=device, dtype=dtype)
    atoms = fcc_cu(n_atoms, rattle=0.05, seed=0)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=dtype, device=device)
    g = maxwell_boltzmann(g, 300.0, seed=0)
    pe, pc = Potential(model, skin=1.0), Potential(model, skin=1.0)
    stepper = CompiledVerlet(pc, backend=backend)
    se = sc = nve.init(g, pe)
    t0 = time.perf_counter()
    sc = stepper.step(sc, DT)
    synchronize(device)
    first = time.perf_counter() - t0
    se = nve.step(se, pe, DT)
    for _ in range(2):  # warm-up of both
        se, sc = nve.step(se, pe, DT), stepper.step(sc, DT)
    compiles = stepper.n_compiles
    t_e = t_c = 0.0
    per_block = max(1, steps // blocks)
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(per_block):
            se = nve.step(se, pe, DT)
        synchronize(device)
        t1 = time.perf_counter()
        for _ in range(per_block):
            sc = stepper.step(sc, DT)
        synchronize(device)
        t_e, t_c = t_e + (t1 - t0), t_c + (time.perf_counter() - t1)
    n = per_block * blocks
    return {
        "case": f"compiled_step_{name}", "n_atoms": g.n_atoms, "steps": n,
        "backend": backend, "eager_s_per_step": t_e / n, "compiled_s_per_step": t_c / n,
        "speedup": t_e / t_c, "first_compiled_step_s": first,
        "recompiles_timed": stepper.n_compiles - compiles, "capacity": stepper.capacity,
        "rebuilds": stepper.n_rebuilds,
        "max_position_diff_A": float((se.positions - sc.positions).abs().max()),
        "max_force_diff_eV_A": float((se.forces - sc.forces).abs().max()),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--models", default="schnet", help="comma-separated: schnet,equivariant")
    p.add_argument("--n-atoms", type=int, default=108)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for name in args.models.split(","):
        rows.append(bench_compiled(name, args.n_atoms, args.steps, device, dtype,
                                   backend=args.backend))
        print(rows[-1], flush=True)
        write_json(args.json, {"benchmark": "md_compiled", "dtype": args.dtype, "dt_fs": DT,
                               "results": rows}, device=str(device))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
