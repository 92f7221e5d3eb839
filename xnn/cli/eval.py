"""``xnn eval MODEL DATA`` or ``xnn eval --split test RUN_DIR``: MAE/RMSE of a trained model
on labelled data, and a parity plot."""

from __future__ import annotations

import argparse

KEYS = ("energy", "forces", "stress")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="errors of a model on labelled data (+ parity plot)",
        description="Print MAE/RMSE for energy (meV/atom), forces (meV/Å, also per element) "
        "and stress (meV/Å³) of MODEL on DATA, and write a parity plot (energy, forces, and "
        "stress when DATA has stress labels). With --split SPLIT, MODEL is a training run "
        "folder: its model.pt is evaluated on exactly the structures of that split of its "
        "training (the run's split.json; the data files must be unchanged). Exits with "
        "status 2 and one line when the model's weights or errors are NaN or infinite.",
    )
    p.add_argument("model", help="model file written by xnn train (model.pt); with --split, "
                   "the run folder (output_dir of xnn train)")
    p.add_argument("data", nargs="?", default=None,
                   help="labelled structures (extxyz or xnn HDF5); not with --split")
    p.add_argument("--split", choices=("train", "val", "test"), default=None,
                   help="evaluate the run folder MODEL on this split of its training data")
    p.add_argument("--batch-size", type=int, default=8, help="structures per batch (default 8)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default auto)")
    p.add_argument("--plot", default=None,
                   help="parity plot PNG (default: parity_<DATA stem>.png next to the model; "
                   "with --split, parity_<SPLIT>_eval.png in the run folder)")
    p.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    for name in KEYS:
        p.add_argument(f"--{name}-key", default=None,
                       help=f"{name} label key (default {name}; with --split, the run's)")
    p.add_argument("--head", default=None,
                   help="multi-head models (xnn train finetune.heads=true): the head that "
                   "predicts (default: the model's first, the new data's); an unknown name "
                   "lists the model's heads")
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names (MACE models "
                   "saved by an earlier xnn, files named in its hyperparameters), which can "
                   "run code; only for files you trust")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.app.evaluate import EvalOptions, run_eval
    from xnn.training.evaluate import format_metrics

    result = run_eval(EvalOptions(
        model=args.model, data=args.data, split=args.split,
        keys=tuple(zip(KEYS, (args.energy_key, args.forces_key, args.stress_key))),
        batch_size=args.batch_size,
        device=args.device, plot=args.plot, json=args.json, trust_file=args.trust_file,
        head=args.head))
    print(f"{result.model_file} on {result.description}")
    print(format_metrics(result.metrics))
    print(f"parity plot: {result.plot}")
    if result.calibration_plot is not None:
        print(f"calibration plot: {result.calibration_plot}")
    return 0
