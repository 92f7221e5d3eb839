"""``xnn committee A.pt B.pt [C.pt ...] --out committee.pt``: one committee model file from
separately trained model files (see :mod:`xnn.app.committee`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "committee",
        help="assemble separately trained model files into one committee model file",
        description="Load K model files of one kind, cutoff and species (MACE or SevenNet "
        "wrappers, or xnn models; e.g. trained with different seeds) and write them as one "
        "committee model file: its prediction is the members' mean and its spread the "
        "uncertainty (energy_std, forces_std, stress_std) in xnn md, relax, eval, the ASE "
        "calculator and workflows (docs/committees.md).",
    )
    p.add_argument("models", nargs="+", help="the members' model files (at least 2)")
    p.add_argument("--out", "-o", required=True, help="the committee model file to write")
    p.add_argument("--trust-file", action="store_true",
                   help="trust the member files: they may unpickle what they hold (MACE "
                   "models saved by an earlier xnn), which can run code; only for files you "
                   "trust. The committee file written holds them as data")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.app.committee import build_committee

    print(build_committee(args.models, args.out, args.trust_file).line())
    return 0
