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
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names (MACE models "
                   "saved by an earlier xnn, files named in its hyperparameters), which can "
                   "run code; only for files you trust")
    p.set_defaults(func=run)
    return p


def _data(args):
    """The model file and the structures to evaluate, from the arguments."""
    from pathlib import Path

    from xnn.app.evaluate import labelled_data, split_data
    from xnn.errors import InputError

    if args.split is not None:
        if args.data is not None:
            raise InputError(f"--split {args.split} evaluates the run folder's own data: give "
                             f"only the run folder (xnn eval --split {args.split} RUN_DIR), "
                             f"not {args.data!r}")
        given = [f"--{k}-key" for k in KEYS if getattr(args, f"{k}_key") is not None]
        if given:
            raise InputError(f"{', '.join(given)} cannot be used with --split: the run's "
                             "split.json names the keys each file was trained with")
        return str(Path(args.model) / "model.pt"), split_data(args.model, args.split)
    if args.data is None:
        raise InputError("give the labelled data to evaluate on (xnn eval MODEL DATA), or "
                         "--split test with a training run folder (xnn eval --split test "
                         "RUN_DIR)")
    keys = {k: getattr(args, f"{k}_key") or k for k in KEYS}
    named = tuple(k for k in KEYS if getattr(args, f"{k}_key") is not None)
    return args.model, labelled_data(args.data, {**keys, "virial": "virial"}, named)


def run(args) -> int:
    import json
    from pathlib import Path

    from xnn import plotting
    from xnn._files import check_output_file
    from xnn.app.evaluate import check_finite_metrics, check_finite_weights
    from xnn.devices import resolve_device
    from xnn.errors import InputError
    from xnn.models.serialization import load_model
    from xnn.training.evaluate import evaluate_model, format_metrics

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    model_file, data = _data(args)
    plot = check_output_file(args.plot, "--plot", "parity.png") if args.plot else \
        Path(model_file).resolve().parent / f"parity_{data.name}.png"
    out_json = check_output_file(args.json, "--json", "metrics.json") if args.json else None
    if Path(model_file).is_file():
        from xnn._torch_files import refuse_non_model_file

        refuse_non_model_file(model_file)  # truncated, or a training/MD checkpoint
    model = load_model(model_file, trust=args.trust_file)
    check_finite_weights(model, model_file)
    metrics, parity = evaluate_model(model, data.dataset, args.batch_size,
                                     resolve_device(args.device))
    check_finite_metrics(metrics, model_file, data)
    print(f"{model_file} on {data.description}")
    print(format_metrics(metrics))
    plot.parent.mkdir(parents=True, exist_ok=True)
    plotting.parity(parity["energy"], parity["forces"], plot, title=data.name,
                    stress=parity.get("stress"))
    print(f"parity plot: {plot}")
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(metrics, indent=2))
    return 0
