"""``xnn eval MODEL DATA``: MAE/RMSE of a trained model on labelled data, and a parity plot."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "eval",
        help="errors of a model on labelled data (+ parity plot)",
        description="Print MAE/RMSE for energy (meV/atom), forces (meV/Å, also per element) "
        "and stress (meV/Å³) of MODEL on DATA, and write a parity plot.",
    )
    p.add_argument("model", help="model file written by xnn train (model.pt)")
    p.add_argument("data", help="labelled structures (extxyz or xnn HDF5)")
    p.add_argument("--batch-size", type=int, default=8, help="structures per batch (default 8)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default auto)")
    p.add_argument("--plot", default=None,
                   help="parity plot PNG (default: parity_<DATA stem>.png next to the model)")
    p.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    p.add_argument("--energy-key", default="energy", help="energy label key (default energy)")
    p.add_argument("--forces-key", default="forces", help="forces label key (default forces)")
    p.add_argument("--stress-key", default="stress", help="stress label key (default stress)")
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names (MACE models "
                   "saved by an earlier xnn, files named in its hyperparameters), which can "
                   "run code; only for files you trust")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import json
    from pathlib import Path

    from xnn import plotting
    from xnn.errors import InputError
    from xnn.io.calculator import resolve_device
    from xnn.models.serialization import load_model
    from xnn.training.evaluate import evaluate_model, format_metrics

    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if Path(args.model).is_file():
        from xnn._torch_files import refuse_non_model_file

        refuse_non_model_file(args.model)  # truncated, or a training/MD checkpoint
    model = load_model(args.model, trust=args.trust_file)
    metrics, parity = evaluate_model(
        model, args.data, args.batch_size, resolve_device(args.device),
        energy_key=args.energy_key, forces_key=args.forces_key, stress_key=args.stress_key,
    )
    print(format_metrics(metrics))
    plot = Path(args.plot) if args.plot else \
        Path(args.model).resolve().parent / f"parity_{Path(args.data).stem}.png"
    plotting.parity(parity["energy"], parity["forces"], plot, title=Path(args.data).name)
    print(f"parity plot: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2))
    return 0
