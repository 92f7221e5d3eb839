"""Batched small systems against one large system, per atom, on the eager NVE step, with
the gather of many cells as it was (``legacy``: ``pos[j]`` indexing and the ``[E, 3, 3]``
product of ``rowvec_matmul``) and as it is, in the same run (issue 20, item 4).

Cases: ``n_systems`` (64) FCC Cu cells of ~``n_small`` atoms in one batch, and one cell of
about as many atoms in total; LJ and SchNet (random weights), float64, stress included
(as in MD with a pressure log). Each row: µs per atom-step of batched and single, for the
legacy and the current code, timed alternately in blocks (the median block);
``batched_over_single`` is the issue's measure (goal <= 1).

Usage::

    python benchmarks/md_batched.py --json benchmarks/results/md_batched_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu, write_json
except ImportError:  # run as `python benchmarks/md_batched.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu, write_json

import xnn.data.graph as graph_module
import xnn.models.derivatives as derivatives_module
from xnn.data import AtomicGraph
from xnn.data import keys as K
from xnn.dynamics import maxwell_boltzmann, nve
from xnn.models import Potential, build

DT = 2.0
MODELS = {
    "lj": lambda: build("lj", sigma=2.338, epsilon=0.409, cutoff=5.8),
    # small SchNet (32 features): the step is then not all filter-network FLOPs
    "schnet": lambda: build("schnet", species=[29], cutoff=5.0, num_features=32,
                            num_filters=32),
}


def _legacy_rowvec_matmul(x, mats, batch, rows=None):
    if mats.shape[0] == 1:
        return x @ mats[0]
    idx = batch if rows is None else batch[rows]
    return (x.unsqueeze(-1) * mats[idx]).sum(-2)


def _legacy_edge_vectors(self, positions=None, cell=None):
    pos = self._fields[K.POSITIONS] if positions is None else positions
    cell = self._fields[K.CELL] if cell is None else cell
    j, i = self._fields[K.EDGE_INDEX][0], self._fields[K.EDGE_INDEX][1]
    vec = pos[j] - pos[i]
    shifts = self._fields.get(K.SHIFTS)
    if shifts is not None:
        vec = vec + _legacy_rowvec_matmul(shifts.to(pos.dtype), cell, self._fields[K.BATCH], i)
    return vec


@contextlib.contextmanager
def legacy(enabled: bool):
    """The gather code of before this change, patched in while ``enabled``."""
    saved = (graph_module.rowvec_matmul, derivatives_module.rowvec_matmul,
             AtomicGraph.edge_vectors)
    if enabled:
        graph_module.rowvec_matmul = _legacy_rowvec_matmul
        derivatives_module.rowvec_matmul = _legacy_rowvec_matmul
        AtomicGraph.edge_vectors = _legacy_edge_vectors
    try:
        yield
    finally:
        (graph_module.rowvec_matmul, derivatives_module.rowvec_matmul,
         AtomicGraph.edge_vectors) = saved


def _graph(atoms_list) -> AtomicGraph:
    gs = [maxwell_boltzmann(AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array,
                                                    a.pbc), 300.0, seed=k)
          for k, a in enumerate(atoms_list)]
    return AtomicGraph.concat(gs) if len(gs) > 1 else gs[0]


def bench(name: str, n_systems: int, n_small: int, steps: int, blocks: int) -> dict:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    small = fcc_cu(n_small, rattle=0.05, seed=0)
    cases = {"batched": _graph([small] * n_systems),
             "single": _graph([fcc_cu(n_small * n_systems, rattle=0.05, seed=0)])}
    runs = {}
    for case, g in cases.items():
        for old in (True, False):
            pot = Potential(model, skin=1.0)
            with legacy(old):
                s = nve.step(nve.init(g, pot), pot, DT)
            runs[(case, old)] = [pot, s, []]
    for _ in range(blocks):
        for key, run in runs.items():
            pot, s, _ = run
            with legacy(key[1]):
                t0 = time.perf_counter()
                for _ in range(steps):
                    s = nve.step(s, pot, DT)
                run[1] = s
                run[2].append(time.perf_counter() - t0)
    # median block: robust to the load of a shared machine
    us = {k: 1e6 * statistics.median(r[2]) / (steps * cases[k[0]].n_atoms)
          for k, r in runs.items()}
    same = torch.equal(runs[("batched", True)][1].positions, runs[("batched", False)][1].positions)
    return {
        "model": name, "n_systems": n_systems, "atoms_per_system": cases["batched"].n_atoms
        // n_systems, "single_n_atoms": cases["single"].n_atoms, "steps": blocks * steps,
        "legacy_batched_us_per_atom_step": us[("batched", True)],
        "legacy_single_us_per_atom_step": us[("single", True)],
        "batched_us_per_atom_step": us[("batched", False)],
        "single_us_per_atom_step": us[("single", False)],
        "legacy_batched_over_single": us[("batched", True)] / us[("single", True)],
        "batched_over_single": us[("batched", False)] / us[("single", False)],
        "batched_speedup_vs_legacy": us[("batched", True)] / us[("batched", False)],
        "trajectories_bitwise_equal": bool(same),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--models", default="lj,schnet")
    p.add_argument("--n-systems", type=int, default=64)
    p.add_argument("--n-small", type=int, default=100)
    p.add_argument("--steps", type=int, default=3, help="steps per block")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("md_batched", "cpu")
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models.split(","):
        rows.append(bench(name, args.n_systems, args.n_small, args.steps, args.blocks))
        print(rows[-1], flush=True)
        write_json(args.json, {"benchmark": "md_batched", "dtype": "float64", "dt_fs": DT,
                               "results": rows}, device="cpu")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
