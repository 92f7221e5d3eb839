"""Kernel backends of the equivariant model: ``cueq`` (cuEquivariance) and ``triton`` (fused
edge tensor product, :mod:`xnn.models.triton_tp`) against ``reference``.

In one run, for each size: the same model (same weights) with each backend of
``--backends`` (default ``reference,cueq``), energy + forces (and stress) on rattled FCC Cu;
each backend's time over the reference's (``<backend>_over_reference_time``), and the
largest difference of its energies and forces from the reference's (the speed-up is checked
against the reference in the same run). With ``--mace`` the mace-torch wrapper's
``backend="cueq"`` (mace's own conversion) is measured the same way.

On CUDA the cueq kernels need ``cuequivariance-ops-torch-cu12`` (recorded as ``cue_ops``);
without it cuEquivariance runs its pure-PyTorch path, which is not meant to be fast. The
triton kernels run on CUDA only (on CPU the triton backend is the reference formula).

Usage::

    python -m benchmarks.kernel_backends --device cuda --sizes 1000 10000 --json out.json
    python -m benchmarks.kernel_backends --device cuda --backends reference,triton,cueq \
        --sizes 10000 --json out.json
    python -m benchmarks.kernel_backends --device cpu --sizes 108 --repeat 2     # smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fcc_cu, synchronize, time_fn, write_json  # noqa: E402
from xnn.data import keys as K  # noqa: E402
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.models import build, compute_properties  # noqa: E402
from xnn.neighbors import with_edges  # noqa: E402


def equivariant(channels: int, correlation: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return build("equivariant", species=[29], cutoff=5.0, channels=channels, l_max=2,
                 hidden_l_max=1, correlation=correlation, avg_num_neighbors=40.0,
                 edge_chunk_size=None)


def tiny_mace(channels: int, correlation: int) -> torch.nn.Module:
    import numpy as np
    from e3nn import o3
    from mace import modules

    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    return modules.ScaleShiftMACE(
        r_max=5.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=2, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=1,
        hidden_irreps=o3.Irreps(f"{channels}x0e + {channels}x1o"),
        MLP_irreps=o3.Irreps("16x0e"), gate=torch.nn.functional.silu,
        atomic_energies=np.array([-3.0]), avg_num_neighbors=40.0, atomic_numbers=[29],
        correlation=correlation, atomic_inter_scale=1.0, atomic_inter_shift=0.0)


def graph_of(n_atoms: int, cutoff: float, device: str, dtype) -> AtomicGraph:
    atoms = fcc_cu(n_atoms)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True,
                                dtype=dtype, device=device)
    return with_edges(g, cutoff, backend="torch" if device.startswith("cuda") else "auto")


def compare(models: dict, g: AtomicGraph, device: str, repeat: int) -> dict:
    """Time both backends on ``g``; their energy/force differences and the time ratio."""
    out, props = {}, {}
    for name, model in models.items():
        props[name] = compute_properties(model, g, forces=True, stress=True)
        t = time_fn(lambda m=model: compute_properties(m, g, forces=True, stress=True),
                    repeat=repeat, warmup=2, device=device)
        out[f"{name}_median_s"] = t["median_s"]
        out[f"{name}_atom_steps_per_s"] = g.n_atoms / t["median_s"]
    synchronize(device)
    ref = props["reference"]
    for name, p in props.items():
        if name == "reference":
            continue
        tag = "" if name == "cueq" else f"{name}_"  # the cueq keys of earlier results
        out[f"{tag}max_abs_energy_diff_eV"] = float((p[K.ENERGY] - ref[K.ENERGY]).abs().max())
        out[f"{tag}max_abs_force_diff_eV_per_A"] = float(
            (p[K.FORCES] - ref[K.FORCES]).abs().max())
        out[f"{name}_over_reference_time"] = out[f"{name}_median_s"] / out["reference_median_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--correlation", type=int, default=3)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--backends", default="reference,cueq",
                   help="comma-separated model.backend values (reference is always measured)")
    p.add_argument("--mace", action="store_true", help="also the mace-torch wrapper (cueq)")
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("kernel_backends", args.device)
    dtype = getattr(torch, args.dtype)
    backends = ["reference", *[b for b in args.backends.split(",") if b != "reference"]]
    results = {"device": args.device, "dtype": args.dtype, "channels": args.channels,
               "correlation": args.correlation, "backends": backends,
               "cue_ops": importlib.util.find_spec("cuequivariance_ops_torch") is not None,
               "equivariant": [], "mace": []}
    base = equivariant(args.channels, args.correlation)
    models = {}
    for backend in backends:
        m = equivariant(args.channels, args.correlation)
        m.load_state_dict(base.state_dict())
        m.set_backend(backend)
        models[backend] = m.to(device=args.device, dtype=dtype).eval()
    for n in args.sizes:
        g = graph_of(n, 5.0, args.device, dtype)
        row = {"n_atoms": g.n_atoms, **compare(models, g, args.device, args.repeat)}
        results["equivariant"].append(row)
        print(f"equivariant {row}", flush=True)
    if args.mace:
        module = tiny_mace(args.channels, args.correlation).to(device=args.device, dtype=dtype)
        wrappers = {b: build("mace", model=module, backend=b).to(args.device).eval()
                    for b in ("reference", "cueq")}
        for n in args.sizes:
            g = graph_of(n, 5.0, args.device, dtype)
            row = {"n_atoms": g.n_atoms, **compare(wrappers, g, args.device, args.repeat)}
            results["mace"].append(row)
            print(f"mace {row}", flush=True)
    if args.json:
        write_json(args.json, results, device=args.device)
    return results


if __name__ == "__main__":
    main()
