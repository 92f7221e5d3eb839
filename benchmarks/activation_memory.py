"""Activation memory of a force-training step with and without activation checkpointing.

``python benchmarks/activation_memory.py [--atoms 500] [--device cpu|cuda] [--repeats 3]
[--json PATH]`` (the recorded CPU result: ``--json
benchmarks/results/activation_memory_cpu.json``)

For SchNet, PaiNN and the equivariant model on a periodic FCC Cu cell (fp64 on CPU, fp32 on
CUDA), one energy + force training step (``compute_properties(training=True)``, then the
loss backward), measured with ``torch.autograd.graph.saved_tensors_hooks`` (deterministic,
machine-independent; parameters excluded, each storage counted once while alive):

* ``kept_after_forces``: bytes autograd holds when the second backward starts (the forward
  graph plus the graph of the forces): what force training must keep;
* ``peak_saved``: the peak of live saved bytes over the whole step, backward recomputations
  included;
* ``peak_allocated``: the allocator's peak above the bytes held before the step, every
  tensor included (gradients, transients): on CUDA ``torch.cuda.max_memory_allocated``, on
  CPU the running sum of the CPU allocator's events recorded by ``torch.profiler``
  (``profile_memory=True``), in a separate run;
* ``step_s``: the step time, in a third run without hooks or profiler (CPU times on a shared
  machine are noisy: compare the ratio).

The equivariant model's edge part is checkpointed per chunk of edges
(:func:`xnn.models.equivariant.checkpoint_chunk`), so its peak is one chunk's recomputation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import fcc_cu, write_json  # noqa: E402
from xnn.data import keys as K  # noqa: E402
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.models import build  # noqa: E402
from xnn.models.derivatives import compute_properties  # noqa: E402
from xnn.neighbors import with_edges  # noqa: E402

MODELS = {
    "schnet": dict(num_features=64, num_filters=64, num_interactions=3),
    "painn": dict(num_features=64, num_interactions=3),
    "equivariant": dict(channels=32, num_interactions=2, edge_chunk_size=None),
}
CUTOFF = 5.0


class SavedBytes:
    """Live bytes of tensors saved for backward (unique storages, parameters excluded)."""

    def __init__(self, params):
        self.params = {p.data_ptr() for p in params}
        self.count: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        if t.data_ptr() in self.params or t.device.type == "meta":
            return t
        return _Holder(self, t)

    def unpack(self, h):
        return h.t if isinstance(h, _Holder) else h

    def add(self, t, sign: int) -> None:
        storage = t.untyped_storage()  # views (slices) of one storage count once
        ptr, n = storage.data_ptr(), storage.nbytes()
        c = self.count.get(ptr, 0) + sign
        if c == 0:
            self.count.pop(ptr, None)
            self.live -= n
        else:
            if c == 1 and sign > 0:
                self.live += n
            self.count[ptr] = c
        self.peak = max(self.peak, self.live)


class _Holder:
    def __init__(self, owner: SavedBytes, t):
        self.owner, self.t = owner, t
        owner.add(t, +1)

    def __del__(self):
        self.owner.add(self.t, -1)


def _step(model, graph) -> None:
    p = compute_properties(model, graph, forces=True, stress=False, training=True)
    ((p[K.ENERGY] ** 2).sum() + (p[K.FORCES] ** 2).sum()).backward()


def _cpu_peak_allocated(model, graph) -> int:
    """Peak of the CPU allocator's live bytes during one step, above those before it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, graph)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type().name == "CPU")
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def measure(name: str, checkpointing: bool, graph: AtomicGraph, device, dtype,
            repeats: int = 1) -> dict:
    torch.manual_seed(0)
    model = build(name, species=[29], cutoff=CUTOFF, activation_checkpointing=checkpointing,
                  **MODELS[name]).to(device=device, dtype=dtype).train()
    counter = SavedBytes(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        p = compute_properties(model, graph, forces=True, stress=False, training=True)
        kept = counter.live
        loss = (p[K.ENERGY] ** 2).sum() + (p[K.FORCES] ** 2).sum()
        loss.backward()
    del p, loss
    out = {"kept_after_forces": kept, "peak_saved": counter.peak}
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _step(model, graph)
        torch.cuda.synchronize()
        out["peak_allocated"] = torch.cuda.max_memory_allocated() - base
    else:
        out["peak_allocated"] = _cpu_peak_allocated(model, graph)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        _step(model, graph)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["step_s"] = min(times)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--atoms", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=3, help="timed steps (the fastest counts)")
    ap.add_argument("--json", default=None,
                    help="default: benchmarks/results/<benchmark>_<device>.json")
    args = ap.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("activation_memory", args.device)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    device = torch.device(args.device)
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    atoms = fcc_cu(args.atoms)
    graph = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array,
                                   list(atoms.pbc), dtype=dtype)
    graph = with_edges(graph, CUTOFF).to(device=device)
    results = {}
    for name in args.models.split(","):
        measure(name, False, graph, device, dtype)  # warm-up (lazy initialisation)
        plain = measure(name, False, graph, device, dtype, args.repeats)
        ckpt = measure(name, True, graph, device, dtype, args.repeats)
        ratios = {k: plain[k] / ckpt[k] for k in plain if k != "step_s" and ckpt[k]}
        ratios["step_time"] = ckpt["step_s"] / plain["step_s"]
        results[name] = {"plain": plain, "checkpointing": ckpt, "ratio_plain_over_ckpt": ratios,
                         "hyperparameters": MODELS[name]}
        print(f"{name:12s} kept {plain['kept_after_forces'] / 2**20:8.1f} -> "
              f"{ckpt['kept_after_forces'] / 2**20:8.1f} MiB ({ratios['kept_after_forces']:.2f}x)"
              f"  peak saved {plain['peak_saved'] / 2**20:8.1f} -> "
              f"{ckpt['peak_saved'] / 2**20:8.1f} MiB ({ratios['peak_saved']:.2f}x)"
              + (f"  peak alloc {ratios['peak_allocated']:.2f}x" if "peak_allocated" in ratios
                 else "") + f"  time {plain['step_s']:.2f} -> {ckpt['step_s']:.2f} s "
              f"(x{ratios['step_time']:.2f})", flush=True)
    payload = {"benchmark": "activation_memory", "command": " ".join(["python", *sys.argv]),
               "n_atoms": len(atoms), "dtype": str(dtype),
               "n_edges": int(graph.edge_index.shape[1]), "cutoff": CUTOFF, "models": results}
    if args.json:
        write_json(args.json, payload, args.device)
    return payload


if __name__ == "__main__":
    main()
