"""``xnn demo --out DIR``: the main job on built-in data, one function per step.

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
import json
import os
import sys
from pathlib import Path

from xnn.errors import InputError

#: Lennard-Jones argon (Rowley et al. style parameters): σ (Å), ε (eV), cutoff 2.5σ (Å)
AR_SIGMA, AR_EPSILON, AR_CUTOFF = 3.405, 0.010323, 8.5125
AR_LATTICE = 5.26  # Å, a slightly off-equilibrium start


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


def prepare_output(out: str | os.PathLike) -> Path:
    """Create the output folder; refuse a path that is an existing file."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {path} exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def step_lj_relax(out: Path, fmax: float = 1e-4, steps: int = 500, repeat: int = 2) -> dict:
    """Relax a rattled ``repeat``³ argon FCC supercell (4 repeat³ atoms), positions and cell.

    Returns:
        a summary dict: energy per atom (eV), max force (eV/Å), stress (Voigt, GPa),
        lattice constant (Å), number of optimizer steps.
    """
    from ase.build import bulk
    from ase.filters import UnitCellFilter
    from ase.optimize import FIRE

    from xnn.io.calculator import Calculator
    from xnn.models.classical import LennardJones
    from xnn.units import EV_PER_A3_TO_GPA

    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    atoms = bulk("Ar", "fcc", a=AR_LATTICE, cubic=True) * (repeat, repeat, repeat)
    atoms.rattle(0.02, seed=0)
    atoms.calc = Calculator(LennardJones(AR_SIGMA, AR_EPSILON, AR_CUTOFF), device="cpu")
    e_start = atoms.get_potential_energy() / len(atoms)
    opt = FIRE(UnitCellFilter(atoms), logfile=str(out / "lj_relax.log"))
    converged = bool(opt.run(fmax=fmax, steps=steps))
    forces = atoms.get_forces()
    stress = atoms.get_stress()
    summary = {
        "system": f"Ar fcc {repeat}x{repeat}x{repeat}, Lennard-Jones",
        "n_atoms": len(atoms),
        "converged": converged,
        "optimizer_steps": int(opt.nsteps),
        "energy_per_atom_start_eV": float(e_start),
        "energy_per_atom_eV": float(atoms.get_potential_energy() / len(atoms)),
        "max_force_eV_per_A": float(abs(forces).max()),
        "stress_voigt_GPa": [float(s) * EV_PER_A3_TO_GPA for s in stress],
        "lattice_constant_A": float(atoms.get_volume() / repeat**3) ** (1.0 / 3.0),
        "model_calls": atoms.calc.n_model_calls,
    }
    atoms.write(out / "lj_relaxed.xyz")
    return summary


def step_train(out: Path, epochs: int, max_minutes: float, n_structures: int) -> dict:
    """EMT Cu data → train the default model for ``epochs`` epochs (capped at
    ``max_minutes``) → test-set errors and plots."""
    from xnn.app.demo import demo_train

    summary = demo_train(out, epochs=epochs, max_minutes=max_minutes,
                         n_structures=n_structures)
    metrics = summary.get("metrics", {})
    keep = {k: v for k, v in metrics.items() if k.startswith("test_") or k.startswith("val_")}
    return {
        "model": str(summary["model"]),
        "data": str(summary["data"]),
        "plots": [str(p) for p in summary.get("plots", [])],
        "epochs": summary["epochs"],
        "epochs_planned": epochs,
        "stopped_by": summary["stopped_by"],
        **({"warning": summary["warning"]} if "warning" in summary else {}),
        **{k: float(v) for k, v in keep.items() if isinstance(v, (int, float))},
    }


def step_md(out: Path, model_file: str, steps: int, temperature: float) -> dict:
    """NVT MD (CSVR) of a 3×3×3 FCC Cu crystal (108 atoms) with the trained model."""
    import csv

    from ase.build import bulk

    from xnn.app.demo import demo_md

    md_dir = out / "md"
    md_dir.mkdir(parents=True, exist_ok=True)
    start = md_dir / "start.xyz"
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (3, 3, 3)
    atoms.rattle(0.02, seed=1)
    atoms.write(start)
    demo_md(model_file, start, md_dir, temperature=temperature, steps=steps, ensemble="csvr")
    with open(md_dir / "thermo.csv") as f:
        rows = list(csv.DictReader(f))
    temps = [float(r["temperature_K"]) for r in rows[len(rows) // 2 :] if "temperature_K" in r]
    return {
        "folder": str(md_dir),
        "steps": steps,
        "target_temperature_K": temperature,
        "mean_temperature_second_half_K": sum(temps) / len(temps) if temps else float("nan"),
        "thermo_plot": str(md_dir / "thermo.png"),
    }


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
    check_args(args)
    out = prepare_output(args.out)
    results = {"lj_relax": step_lj_relax(out, args.fmax, args.steps, args.repeat)}
    print_summary("lj_relax", results["lj_relax"])
    if not args.only_lj:
        results["train"] = step_train(out, args.epochs, args.max_minutes, args.n_structures)
        print_summary("train", results["train"])
        results["md"] = step_md(out, results["train"]["model"], args.md_steps, args.temperature)
        print_summary("md", results["md"])
    write_json(out / "summary.json", results)
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
