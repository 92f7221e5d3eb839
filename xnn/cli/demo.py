"""``xnn demo --out DIR``: the main job on built-in data (an argument shell over
:func:`xnn.app.demo.run_demo`, whose steps are):

1. ``step_lj_relax``: relax positions and cell of a rattled Lennard-Jones argon FCC crystal
   with ASE's FIRE (on a ``UnitCellFilter``: the Fréchet/Exp filters spend most of the time
   in scipy's matrix exponential for this tiny system) and our calculator.
2. ``step_train``: label Cu structures with ASE's EMT, train the default model for a fixed
   number of epochs (a wall-clock cap warns loudly when it stops the training early), evaluate
   it on the test split (learning curves and parity plots).
3. ``step_md``: NVT MD (CSVR thermostat) of an FCC Cu crystal with the trained model,
   thermo log and plot.

Everything lands in ``DIR``; ``DIR/summary.json`` collects the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from xnn.errors import InputError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run a small end-to-end demo and write its results to a folder",
        description="Generate EMT Cu data, train a model on it, evaluate it (parity and "
        "learning-curve plots), run NVT MD with it (thermo plot), and relax a Lennard-Jones "
        "argon crystal; everything is written to OUT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="demo_output", help="output folder (created if missing)")
    p.add_argument("--fmax", type=float, default=1e-4, help="relaxation force threshold (eV/Å)")
    p.add_argument("--steps", type=int, default=500, help="maximum relaxation steps")
    p.add_argument("--repeat", type=int, default=2, help="LJ: FCC conventional cells per axis")
    p.add_argument("--epochs", type=int, default=40,
                   help="training epochs (a fixed count: the result does not depend on the "
                   "machine's speed)")
    p.add_argument("--max-minutes", type=float, default=15.0,
                   help="wall-clock cap of the training; if it stops the training before the "
                   "last epoch, the demo warns that its result depends on the machine's load")
    p.add_argument("--n-structures", type=int, default=200, help="EMT structures to generate")
    p.add_argument("--md-steps", type=int, default=400, help="MD steps (1 fs each)")
    p.add_argument("--temperature", type=float, default=300.0, help="MD temperature (K)")
    p.add_argument(
        "--only-lj", action="store_true", help="only relax the LJ crystal (no training, no MD)"
    )
    p.set_defaults(func=run)


def print_summary(name: str, summary: dict) -> None:
    print(f"[{name}]")
    for k, v in summary.items():
        if k == "warning":  # printed on stderr, where it is seen
            continue
        if isinstance(v, float):
            v = f"{v:.6g}"
        elif isinstance(v, list):
            v = "[" + ", ".join(f"{x:.3g}" if isinstance(x, float) else str(x) for x in v) + "]"
        print(f"  {k}: {v}")


def check_args(args: argparse.Namespace) -> None:
    """Validate options before anything is written."""
    if args.repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {args.repeat}")
    if not args.fmax > 0:
        raise InputError(f"--fmax must be > 0, got {args.fmax}")
    if args.steps < 1:
        raise InputError(f"--steps must be >= 1, got {args.steps}")
    if args.epochs < 1:
        raise InputError(f"--epochs must be >= 1, got {args.epochs}")
    if not args.max_minutes > 0:
        raise InputError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.n_structures < 10:
        raise InputError(f"--n-structures must be >= 10, got {args.n_structures}")
    if args.md_steps < 1:
        raise InputError(f"--md-steps must be >= 1, got {args.md_steps}")
    if not 0 < args.temperature < float("inf"):  # NaN fails too
        raise InputError(f"--temperature must be a finite number > 0 (K), got "
                         f"{args.temperature}")


def run(args: argparse.Namespace) -> int:
    from xnn.app.demo import run_demo

    check_args(args)
    out, results = run_demo(args.out, args.fmax, args.steps, args.repeat, args.only_lj,
                            args.epochs, args.max_minutes, args.n_structures, args.md_steps,
                            args.temperature)
    for name, summary in results.items():
        print_summary(name, summary)
    print(f"demo output written to {out.resolve()}")
    warning = results.get("train", {}).get("warning")
    if warning:
        print(warning, file=sys.stderr)
    hint = path_hint()
    if hint:
        print(hint)
    return 0


def path_hint() -> str | None:
    """How to get the ``xnn`` command of this environment on PATH, when it is not: after
    ``make demo`` the virtual environment is not activated in the user's shell."""
    bin_dir = Path(sys.executable).parent
    on_path = [Path(p).resolve() for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if bin_dir.resolve() in on_path or not (bin_dir / "activate").is_file():
        return None
    return (f"to run xnn yourself: source {bin_dir / 'activate'} (then xnn --help; or run "
            f"{bin_dir / 'xnn'} directly)")
