"""The cost of planning an epoch's batches per rank at foundation-model scale.

Every rank plans the whole epoch's global batches (a pure function of ``(seed, epoch)``,
no collective) and keeps its own share of each. This measures that plan, per rank, on a
synthetic ``n_atoms`` array (int32, 8 to 500 atoms, log-uniform) of ``--sizes`` structures
for each number of data-parallel ranks in ``--ranks``:

* ``atoms``: the default, ``data.max_atoms_per_batch = budget × ranks`` global batches of
  a seeded permutation (:func:`~xnn.data.datasets.make_batches`), this rank's greedy share
  of each (:func:`~xnn.data.datasets.shard_batches`, what ``BatchPlan.shares`` does);
* ``balanced``: ``data.balance=atoms``, the steps packed as ``ranks`` shares of ``budget``
  atoms (:func:`~xnn.training.balance.balanced_batches`).

``after`` is the code of this tree; ``before`` is the per-structure loops it replaced (kept
below, the same batches). ``before`` is measured on ``--before-n`` structures (a pure Python
loop over structures: its cost is linear in ``n``) and extrapolated linearly to each size
(``extrapolated: true`` in the row); ``after`` is measured at every size up to ``--max-n``
and extrapolated the same way above it. Each case runs in a fresh process: ``seconds`` is
its wall time, ``peak_mib`` its peak resident set (``ru_maxrss``) less the resident set
with the ``n_atoms`` array made (the plan's own memory, its result lists included).

Usage::

    python benchmarks/plan_scale.py --json plan_scale.json
    python benchmarks/plan_scale.py --sizes 1000000 --ranks 8 --max-n 1000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

from xnn.data.datasets import make_batches, shard_batch, shard_batches
from xnn.training.balance import balanced_batches


def synthetic_sizes(n: int, seed: int = 0) -> np.ndarray:
    """``[n]`` int32 atoms per structure, log-uniform in 8..500."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(8), np.log(500), n)).astype(np.int32)


# ---------------------------------------------------------------- before: the old loops
def _old_chunks(indices, n_atoms, max_atoms):
    batches, current, count = [], [], 0
    for i in indices:
        if current and count + int(n_atoms[i]) > max_atoms:
            batches.append(current)
            current, count = [], 0
        current.append(i)
        count += int(n_atoms[i])
    if current:
        batches.append(current)
    return batches


def _old_pack(window, sizes, bins, budget, last):
    head = window[0]
    cap = max(budget, int(sizes[window].max()))
    rest = sorted(window[1:], key=lambda i: (-int(sizes[i]), i))
    if last and int(sizes[window].sum()) <= bins * cap:
        cap = None
    shares = [[head]] + [[] for _ in range(bins - 1)]
    load = [int(sizes[head])] + [0] * (bins - 1)
    left = []
    for i in rest:
        n = int(sizes[i])
        k = min(range(bins), key=lambda b: (load[b], b))
        if cap is not None and load[k] + n > cap:
            left.append(i)
            continue
        shares[k].append(i)
        load[k] += n
    kept = set(left)
    return [sorted(s) for s in shares], [i for i in window[1:] if i in kept]


def _old_balanced(n_atoms, order, bins, budget):
    sizes = np.asarray(n_atoms, dtype=np.int64)
    stream, window, steps, pos = [int(i) for i in order], [], [], 0
    while pos < len(stream) or window:
        take = min(64 * bins - len(window), len(stream) - pos)
        window += stream[pos : pos + take]
        pos += take
        shares, window = _old_pack(window, sizes, bins, budget, pos == len(stream))
        steps.append(shares)
    return steps


# ---------------------------------------------------------------- one case
def plan(mode: str, impl: str, n_atoms: np.ndarray, ranks: int, budget: int) -> int:
    """Rank 0's plan of epoch 0; returns the number of steps."""
    order = np.random.default_rng([0, 0]).permutation(len(n_atoms))
    if mode == "balanced":
        if impl == "before":
            return len(_old_balanced(n_atoms, order, ranks, budget))
        return len(balanced_batches(n_atoms, order, ranks, budget))
    if impl == "before":
        batches = _old_chunks(order.tolist(), n_atoms, budget * ranks)
        mine = [shard_batch(b, n_atoms, 0, ranks) for b in batches]  # per batch, as before
    else:
        batches = make_batches(n_atoms, max_atoms=budget * ranks, shuffle=True)
        mine = shard_batches(batches, n_atoms, 0, ranks)
    return len(mine)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(mode: str, impl: str, n: int, ranks: int, budget: int) -> dict:
    """One case in this process (the ``--case`` entry)."""
    n_atoms = synthetic_sizes(n)
    base = _rss_mib()
    t0 = time.perf_counter()
    steps = plan(mode, impl, n_atoms, ranks, budget)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "impl": impl, "n": n, "ranks": ranks, "budget": budget,
            "steps": steps, "seconds": seconds, "peak_mib": max(peak - base, 0.0)}


def _spawn(mode, impl, n, ranks, budget) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", mode, impl, str(n), str(ranks),
                          str(budget)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", default=["atoms", "balanced"])
    ap.add_argument("--budget", type=int, default=2000, help="atoms per rank's share")
    ap.add_argument("--before-n", type=int, default=10**5)
    ap.add_argument("--max-n", type=int, default=10**7, help="largest n measured (after)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", nargs=5, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        mode, impl, n, ranks, budget = a.case
        print(json.dumps(run_case(mode, impl, int(n), int(ranks), int(budget))))
        return
    rows = []
    for mode in a.modes:
        for ranks in a.ranks:
            measured = {"before": {}, "after": {}}
            measured["before"][a.before_n] = _spawn(mode, "before", a.before_n, ranks,
                                                    a.budget)
            for n in a.sizes:
                if n <= a.max_n:
                    measured["after"][n] = _spawn(mode, "after", n, ranks, a.budget)
            for impl in ("before", "after"):
                for n in a.sizes:
                    if n in measured[impl]:
                        row = dict(measured[impl][n], extrapolated=False)
                    else:  # linear in n from the largest measured size
                        ref = measured[impl][max(measured[impl])]
                        f = n / ref["n"]
                        row = dict(ref, n=n, steps=None, seconds=ref["seconds"] * f,
                                   peak_mib=ref["peak_mib"] * f, extrapolated=True)
                    rows.append(row)
                    print(f"{mode:9s} ranks={ranks:3d} {impl:6s} n={n:>11,d} "
                          f"{row['seconds']:9.2f} s {row['peak_mib']:9.1f} MiB"
                          f"{'  (extrapolated)' if row['extrapolated'] else ''}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "plan_scale", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
