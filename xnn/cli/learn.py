"""``xnn learn LOOP.yaml [key=value ...]``: the active-learning loop (see ``xnn learn --help``)."""

from __future__ import annotations

from xnn.cli.md import add_config_parser, run_config


def add_parser(sub) -> None:
    from xnn.config.learn import LearnConfig

    p = add_config_parser(
        sub, "learn", LearnConfig, "active learning: train a committee, explore, select the "
        "most uncertain structures, label them, repeat",
        "Active-learning loop. Each round trains a committee (one xnn train run with "
        "committee.size=train.committee) on the initial data plus every label so far, "
        "explores with workflow stages from structures of the dataset, scores every sampled "
        "frame by its largest per-atom calibrated committee force standard deviation, "
        "selects up to select.budget frames above select.threshold (null: all eligible) by "
        "farthest-point sampling on a radial descriptor, and labels "
        "them (label.calculator: emt, or package.module:factory with label.trust=true). "
        "Writes round_NNN/ (model.pt, candidates/selected/labelled.extxyz, summary.json), "
        "learning_curve.csv/png and journal.jsonl to output; running the same command again "
        "continues a killed loop without labelling any structure twice.",
        example="rounds=5",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from xnn.app.learn import run_learn
    from xnn.config.learn import LearnConfig

    return run_config(args, "learn", LearnConfig, run_learn)
