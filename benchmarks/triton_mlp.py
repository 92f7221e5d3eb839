"""MACE's radial MLPs through the fused Triton kernel (:mod:`xnn.models.triton_mlp`) against
mace-torch's e3nn layers, as the compiled MACE MD step runs them (``_mace_pairs.RADIAL``).

The networks are the ``conv_tp_weights`` of both interaction blocks of the peers' MACE
(``benchmarks/peers_frameworks.base_model("mace")``: the random-weight ScaleShiftMACE of
``benchmarks/models.py``, 128x0e+128x1o, l_max 3, 2 interactions, r_c 6 Å; e3nn
``FullyConnectedNet`` [8, 64, 64, 64, N], N = 512 and 1280; without mace-torch, e3nn
networks of those shapes with their own weights), cast to float32 with frozen weights
(inference: no weight gradients). The rows are the edge pairs of rattled FCC Cu at
6 Å (``--atoms`` 10000: 10,976 atoms, 428,070 pairs, the rows of the paired step's radial
MLPs; ``--rows`` resamples them), ``x`` = Bessel basis times polynomial cutoff of each
length (MACE's ``edge_feats``) and ``s`` = the cutoff.

Variants, each on the same inputs:

* ``torch``: ``mlp(x) * s[:, None]`` with the e3nn module in fp32 (cuBLAS fp32 GEMMs), the
  gradients in ``x`` and ``s`` by autograd (mace-torch's code);
* ``ieee`` / ``tf32x3``: ``_mace_pairs.fused_layers`` + ``triton_mlp.pack`` (done once,
  outside the timings; ``pack_s`` is its own time: the step does it per call) +
  ``triton_mlp.radial_mlp(..., precision)``.

``--scale``: ``on`` times ``y = mlp(x) * s`` and its gradients in ``x`` and ``s``; ``off``
``y = mlp(x)`` and its gradient in ``x`` (the benchmarks' MACE builds its radial embedding
with ``apply_cutoff=True``: the cutoff is already in ``edge_feats`` and the interaction
blocks get ``cutoff=None``); ``both`` (default) both. Per block, scale mode and variant:
the median times of the forward (``torch.no_grad``) and of forward + backward
(``torch.autograd.grad(y, (x, s), g)`` with a fixed random ``g``: the gradient of
``(y * g).sum()``), CUDA-synchronised, their speed-ups over ``torch`` in the same run
(``torch time / variant time``), the peak memory of forward + backward above the inputs,
and the largest errors of ``y``, ``dx``, ``ds`` against the fp64 evaluation of the torch
path on the same (fp32) inputs and weights, relative to the largest magnitude of each
(``rel_err_*``): the tf32x3 error against plain fp32's. ``fused_fp64`` checks the kernels in
float64 against the same reference (errors of fp64's order: the formula is right).

``--sweep`` times the kernels alone (``triton_mlp.forward`` / ``backward``, no autograd) on
the block with the largest N for (BLOCK_P, BLOCK_N, NUM_WARPS, NUM_STAGES) in
{64, 128, 32}² x {4, 8} x {3, 2, 4}, forward (the first scale mode) and backward (each) as
``--sweep-parts`` selects, per
``--sweep-precisions`` (tf32x3 first), by setting the module
constants (restored after), under ``--sweep-budget-s`` (the configurations not reached are
left out), and records the fastest and its gain over the defaults. ``--compile`` adds each variant's
forward under ``torch.compile(fullgraph=True)`` (the backward through AOTAutograd).

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is set here; the
compiled variants run the torch formula instead): slow, smoke runs only (``--quick``: 200
rows, a few repeats; the sweep tries two tilings; times mean nothing).

Usage::

    python benchmarks/triton_mlp.py --device cuda --sweep --json triton_mlp_h200.json
    python benchmarks/triton_mlp.py --device cpu --quick --json /tmp/triton_mlp_cpu.json
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    fcc_cu,
    peak_memory,
    reset_peak_memory,
    time_fn,
    write_json,
)
from xnn.models import triton_mlp  # noqa: E402
from xnn.models.external import _mace_pairs  # noqa: E402

CUTOFF = 6.0
VARIANTS = ("torch", "ieee", "tf32x3")
SWEEP = [(bp, bn, w, st) for bp in (64, 128, 32) for bn in (64, 128, 32) for w in (4, 8)
         for st in (3, 2, 4)]
QUICK_SWEEP = [(64, 32, 4, 3), (64, 64, 4, 2)]
_CONSTANTS = ("BLOCK_P", "BLOCK_N", "NUM_WARPS", "NUM_STAGES", "BWD_BLOCK_P", "BWD_BLOCK_N",
              "BWD_NUM_WARPS", "BWD_NUM_STAGES")


# --------------------------------------------------------------------------- inputs
def pair_lengths(n_atoms: int, rows: int | None, seed: int = 0) -> tuple[np.ndarray, dict]:
    """Lengths of the edge pairs (each unordered pair once) of rattled FCC Cu of about
    ``n_atoms`` atoms within :data:`CUTOFF`; ``rows``: that many drawn from them (without
    replacement where there are enough)."""
    from ase.neighborlist import neighbor_list

    atoms = fcc_cu(n_atoms, rattle=0.05, seed=0)
    i, j, d, shift = neighbor_list("ijdS", atoms, CUTOFF)
    # one of each pair: i < j, or a self image with its shift lexicographically positive
    pos = (shift[:, 0] > 0) | ((shift[:, 0] == 0) & (
        (shift[:, 1] > 0) | ((shift[:, 1] == 0) & (shift[:, 2] > 0))))
    d = d[(i < j) | ((i == j) & pos)]
    info = {"cell_atoms": len(atoms), "cell_pairs": int(d.size),
            "pairs_per_atom": d.size / len(atoms)}
    if rows is not None:
        rng = np.random.default_rng(seed)
        d = rng.choice(d, size=rows, replace=rows > d.size)
    return d, info


def radial_networks() -> tuple[list[torch.nn.Module], object, str]:
    """``(the blocks' conv_tp_weights (float64), the radial embedding or None, source)``:
    the peers' MACE, or without mace-torch e3nn networks of the same shapes (own random
    weights) and :func:`_embedding`'s basis."""
    try:
        from benchmarks.peers_frameworks import base_model

        model = base_model("mace")  # float64, seed 0: the peers' weights
    except ImportError as e:
        from e3nn.nn import FullyConnectedNet

        torch.manual_seed(0)
        nets = [FullyConnectedNet([8, 64, 64, 64, n], torch.nn.functional.silu).double()
                for n in (512, 1280)]
        return nets, None, f"e3nn FullyConnectedNet, own weights (mace-torch: {e})"
    return ([b.conv_tp_weights for b in model.interactions], model.radial_embedding,
            "peers_frameworks.base_model('mace')")


def _embedding(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MACE's ``BesselBasis(6 Å, 8)`` and ``PolynomialCutoff(6 Å, p=5)`` of ``r [P, 1]``."""
    f32 = torch.float32  # mace-torch's buffers: made in the default dtype, then cast
    w = (np.pi / CUTOFF * torch.linspace(1.0, 8.0, 8, dtype=f32)).to(r.dtype)
    pre = torch.tensor((2.0 / CUTOFF) ** 0.5, dtype=f32).to(r.dtype)
    bessel = pre * torch.sin(w * r) / r
    u, p = r / CUTOFF, 5.0
    cut = (1.0 - (p + 1) * (p + 2) / 2 * u**p + p * (p + 2) * u ** (p + 1)
           - p * (p + 1) / 2 * u ** (p + 2)) * (u < 1.0)
    return bessel, cut


def mace_inputs(emb, lengths: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [P, 8], s [P, 1])`` in float32: MACE's ``edge_feats`` (Bessel basis times
    polynomial cutoff) and the cutoff, computed in float64 by the model's own blocks (or
    :func:`_embedding` where ``emb`` is None)."""
    r = torch.as_tensor(lengths, dtype=torch.float64).reshape(-1, 1)
    with torch.no_grad():
        if emb is None:
            bessel, cut = _embedding(r)
        else:
            bessel, cut = emb.bessel_fn.double()(r), emb.cutoff_fn.double()(r)
        x = bessel * cut
    return x.float().to(device), cut.float().to(device)


# --------------------------------------------------------------------------- the variants
def torch_fn(mlp):
    def f(x, s):
        y = mlp(x)
        return y if s is None else y * s

    return f


def fused_fn(packed, precision: str):
    wh, bh, wo, bo = packed

    def f(x, s):
        return triton_mlp.radial_mlp(x, wh, wo, bh, bo, None if s is None else s.reshape(-1),
                                     precision=precision)

    return f


def packed_weights(mlp) -> tuple:
    layers = _mace_pairs.fused_layers(mlp)
    if layers is None:
        raise RuntimeError("fused_layers refused the radial network (weights requiring "
                           "gradients, or not an e3nn FullyConnectedNet with SiLU)")
    return triton_mlp.pack(*layers)


def fwd_bwd(f, x, s, g):
    y = f(x, s)
    return torch.autograd.grad(y, (x,) if s is None else (x, s), g)


def evaluate(f, x, s, g) -> tuple[torch.Tensor, ...]:
    """``(y, dx[, ds])`` detached, ``ds`` flattened."""
    y = f(x, s)
    grads = torch.autograd.grad(y, (x,) if s is None else (x, s), g)
    return (y.detach(), *(t.reshape(t.shape[0], -1) if i == 0 else t.reshape(-1)
                          for i, t in enumerate(grads)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` (in float64)."""
    b = b.double()
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-300))


def errors(got, ref) -> dict:
    return {f"rel_err_{k}": rel_err(a, b) for k, a, b in zip(("y", "dx", "ds"), got, ref)}


def measure(f, x, s, g, device, repeat: int, warmup: int) -> dict:
    with torch.no_grad():
        fwd = time_fn(lambda: f(x, s), repeat=repeat, warmup=warmup, device=device)
    fb = time_fn(lambda: fwd_bwd(f, x, s, g), repeat=repeat, warmup=warmup, device=device)
    row = {"forward_s": fwd["median_s"], "forward_backward_s": fb["median_s"],
           "forward_min_s": fwd["min_s"], "forward_backward_min_s": fb["min_s"]}
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        reset_peak_memory(device)
        fwd_bwd(f, x, s, g)
        row["peak_bytes_forward_backward"] = peak_memory(device) - base
    return row


def run_block(index: int, mlp32, x, s_col, device, args) -> dict:
    """Every variant (and scale mode) on one block's radial network."""
    n_out = int(mlp32.hs[-1])
    gen = torch.Generator(device=device).manual_seed(100 + index)
    g = torch.randn(x.shape[0], n_out, device=device, generator=gen)
    mlp64 = copy.deepcopy(mlp32).double()
    packed = packed_weights(mlp32)
    entry = {"block": index, "layers": [int(h) for h in mlp32.hs], "rows": x.shape[0],
             "N": n_out, "H": int(packed[0].shape[1]), "pack_s": time_fn(
                 lambda: packed_weights(mlp32), repeat=args.repeat, warmup=args.warmup,
                 device=device)["median_s"], "scales": {}}
    fns = {"torch": torch_fn(mlp32), "ieee": fused_fn(packed, "ieee"),
           "tf32x3": fused_fn(packed, "tf32x3")}
    if args.compile:
        import torch._dynamo.config as dynamo_config

        # one code object per variant kind, recompiled per block, scale mode and grad mode
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        for name in VARIANTS:
            fns[f"{name}_compiled"] = torch.compile(fns[name], fullgraph=True, dynamic=False)
    for scale in args.scales:
        xg = x.detach().clone().requires_grad_(True)
        sg = s_col.detach().clone().requires_grad_(True) if scale == "on" else None
        x64 = xg.detach().double().requires_grad_(True)
        s64 = None if sg is None else sg.detach().double().requires_grad_(True)
        ref = evaluate(torch_fn(mlp64), x64, s64, g.double())
        rows = {}
        try:
            fused64 = fused_fn(packed_weights(mlp64), "ieee")
            rows["fused_fp64"] = errors(evaluate(fused64, x64, s64, g.double()), ref)
        except Exception as e:
            rows["fused_fp64"] = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
        del x64, s64
        for name, f in fns.items():
            try:
                row = measure(f, xg, sg, g, device, args.repeat, args.warmup)
                row.update(errors(evaluate(f, xg, sg, g), ref))
            except Exception as e:  # e.g. a compile failure: record, go on
                row = {"error": f"{type(e).__name__}: {str(e).strip()[:300]}"}
            rows[name] = row
        del ref
        for name, row in rows.items():
            base = rows["torch"]
            for part in ("forward", "forward_backward"):
                if f"{part}_s" in row and f"{part}_s" in base and name != "torch":
                    row[f"speedup_vs_torch_{part}"] = base[f"{part}_s"] / row[f"{part}_s"]
                tc = rows.get("torch_compiled", {})
                if name.endswith("_compiled") and f"{part}_s" in row and f"{part}_s" in tc \
                        and name != "torch_compiled":
                    row[f"speedup_vs_torch_compiled_{part}"] = tc[f"{part}_s"] / row[f"{part}_s"]
        entry["scales"][scale] = rows
        _print_rows(index, n_out, scale, rows)
    return entry


def _print_rows(index, n_out, scale, rows) -> None:
    print(f"block {index} (N={n_out}), scale {scale}:")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:18s} {r['error']}")
            continue
        t = "" if "forward_s" not in r else (
            f"fwd {r['forward_s'] * 1e3:8.3f} ms  fwd+bwd {r['forward_backward_s'] * 1e3:8.3f} ms"
            + (f"  (x{r['speedup_vs_torch_forward']:.2f}, "
               f"x{r['speedup_vs_torch_forward_backward']:.2f})"
               if "speedup_vs_torch_forward" in r else ""))
        err = "  ".join(f"{k[8:]} {v:.2e}" for k, v in r.items() if k.startswith("rel_err"))
        print(f"  {name:18s} {t}  rel err {err}", flush=True)


# --------------------------------------------------------------------------- tiling sweep
class _OverBudget(Exception):
    """``--sweep-budget-s`` ran out."""


def sweep(mlp32, x, s_col, device, args, save=None) -> dict:
    """The kernels alone for each (BLOCK_P, BLOCK_N, NUM_WARPS): forward (the first scale
    mode), backward (each scale mode), tf32x3 first, then ieee. ``save(out)`` after each
    configuration (a run cut short by a time limit keeps its rows)."""
    configs = QUICK_SWEEP if args.quick else SWEEP
    wh, bh, wo, bo = packed_weights(mlp32)
    n_out = int(wo.shape[1])
    gen = torch.Generator(device=device).manual_seed(7)
    g = torch.randn(x.shape[0], n_out, device=device, generator=gen)
    s = s_col.reshape(-1)
    saved = {k: getattr(triton_mlp, k) for k in _CONSTANTS}
    out = {"N": n_out, "rows": x.shape[0], "defaults": saved, "configs": [], "best": {}}
    if device.type != "cuda":
        out["note"] = "Triton's interpreter: BLOCK_P and warps are ignored, times meaningless"
    parts = [("forward", args.scales[0])] * ("forward" in args.sweep_parts)
    parts += [("backward", sc) for sc in args.scales] * ("backward" in args.sweep_parts)
    t0 = time.perf_counter()
    try:
        for precision in args.sweep_precisions:
            for part, scale in parts:
                sp = s if scale == "on" else None
                for bp, bn, w, st in configs:
                    if time.perf_counter() - t0 > args.sweep_budget_s:
                        out["note_budget"] = f"cut short by --sweep-budget-s {args.sweep_budget_s}"
                        raise _OverBudget
                    for k, v in saved.items():
                        setattr(triton_mlp, k, v)
                    if part == "forward":
                        triton_mlp.BLOCK_P, triton_mlp.BLOCK_N, triton_mlp.NUM_WARPS = bp, bn, w
                        triton_mlp.NUM_STAGES = st

                        def call(sp=sp, precision=precision):
                            return triton_mlp.forward(x, wh, bh, wo, bo, sp, precision)
                    else:
                        triton_mlp.BWD_BLOCK_P, triton_mlp.BWD_BLOCK_N = bp, bn
                        triton_mlp.BWD_NUM_WARPS, triton_mlp.BWD_NUM_STAGES = w, st

                        def call(sp=sp, precision=precision):
                            return triton_mlp.backward(g, x, wh, bh, wo, bo, sp, precision,
                                                       sp is not None)
                    row = {"precision": precision, "part": part, "scale": scale,
                           "block_p": bp, "block_n": bn, "num_warps": w, "num_stages": st}
                    try:
                        row["time_s"] = time_fn(call, repeat=args.repeat, warmup=args.warmup,
                                                device=device)["median_s"]
                    except Exception as e:  # e.g. out of resources for a large tile
                        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
                    out["configs"].append(row)
                    print({k: v for k, v in row.items()}, flush=True)
                    if save is not None:
                        save(out)
    except _OverBudget:
        pass
    finally:
        for k, v in saved.items():
            setattr(triton_mlp, k, v)
    for row in out["configs"]:
        if "time_s" not in row:
            continue
        key = f"{row['precision']}_{row['part']}_scale_{row['scale']}"
        best = out["best"].get(key)
        if best is None or row["time_s"] < best["time_s"]:
            out["best"][key] = {k: row[k] for k in ("block_p", "block_n", "num_warps",
                                                     "num_stages", "time_s")}
    for key, best in out["best"].items():
        prec, part = key.split("_")[:2]
        default = next((r for r in out["configs"] if f"{r['precision']}_{r['part']}_scale_"
                        f"{r['scale']}" == key and "time_s" in r and _is_default(r, saved)),
                       None)
        if default is not None:
            best["default_time_s"] = default["time_s"]
            best["speedup_over_default"] = default["time_s"] / best["time_s"]
    print("best:", out["best"], flush=True)
    return out


def _is_default(row: dict, saved: dict) -> bool:
    p = "" if row["part"] == "forward" else "BWD_"
    return (row["block_p"], row["block_n"], row["num_warps"], row["num_stages"]) == (
        saved[f"{p}BLOCK_P"], saved[f"{p}BLOCK_N"], saved[f"{p}NUM_WARPS"],
        saved[f"{p}NUM_STAGES"])


# --------------------------------------------------------------------------- driver
def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("torch", "triton", "e3nn", "mace-torch"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--atoms", type=int, default=None,
                   help="FCC Cu cell whose edge pairs are the rows (default 10000: 10,976 "
                        "atoms; --quick 108)")
    p.add_argument("--rows", type=int, default=None, help="rows P drawn from the cell's "
                   "pair lengths (default: all of them, 428,070 at 10,976 atoms; quick 200)")
    p.add_argument("--scale", default="both", choices=("both", "on", "off"),
                   help="with the cutoff factor s (and dL/ds), without, or both")
    p.add_argument("--blocks", default="all", help="interaction blocks, e.g. '1' (default all)")
    p.add_argument("--repeat", type=int, default=None, help="timed calls (default 20; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls (default 3; quick 1)")
    p.add_argument("--sweep", action="store_true",
                   help="also time (BLOCK_P, BLOCK_N, NUM_WARPS, NUM_STAGES) tilings of the "
                        "kernels")
    p.add_argument("--sweep-precisions", default="tf32x3,ieee",
                   help="precisions the sweep times, in order")
    p.add_argument("--sweep-parts", default="forward,backward",
                   help="kernels the sweep times, of forward,backward")
    p.add_argument("--sweep-budget-s", type=float, default=90.0,
                   help="stop the sweep after this many seconds")
    p.add_argument("--compile", action="store_true",
                   help="also each variant's forward under torch.compile(fullgraph=True)")
    p.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("triton_mlp_sweep" if args.sweep else "triton_mlp", args.device)
    args.sweep_precisions = [x for x in args.sweep_precisions.split(",") if x]
    args.sweep_parts = [x for x in args.sweep_parts.split(",") if x]
    if not set(args.sweep_parts) <= {"forward", "backward"}:
        p.error(f"--sweep-parts: forward and/or backward, not {args.sweep_parts}")
    device = torch.device(args.device)
    if args.quick:
        args.atoms = args.atoms or 108
        args.rows = args.rows or 200
    args.atoms = args.atoms or 10_000
    args.repeat = args.repeat or (2 if args.quick else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    # off first: the step of the benchmarks' MACE (apply_cutoff: no s), first in the sweep
    args.scales = ["off", "on"] if args.scale == "both" else [args.scale]
    if device.type == "cpu":  # the kernels in Triton's interpreter (read at each call)
        os.environ["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    nets, emb, source = radial_networks()
    lengths, cell = pair_lengths(args.atoms, args.rows)
    x, s_col = mace_inputs(emb, lengths, device)
    setup_s = time.perf_counter() - t0
    mlps = [copy.deepcopy(n).float().to(device).requires_grad_(False) for n in nets]
    which = range(len(mlps)) if args.blocks == "all" else [int(b) for b in args.blocks.split(",")]
    results = {
        "benchmark": "triton_mlp", "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpreter": device.type != "cuda", "quick": args.quick, "versions": _versions(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "networks": source, "rows": int(x.shape[0]), "row_source": {"atoms": args.atoms, **cell,
                                                "resampled": args.rows is not None},
        "cutoff_A": CUTOFF, "repeat": args.repeat, "warmup": args.warmup,
        "tiling": {k: getattr(triton_mlp, k) for k in _CONSTANTS}, "setup_s": setup_s,
        "timing": "median of --repeat calls after --warmup, CUDA-synchronised; forward under "
                  "no_grad; forward_backward: autograd.grad(y, (x, s), g)",
        "errors": "max |v - ref| / max |ref| per output, ref: the torch path in float64 on "
                  "the same float32 inputs and weights",
        "blocks": [], "sweep": None,
    }
    print(f"rows {results['rows']} ({cell}), device {results['device_name']}, "
          f"setup {setup_s:.1f} s", flush=True)
    for i in which:
        results["blocks"].append(run_block(i, mlps[i], x, s_col, device, args))
        if args.json:
            write_json(args.json, results, device=str(device))
    if args.sweep:
        widest = max(which, key=lambda i: int(mlps[i].hs[-1]))

        def save(part: dict) -> None:  # after each tiling: a run cut short keeps its rows
            results["sweep"] = {"block": widest, **part}
            write_json(args.json, results, device=str(device))

        results["sweep"] = {"block": widest, **sweep(mlps[widest], x, s_col, device, args,
                                                      save if args.json else None)}
    if args.json:
        write_json(args.json, results, device=str(device))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
