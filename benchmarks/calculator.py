"""Time per ASE call of ``xnn.Calculator`` against the calculators ASE users already have.

What an ASE user sees per step of an ASE driver (MD, relaxation, NEB): one
``get_forces`` + ``get_potential_energy`` + ``get_stress`` after the atoms moved.

Cases (rattled FCC Cu, moved by 1e-3 Å between calls, both calculators on copies of the
same atoms, timed alternately):

* ``mace``: the random-weight mace-torch ``ScaleShiftMACE`` of ``benchmarks/models.py``,
  saved once and loaded by both ``mace.calculators.MACECalculator`` and
  ``xnn.Calculator(xnn.models.build("mace", model=...))`` (same weights, fp64); forces are
  compared.
* ``lj``: ``xnn.Calculator`` with xnn's Lennard-Jones against ASE's own
  ``ase.calculators.lj.LennardJones`` (same parameters; forces compared): the wrapper's
  fixed cost per call, where the model costs next to nothing.

Usage::

    python benchmarks/calculator.py --json benchmarks/results/calculator_cpu.json
    python benchmarks/calculator.py --json /tmp/c.json --sizes 4 32 --calls 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

try:
    from benchmarks.common import fcc_cu, write_json
except ImportError:  # run as `python benchmarks/calculator.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, write_json

from xnn.io.calculator import Calculator

LJ = dict(sigma=2.338, epsilon=0.409, cutoff=5.8)


def per_call(calcs: dict, atoms, calls: int, warmup: int = 2, seed: int = 0) -> dict:
    """Median seconds per call of each calculator in ``calcs`` (name -> calculator), each on
    its own copy of ``atoms`` moved by the same random displacements, in alternating order;
    and the largest force difference from the first calculator."""
    rng = np.random.default_rng(seed)
    copies = {}
    for name, calc in calcs.items():
        a = atoms.copy()
        a.calc = calc
        copies[name] = a
    times: dict[str, list[float]] = {name: [] for name in calcs}
    order = list(copies.items())
    for k in range(warmup + calls):
        step = rng.normal(0.0, 1e-3, atoms.positions.shape)
        for name, a in order if k % 2 == 0 else order[::-1]:
            a.positions += step
            t0 = time.perf_counter()
            a.get_forces()
            a.get_potential_energy()
            a.get_stress()
            if k >= warmup:
                times[name].append(time.perf_counter() - t0)
    first, *rest = copies
    forces = {name: a.get_forces() for name, a in copies.items()}
    return {
        "s_per_call": {name: statistics.median(v) for name, v in times.items()},
        "force_max_abs_diff_eV_A": {name: float(np.abs(forces[name] - forces[first]).max())
                                    for name in rest},
        "force_max_abs_eV_A": float(np.abs(forces[first]).max()),
    }


def bench_mace(sizes, calls: int, device: str) -> list[dict]:
    from mace.calculators import MACECalculator

    from benchmarks.models import build_mace
    from xnn.models import build

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mace.model")
        torch.save(build_mace(40.0).double().eval(), path)
        for n in sizes:
            atoms = fcc_cu(n)
            model = torch.load(path, weights_only=False)
            calcs = {"xnn": Calculator(build("mace", model=model), device=device),
                     "mace": MACECalculator(model_paths=path, device=device,
                                            default_dtype="float64")}
            rows.append(_row("mace", atoms, calcs, calls))
    return rows


def bench_lj(sizes, calls: int, device: str) -> list[dict]:
    from ase.calculators.lj import LennardJones

    from xnn.models import build

    rows = []
    for n in sizes:
        atoms = fcc_cu(n)
        calcs = {"xnn": Calculator(build("lj", **LJ), device=device),
                 "ase": LennardJones(sigma=LJ["sigma"], epsilon=LJ["epsilon"], rc=LJ["cutoff"])}
        rows.append(_row("lj", atoms, calcs, calls))
    return rows


def _row(case: str, atoms, calcs: dict, calls: int) -> dict:
    """:func:`per_call` of ``calcs`` ("xnn" and one peer) on ``atoms`` as a printed row with
    the ratio ``xnn_over_<peer>_time``."""
    r = per_call(calcs, atoms, calls)
    peer = next(name for name in calcs if name != "xnn")
    row = {"case": case, "n_atoms": len(atoms), **r,
           f"xnn_over_{peer}_time": r["s_per_call"]["xnn"] / r["s_per_call"][peer]}
    print(_line(row), flush=True)
    return row


def _line(row: dict) -> str:
    ms = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in row["s_per_call"].items())
    diff = max(row["force_max_abs_diff_eV_A"].values())
    return f"{row['case']:<5} {row['n_atoms']:>6} atoms: {ms} (forces differ by {diff:.1e} eV/Å)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--sizes", type=int, nargs="*", default=[4, 32, 108, 256],
                   help="atom counts (FCC supercells near these)")
    p.add_argument("--calls", type=int, default=10, help="timed calls per calculator and size")
    p.add_argument("--cases", nargs="*", default=["mace", "lj"], choices=["mace", "lj"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("calculator", args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    if "mace" in args.cases:
        rows += bench_mace(args.sizes, args.calls, args.device)
    if "lj" in args.cases:
        rows += bench_lj(args.sizes, args.calls, args.device)
    payload = {"benchmark": "ASE calculator time per call (forces + energy + stress)",
               "dtype": "float64", "results": rows}
    print(f"wrote {write_json(args.json, payload, device=args.device)}")


if __name__ == "__main__":
    main()
