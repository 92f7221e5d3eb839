"""``xnn data emt|bulk|convert|inspect``: built-in EMT reference data, crystals, extxyz → HDF5
conversion, and the keys a data file holds."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("data", help="generate EMT data, convert data files",
                       description="Data utilities.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    emt = dsub.add_parser(
        "emt", help="structures labelled with ASE's EMT (energy, forces, stress)",
        description="Strained, rattled, vacancy, surface and MD structures labelled with "
        "ASE's EMT; identical output for the same --n, --elements and --seed.",
    )
    emt.add_argument("--out", required=True, help="output file (.xyz or .extxyz: extxyz; .h5 "
                     "or .hdf5: xnn HDF5)")
    emt.add_argument("--elements", default="Cu", help="comma-separated symbols (default Cu)")
    emt.add_argument("--n", type=int, default=200, help="number of structures (default 200)")
    emt.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    emt.set_defaults(func=run_emt)
    _add_bulk(dsub)
    conv = dsub.add_parser(
        "convert", help="extxyz (any ASE format) to xnn HDF5",
        description="Convert labelled structures to the xnn HDF5 layout (lazily read, for "
        "datasets larger than memory).",
    )
    conv.add_argument("input", help="input file (extxyz or any ASE format)")
    conv.add_argument("output", help="output .h5 file")
    conv.add_argument("--energy-key", default="energy", help="energy label key")
    conv.add_argument("--forces-key", default="forces", help="forces label key")
    conv.add_argument("--stress-key", default="stress", help="stress label key")
    conv.add_argument("--virial-key", default="virial", help="virial label key")
    conv.set_defaults(func=run_convert)
    _add_inspect(dsub)
    return p


def _add_bulk(dsub) -> None:
    bulk = dsub.add_parser(
        "bulk", help="a cubic crystal supercell (a structure to simulate, no labels)",
        description="The conventional cubic cell of an element's reference crystal (ASE: fcc "
        "Cu, bcc Fe, diamond Si, ...) repeated --repeat times along each axis, every atom "
        "displaced by Gaussian noise of --rattle Å (seeded).",
    )
    bulk.add_argument("--out", required=True, help="output file (.xyz or .extxyz: extxyz)")
    bulk.add_argument("--element", default="Cu", help="chemical symbol (default Cu)")
    bulk.add_argument("--repeat", type=int, default=4,
                      help="cubic cells along each axis (default 4: 256 fcc atoms)")
    bulk.add_argument("--a", type=float, default=None,
                      help="lattice constant in Å (default: ASE's reference value)")
    bulk.add_argument("--rattle", type=float, default=0.05,
                      help="displacement standard deviation in Å (default 0.05)")
    bulk.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    bulk.set_defaults(func=run_bulk)


def _add_inspect(dsub) -> None:
    ins = dsub.add_parser(
        "inspect", help="the keys (labels) a structure file holds",
        description="List the info keys, per-atom arrays and calculator results of the "
        "structures of FILE (extxyz, any ASE format, xnn HDF5) with the number of structures "
        "holding each, and where xnn finds the energy, forces, stress and virial labels with "
        "the given keys (xnn train: data.datasets.N.energy_key=KEY ...; xnn eval: "
        "--energy-key KEY ...).",
    )
    ins.add_argument("file", help="structure file")
    ins.add_argument("--limit", type=int, default=None,
                     help="read only the first N structures (default: all)")
    for prop in ("energy", "forces", "stress", "virial"):
        ins.add_argument(f"--{prop}-key", default=prop, help=f"{prop} label key (default {prop})")
    ins.set_defaults(func=run_inspect)


def run_emt(args) -> int:
    from xnn.app.data import write_emt_file

    n = write_emt_file(args.out, args.n, args.elements.split(","), args.seed)
    print(f"wrote {n} EMT structures to {args.out}")
    return 0


def run_bulk(args) -> int:
    from xnn.app.data import write_bulk_file

    path, n = write_bulk_file(args.out, args.element, args.repeat, args.a, args.rattle,
                              args.seed)
    print(f"wrote {n} {args.element} atoms ({args.repeat}x{args.repeat}x"
          f"{args.repeat} cubic cells) to {path}")
    return 0


def run_convert(args) -> int:
    from xnn.app.data import PROPERTIES, convert_file

    keys = dict(zip(PROPERTIES, (args.energy_key, args.forces_key, args.stress_key,
                                 args.virial_key)))
    n, atoms = convert_file(args.input, args.output, keys)
    print(f"wrote {n} structures ({atoms} atoms) to {args.output}")
    return 0


def run_inspect(args) -> int:
    from xnn.app.data import PROPERTIES, inspect_file

    keys = dict(zip(PROPERTIES, (args.energy_key, args.forces_key, args.stress_key,
                                 args.virial_key)))
    print(inspect_file(args.file, args.limit, keys))
    return 0
