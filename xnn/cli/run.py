"""``xnn run WORKFLOW.yaml [key=value ...]``: many structures through stages (relax, nve,
nvt, npt), batched with in-flight refill (see ``xnn run --help``)."""

from __future__ import annotations

from xnn.cli.md import add_config_parser, run_config


def add_parser(sub) -> None:
    from xnn.config.workflow import STAGE_OPTIONS, WorkflowConfig

    options = "; ".join(f"{t}: " + ", ".join(f"{k}={v}" for k, v in o.items())
                        for t, o in STAGE_OPTIONS.items())

    p = add_config_parser(
        sub, "run", WorkflowConfig, "run a workflow: structures through relax/nve/nvt/npt "
        "stages, batched",
        "Run every frame of a structure file through the workflow's stages (relax -> nvt -> "
        "npt ...). Up to `slots` systems advance together; a system that finishes a stage "
        "moves on at once and its slot is refilled from the queue. Writes results.csv (one "
        "row per system and stage), trajectories/, final.xyz and summary.json to output.dir; "
        "resume=output.dir/checkpoint.pt continues a killed campaign. Under torchrun the "
        "systems are shared among the ranks (each system on one rank, `slots` per rank; one "
        "results.csv, as one process writes it). Each stage is {type, name, "
        f"trajectory_every, ...}} with the options of its type (defaults) -- {options}.",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from xnn.app.workflow import run_workflow
    from xnn.config.workflow import WorkflowConfig

    return run_config(args, "run", WorkflowConfig, run_workflow)
