"""``xnn train CONFIG.yaml [key=value ...]``: train a potential (one process, torchrun or srun)."""

from __future__ import annotations

import argparse

EPILOG_HEAD = """your own data: name the labels of each file by its keys (extxyz info/arrays keys or
a single-point calculator's results), e.g.
  xnn train cfg.yaml data.datasets.0.path=dft.xyz data.datasets.0.energy_key=REF_energy \\
      data.datasets.0.forces_key=REF_forces data.datasets.0.stress_key=REF_stress
`xnn data inspect FILE` lists the keys a file holds; docs/train-your-data.md has the units,
the stress convention, E0s, splits and every model's hyperparameters.

switch the model type: model.name=painn model.hyperparameters=null (key=null empties a
mapping such as model.hyperparameters; the YAML's settings of another model are dropped).

configuration keys (set in the YAML file or as key=value overrides; list entries by
index, e.g. data.datasets.0.path=train.xyz; data.datasets.1=null removes entry 1):
"""


def _epilog() -> str:
    from xnn.config.loader import describe
    from xnn.config.train import TrainConfig

    return EPILOG_HEAD + describe(TrainConfig)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="train a potential from a YAML config",
        description="Train a machine-learned potential. Launch with torchrun or srun for "
        "data-parallel training over several GPUs or nodes.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML config file (optional: all keys have defaults)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config and exit")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.config.loader import load_config, split_config_args, to_yaml
    from xnn.config.train import TrainConfig

    config, overrides = split_config_args(args.config, args.overrides)
    cfg = load_config(TrainConfig, config, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from xnn.app.train import run_train

    run_train(cfg)
    return 0
