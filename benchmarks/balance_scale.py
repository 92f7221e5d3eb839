"""Load-balanced boxes at 512 GPUs (issue 47 remedy 1): ``parallel.balance`` none vs shift on
the at-scale ghost plans, priced by the step-cost model.

For the plan's slab (periodic x, y; vacuum along z, not periodic), rod (``cylinder``:
periodic z, vacuum along x, y) and FCC crystal at 250k atoms per GPU on 512 GPUs, modes sync
(6 Å) and halo (11 Å), :func:`xnn.distributed.cost.plan.plan_counts` gives every rank's
counts with equal-width boxes and with cuts at atom-count quantiles (the same
:func:`~xnn.distributed.domain.partition.balanced` a run calls); the equivariant model's
1-GPU calibration and the InfiniBand link of ``benchmarks/scaling_model.py`` price one MD
step (:func:`xnn.distributed.cost.model.md_step`). ``ideal_step_s`` is one GPU evaluating
its even share (N / P atoms, the sync plan's edges / P) with nothing else: the efficiency is
its ratio to the step::

    python benchmarks/balance_scale.py --json benchmarks/results/balance_scale_cpu.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

try:
    from benchmarks.common import write_json
except ImportError:  # run as `python benchmarks/balance_scale.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import write_json

from benchmarks.scaling_model import _links, gpu_calibrations
from xnn.distributed.cost.model import md_step
from xnn.distributed.cost.plan import plan_counts

CUTOFF = 5.0
WIDTHS = {"sync": CUTOFF + 1.0, "halo": 2 * CUTOFF + 1.0}
SYSTEMS = ("slab", "cylinder", "fcc")
GPUS, PER_GPU = 512, 250_000


def _ratio(a) -> float:
    return float(a.max() / a.mean())


def rows() -> list[dict]:
    comp, shape = gpu_calibrations()["equivariant"]
    link = _links(GPUS)
    out = []
    for system in SYSTEMS:
        even_edges = None
        for mode in ("sync", "halo"):
            sh = shape if mode != "halo" else replace(shape, sync_points=0)
            for balance in ("none", "shift"):
                t0 = time.perf_counter()
                c = plan_counts(system, PER_GPU * GPUS, GPUS, mode=mode, cutoff=CUTOFF,
                                halo_width=WIDTHS[mode], balance=balance)
                seconds = time.perf_counter() - t0
                if even_edges is None:  # sync, none: the edges of the owned atoms
                    even_edges = float(c.edges.sum()) / GPUS
                t = md_step(c, comp, sh, link)
                ideal = float(comp.seconds(c.n_atoms / GPUS, even_edges))
                out.append({"system": system, "mode": mode, "balance": balance,
                            "n_atoms": c.n_atoms, "gpus": GPUS, "grid": list(c.grid),
                            "halo_width": WIDTHS[mode],
                            "owned_max_over_mean": _ratio(c.owned),
                            "held_max_over_mean": _ratio(c.held),
                            "edges_max_over_mean": _ratio(c.edges),
                            "step_s": t.total, "split": t.split(), "ideal_step_s": ideal,
                            "efficiency": ideal / t.total, "method": c.method,
                            "seconds": seconds})
                r = out[-1]
                print(f"{system:8s} {mode:4s} {balance:5s} grid {c.grid} owned "
                      f"{r['owned_max_over_mean']:.3f} held {r['held_max_over_mean']:.3f} "
                      f"step {t.total:.4g} s eff {r['efficiency']:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    out = {"benchmark": "balance_scale",
           "machine": {"torch_version": torch.__version__, "python": platform.python_version(),
                       "device": "cpu", "threads": 1,
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
           "settings": {"cutoff": CUTOFF, "widths": WIDTHS, "gpus": GPUS,
                        "atoms_per_gpu": PER_GPU, "model": "equivariant (H200 1-GPU "
                        "calibration of scaling_model.py)", "link": "InfiniBand NDR"},
           "rows": rows(), "total_s": 0.0}
    out["total_s"] = time.perf_counter() - start
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
