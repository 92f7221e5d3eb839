"""Context-parallel training: peak memory per rank and step time of one large structure.

One training step (energy + forces + stress loss, double backward, SGD) of one FCC copper
cell of about ``--atoms`` atoms, decomposed over ``dd`` ranks of one dd group
(:func:`xnn.distributed.entries.parallelize_train` with ``dp=1``; ``dd=1`` is the
one-process path). Every point runs on freshly spawned ranks (gloo on CPU; one GPU per rank
with ``--device cuda``), with and without activation checkpointing (``--checkpointing``:
``activation_checkpointing=True`` passed to the model if its builder accepts it), the same
structure and model for every row::

    python benchmarks/cp_training.py --json /tmp/cp.json --atoms 20000 --dd 1,2,4
    python benchmarks/cp_training.py --json /tmp/cp.json --atoms 2000 --checkpointing

Per point: per-rank peak memory of the step over the memory before it (CPU: resident set
size, high-water mark reset through ``/proc/self/clear_refs`` and also sampled every 2 ms;
CUDA: ``torch.cuda.max_memory_allocated`` after a reset), the slowest rank's median step
time, owned and ghost atoms per rank. The JSON's ``ratios`` give each row's peak memory
per rank and step time over the ``dd = 1`` row of the same checkpointing setting, and the
checkpointing rows over the plain ones. Goals (issue 17, reported, not asserted): peak per
rank at dd = 4 <= 0.32 x dd = 1; checkpointing >= 2.5x less activation memory for the
equivariant model.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss(field: str = "VmRSS") -> int:
    """Bytes of ``field`` (VmRSS, VmHWM) of this process, from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class PeakMemory:
    """Peak memory of a block over the memory before it (bytes)."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = self.sampled = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, _rss())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return False
        self._stop.set()
        self._thread.join()
        top = max(self.sampled, _rss("VmHWM") if self.hwm else 0)
        self.peak = top - self.base
        return False


def structure(n_atoms: int, seed: int = 0):
    """A rattled FCC copper cell of about ``n_atoms`` atoms with random labels."""
    import numpy as np
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph

    reps = max(1, round((n_atoms / 4) ** (1 / 3)))
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((reps, reps, reps))
    atoms.rattle(0.05, seed=seed)
    rng = np.random.default_rng(seed)
    n = len(atoms)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    return g.replace(energy=torch.tensor([-3.5 * n]), forces=torch.tensor(
        rng.normal(0, 0.1, (n, 3))), stress=torch.zeros(1, 3, 3))


def supports_checkpointing(name: str) -> bool:
    """Whether the model's constructor takes ``activation_checkpointing``."""
    from xnn.models import model_class

    return "activation_checkpointing" in inspect.signature(model_class(name)).parameters


def build_model(args, checkpointing: bool):
    """The model (seeded: the same weights in every row); ``None`` when checkpointing is
    asked for and the model does not support it."""
    from xnn.models import build

    hp = json.loads(args.hparams) if args.hparams else {}
    if checkpointing:
        if not supports_checkpointing(args.model):
            return None
        hp["activation_checkpointing"] = True
    torch.manual_seed(0)
    return build(args.model, species=[29], cutoff=args.cutoff, **hp)


def run_point(rank: int, world: int, args, checkpointing: bool) -> dict:
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager
    from xnn.neighbors import with_edges
    from xnn.training.losses import TermSpec
    from xnn.training.trainer import Trainer

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    manager = DistributedManager.initialize(device=device.type, timeout_s=args.timeout)
    torch.manual_seed(0)
    model = build_model(args, checkpointing)
    if model is None:
        return {"rank": rank, "error": f"{args.model} does not accept activation_checkpointing"}
    dtype = torch.float32 if args.device == "cuda" else torch.float64
    model = model.to(device=device, dtype=dtype)
    plan = parallelize_train(manager, 1, world)
    graph = structure(args.point_atoms)
    if world == 1:
        graph = with_edges(graph, args.cutoff)  # the one-process path needs edges
    specs = {"energy": TermSpec(1.0), "forces": TermSpec(10.0), "stress": TermSpec(1.0)}
    trainer = Trainer(model, specs, torch.optim.SGD(model.parameters(), lr=1e-6),
                      reducer=plan.reducer, device=device, dtype=dtype,
                      predictor=plan.predictor(model, device, dtype))
    counts = [1.0, 3.0 * graph.n_atoms, 9.0]
    times, peaks = [], []
    for step in range(args.steps + 1):  # the first step warms up
        plan.reducer.barrier()
        with PeakMemory(device) as mem:
            t0 = time.perf_counter()
            trainer.train_step([graph], step, counts=counts)
            dt = time.perf_counter() - t0
        if step:
            times.append(dt)
            peaks.append(mem.peak)
    stats = getattr(trainer.predictor, "last_stats", {})
    return {"rank": rank, "requested_atoms": args.point_atoms, "n_atoms": graph.n_atoms,
            "step_s": statistics.median(times),
            "peak_bytes": max(peaks), "n_owned": stats.get("n_owned", graph.n_atoms),
            "n_ghost": stats.get("n_ghost", 0)}


def _entry(rank, world, port, out_dir, args, checkpointing):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    try:
        out = run_point(rank, world, args, checkpointing)
    except Exception as e:  # noqa: BLE001 - reported in the JSON row
        out = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


def spawn_point(args, world: int, checkpointing: bool) -> list[dict]:
    from benchmarks.common import spawn_json_ranks

    return spawn_json_ranks(_entry, world, (args, checkpointing), args.timeout)


def summarise(dd: int, checkpointing: bool, ranks: list[dict]) -> dict:
    row = {"dd": dd, "checkpointing": checkpointing, "ranks": ranks}
    row["requested_atoms"] = ranks[0].get("requested_atoms")
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
        return row
    row.update(n_atoms=ranks[0]["n_atoms"],
               peak_mb_per_rank=max(r["peak_bytes"] for r in ranks) / 2**20,
               step_s=max(r["step_s"] for r in ranks),
               max_held_atoms=max(r["n_owned"] + r["n_ghost"] for r in ranks))
    return row


def largest(rows: list[dict], budget_gb: float) -> dict:
    """Largest trainable structure per ``(dd, checkpointing)`` under a per-rank memory budget:
    the peak per rank is fitted as ``a + b * n_atoms`` over the measured sizes (least squares;
    it is linear in the atoms once the model's weights are counted in ``a``) and solved for
    the budget. An estimate: reported with the fit's points."""
    import numpy as np

    out = {}
    groups: dict = {}
    for r in rows:
        if "error" not in r:
            groups.setdefault((r["dd"], r["checkpointing"]), []).append(r)
    for (dd, ck), rs in sorted(groups.items()):
        if len({r["n_atoms"] for r in rs}) < 2:
            continue
        n = np.array([r["n_atoms"] for r in rs], dtype=float)
        m = np.array([r["peak_mb_per_rank"] for r in rs]) / 1024
        b, a = np.polyfit(n, m, 1)
        out[f"dd{dd}{'_ckpt' if ck else ''}"] = {
            "gb_per_1k_atoms": 1000 * b, "intercept_gb": a,
            "largest_atoms": int((budget_gb - a) / b) if b > 0 else None}
    for ck in ("", "_ckpt"):
        one, four = out.get(f"dd1{ck}"), out.get(f"dd4{ck}")
        if one and four and one["largest_atoms"] and four["largest_atoms"]:
            out[f"dd4{ck}_largest_over_dd1"] = four["largest_atoms"] / one["largest_atoms"]
    return {"budget_gb_per_rank": budget_gb, **out}


def ratios(rows: list[dict]) -> dict:
    top = max((r["n_atoms"] for r in rows if "error" not in r), default=None)
    ok = {(r["dd"], r["checkpointing"]): r for r in rows
          if "error" not in r and r["n_atoms"] == top}  # ratios at the largest size
    out = {}
    for (dd, ck), r in ok.items():
        base = ok.get((1, ck))
        if base is not None and dd != 1:
            out[f"dd{dd}{'_ckpt' if ck else ''}_peak_over_dd1"] = \
                r["peak_mb_per_rank"] / base["peak_mb_per_rank"]
            out[f"dd{dd}{'_ckpt' if ck else ''}_step_over_dd1"] = r["step_s"] / base["step_s"]
        plain = ok.get((dd, False))
        if ck and plain is not None:
            out[f"dd{dd}_plain_peak_over_ckpt"] = \
                plain["peak_mb_per_rank"] / r["peak_mb_per_rank"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--atoms", default="20000",
                   help="atoms of the structure (about); comma-separated for several sizes "
                        "(then the largest trainable structure under --budget-gb is fitted)")
    p.add_argument("--budget-gb", type=float, default=80.0,
                   help="per-rank memory budget of the largest-structure estimate (GB)")
    p.add_argument("--dd", default="1,2,4", help="comma-separated dd degrees")
    p.add_argument("--model", default="schnet")
    p.add_argument("--hparams", default="", help="model hyperparameters as JSON")
    p.add_argument("--cutoff", type=float, default=4.0, help="Å")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--checkpointing", action="store_true",
                   help="also rows with model activation checkpointing")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=1800.0, help="s per point")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = "cp_training" + ("" if args.model == "schnet" else f"_{args.model}")
        args.json = results_path(name, args.device, 1)
    rows = []
    for n in [int(x) for x in str(args.atoms).split(",")]:
        args.point_atoms = n
        for ck in ([False, True] if args.checkpointing else [False]):
            for dd in [int(x) for x in args.dd.split(",")]:
                row = summarise(dd, ck, spawn_point(args, dd, ck))
                print(json.dumps({k: v for k, v in row.items() if k != "ranks"}), flush=True)
                rows.append(row)
    try:
        from benchmarks.common import machine_info
    except ImportError:  # run as a script
        from common import machine_info

    result = {"benchmark": "cp_training", "args": vars(args), "machine": machine_info(
        args.device), "rows": rows, "ratios": ratios(rows),
        "largest_trainable": largest(rows, args.budget_gb),
        "checkpointing_supported": supports_checkpointing(args.model)}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps({"ratios": result["ratios"],
                      "largest_trainable": result["largest_trainable"]}, indent=2))
    return result


if __name__ == "__main__":
    main()
