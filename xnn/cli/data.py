"""``xnn data emt|bulk|convert|prepare|inspect``: built-in EMT reference data, crystals,
extxyz → HDF5 conversion, prepared sharded datasets, and the keys a data file holds."""

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
    _add_prepare(dsub)
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


def _add_prepare(dsub) -> None:
    prep = dsub.add_parser(
        "prepare", help="a sharded, preprocessed dataset for training at scale",
        description="Write the structures of IN... (extxyz, any ASE format, xnn HDF5, ASE "
        "db/LMDB) as one prepared dataset: per shard flat arrays (.npy, memory-mapped by "
        "each rank and data-loader worker), per-structure atom and edge counts at --cutoff, "
        "and the dataset statistics (E0s, mean neighbour count, force RMS) that xnn train "
        "reuses when model.cutoff equals --cutoff. Streamed: memory does not grow with the "
        "input. Train on it with data.datasets.0.path=DIR.",
    )
    prep.add_argument("inputs", nargs="+", metavar="IN", help="input files")
    prep.add_argument("--out", required=True, help="output folder (written as OUT.tmp, then "
                      "renamed)")
    prep.add_argument("--shards", type=int, default=1,
                      help="number of shards, about equal in atoms (default 1)")
    prep.add_argument("--cutoff", type=float, default=5.0,
                      help="cutoff (Å) of the stored edge counts and mean neighbour count; "
                      "use the model.cutoff you will train with (default 5.0, xnn train's)")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace an existing non-empty --out")
    for prop in ("energy", "forces", "stress", "virial"):
        prep.add_argument(f"--{prop}-key", default=prop, help=f"{prop} label key (default "
                          f"{prop})")
    prep.set_defaults(func=run_prepare)


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


def run_prepare(args) -> int:
    from xnn.app.data import PROPERTIES, prepare_files

    keys = dict(zip(PROPERTIES, (args.energy_key, args.forces_key, args.stress_key,
                                 args.virial_key)))
    m = prepare_files(args.inputs, args.out, args.shards, args.cutoff, keys, args.overwrite)
    stats = m["statistics"]
    print(f"wrote {m['n_structures']} structures ({m['n_atoms']} atoms) in "
          f"{len(m['shards'])} shards to {args.out}; cutoff {m['cutoff']:g} Å: "
          f"{stats['avg_num_neighbors']:.2f} neighbours per atom, force RMS "
          f"{stats['force_rms'] or float('nan'):.4g} eV/Å")
    return 0


def run_inspect(args) -> int:
    from xnn.app.data import PROPERTIES, inspect_file

    keys = dict(zip(PROPERTIES, (args.energy_key, args.forces_key, args.stress_key,
                                 args.virial_key)))
    print(inspect_file(args.file, args.limit, keys))
    return 0
