"""Blocking collectives per decomposed MD step, by integrator and mode (issue 47 item 5).

Spawns gloo ranks on CPU, runs each integrator on an FCC crystal through
:class:`xnn.distributed.DecomposedPotential` (``integrator.step(..., reduce=pot.reducer)``
then ``pot.maybe_migrate``), and counts every collective of each step with
:func:`xnn.distributed.collectives.count_collectives`. Steps are split into those without a
ghost-plan rebuild and those with one (a small skin makes them frequent). Prints a table and
optionally writes JSON; ``--time`` adds the mean step time of NVE LJ at given sizes::

    python benchmarks/collectives_per_step.py --ranks 2 --json /tmp/counts.json
    python benchmarks/collectives_per_step.py --ranks 2 --time 2000,16000 --cases none
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENSEMBLES = ("nve", "langevin", "nhc", "npt")
#: (model, mode, ensembles, committee)
CASES = [("lj", "halo", ENSEMBLES), ("schnet", "sync", ENSEMBLES),
         ("schnet", "graph", ENSEMBLES), ("committee", "halo", ("nve", "langevin"))]


def model_of(name: str):
    from xnn.models import build
    from xnn.models.committee import Committee

    torch.manual_seed(0)
    if name == "lj":
        return build("lj", sigma=2.3, epsilon=0.4, cutoff=5.0).double()
    small = {"num_features": 8, "num_filters": 8, "num_basis": 8}
    if name == "schnet":
        return build("schnet", species=[29], cutoff=3.0, num_interactions=2, **small).double()
    return Committee({"name": "schnet", "species": [29], "cutoff": 3.0, "num_interactions": 2,
                      **small}, size=3, seeds=[1, 2, 3]).double()


def crystal(reps, temperature=1500.0):
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph
    from xnn.dynamics.state import maxwell_boltzmann

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(reps)
    atoms.rattle(0.05, seed=1)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                dtype=torch.float64)
    return maxwell_boltzmann(g, temperature, seed=1)


def init(ensemble, graph, pot):
    from xnn.dynamics import langevin, nhc, npt, nve

    r = pot.reducer
    if ensemble == "nve":
        return nve, nve.init(graph, pot, reduce=r)
    if ensemble == "langevin":
        return langevin, langevin.init(graph, pot, 1500.0, friction=0.02, seed=5, reduce=r)
    if ensemble == "nhc":
        return nhc, nhc.init(graph, pot, 1500.0, tau=20.0, reduce=r)
    return npt, npt.init(graph, pot, 1500.0, 0.0, tau=20.0, tau_p=50.0, compressibility=0.5,
                         seed=5, reduce=r)


def count_case(manager, model_name, mode, ensemble, steps, skin, reps):
    """Per-step collective counts on this rank: ``{"plain": [...], "rebuild": [...]}``."""
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives

    pot = parallelize(model_of(model_name), manager, mode, skin=skin)
    graph = crystal(reps)
    owned = pot.scatter(graph if manager.rank == 0 else None)
    integrator, state = init(ensemble, owned, pot)
    out = {"plain": [], "rebuild": []}
    for _ in range(steps):
        before = pot.state.counters.rebuilds
        with count_collectives() as n:
            state = integrator.step(state, pot, 2.0, reduce=pot.reducer)
            state = pot.maybe_migrate(state)
        kind = "rebuild" if pot.state.counters.rebuilds != before else "plain"
        out[kind].append({"calls": dict(n.calls), "nbytes": dict(n.nbytes),
                          "messages": n.messages, "blocking": n.blocking})
    return out


def time_case(manager, n_atoms, steps):
    """Mean wall time (s) per NVE LJ step of ``n_atoms`` (slowest rank)."""
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import all_reduce_max, count_collectives
    from xnn.dynamics import nve

    side = max(1, round((n_atoms / 4) ** (1 / 3)))
    pot = parallelize(model_of("lj"), manager, "halo", skin=1.0)
    owned = pot.scatter(crystal((side, side, side), 300.0) if manager.rank == 0 else None)
    state = nve.init(owned, pot, reduce=pot.reducer)
    for _ in range(3):
        state = pot.maybe_migrate(nve.step(state, pot, 1.0, reduce=pot.reducer))
    t0 = time.perf_counter()
    with count_collectives() as n:
        for _ in range(steps):
            state = pot.maybe_migrate(nve.step(state, pot, 1.0, reduce=pot.reducer))
    dt = torch.tensor([(time.perf_counter() - t0) / steps,
                       sum(n.seconds.values()) / steps,
                       n.seconds["all_reduce"] / steps], dtype=torch.float64)
    dt = all_reduce_max(dt).tolist()
    return {"n_atoms": 4 * side ** 3, "s_per_step": dt[0], "collective_s_per_step": dt[1],
            "all_reduce_s_per_step": dt[2], "blocking_per_step": n.blocking / steps,
            "all_reduce_per_step": n.calls["all_reduce"] / steps}


def latency(n_calls: int) -> dict:
    """Mean wall time (s, slowest rank) of one all-reduce of 1, 10 and 1000 doubles (the
    cost that each removed all-reduce saved), after a barrier-like warm-up."""
    from xnn.distributed import collectives as C

    out = {}
    for n in (1, 10, 1000):
        t = torch.zeros(n, dtype=torch.float64)
        for _ in range(20):
            C.all_reduce_(t)
        t0 = time.perf_counter()
        for _ in range(n_calls):
            C.all_reduce_(t)
        dt = torch.tensor([(time.perf_counter() - t0) / n_calls], dtype=torch.float64)
        out[n] = float(C.all_reduce_max(dt)[0])
    return out


def worker(rank, world_size, args):
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(backend="gloo")
    torch.set_num_threads(1)
    results = {"counts": [], "timing": []}
    for model_name, mode, ensembles in CASES if args.cases == "all" else []:
        for ens in ensembles:
            c = count_case(manager, model_name, mode, ens, args.steps, args.skin, (3, 3, 3))
            results["counts"].append({"model": model_name, "mode": mode, "ensemble": ens,
                                      **c})
    if args.latency:
        results["latency"] = latency(args.latency)
    for n in [int(x) for x in args.time.split(",") if x]:
        results["timing"].append(time_case(manager, n, args.time_steps))
    manager.cleanup()
    return results


def summary(rows):
    """``kind -> (blocking, calls by kind)`` of the first step of each kind (and whether every
    step of that kind counted the same)."""
    out = {}
    for kind in ("plain", "rebuild"):
        if not rows[kind]:
            continue
        keys = {json.dumps(r["calls"], sort_keys=True) for r in rows[kind]}
        calls = Counter(rows[kind][0]["calls"])
        out[kind] = {"blocking": rows[kind][0]["blocking"], "calls": dict(calls),
                     "steps": len(rows[kind]), "uniform": len(keys) == 1}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skin", type=float, default=0.2)
    p.add_argument("--cases", choices=("all", "none"), default="all")
    p.add_argument("--time", default="", help="comma-separated atom counts to time (NVE LJ)")
    p.add_argument("--time-steps", type=int, default=20)
    p.add_argument("--latency", type=int, default=0,
                   help="time this many all-reduces of 1, 10 and 1000 doubles")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from xnn.testing.ranks import spawn

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = spawn(worker, args.ranks, (args,), timeout_s=3000.0)
    rank0 = results[0]
    for r in rank0["counts"]:
        s = summary(r)
        for kind, v in s.items():
            calls = ", ".join(f"{k} {n}" for k, n in sorted(v["calls"].items()))
            print(f"{r['model']:9s} {r['mode']:5s} {r['ensemble']:8s} {kind:7s} "
                  f"blocking {v['blocking']:3d} ({calls}) over {v['steps']} steps"
                  f"{'' if v['uniform'] else ' (not uniform)'}")
    for t in rank0["timing"]:
        print(f"NVE LJ {t['n_atoms']} atoms on {args.ranks} ranks: "
              f"{1e3 * t['s_per_step']:.2f} ms/step, {t['blocking_per_step']:.2f} blocking "
              f"({t['all_reduce_per_step']:.2f} all-reduces) per step; in collectives "
              f"{1e3 * t['collective_s_per_step']:.2f} ms/step (all-reduces "
              f"{1e3 * t['all_reduce_s_per_step']:.2f} ms; slowest rank)")
    for n, t in rank0.get("latency", {}).items():
        print(f"all-reduce of {n} doubles on {args.ranks} ranks: {1e6 * t:.1f} us")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "rank0": rank0}, indent=1))


if __name__ == "__main__":
    main()
