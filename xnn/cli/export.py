"""``xnn export MODEL.pt --format {export,aoti,torchscript} --out FILE``: a self-contained
artefact that computes energy, forces and stress and loads with torch alone.

The artefact's inputs are plain tensors with the caller's neighbor list (see
:mod:`xnn.models.export` and docs/user-guide.md#xnn-export for the contract).
"""

from __future__ import annotations

import argparse

SUFFIX = {"export": ".pt2", "aoti": ".pt2", "torchscript": ".pt"}
LOADER = {
    "export": "torch.export.load(FILE).module()",
    "aoti": "torch._inductor.aoti_load_package(FILE)",
    "torchscript": "torch.jit.load(FILE)",
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="export a model to a torch-only artefact (energy, forces, stress)",
        description="Write MODEL as a torch.export program, an AOTInductor package or "
        "TorchScript that maps (positions, numbers, cell, pbc, batch, edge_index, shifts) to "
        "(energy, forces, stress) and loads without xnn. The caller provides the full "
        "neighbor list (both directions, distance < the model's cutoff).",
    )
    p.add_argument("model", help="model file written by xnn train (model.pt)")
    p.add_argument("--format", default="export", choices=list(SUFFIX),
                   help="export: torch.export program (.pt2); aoti: AOTInductor package "
                   "(.pt2, compiled C++, slow to build); torchscript: TorchScript (.pt, "
                   "deprecated by torch but widely loadable) (default export)")
    p.add_argument("--out", default=None,
                   help="output file (default: MODEL with suffix .<format>.pt2 / .pt)")
    p.add_argument("--dtype", default=None, choices=["float64", "float32"],
                   help="dtype of the artefact (default: the model's)")
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names (MACE models "
                   "saved by an earlier xnn, files named in its hyperparameters), which can "
                   "run code; only for files you trust")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from pathlib import Path

    import torch

    from xnn._files import check_output_file
    from xnn.models.serialization import export_model, load_model

    src = Path(args.model)
    out = Path(args.out) if args.out else src.with_name(
        f"{src.stem}.{args.format}{SUFFIX[args.format]}")
    check_output_file(out, "--out", example=f"model{SUFFIX[args.format]}")  # before any work
    model = load_model(args.model, trust=args.trust_file)
    if args.dtype is not None:
        model = model.to(getattr(torch, args.dtype))
    path = export_model(model, out, format=args.format)
    print(f"wrote {path} ({args.format}, cutoff {float(model.cutoff)} Å); load with "
          f"{LOADER[args.format].replace('FILE', repr(str(path)))}")
    return 0
