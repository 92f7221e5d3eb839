"""``xnn relax CONFIG.yaml [key=value ...]``: FIRE relaxation (see ``xnn relax --help``)."""

from __future__ import annotations

from xnn.cli.md import add_config_parser, run_config


def add_parser(sub) -> None:
    from xnn.config.md import RelaxConfig

    p = add_config_parser(
        sub, "relax", RelaxConfig, "relax structures (positions, optionally the cell) with FIRE",
        "Relax every frame of a structure file with FIRE until all forces are below fmax; "
        "relax_cell=true also relaxes the cell toward pressure. Writes relaxed.xyz and "
        "relax.csv to output.dir.",
        example="max_steps=500 fmax=0.01",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from xnn.app.relax import run_relax
    from xnn.config.md import RelaxConfig

    return run_config(args, "relax", RelaxConfig, run_relax)
