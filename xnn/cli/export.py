"""``xnn export MODEL.pt --format {export,aoti,torchscript} --out FILE``: a self-contained
artefact that computes energy, forces and stress and loads with torch alone;
``--format lammps-mliap``: the file of ``pair_style mliap unified FILE 0`` (LAMMPS, Kokkos).

The artefact's inputs are plain tensors with the caller's neighbor list (see
:mod:`xnn.models.export` and docs/user-guide.md#xnn-export for the contract).
"""

from __future__ import annotations

import argparse

from xnn.app.export import SUFFIX


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "export",
        help="export a model to a torch-only artefact (energy, forces, stress)",
        description="Write MODEL as a torch.export program, an AOTInductor package or "
        "TorchScript that maps (positions, numbers, cell, pbc, batch, edge_index, shifts) to "
        "(energy, forces, stress) and loads without xnn. The caller provides the full "
        "neighbor list (both directions, distance < the model's cutoff). --format "
        "lammps-mliap writes the object LAMMPS's pair_style mliap unified FILE 0 loads "
        "(docs/lammps-mliap.md).",
    )
    p.add_argument("model", help="model file written by xnn train (model.pt)")
    p.add_argument("--format", default="export", choices=list(SUFFIX),
                   help="export: torch.export program (.pt2); aoti: AOTInductor package "
                   "(.pt2, compiled C++, slow to build); torchscript: TorchScript (.pt, "
                   "deprecated by torch but widely loadable); lammps-mliap: the object of "
                   "pair_style mliap unified FILE 0 (.pt, needs xnn where LAMMPS runs) "
                   "(default export)")
    p.add_argument("--out", default=None,
                   help="output file (default: MODEL with suffix .<format>.pt2 / .pt)")
    p.add_argument("--dtype", default=None, choices=["float64", "float32"],
                   help="dtype of the artefact (default: the model's)")
    p.add_argument("--elements", nargs="+", default=None, metavar="EL",
                   help="lammps-mliap: element of each LAMMPS atom type, as in pair_coeff * * "
                   "Cu O (default: the model's species in order, types 1..n)")
    p.add_argument("--mode", default="spatial", choices=["spatial", "halo", "sync"],
                   help="lammps-mliap: sync: ghosts of one cutoff, features exchanged at the "
                   "model's sync points through LAMMPS; halo: no exchange (a multi-hop model then "
                   "needs ghost neighbours: the printed lines); "
                   "spatial: sync where the model has sync points, else halo "
                   "(default spatial)")
    p.add_argument("--device", default=None,
                   help="lammps-mliap: cpu or cuda (default: where LAMMPS's arrays are, the "
                   "GPU under Kokkos-CUDA)")
    p.add_argument("--trust-file", action="store_true",
                   help="trust MODEL: it may unpickle what it holds or names (MACE models "
                   "saved by an earlier xnn, files named in its hyperparameters), which can "
                   "run code; only for files you trust")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    from xnn.app.export import export_file

    done = export_file(args.model, args.out, args.format, args.dtype, args.trust_file,
                       args.elements, args.mode, args.device)
    print(f"wrote {done.path} ({done.format}, cutoff {done.cutoff} Å); load with "
          f"{done.loader()}")
    return 0
