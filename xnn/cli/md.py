"""``xnn md CONFIG.yaml [key=value ...]``: molecular dynamics (see ``xnn md --help``)."""

from __future__ import annotations

import argparse


def add_config_parser(sub, name: str, schema, summary: str, description: str,
                      example: str = "steps=1000"):
    """The parser of a config command: an optional YAML file, ``key=value`` overrides
    (``example``: the one the help shows), ``--print-config``; the epilog lists every key."""
    from xnn.config.loader import describe

    p = sub.add_parser(
        name, help=summary, description=description,
        epilog="options (set in the YAML file or as key=value):\n" + describe(schema),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional)")
    p.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example}")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def add_parser(sub) -> None:
    from xnn.config.md import MDConfig

    p = add_config_parser(
        sub, "md", MDConfig, "run molecular dynamics (nve, langevin, nhc, csvr, npt)",
        "Molecular dynamics of every frame of a structure file with a model file or a built-in "
        "model. Writes thermo.csv/png, a trajectory and checkpoints to output.dir; "
        "resume=CHECKPOINT continues a run exactly.",
    )
    p.set_defaults(func=run)


def run_config(args, command: str, schema, runner) -> int:
    """Load ``schema`` from the command's config and overrides; print it or run ``runner``."""
    from xnn.config.loader import load_config, split_config_args, to_yaml

    config, overrides = split_config_args(args.config, args.overrides)
    cfg = load_config(schema, config, overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return 0
    out = runner(cfg)
    from xnn.distributed.manager import detect_launch

    if detect_launch().rank == 0:  # one line for the job, not one per rank
        print(f"xnn {command}: done; results in {out}")
    return 0


def run(args) -> int:
    from xnn.app.md import run_md
    from xnn.config.md import MDConfig

    return run_config(args, "md", MDConfig, run_md)
