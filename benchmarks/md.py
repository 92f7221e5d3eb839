"""MD throughput (atom-steps/s) of xnn's integrators against ASE's MD loop and torch-sim.

Cases (FCC Cu, rattled, NVE velocity Verlet, 300 K initial velocities, same time step):

* ``lj`` / ``equivariant``: one system of ~1k / 10k / 100k atoms (``--quick``: ~100 / 500),
  advanced by ``xnn.dynamics.nve``; the same model and the same run through ASE's
  ``VelocityVerlet`` driving ``xnn.Calculator`` (ASE's loop overhead + one model call per
  step; skipped above 10k atoms where it would only measure the model).
* ``batched_lj``: B systems of 32 atoms in one batch (``--quick``: B = 16; else 512) vs
  ASE's loop over the same systems one at a time (timed on a few, scaled to B).
* ``mace``: the same random-weight mace-torch ``ScaleShiftMACE`` as ``benchmarks/models.py``
  through ``xnn.models.build("mace", model=...)`` + xnn NVE, and through torch-sim's
  ``MaceModel`` + NVE integrator (when ``torch_sim`` is importable; else recorded skipped).
  With ``--compile`` also xnn with ``Potential(compile=True)`` (mace-torch's own compile
  preparation, ``torch.compile`` with dynamic shapes), after a check of its forces against
  eager ones in the same run (``compiled_force_rel_error``). torch-sim 0.4.0's ``MaceModel``
  has no compile option.

Throughput = atoms × steps / wall time, after warm-up steps (neighbor lists included: a
Verlet skin of 1 Å, rebuilt when needed, as in production).

Usage::

    python benchmarks/md.py --json benchmarks/results/md_cpu.json --quick
    python benchmarks/md.py --json benchmarks/results/md_h200.json --device cuda --dtype float32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu, synchronize, write_json
except ImportError:  # run as `python benchmarks/md.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, synchronize, write_json

from xnn.data import AtomicGraph
from xnn.dynamics import maxwell_boltzmann, nve
from xnn.models import Potential, build

DT = 2.0  # fs
LJ = dict(sigma=2.338, epsilon=0.409, cutoff=5.8)  # Cu-like LJ parameters
SIZES, QUICK_SIZES = (1_000, 10_000, 100_000), (100, 500)


def graph_of(atoms, device, dtype) -> AtomicGraph:
    g = AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array,
                                atoms.pbc, dtype=dtype, device=device)
    return maxwell_boltzmann(g, 300.0, seed=0)


def xnn_rate(model, graph: AtomicGraph, steps: int, warmup: int = 3, stress: bool = True,
             compile: bool = False) -> dict:
    """Atom-steps/s of xnn NVE (one model call per step; stress too unless ``stress=False``;
    ``compile``: ``Potential(compile=True)``, compiled during the warm-up steps)."""
    pot = Potential(model, skin=1.0, compile=compile)
    s = nve.init(graph, pot)
    s = s.replace(compute_stress=stress and s.compute_stress)
    for _ in range(warmup):
        s = nve.step(s, pot, DT)
    synchronize(graph.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        s = nve.step(s, pot, DT)
    synchronize(graph.device)
    el = time.perf_counter() - t0
    return {"atom_steps_per_s": graph.n_atoms * steps / el, "s_per_step": el / steps,
            "neighbor_builds": pot.neighbors.n_builds, "steps": steps}


def ase_rate(model, atoms_list, steps: int, device, dtype, warmup: int = 2) -> dict:
    """Atom-steps/s of ASE's VelocityVerlet + xnn.Calculator, one system after the other."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from xnn.io.calculator import Calculator

    total, el = 0, 0.0
    for atoms in atoms_list:
        a = atoms.copy()
        g = graph_of(a, "cpu", torch.float64)
        a.set_velocities(g.velocities.numpy() / units.fs)
        a.calc = Calculator(model, device=device, dtype=dtype, skin=1.0)
        md = VelocityVerlet(a, timestep=DT * units.fs)
        md.run(warmup)
        t0 = time.perf_counter()
        md.run(steps)
        el += time.perf_counter() - t0
        total += len(a) * steps
    return {"atom_steps_per_s": total / el, "steps": steps, "systems_timed": len(atoms_list)}


def bench_single(name: str, make_model, sizes, steps, device, dtype, ase_max=10_000) -> list:
    rows = []
    for n in sizes:
        atoms = fcc_cu(n)
        row = {"case": name, "n_atoms": len(atoms)}
        try:
            model = make_model().to(device=device, dtype=dtype).eval()
            row["xnn"] = xnn_rate(model, graph_of(atoms, device, dtype), steps)
            if len(atoms) <= ase_max:
                row["ase_loop"] = ase_rate(model, [atoms], max(2, steps // 2), device, dtype)
                row["speedup_vs_ase"] = (row["xnn"]["atom_steps_per_s"]
                                         / row["ase_loop"]["atom_steps_per_s"])
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            torch.cuda.empty_cache()
        print(row, flush=True)
        rows.append(row)
    return rows


def bench_batched(n_systems: int, steps: int, device, dtype) -> dict:
    model = build("lj", **LJ).to(device=device, dtype=dtype).eval()
    atoms = [fcc_cu(32, seed=i) for i in range(n_systems)]
    g = AtomicGraph.concat([graph_of(a, device, dtype) for a in atoms])
    row = {"case": "batched_lj", "n_systems": n_systems, "atoms_per_system": 32,
           "xnn": xnn_rate(model, g, steps)}
    row["ase_loop"] = ase_rate(model, atoms[:2], steps, device, dtype)
    row["speedup_vs_ase"] = row["xnn"]["atom_steps_per_s"] / row["ase_loop"]["atom_steps_per_s"]
    print(row, flush=True)
    return row


def _patch_torchsim_mace_setup(cls) -> None:
    """torch-sim 0.4.0's ``MaceModel.setup_from_system_idx`` calls ``.numpy()`` on the
    state's (CUDA) atomic numbers; run that one-off set-up on CPU copies instead."""
    if getattr(cls, "_xnn_patched", False):
        return
    original = cls.setup_from_system_idx

    def setup(self, atomic_numbers, system_idx):
        original(self, atomic_numbers.cpu(), system_idx.cpu())
        self.atomic_numbers, self.system_idx = atomic_numbers, system_idx

    cls.setup_from_system_idx = setup
    cls._xnn_patched = True


def torchsim_rate(mace_model, atoms, steps: int, device, dtype, warmup: int = 3) -> dict:
    """torch-sim's NVE with its MaceModel (API of torch-sim 0.2–0.5, imported lazily)."""
    import torch_sim as ts
    from torch_sim.models.mace import MaceModel

    _patch_torchsim_mace_setup(MaceModel)

    model = MaceModel(model=mace_model, device=device, dtype=dtype, compute_forces=True,
                      compute_stress=False)
    state = ts.io.atoms_to_state([atoms], device=device, dtype=dtype)
    kt = torch.tensor(300.0 * 8.617333262e-5, device=device, dtype=dtype)
    dt = torch.tensor(DT * 0.09822694788464063, device=device, dtype=dtype)  # fs -> ASE time
    if hasattr(ts, "nve_init"):  # torch-sim >= 0.4
        s = ts.nve_init(state=state, model=model, kT=kt, seed=0)

        def step(x):
            return ts.nve_step(state=x, model=model, dt=dt)
    else:  # torch-sim 0.2 / 0.3: (init_fn, update_fn) factories
        from torch_sim.integrators import nve as ts_nve

        init_fn, update_fn = ts_nve(model=model, dt=dt, kT=kt)
        s = init_fn(state)
        step = update_fn
    for _ in range(warmup):
        s = step(s)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        s = step(s)
    synchronize(device)
    el = time.perf_counter() - t0
    return {"atom_steps_per_s": len(atoms) * steps / el, "steps": steps,
            "version": _version("torch-sim-atomistic")}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


def compiled_force_error(eager_model, compiled_model, graph: AtomicGraph) -> float:
    """Max |F_compiled - F_eager| / max |F_eager| on ``graph`` (two wrappers of one model)."""
    eager = Potential(eager_model, skin=1.0)(graph, stress=False)["forces"]
    compiled = Potential(compiled_model, skin=1.0, compile=True)(graph, stress=False)["forces"]
    return float((compiled - eager).abs().max() / eager.abs().max())


def bench_mace(sizes, steps, device, dtype, compile: bool = False, on_row=None) -> list:
    try:
        from benchmarks.models import build_mace
        mace_model = build_mace(avg_num_neighbors=40.0).to(device=device, dtype=dtype).eval()
    except ImportError as e:
        return [{"case": "mace", "skipped": f"mace-torch not importable: {e}"}]
    rows = []
    wrapped = build("mace", model=mace_model).to(device=device, dtype=dtype).eval()
    # compiled once (dynamic shapes), reused for every size
    compiled = build("mace", model=mace_model).to(device=device, dtype=dtype).eval() \
        if compile else None
    for n in sizes:
        atoms = fcc_cu(n)
        row = {"case": "mace", "n_atoms": len(atoms)}
        try:
            # torch-sim is asked for energy and forces only: so is xnn
            row["xnn"] = xnn_rate(wrapped, graph_of(atoms, device, dtype), steps, stress=False)
            if compiled is not None:  # mace-torch's compile preparation, through Potential
                g = graph_of(atoms, device, dtype)
                t0 = time.perf_counter()
                row["compiled_force_rel_error"] = compiled_force_error(wrapped, compiled, g)
                row["first_compiled_call_s"] = time.perf_counter() - t0
                row["xnn_compiled"] = xnn_rate(compiled, g, steps, stress=False, compile=True)
            try:
                row["torch_sim"] = torchsim_rate(mace_model, atoms, steps, device, dtype)
                row["speedup_vs_torch_sim"] = (row["xnn"]["atom_steps_per_s"]
                                               / row["torch_sim"]["atom_steps_per_s"])
                if "xnn_compiled" in row:
                    row["speedup_compiled_vs_torch_sim"] = (
                        row["xnn_compiled"]["atom_steps_per_s"]
                        / row["torch_sim"]["atom_steps_per_s"])
            except ImportError as e:
                row["torch_sim"] = {"skipped": f"torch_sim not importable: {e}"}
            except torch.OutOfMemoryError:
                row["torch_sim"] = {"error": "out of memory"}
                torch.cuda.empty_cache()
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            torch.cuda.empty_cache()
        print(row, flush=True)
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per case")
    p.add_argument("--sizes", default=None, help="comma-separated atom counts (default "
                   "1000,10000,100000; quick 100,500)")
    p.add_argument("--eq-sizes", default=None, help="comma-separated atom counts of the "
                   "equivariant rows (default: --sizes)")
    p.add_argument("--mace-sizes", default=None, help="comma-separated atom counts of the MACE "
                   "rows (default: --sizes)")
    p.add_argument("--compile", action="store_true",
                   help="MACE rows: also time xnn with Potential(compile=True)")
    p.add_argument("--only", default=None,
                   choices=("lj", "equivariant", "batched", "mace", "compiled", "cells"),
                   help="run one case only (compiled: benchmarks/md_compiled.py's compiled "
                   "vs eager step; cells: benchmarks/md_batched.py's 64 small cells vs one; "
                   "both only when asked for)")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = "md_mace_compiled" if args.compile and args.only == "mace" else "md"
        args.json = results_path(name, args.device)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    def counts(text):
        return tuple(int(x) for x in text.split(","))

    sizes = counts(args.sizes) if args.sizes else QUICK_SIZES if args.quick else SIZES
    steps = args.steps or (5 if args.quick else 50)
    eq_species = [29]
    results = []

    def run(case: str) -> bool:
        return args.only in (None, case)

    if run("lj"):
        results += bench_single("lj", lambda: build("lj", **LJ), sizes, steps, device, dtype)
    if run("equivariant"):
        eq_sizes = counts(args.eq_sizes) if args.eq_sizes else sizes[:2] if args.quick else sizes
        results += bench_single(
            "equivariant", lambda: build("equivariant", species=eq_species, cutoff=5.0),
            eq_sizes, max(2, steps // 2), device, dtype)
    if run("batched"):
        results.append(bench_batched(16 if args.quick else 512, steps, device, dtype))

    def save(extra=()):  # also after every MACE row: a run cut short keeps what it measured
        write_json(args.json, {"benchmark": "md", "dtype": args.dtype, "dt_fs": DT,
                               "quick": args.quick, "results": results + list(extra)},
                   device=str(device))

    if args.only == "compiled":
        from benchmarks.md_compiled import bench_compiled

        results += [bench_compiled(name, sizes[0], steps, device, dtype)
                    for name in ("schnet", "equivariant")]
    if args.only == "cells":
        from benchmarks.md_batched import bench as bench_cells

        results += [bench_cells(name, 64, 100, max(1, steps // 3), 3) for name in ("lj", "schnet")]
    if run("mace"):
        mace_sizes = counts(args.mace_sizes) if args.mace_sizes \
            else sizes[:1] if args.quick else sizes
        results += bench_mace(mace_sizes, max(2, steps // 2), device,
                              dtype, compile=args.compile, on_row=save)
    save()
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
