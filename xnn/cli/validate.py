"""``xnn validate``: a model single-process vs decomposed over all ranks, compared by atom id.

    torchrun --nproc-per-node 4 -m xnn validate --model lj --structure big.xyz --grid 2,2,1

Rank 0 reads the structure and runs the model in one process; all ranks then evaluate it
decomposed; the worst absolute and relative errors of energy, forces (matched by atom id)
and stress are printed, and the exit status is 1 above ``--tol``. ``--skip-reference`` turns
it into a decomposed single-point evaluation (results gathered on rank 0, ``--output``).
"""

from __future__ import annotations

import argparse

from xnn.distributed.domain.balance import BALANCE
from xnn.distributed.domain.staged import EXCHANGES
from xnn.distributed.modes import MODES


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
                   help="trust the --model file (or the file a spec names): it may unpickle "
                   "what it holds or names (MACE models saved by an earlier xnn, files named "
                   "in its hyperparameters), which can run code; only for files you trust")
    p.add_argument("--structure", required=True, help="structure file (any ASE format)")
    p.add_argument("--index", default="-1", help="structure index in the file (default -1)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                   help="evaluation dtype (default float64)")
    p.add_argument("--grid", default=None, help="boxes px,py,pz (default: automatic)")
    p.add_argument("--mode", default="auto", choices=list(MODES),
                   help="how the ranks split the structure, as parallel.mode of xnn md, "
                   "relax and train -- " + "; ".join(f"{k}: {v}" for k, v in MODES.items())
                   + " (default auto; the chosen mode and its reason are printed)")
    p.add_argument("--order", default="morton", choices=["morton", "index"],
                   help="atom order split into blocks by --mode graph: morton (space-filling "
                   "curve, fewer cross-rank edges) or index (by atom id); default morton")
    p.add_argument("--balance", default="none", choices=list(BALANCE),
                   help="how the spatial modes cut the boxes, as parallel.balance of xnn md "
                   "and relax -- " + "; ".join(f"{k}: {v}" for k, v in BALANCE.items())
                   + " (default none)")
    p.add_argument("--exchange", default="direct", choices=list(EXCHANGES),
                   help="how the spatial modes send ghost rows, as parallel.exchange of xnn "
                   "md, relax and train -- " + "; ".join(f"{k}: {v}" for k, v in
                                                        EXCHANGES.items())
                   + " (default direct)")
    p.add_argument("--skin", type=float, default=0.0, help="Verlet skin in Å (default 0)")
    p.add_argument("--tol", type=float, default=1e-10,
                   help="maximum relative error allowed (default 1e-10)")
    p.add_argument("--json", default=None, help="write the report to this JSON file (rank 0)")
    p.add_argument("--skip-reference", action="store_true",
                   help="no single-process run: decomposed single point only")
    p.add_argument("--output", default=None,
                   help="write the structure with decomposed energy/forces/stress (rank 0)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--parallel.timeout_s", dest="timeout", type=float,
                   default=None, metavar="S",
                   help="under torchrun/srun: timeout of the rendezvous and of every collective "
                   "(s, default 600 as the parallel.timeout_s of xnn train, md, relax and run)")
    p.add_argument("--timeout", dest="old_timeout", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.app.validate import ValidateOptions, run_validate
    from xnn.distributed.manager import DEFAULT_TIMEOUT_S
    from xnn.errors import InputError

    if args.old_timeout is not None:
        raise InputError("--timeout was renamed: write --parallel.timeout_s "
                         f"{args.old_timeout}")

    return run_validate(ValidateOptions(
        model=args.model, structure=args.structure, index=args.index, dtype=args.dtype,
        grid=args.grid, mode=args.mode, skin=args.skin, tol=args.tol, json=args.json,
        skip_reference=args.skip_reference, output=args.output, device=args.device,
        timeout=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
        trust_file=args.trust_file, order=args.order, balance=args.balance,
        exchange=args.exchange))
