"""The fused weighted batched matmul of the edge tensor product (``model.kernel_backend=triton``,
:mod:`xnn.models.triton_tp`) against the reference ``_weighted_bmm`` (``Z = w ⊗ x``, then
``torch.bmm``), in one run.

For each group shape ``(P, A, K)`` of the equivariant model's edge tensor products (l_max 2:
``(3, 1, 9)`` from ``l1 = 0``, ``(4, 3, 9)`` from ``l1 = 1``, with ``--hidden-l-max 2`` also
``(4, 5, 9)``) at ``--edges`` edges (default 479,326: 10,976 Cu atoms at a 5 Å cutoff) and
``--channels`` channels: the median time of the forward and of forward + backward (all three
gradients) of both, their ratios (``triton_over_reference_*``), the peak memory of forward +
backward, and the largest differences relative to the reference's largest entry (output and
each gradient). The whole :class:`~xnn.models.equivariant_ops.EdgeTensorProduct` (coupling
matrices included) is timed the same way. ``--sweep`` also times the kernels alone for
``BLOCK_E x num_warps`` tilings, for each group shape and for the grouped call of each
tensor product with ``l_in >= 1``, and records the fastest (to choose the defaults,
``triton_tp.FWD_TILE``, ``BWD_TILE`` and their warps). No assertion on times: the JSON records them.

On CPU the triton operator is the reference formula (smoke runs only).

Usage::

    python -m benchmarks.triton_tp --device cuda --dtype float32 --json triton_tp_h200.json
    python -m benchmarks.triton_tp --device cuda --sweep --json triton_tp_sweep.json
    python -m benchmarks.triton_tp --device cpu --edges 2000 --repeat 2      # smoke run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import peak_memory, reset_peak_memory, time_fn, write_json  # noqa: E402
from xnn.models import triton_tp  # noqa: E402
from xnn.models.equivariant_ops import EdgeTensorProduct, _weighted_bmm  # noqa: E402


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _fwd_bwd(fn, inputs, g):
    out = fn(*inputs)
    return torch.autograd.grad(out, inputs, g)


def compare_op(shape, n_edges: int, channels: int, device, dtype, repeat: int) -> dict:
    """One group shape: both implementations, forward and forward + backward."""
    p, a, k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    w_all = torch.randn(n_edges, channels, p + 1, device=device, dtype=dtype, generator=gen)
    x_all = torch.randn(n_edges, channels, a + 1, device=device, dtype=dtype, generator=gen)
    w, x = w_all[:, :, :p], x_all[:, :, 1:]  # strided, as the model passes them
    m = torch.randn(n_edges, p * a, k, device=device, dtype=dtype, generator=gen)
    g = torch.randn(n_edges, channels, k, device=device, dtype=dtype, generator=gen)
    inputs = [t.requires_grad_() for t in (w, x, m)]
    row = {"P": p, "A": a, "K": k, "n_edges": n_edges, "channels": channels}
    results = {}
    for name, fn in (("reference", _weighted_bmm), ("triton", triton_tp.weighted_bmm)):
        with torch.no_grad():
            row[f"{name}_forward_s"] = time_fn(lambda f=fn: f(w, x, m), repeat=repeat,
                                               warmup=2, device=device)["median_s"]
        row[f"{name}_forward_backward_s"] = time_fn(
            lambda f=fn: _fwd_bwd(f, inputs, g), repeat=repeat, warmup=2,
            device=device)["median_s"]
        reset_peak_memory(device)
        results[name] = (fn(*inputs).detach(), *_fwd_bwd(fn, inputs, g))
        row[f"{name}_peak_memory_bytes"] = peak_memory(device)
    for part in ("forward", "forward_backward"):
        row[f"triton_over_reference_{part}"] = (row[f"triton_{part}_s"]
                                                / row[f"reference_{part}_s"])
    for label, got, want in zip(("out", "grad_w", "grad_x", "grad_m"), results["triton"],
                                results["reference"]):
        row[f"max_rel_diff_{label}"] = _rel_diff(got, want)
    return row


def _tp_inputs(tp: EdgeTensorProduct, n_rows: int, n_edges: int, channels: int, gen, device,
               dtype) -> list[torch.Tensor]:
    """Random leaves ``x [n_rows, C, (l_in+1)^2]``, ``y [n_edges, 9]``, ``w [n_edges, C,
    num_paths]`` for ``tp`` (in this order from ``gen``)."""
    shapes = ((n_rows, channels, (tp.l_in + 1) ** 2), (n_edges, 9),
              (n_edges, channels, tp.num_paths))
    return [torch.randn(s, device=device, dtype=dtype, generator=gen, requires_grad=True)
            for s in shapes]


def compare_tensor_product(l_in: int, n_edges: int, channels: int, device, dtype,
                           repeat: int) -> dict:
    """The whole edge tensor product ``(l_in, 2, 2)``, forward + backward, both backends."""
    tp = EdgeTensorProduct(l_in, 2, 2).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    x, y, w = _tp_inputs(tp, n_edges, n_edges, channels, gen, device, dtype)
    g = torch.randn(n_edges, channels, 9, device=device, dtype=dtype, generator=gen)
    row, results = {"case": f"edge_tensor_product_l_in_{l_in}", "n_edges": n_edges}, {}
    for backend in ("reference", "triton"):
        tp.set_backend(backend)
        row[f"{backend}_forward_backward_s"] = time_fn(
            lambda: _fwd_bwd(tp, (x, y, w), g), repeat=repeat, warmup=2,
            device=device)["median_s"]
        results[backend] = (tp(x, y, w).detach(), *_fwd_bwd(tp, (x, y, w), g))
    row["triton_over_reference_forward_backward"] = (row["triton_forward_backward_s"]
                                                     / row["reference_forward_backward_s"])
    for label, got, want in zip(("out", "grad_x", "grad_y", "grad_w"), results["triton"],
                                results["reference"]):
        row[f"max_rel_diff_{label}"] = _rel_diff(got, want)
    return row


def compare_conv(l_in: int, n_edges: int, n_atoms: int, channels: int, device, dtype,
                 repeat: int) -> dict:
    """The convolution of an interaction, ``scatter(tp(h[sender], y, w), receiver)``, forward
    + backward: the reference backend (gather, product, ``index_add``), triton's product
    between the same gather and ``index_add``, and triton's fused kernel (``tp_conv``)."""
    tp = EdgeTensorProduct(l_in, 2, 2).to(device)
    gen = torch.Generator(device=device).manual_seed(2)
    h, y, w = _tp_inputs(tp, n_atoms, n_edges, channels, gen, device, dtype)
    receiver = torch.randint(0, n_atoms, (n_edges,), device=device, generator=gen).sort().values
    sender = torch.randint(0, n_atoms, (n_edges,), device=device, generator=gen)
    g = torch.randn(n_atoms, channels, 9, device=device, dtype=dtype, generator=gen)

    def unfused(h, y, w):
        m = tp(h.index_select(0, sender), y, w)
        return m.new_zeros((n_atoms, *m.shape[1:])).index_add(0, receiver, m)

    row, results = {"case": f"convolution_l_in_{l_in}", "n_edges": n_edges,
                    "n_atoms": n_atoms}, {}
    for name, backend, fn in (("reference", "reference", unfused),
                              ("triton_unfused", "triton", unfused),
                              ("triton_fused", "triton",
                               lambda h, y, w: tp.conv(h, y, w, sender, receiver, n_atoms))):
        tp.set_backend(backend)
        row[f"{name}_forward_backward_s"] = time_fn(
            lambda f=fn: _fwd_bwd(f, (h, y, w), g), repeat=repeat, warmup=2,
            device=device)["median_s"]
        reset_peak_memory(device)
        results[name] = (fn(h, y, w).detach(), *_fwd_bwd(fn, (h, y, w), g))
        row[f"{name}_peak_memory_bytes"] = peak_memory(device)
    for name in ("triton_unfused", "triton_fused"):
        row[f"{name}_over_reference"] = (row[f"{name}_forward_backward_s"]
                                         / row["reference_forward_backward_s"])
        for label, got, want in zip(("out", "grad_h", "grad_y", "grad_w"), results[name],
                                    results["reference"]):
            row[f"{name}_max_rel_diff_{label}"] = _rel_diff(got, want)
    return row


def sweep(groups: list[int], n_edges: int, channels: int, device, dtype, repeat: int) -> dict:
    """The kernels alone (no autograd) for each ``BLOCK_E x num_warps``, for the flat
    ``groups`` of one call (one group, or all of an edge tensor product's); the fastest."""
    k, grp = 9, [groups[i : i + 3] for i in range(0, len(groups), 3)]
    n_paths, rows = sum(q[0] for q in grp), sum(q[0] * q[1] for q in grp)
    dx = max(q[1] + q[2] for q in grp)
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n_edges, channels, n_paths, device=device, dtype=dtype, generator=gen)
    x = torch.randn(n_edges, channels, dx, device=device, dtype=dtype, generator=gen)
    m = torch.randn(n_edges, rows, k, device=device, dtype=dtype, generator=gen)
    g = torch.randn(n_edges, channels, k, device=device, dtype=dtype, generator=gen)
    table = []
    for block_e in (1, 2, 4, 8, 16):
        for num_warps in (1, 2, 4):
            try:
                t_f = time_fn(lambda b=block_e, n=num_warps: triton_tp.forward(
                    w, x, m, groups, block_e=b, num_warps=n), repeat=repeat, warmup=2,
                    device=device)
                t_b = time_fn(lambda b=block_e, n=num_warps: triton_tp.backward(
                    g, w, x, m, groups, block_e=b, num_warps=n), repeat=repeat, warmup=2,
                    device=device)
            except Exception as e:  # e.g. out of resources for a large tile
                table.append({"block_e": block_e, "num_warps": num_warps,
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
                continue
            table.append({"block_e": block_e, "num_warps": num_warps,
                          "forward_s": t_f["median_s"], "backward_s": t_b["median_s"]})
    ok = [r for r in table if "error" not in r]
    best = {part: min(ok, key=lambda r, q=part: r[f"{q}_s"]) for part in ("forward", "backward")}
    return {"groups": groups, "n_edges": n_edges, "channels": channels,
            "default_tiling": {
                "forward": [*triton_tp._tiling(n_edges, channels, False, None,
                                               triton_tp.FWD_TILE)[:2], triton_tp.FWD_WARPS],
                "backward": [*triton_tp._tiling(n_edges, channels, False, None,
                                                triton_tp.BWD_TILE)[:2], triton_tp.BWD_WARPS]},
            "tilings": table, "best": best}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--edges", type=int, default=479326)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--atoms", type=int, default=10976, help="nodes of the convolution")
    p.add_argument("--hidden-l-max", type=int, default=1, choices=(0, 1, 2))
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time BLOCK_E x num_warps")
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("triton_tp", args.device)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    shapes = sorted({(p1 - p0, 2 * l1 + 1, 9) for l_in in range(args.hidden_l_max + 1)
                     for l1, p0, p1 in EdgeTensorProduct(l_in, 2, 2).groups})
    results = {"benchmark": "triton_tp", "device": args.device, "dtype": args.dtype,
               "forward_tiling": [triton_tp.FWD_TILE, triton_tp.FWD_WARPS],
               "backward_tiling": [triton_tp.BWD_TILE, triton_tp.BWD_WARPS],
               "ops": [], "tensor_products": [], "convolutions": [], "sweeps": []}
    for shape in shapes:
        row = compare_op(shape, args.edges, args.channels, device, dtype, args.repeat)
        results["ops"].append(row)
        print(row, flush=True)
    for l_in in range(args.hidden_l_max + 1):
        row = compare_tensor_product(l_in, args.edges, args.channels, device, dtype,
                                     args.repeat)
        results["tensor_products"].append(row)
        print(row, flush=True)
    for l_in in range(args.hidden_l_max + 1):
        row = compare_conv(l_in, args.edges, args.atoms, args.channels, device, dtype,
                           args.repeat)
        results["convolutions"].append(row)
        print(row, flush=True)
    if args.sweep and device.type == "cuda":
        calls = [[p_, a_, 0] for p_, a_, _ in shapes] + [  # then whole tensor products
            [v for l1, p0, p1 in EdgeTensorProduct(l_in, 2, 2).groups
             for v in (p1 - p0, 2 * l1 + 1, l1 * l1)] for l_in in range(1, args.hidden_l_max + 1)]
        for groups in calls:
            row = sweep(groups, args.edges, args.channels, device, dtype, args.repeat)
            results["sweeps"].append(row)
            print({"groups": groups, "best": row["best"], "default": row["default_tiling"]},
                  flush=True)
    if args.json:
        write_json(args.json, results, device=args.device)
    return results


if __name__ == "__main__":
    main()
