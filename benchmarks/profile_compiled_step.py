"""Where the compiled MD step's time goes: a torch.profiler table (CUDA kernels) of the
``md.compile=true`` NVE step (inductor; ``--eager``: the plain step) of the ``equivariant``
model (``--model mace``: the MACE of ``benchmarks/peers.py``, r_c 6 Å) on rattled FCC Cu.
After the table: the wall time per step and the CUDA kernels' summed time per step (their
ratio says how much of the step the GPU is busy; the rest is launch or host time).

A diagnostic, not a benchmark (no JSON). The H200 table at 10,976 atoms, fp32, is
``results/profile_compiled_equivariant_10k_h200.txt``::

    python benchmarks/profile_compiled_step.py --atoms 10000 --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fcc_cu, synchronize  # noqa: E402
from xnn.data import AtomicGraph  # noqa: E402
from xnn.dynamics import maxwell_boltzmann, nve  # noqa: E402
from xnn.dynamics.compiled_thermo import CompiledIntegrator  # noqa: E402
from xnn.models import Potential, build  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", type=int, default=10000)
    p.add_argument("--device", default="cuda")
    p.add_argument("--kernel-backend", default="reference",
                   choices=("reference", "cueq", "triton"))
    p.add_argument("--model", default="equivariant", choices=("equivariant", "mace"))
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--eager", action="store_true", help="profile the eager step instead")
    p.add_argument("--pairs", default="index", choices=("index", "split", "concat", "off"),
                   help="MACE with cueq: radial MLPs once per edge pair, the fused "
                        "convolution reading the half-size weights by index (default), once "
                        "per half of the edges, or on them concatenated; off: per edge")
    p.add_argument("--index-dtype", default="int64", choices=("int32", "int64"),
                   help="MACE with cueq, paired: dtype of the fused convolution's indices")
    p.add_argument("--radial", default="torch", choices=("torch", "ieee", "tf32x3"),
                   help="the radial MLPs through their torch layers (default) or the fused "
                        "Triton kernel, fp32 or 3xTF32 products (MACE: paired, cueq)")
    a = p.parse_args(argv)
    dev, dt = torch.device(a.device), torch.float32
    atoms = fcc_cu(a.atoms, rattle=0.05, seed=0)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=dt, device=dev)
    g = maxwell_boltzmann(g, 300.0, seed=0)
    torch.manual_seed(0)
    if a.model == "mace":
        from benchmarks.peers_frameworks import base_model

        model = build("mace", model=base_model("mace"), backend=a.kernel_backend)
    else:
        model = build("equivariant", species=[29], cutoff=5.0)
        model.set_backend(a.kernel_backend)
    model = model.to(device=dev, dtype=dt).eval().requires_grad_(False)  # as `xnn md` has it
    from xnn.models import equivariant

    equivariant.RADIAL_KERNEL = a.radial
    pot = Potential(model, skin=1.0)
    integ = None if a.eager else CompiledIntegrator("nve", pot, backend="inductor")
    if integ is not None:
        from xnn.models.external import _mace_pairs

        _mace_pairs.FUSION = a.pairs if a.pairs != "off" else _mace_pairs.FUSION
        _mace_pairs.INDEX_DTYPE = getattr(torch, a.index_dtype)
        _mace_pairs.RADIAL = a.radial
        integ.stepper.paired = integ.stepper.paired and a.pairs != "off"
        print(f"paired edges: {integ.stepper.paired} ({a.pairs}, {a.index_dtype} indices, "
              f"radial MLPs {a.radial})")
    step = (lambda s: nve.step(s, pot, 2.0)) if a.eager else (lambda s: integ.step(s, pot, 2.0))
    state = nve.init(g, pot)
    for _ in range(4):  # compile and warm up
        state = step(state)
    synchronize(dev)
    acts = [ProfilerActivity.CUDA] if dev.type == "cuda" else [ProfilerActivity.CPU]
    t0, n = time.perf_counter(), 5
    for _ in range(n):
        state = step(state)
    synchronize(dev)
    wall = (time.perf_counter() - t0) / n
    with profile(activities=acts) as prof:
        for _ in range(3):
            state = step(state)
        synchronize(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    events = prof.key_averages()
    print(events.table(sort_by=key, row_limit=a.rows, max_name_column_width=160))
    if dev.type == "cuda":  # kernels only: device-side events (no CPU time of their own)
        busy = sum(e.self_device_time_total for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA) / 3e6
        print(f"wall {wall * 1e3:.2f} ms/step; CUDA kernels {busy * 1e3:.2f} ms/step "
              f"({busy / wall:.0%} busy)")
    else:
        print(f"wall {wall * 1e3:.2f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
