"""Compiled MD step (``md.compile=true``, :mod:`xnn.dynamics.compiled`) against the eager
step, same model, same start, same run (called by ``benchmarks/md.py --only compiled``;
also runnable alone).

For each model (SchNet and the equivariant model, random weights; FCC Cu ``n_atoms``) and
ensemble (``nve``, ``langevin``, ``csvr``, ``nhc``) the eager step, the compiled step and,
on CUDA, the compiled step replayed as a CUDA graph (``md.cuda_graph=true``, the same
compiled function) are timed in alternating blocks after warm-up; the compiled and graph
blocks continue one trajectory, and the eager trajectory is then run (untimed) to the
same step. The row gives seconds per step of each, ``speedup`` (eager / compiled) and
``speedup_cuda_graph`` (eager / graph), the time to the first compiled step (tracing and
inductor compilation) and to the graph's capture, the compiles, dynamo graphs and
captures during the timed steps (``recompiles_timed`` must be 0), the rebuilds, and the
largest position and force differences from the eager trajectory after the first step
and after all steps (checked in the same run; chaotic growth of rounding makes the
latter grow with the steps in fp32).

``--unfiltered`` also times, in the same blocks, the eager and compiled steps that give the
model the whole Verlet list (``cutoff + skin``), as before the steps filtered it to the
cutoff: ``filter_speedup_eager`` and ``filter_speedup_compiled`` are their times over the
filtered steps' (and the unfiltered trajectories are checked against the filtered ones).
``--unpaired`` likewise times the compiled and the eager step with the list as built, for a
model that runs its radial networks once per reverse edge pair on the paired list
(``pairs_edges``): ``pairs_speedup_compiled`` and ``pairs_speedup_eager`` are their times
over the paired steps' (trajectories checked).

Usage::

    python benchmarks/md_compiled.py --json benchmarks/results/md_compiled_cpu.json
    python benchmarks/md_compiled.py --device cuda --dtype float32 --models equivariant \\
        --ensembles nve,langevin --n-atoms 10000 --steps 30 --json md_compiled_h200.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

try:
    from benchmarks.common import fcc_cu, synchronize, write_json
except ImportError:  # run as `python benchmarks/md_compiled.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, synchronize, write_json

from xnn.data import AtomicGraph
from xnn.dynamics import maxwell_boltzmann
from xnn.dynamics.compiled_thermo import CompiledIntegrator
from xnn.dynamics.registry import get_integrator
from xnn.models import Potential, build

DT = 2.0
MODELS = {
    "schnet": lambda: build("schnet", species=[29], cutoff=5.0),
    "painn": lambda: build("painn", species=[29], cutoff=5.0),
    "equivariant": lambda: build("equivariant", species=[29], cutoff=5.0),
}
ENSEMBLE_ARGS = {"nve": {}, "langevin": dict(temperature=300.0, friction=0.01, seed=1),
                 "csvr": dict(temperature=300.0, tau=50.0, seed=1),
                 "nhc": dict(temperature=300.0, tau=50.0)}


class WholeList(Potential):
    """A :class:`~xnn.models.Potential` whose model sees the whole Verlet list (no filter to
    the cutoff): the eager step as it was before the filter."""

    def edges_for_model(self, graph: AtomicGraph, paired: bool = False):
        return self.neighbors(graph), False


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _timed(fn, state, n: int, device) -> tuple:
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        state = fn(state)
    synchronize(device)
    return state, time.perf_counter() - t0


def _diffs(eager, compiled) -> tuple[float, float]:
    return (float((eager.positions - compiled.positions).abs().max()),
            float((eager.forces - compiled.forces).abs().max()))


def bench_compiled(name: str, n_atoms: int, steps: int, device, dtype, blocks: int = 3,
                   backend: str = "inductor", ensemble: str = "nve",
                   cuda_graph: bool | None = None, kernel_backend: str = "reference",
                   unfiltered: bool = False, unpaired: bool = False) -> dict:
    """One row: eager, compiled (and CUDA-graph) steps of ``name`` on ~``n_atoms`` Cu atoms.

    Args:
        steps: timed steps of each kind (split into ``blocks`` alternating blocks).
        cuda_graph: time the CUDA-graph replay too (default: on CUDA devices).
        kernel_backend: the compiled step's model runs this kernel backend
            (``model.backend``: ``reference``, ``cueq`` or ``triton``); the eager baseline
            keeps the reference, and with another backend the eager step with that backend
            is timed too.
        unfiltered: time the eager and compiled steps without the filter to the cutoff too
            (the compiled one with the kernel backend).
        unpaired: time the compiled and eager steps without the reverse-pair layout too.
    """
    device = torch.device(device)
    cuda_graph = device.type == "cuda" if cuda_graph is None else cuda_graph
    torch.manual_seed(0)
    model = MODELS[name]().to(device=device, dtype=dtype).eval()  # as md_setup
    atoms = fcc_cu(n_atoms, rattle=0.05, seed=0)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=dtype, device=device)
    g = maxwell_boltzmann(g, 300.0, seed=0)
    mod = get_integrator(ensemble)
    model_c = model
    if kernel_backend != "reference":
        model_c = copy.deepcopy(model)
        model_c.set_backend(kernel_backend)
    pe, pc = Potential(model, skin=1.0), Potential(model_c, skin=1.0)
    # the eager kernel-backend step gets its own copy: tracing may cache state on a module
    pk = Potential(copy.deepcopy(model_c), skin=1.0) if model_c is not model else None
    integ = CompiledIntegrator(ensemble, pc, backend=backend)
    stepper = integ.stepper
    # the CUDA graph: its own integrator and model copy, captured from its first calls (the
    # way md.cuda_graph=true runs; turning it on for an already-called compiled step made
    # dynamo trace cuEquivariance's Python again inside the capture, which failed)
    pg = Potential(copy.deepcopy(model_c), skin=1.0) if cuda_graph else None
    integ_g = (CompiledIntegrator(ensemble, pg, backend=backend, cuda_graph=True)
               if cuda_graph else None)

    pu = WholeList(model, skin=1.0) if unfiltered else None
    pcu = Potential(copy.deepcopy(model_c), skin=1.0) if unfiltered else None
    integ_u = CompiledIntegrator(ensemble, pcu, backend=backend) if unfiltered else None
    if unfiltered:
        integ_u.stepper.filters = False  # the model sees the padded whole list
    pcp = Potential(copy.deepcopy(model_c), skin=1.0) if unpaired else None
    integ_p = CompiledIntegrator(ensemble, pcp, backend=backend) if unpaired else None
    pep = Potential(model, skin=1.0) if unpaired else None
    if unpaired:
        integ_p.stepper.paired = False  # the list as built: radial work per edge
        pep.paired = False

    def eager_step(s):
        return mod.step(s, pe, DT)

    def compiled_step(s):
        return integ.step(s, pc, DT)

    se = sc = mod.init(g, pe, **ENSEMBLE_ARGS[ensemble])
    sc, first = _timed(compiled_step, sc, 1, device)
    se = eager_step(se)
    first_diffs = _diffs(se, sc)
    se, sc = _timed(eager_step, se, 2, device)[0], _timed(compiled_step, sc, 2, device)[0]
    capture, sg = 0.0, None
    if cuda_graph:  # compile, two warm-up calls, then the capture
        sg = mod.init(g, pg, **ENSEMBLE_ARGS[ensemble])
        sg, capture = _timed(lambda s: integ_g.step(s, pg, DT), sg, 4, device)
    su = scu = None
    if unfiltered:
        su = mod.init(g, pu, **ENSEMBLE_ARGS[ensemble])
        scu = mod.init(g, pcu, **ENSEMBLE_ARGS[ensemble])
        su = _timed(lambda s: mod.step(s, pu, DT), su, 3, device)[0]
        scu = _timed(lambda s: integ_u.step(s, pcu, DT), scu, 3, device)[0]
    scp = sep = None
    if unpaired:
        scp = mod.init(g, pcp, **ENSEMBLE_ARGS[ensemble])
        scp = _timed(lambda s: integ_p.step(s, pcp, DT), scp, 3, device)[0]
        sep = mod.init(g, pep, **ENSEMBLE_ARGS[ensemble])
        sep = _timed(lambda s: mod.step(s, pep, DT), sep, 3, device)[0]
    compiles, graphs = stepper.n_compiles, _graphs()
    t = {"eager": 0.0, "compiled": 0.0, "cuda_graph": 0.0, "eager_kernel": 0.0,
         "eager_unfiltered": 0.0, "compiled_unfiltered": 0.0, "compiled_unpaired": 0.0,
         "eager_unpaired": 0.0}
    sk = mod.init(se.graph, pk, **ENSEMBLE_ARGS[ensemble]) if pk is not None else None
    per_block = max(1, steps // blocks)
    for _ in range(blocks):
        se, dt_e = _timed(eager_step, se, per_block, device)
        sc, dt_c = _timed(compiled_step, sc, per_block, device)
        t["eager"] += dt_e
        if sk is not None:
            sk, dt_k = _timed(lambda s: mod.step(s, pk, DT), sk, per_block, device)
            t["eager_kernel"] += dt_k
        t["compiled"] += dt_c
        if cuda_graph:
            sg, dt_g = _timed(lambda s: integ_g.step(s, pg, DT), sg, per_block, device)
            t["cuda_graph"] += dt_g
        if unfiltered:
            su, dt_u = _timed(lambda s: mod.step(s, pu, DT), su, per_block, device)
            scu, dt_cu = _timed(lambda s: integ_u.step(s, pcu, DT), scu, per_block, device)
            t["eager_unfiltered"] += dt_u
            t["compiled_unfiltered"] += dt_cu
        if unpaired:
            scp, dt_p = _timed(lambda s: integ_p.step(s, pcp, DT), scp, per_block, device)
            t["compiled_unpaired"] += dt_p
            sep, dt_ep = _timed(lambda s: mod.step(s, pep, DT), sep, per_block, device)
            t["eager_unpaired"] += dt_ep
    recompiles, new_graphs = stepper.n_compiles - compiles, _graphs() - graphs
    while se.step < sc.step:  # the eager trajectory to the same step, untimed
        se = eager_step(se)
    n = per_block * blocks
    pos, force = _diffs(se, sc)
    row = {
        "case": f"compiled_step_{name}_{ensemble}", "ensemble": ensemble,
        "n_atoms": g.n_atoms, "steps": n, "backend": backend, "kernel_backend": kernel_backend,
        "eager_s_per_step": t["eager"] / n, "compiled_s_per_step": t["compiled"] / n,
        "speedup": t["eager"] / t["compiled"], "first_compiled_step_s": first,
        "recompiles_timed": recompiles, "dynamo_graphs_timed": new_graphs,
        "capacity": stepper.capacity, "active_capacity": stepper.active_capacity,
        "active_edges": stepper.n_active, "rebuilds": stepper.n_rebuilds,
        "trajectory_steps": sc.step,
        "first_step_position_diff_A": first_diffs[0], "first_step_force_diff_eV_A": first_diffs[1],
        "max_position_diff_A": pos, "max_force_diff_eV_A": force,
    }
    if unfiltered:
        while su.step < se.step:
            su = mod.step(su, pu, DT)
        row.update(eager_unfiltered_s_per_step=t["eager_unfiltered"] / n,
                   compiled_unfiltered_s_per_step=t["compiled_unfiltered"] / n,
                   filter_speedup_eager=t["eager_unfiltered"] / t["eager"],
                   filter_speedup_compiled=t["compiled_unfiltered"] / t["compiled"],
                   unfiltered_list_edges=int(integ_u.stepper._edges[0].shape[1]),
                   unfiltered_eager_position_diff_A=_diffs(se, su)[0],
                   unfiltered_compiled_position_diff_A=_diffs(scu, sc)[0]
                   if scu.step == sc.step else None)
    if unpaired:
        row.update(paired=stepper.paired, compiled_unpaired_s_per_step=t["compiled_unpaired"] / n,
                   pairs_speedup_compiled=t["compiled_unpaired"] / t["compiled"],
                   unpaired_compiled_position_diff_A=_diffs(scp, sc)[0]
                   if scp.step == sc.step else None,
                   eager_paired=pe.paired, eager_unpaired_s_per_step=t["eager_unpaired"] / n,
                   pairs_speedup_eager=t["eager_unpaired"] / t["eager"],
                   unpaired_eager_position_diff_A=_diffs(sep, se)[0]
                   if sep.step == se.step else None)
    if sk is not None:
        row.update(eager_kernel_s_per_step=t["eager_kernel"] / n,
                   speedup_eager_kernel=t["eager"] / t["eager_kernel"])
    if cuda_graph:
        row.update(cuda_graph_s_per_step=t["cuda_graph"] / n,
                   speedup_cuda_graph=t["eager"] / t["cuda_graph"],
                   cuda_graph_compile_warmup_and_capture_s=capture,
                   cuda_graph_captures=integ_g.stepper._replay.n_captures,
                   cuda_graph_recompiles=integ_g.stepper.n_compiles - 1)
    if device.type == "cuda":
        row["peak_memory_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--models", default="schnet", help="comma-separated: schnet,painn,equivariant")
    p.add_argument("--n-atoms", type=int, default=108)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--ensembles", default="nve", help="comma-separated: nve,langevin,csvr,nhc")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--kernel-backends", default="reference",
                   help="comma-separated model.backend values of the compiled step")
    p.add_argument("--no-cuda-graph", action="store_true", help="on CUDA: skip the graph replay")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--unfiltered", action="store_true",
                   help="also time the steps that give the model the whole Verlet list")
    p.add_argument("--unpaired", action="store_true",
                   help="also time the compiled step without the reverse-pair layout")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("md_compiled", args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    for name in args.models.split(","):
        for ensemble, kb in [(e, k) for e in args.ensembles.split(",")
                             for k in args.kernel_backends.split(",")]:
            rows.append(bench_compiled(name, args.n_atoms, args.steps, device, dtype,
                                       backend=args.backend, ensemble=ensemble,
                                       cuda_graph=False if args.no_cuda_graph else None,
                                       kernel_backend=kb, unfiltered=args.unfiltered,
                                       unpaired=args.unpaired))
            print(rows[-1], flush=True)
            write_json(args.json, {"benchmark": "md_compiled", "dtype": args.dtype,
                                   "dt_fs": DT, "results": rows}, device=str(device))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
