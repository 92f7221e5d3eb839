"""``xnn validate``: a model single-process vs decomposed over all ranks, compared by atom id.

    torchrun --nproc-per-node 4 -m xnn validate --model lj --structure big.xyz --grid 2,2,1

Rank 0 reads the structure and runs the model in one process; all ranks then evaluate it
decomposed; the worst absolute and relative errors of energy, forces (matched by atom id)
and stress are printed, and the exit status is 1 above ``--tol``. ``--skip-reference`` turns
it into a decomposed single-point evaluation (results gathered on rank 0, ``--output``).
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "validate",
        help="compare a model single-process vs domain-decomposed (run under torchrun)",
        description="Evaluate MODEL on STRUCTURE in one process (rank 0) and decomposed over "
        "all ranks; print the worst absolute/relative errors of energy, forces by atom id and "
        "stress; exit 1 above --tol. Launch with torchrun or srun (1 rank also works).",
    )
    p.add_argument("--model", required=True,
                   help="model file (xnn save_model) or built-in spec, e.g. lj or "
                   "lj:sigma=2.3,epsilon=0.4,cutoff=5.0 or painn:cutoff=4.0 (random weights)")
    p.add_argument("--trust-file", action="store_true",
                   help="also load a model file that holds pickled code (a MACE wrapper saved "
                   "by an earlier xnn); it can run code: only for files you trust")
    p.add_argument("--structure", required=True, help="structure file (any ASE format)")
    p.add_argument("--index", default="-1", help="structure index in the file (default -1)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                   help="evaluation dtype (default float64)")
    p.add_argument("--grid", default=None, help="boxes px,py,pz (default: automatic)")
    p.add_argument("--mode", default="auto", choices=["auto", "halo", "sync"],
                   help="halo: ghosts within the receptive field (any model); sync: per-layer "
                   "feature exchange at the model's sync points (halo of one cutoff); auto: "
                   "sync for models with sync points, else halo (default auto)")
    p.add_argument("--skin", type=float, default=0.0, help="Verlet skin in Å (default 0)")
    p.add_argument("--tol", type=float, default=1e-10,
                   help="maximum relative error allowed (default 1e-10)")
    p.add_argument("--json", default=None, help="write the report to this JSON file (rank 0)")
    p.add_argument("--skip-reference", action="store_true",
                   help="no single-process run: decomposed single point only")
    p.add_argument("--output", default=None,
                   help="write the structure with decomposed energy/forces/stress (rank 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="collective timeout in seconds (default 600)")
    p.set_defaults(func=run)
    return p


def _report_lines(report: dict, tol: float) -> list[str]:
    lines = [f"{'quantity':<10} {'max abs error':>14} {'max rel error':>14} {'scale':>12}"]
    for name, r in report.items():
        lines.append(f"{name:<10} {r['max_abs']:>14.3e} {r['max_rel']:>14.3e} {r['scale']:>12.4g}")
    worst = max(r["max_rel"] for r in report.values())
    lines.append(f"worst relative error {worst:.3e} ({'PASS' if worst <= tol else 'FAIL'}, "
                 f"tol {tol:.1e})")
    return lines


def _write_output(path: str, graph, out) -> None:
    import numpy as np
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.io import write

    from xnn.data.ase_io import to_ase

    atoms = to_ase(graph.detach().to("cpu"))[0]
    order = np.argsort(graph.atom_id.cpu().numpy())
    forces = np.empty((len(atoms), 3))
    forces[order] = out["forces"].cpu().numpy()
    results = {"energy": float(out["energy"].sum()), "forces": forces}
    if bool(graph.pbc.all()):
        results["stress"] = out["stress"][0].cpu().numpy()
    atoms.calc = SinglePointCalculator(atoms, **results)
    write(path, atoms)


def _report(args, manager, dd, graph, out, ref, seconds: dict) -> bool:
    """Print (and write) the comparison on rank 0; True if above the tolerance."""
    import json
    from pathlib import Path

    from xnn.distributed import validate as V

    info = {"world_size": manager.world_size, "n_atoms": graph.n_atoms,
            "grid": dd.stats()["grid"], "halo_width": dd.halo_width, "mode": dd.mode,
            "energy": float(out["energy"].sum()), **seconds}
    print(f"xnn validate: {graph.n_atoms} atoms on {manager.world_size} rank(s), grid "
          f"{'x'.join(map(str, info['grid']))}, halo {dd.halo_width:.3g} Å, mode {dd.mode}; "
          f"energy {info['energy']:.10g} eV ({seconds['seconds_decomposed']:.3g} s decomposed)")
    failed = False
    if ref is not None:
        report = V.compare(out, ref, graph)
        info.update(report=report, tol=args.tol)
        print("\n".join(_report_lines(report, args.tol)))
        failed = max(r["max_rel"] for r in report.values()) > args.tol
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    if args.output:
        _write_output(args.output, graph, out)
    return failed


def run(args) -> int:
    import time

    import torch

    from xnn.distributed import DistributedManager, DomainDecomposed
    from xnn.distributed import collectives as C
    from xnn.distributed import validate as V
    from xnn.distributed.domain.partition import parse_grid
    from xnn.errors import InputError

    dtype = getattr(torch, args.dtype)
    grid = parse_grid(args.grid)
    if args.tol <= 0:
        raise InputError(f"--tol must be > 0, got {args.tol}")
    manager = DistributedManager.initialize(timeout_s=args.timeout, device=args.device)
    try:
        graph = V.read_structure_rank0(args.structure, args.index)
        species = C.broadcast_object(
            None if graph is None else sorted(set(graph.numbers.tolist())))
        model = V.load_model_everywhere(args.model, species, trust=args.trust_file)
        model = model.to(manager.device, dtype)
        dd = DomainDecomposed(model, manager, grid=grid, skin=args.skin, mode=args.mode)
        graph = None if graph is None else graph.to(manager.device, dtype)  # rank 0 only
        ref, seconds = None, {}
        with C.guarded(None, "single-process reference"):
            if manager.is_main and not args.skip_reference:
                t0 = time.perf_counter()
                ref = V.single_process(model, graph)
                seconds["seconds_single"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = dd(graph)
        seconds["seconds_decomposed"] = time.perf_counter() - t0
        status = torch.zeros(1, device=manager.device)
        with C.guarded(None, "report on rank 0"):
            if manager.is_main:
                status[0] = float(_report(args, manager, dd, graph, out, ref, seconds))
        C.all_reduce_(status)
        return int(status.item() > 0)
    finally:
        manager.cleanup()
