"""The cost of planning an epoch's batches per rank at foundation-model scale.

Every rank plans the whole epoch's global batches (a pure function of ``(seed, epoch)``,
no collective) and keeps its own share of each. This measures that plan, per rank, on a
synthetic ``n_atoms`` array (int32, 8 to 500 atoms, log-uniform) of ``--sizes`` structures
for each number of data-parallel ranks in ``--ranks``, for rank 0 of epoch 0:

* ``atoms``: the default, ``data.max_atoms_per_batch = budget × ranks`` global batches of
  a seeded permutation, this rank's greedy share of each;
* ``balanced``: ``data.balance=atoms``, the steps packed as ``ranks`` shares of ``budget``
  atoms;
* ``split``: what comes before the plan, the training split of a source of ``n`` structures
  (its ``n_atoms`` int64, as the lazy sources hold it): 5% validation and 5% test
  (:func:`~xnn.data.datasets.split_indices`) and the :class:`~xnn.data.datasets.Subset`
  of each (``before``: the int64 permutation, sorted copies and int64 subsets it replaced);
* ``draws``: ``data.samples_per_epoch = n`` draws by dataset weight from ``n`` structures of
  one weight (:func:`~xnn.training.sampling.sample_epoch`; ``before``: ``rng.choice`` cast to
  int32, as the planner did);
* ``record``: the split as above, then the run's split record (``split.json``) made from it,
  written and read back (:mod:`xnn.app.split_record`: the splits' own int32 arrays held,
  ``split.npy`` written a row at a time and read memory-mapped; ``before``: each split's
  indices as a Python list, written as a JSON text of lists and read back with
  ``json.loads``, as :func:`~xnn.app.train_data.split_membership` and ``write_split`` did).
  Less the ``split`` row, the record's own memory. ``ranks`` plays no part in these three.

``after`` is the planner of this tree (:class:`~xnn.training.plan.BatchPlan`: the epoch as
two int32/int64 arrays, this rank's shares made a block at a time while they are read, as
the training loop reads them); ``before`` is the list planner it replaced (every global
batch and share of the epoch as Python lists: :func:`~xnn.data.datasets.make_batches` with
:func:`~xnn.data.datasets.shard_batches`, or :func:`~xnn.training.balance.balanced_batches`,
which still give those lists). Both are measured up to ``--max-n`` structures and
extrapolated linearly above it (``extrapolated: true`` in the row; ``before`` up to
``--max-n-before``). Each case runs in a
fresh process: ``seconds`` is its wall time (``cpu_s`` its CPU time, steadier on a shared
machine), ``peak_mib`` its peak resident set (``ru_maxrss``) less the resident set with
the ``n_atoms`` array made (the plan's own memory, the shares read included).

Usage::

    python benchmarks/plan_scale.py --json plan_scale.json
    python benchmarks/plan_scale.py --sizes 1000000 --ranks 8 --max-n 1000000
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from xnn.data.datasets import make_batches, shard_batches
from xnn.training.balance import balanced_batches


def synthetic_sizes(n: int, seed: int = 0, block: int = 1 << 20) -> np.ndarray:
    """``[n]`` int32 atoms per structure, log-uniform in 8..500 (drawn a block at a time:
    the same numbers as one draw, without float64 temporaries of the whole array, which
    would count in the peak resident set of the plan)."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int32)
    for a in range(0, n, block):
        out[a:a + block] = np.exp(rng.uniform(np.log(8), np.log(500), min(block, n - a)))
    return out


class _Sizes:
    """A training set as the planner reads it: its atom counts."""

    def __init__(self, n_atoms: np.ndarray):
        self.n_atoms = n_atoms

    def __len__(self) -> int:
        return len(self.n_atoms)


# ---------------------------------------------------------------- one case
def _split_before(dataset: _Sizes, n: int) -> list:
    """The training set's split and subsets as they were made before (int64 throughout)."""
    perm = np.random.default_rng(0).permutation(n)
    m = int(round(n * 0.05))
    parts = [np.sort(perm[2 * m:]), np.sort(perm[:m]), np.sort(perm[m:2 * m])]
    del perm
    return [_Sizes(np.asarray(dataset.n_atoms)[p]) for p in parts] + parts  # Subset's arrays


def _record(impl: str, parts: list, folder: Path) -> int:
    """The split record of ``parts`` (train, val, test Subsets) made, written to ``folder``
    and read back; returns the structures read back."""
    names = ("train", "val", "test")
    if impl == "before":
        m = {"files": [], **{k: [{"file": 0, "indices": p.indices.tolist()}]
                             for k, p in zip(names, parts)}}
        text = json.dumps({"format": "xnn-split", "version": 1, "seed": 0, **m}, indent=1)
        text = re.sub(r"\[\n\s*([-\d,\s]*?)\n\s*\]",
                      lambda g: f"[{' '.join(g[1].split())}]", text)
        (folder / "split.json").write_text(text + "\n")
        back = json.loads((folder / "split.json").read_text())
    else:
        from xnn.app.split_record import read_split, write_split

        m = {"files": [], **{k: [{"file": 0, "indices": p.indices}]
                             for k, p in zip(names, parts)}}
        write_split(m, {"seed": 0}, folder / "split.json")
        back = read_split(folder / "split.json")
    return sum(len(r["indices"]) for k in names for r in back[k])


def prepare(mode: str, impl: str, n_atoms: np.ndarray) -> int:
    """The split (``split``), its record (``record``) or the epoch's draws (``draws``);
    returns structures held."""
    if mode == "record":
        import tempfile

        from xnn.data.datasets import Subset, split_indices

        ds = _Sizes(n_atoms)
        parts = [Subset(ds, p) for p in split_indices(len(n_atoms), 0.05, 0.05, seed=0)]
        with tempfile.TemporaryDirectory() as folder:
            return _record(impl, parts, Path(folder))
    if mode == "split":
        from xnn.data.datasets import Subset, split_indices

        ds = _Sizes(n_atoms)
        if impl == "before":
            return len(_split_before(ds, len(n_atoms))[0])
        parts = split_indices(len(n_atoms), 0.05, 0.05, seed=0)
        return len([Subset(ds, p) for p in parts][0])
    weights = np.ones(len(n_atoms))  # structure_weights of one file
    if impl == "before":
        drawn = np.random.default_rng([0, 0]).choice(len(weights), size=len(weights),
                                                      replace=True, p=weights / weights.sum())
        return len(drawn.astype(np.int32))
    from xnn.training.sampling import sample_epoch

    return len(sample_epoch(weights, len(weights), 0, 0))


def plan(mode: str, impl: str, n_atoms: np.ndarray, ranks: int, budget: int) -> int:
    """Rank 0's plan of epoch 0, its shares read once; returns the number of steps (for
    ``split`` and ``draws``: the training structures, or the draws)."""
    if mode in ("split", "draws", "record"):
        return prepare(mode, impl, n_atoms)
    if impl == "before":
        if mode == "balanced":
            order = np.random.default_rng([0, 0]).permutation(len(n_atoms))
            return len(balanced_batches(n_atoms, order, ranks, budget))
        batches = make_batches(n_atoms, max_atoms=budget * ranks, shuffle=True)
        return len(shard_batches(batches, n_atoms, 0, ranks))
    from xnn.training.loop import LoopSettings
    from xnn.training.plan import BatchPlan
    from xnn.training.sharding import BatchSharding

    settings = LoopSettings(batch_size=None, max_atoms_per_batch=budget * ranks,
                            balance_bins=ranks if mode == "balanced" else None)
    batches, shares = BatchPlan(settings, _Sizes(n_atoms), BatchSharding(0, ranks)).shares(0)
    held = sum(len(s) for s in shares)  # read as the training loop reads them
    assert held > 0
    return len(batches)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_case(mode: str, impl: str, n: int, ranks: int, budget: int) -> dict:
    """One case in this process (the ``--case`` entry)."""
    n_atoms = synthetic_sizes(n)
    if mode in ("split", "record"):  # as a lazy source held it
        n_atoms = n_atoms.astype(np.int64)
    base = _rss_mib()
    t0, c0 = time.perf_counter(), time.process_time()
    steps = plan(mode, impl, n_atoms, ranks, budget)
    seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "impl": impl, "n": n, "ranks": ranks, "budget": budget,
            "steps": steps, "seconds": seconds, "cpu_s": cpu_s,
            "peak_mib": max(peak - base, 0.0)}


def _spawn(mode, impl, n, ranks, budget) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", mode, impl, str(n), str(ranks),
                          str(budget)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", default=["atoms", "balanced"],
                    help="atoms, balanced, split, draws, record")
    ap.add_argument("--budget", type=int, default=2000, help="atoms per rank's share")
    ap.add_argument("--max-n", type=int, default=10**8, help="largest n measured (after)")
    ap.add_argument("--max-n-before", type=int, default=10**7,
                    help="largest n measured (before: its lists need ~5 GiB at 10^8)")
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
            for impl in ("before", "after"):
                for n in a.sizes:
                    if n <= (a.max_n if impl == "after" else a.max_n_before):
                        measured[impl][n] = _spawn(mode, impl, n, ranks, a.budget)
            for impl in ("before", "after"):
                for n in a.sizes:
                    if n in measured[impl]:
                        row = dict(measured[impl][n], extrapolated=False)
                    else:  # linear in n from the largest measured size
                        ref = measured[impl][max(measured[impl])]
                        f = n / ref["n"]
                        row = dict(ref, n=n, steps=None, seconds=ref["seconds"] * f,
                                   cpu_s=ref.get("cpu_s", float("nan")) * f,
                                   peak_mib=ref["peak_mib"] * f, extrapolated=True)
                    rows.append(row)
                    print(f"{mode:9s} ranks={ranks:3d} {impl:6s} n={n:>11,d} "
                          f"{row['seconds']:9.2f} s ({row.get('cpu_s', float('nan')):.2f} "
                          f"CPU s) {row['peak_mib']:9.1f} MiB"
                          f"{'  (extrapolated)' if row['extrapolated'] else ''}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"benchmark": "plan_scale", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
