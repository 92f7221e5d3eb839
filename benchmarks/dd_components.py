"""Components of one decomposed MD step, per rank: the data the step-cost model is fitted to
and checked against (issue 47, :mod:`xnn.distributed.cost.model`).

Runs velocity-Verlet NVE of an FCC crystal (argon for ``--model lj``, copper for the ML
models) decomposed over 1, 2, 4, 8 freshly spawned gloo ranks (or the ranks torchrun
started) and records, per rank: owned, ghost and held atoms, local edges, rows sent and
received per exchange, peers, and over the timed steps the wall time split exclusively
(:class:`xnn.distributed.cost.tally.CollectiveTally`) into

* ``evaluate``: the model's forward and backward on owned + ghost atoms and the local
  graph (the compute the model prices per atom and per edge),
* ``integrate``: the integrator's own arithmetic,
* ``p2p``: halo and sync-point exchanges (``batch_isend_irecv``, waits included),
* ``all_reduce``, ``all_gather``, ``object``: the collectives,
* ``rebuild`` and ``migration``: ghost-plan rebuilds and atom migration (with their counts),

plus the number, bytes and messages of every collective per step (the first timed step's
calls listed one by one). ``--scales`` repeats each point with the lattice expanded (e.g.
``1.0,1.1``): fewer edges per atom at the same cutoff, which separates the cost per atom
from the cost per edge in the calibration. On ``--device cuda`` (one rank) it measures the
model's step on one GPU (fp32) at each size.

Commands the results come from (``--threads 1`` per rank; each call within ~8 min on a
dedicated 16-core host, from per-atom costs measured on a 2-core machine; ``--append`` adds
the call's rows to the file's)::

    python benchmarks/dd_components.py --models lj --ranks 1,2,4,8 --sizes 4000,32000 \
        --scales 1.0,1.1 --json benchmarks/results/dd_components_cpu16.json
    python benchmarks/dd_components.py --models schnet --ranks 1,2,4,8 --sizes 2048,4000 \
        --scales 1.0,1.1 --steps 5 --warmup 1 --append \
        --json benchmarks/results/dd_components_cpu16.json
    python benchmarks/dd_components.py --models equivariant --ranks 1,2,4,8 --sizes 500,2048 \
        --scales 1.0,1.1 --steps 5 --warmup 1 --append \
        --json benchmarks/results/dd_components_cpu16.json
    python benchmarks/dd_components.py --device cuda --models lj,equivariant,mace \
        --ranks 1 --sizes 4000,32000,108000,256000 --scales 1.0,1.1 --steps 8 \
        --json benchmarks/results/dd_components_h100.json
    python benchmarks/dd_components.py --models lj,equivariant --ranks 1,2 --sizes 500 \
        --steps 3 --json /tmp/dd_components.json          # quick look, 2 cores

Then ``python benchmarks/scaling_model.py`` checks the model on them (gloo link fitted on the
2-rank rows; MACE's GPU calibration from the H100 file).

Each (model, size, scale, ranks) point is a fresh set of processes; a point that fails or
exceeds ``--timeout`` is a row with ``error``. The JSON is rewritten after every point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import write_json, write_rank_json
except ImportError:  # run as `python benchmarks/dd_components.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import write_json, write_rank_json

SECTIONS = ("evaluate", "integrate", "rebuild", "migration", "p2p", "all_reduce",
            "all_gather", "object")
AR = {"symbol": "Ar", "a": 5.26}  # LJ argon near its 0 K lattice constant
CU = {"symbol": "Cu", "a": 3.61}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--models", default="lj,schnet,equivariant",
                   help="comma list of lj, schnet, equivariant, mace")
    p.add_argument("--mode", default="spatial", choices=("spatial", "halo", "sync", "graph"),
                   help="decomposition mode (spatial: sync for models with sync points)")
    p.add_argument("--sizes", default="4000", help="comma list of target atom counts")
    p.add_argument("--scales", default="1.0", help="comma list of lattice scale factors")
    p.add_argument("--ranks", default="1,2,4,8", help="comma list of rank counts")
    p.add_argument("--steps", type=int, default=10, help="timed MD steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed MD steps first")
    p.add_argument("--dt", type=float, default=2.0, help="time step (fs)")
    p.add_argument("--temperature", type=float, default=300.0, help="initial temperature (K)")
    p.add_argument("--cutoff", type=float, default=5.0, help="model cutoff (Å; not mace)")
    p.add_argument("--skin", type=float, default=1.0, help="Verlet skin (Å)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    p.add_argument("--append", action="store_true",
                   help="keep the rows already in --json (another model's call)")
    args = p.parse_args(argv)
    args.models = [s.strip() for s in args.models.split(",") if s.strip()]
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.scales = [float(s) for s in args.scales.split(",") if s.strip()]
    args.ranks = [int(s) for s in args.ranks.split(",") if s.strip()]
    bad = [m for m in args.models if m not in ("lj", "schnet", "equivariant", "mace")]
    if bad:
        p.error(f"unknown models {bad}; choose from lj, schnet, equivariant, mace")
    return args


# ---------------------------------------------------------------------------- one point


def build_model(name: str, cutoff: float, device, dtype):
    from xnn.models import build

    torch.manual_seed(0)
    if name == "lj":
        model = build("lj", sigma=3.405, epsilon=0.0104, cutoff=cutoff)
    elif name in ("equivariant", "schnet"):
        model = build(name, species=[29], cutoff=cutoff)
    else:
        from benchmarks.models import build_mace

        model = build("mace", model=build_mace(avg_num_neighbors=40.0))
    return model.to(device=device, dtype=dtype).eval()


def crystal(n_atoms: int, model: str, scale: float, dtype):
    """FCC supercell (``k×k×k`` cubic cells, count closest to ``n_atoms``), lattice × scale."""
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph

    el = AR if model == "lj" else CU
    k = max(1, round((n_atoms / 4) ** (1 / 3)))
    atoms = bulk(el["symbol"], "fcc", a=el["a"] * scale, cubic=True).repeat((k, k, k))
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   dtype=dtype)


def _instrument(pot, tally) -> None:
    """Time ghost-plan rebuilds and migrations as their own sections (instance wrappers)."""
    rebuild, migrate = pot._rebuild, pot.layout.migrate

    def timed_rebuild(*a, **kw):
        with tally.section("rebuild"):
            return rebuild(*a, **kw)

    def timed_migrate(*a, **kw):
        with tally.section("migration"):
            return migrate(*a, **kw)

    pot._rebuild, pot.layout.migrate = timed_rebuild, timed_migrate


def _calls(calls) -> dict:
    out = {}
    for c in calls:
        d = out.setdefault(c.kind, {"calls": 0, "bytes_sent": 0, "bytes_recv": 0,
                                    "messages": 0})
        d["calls"] += 1
        d["bytes_sent"] += c.bytes_sent
        d["bytes_recv"] += c.bytes_recv
        d["messages"] += c.messages
    return out


def run_point(manager, args, model_name: str, n_atoms: int, scale: float) -> dict:
    """One point on this rank: its counts and its step split into components."""
    from xnn.distributed import parallelize
    from xnn.distributed.cost.tally import CollectiveTally
    from xnn.distributed.graph.auto import feature_size
    from xnn.dynamics import nve
    from xnn.dynamics.state import maxwell_boltzmann

    device = manager.device
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    model = build_model(model_name, args.cutoff, device, dtype)
    pot = parallelize(model, manager, args.mode, skin=args.skin)
    graph = crystal(n_atoms, model_name, scale, dtype).to(device) if manager.is_main else None
    owned = pot.scatter(graph)
    del graph
    reduce = pot.reducer
    state = nve.init(maxwell_boltzmann(owned, args.temperature, seed=1, reduce=reduce), pot,
                     reduce=reduce)
    tally = CollectiveTally()
    _instrument(pot, tally)

    def evaluate(graph, forces=True, stress=True):
        with tally.section("evaluate"):
            return pot(graph, forces, stress)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    st0 = pot.stats()
    held, edges = st0["n_held"], st0["n_edges"]
    with tally:
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                sync()
                tally.seconds.clear()
                mark, c0 = tally.mark(), pot.state.counters
                t0 = time.perf_counter()
            with tally.section("integrate"):
                state = nve.step(state, evaluate, args.dt, reduce=reduce)
                state = pot.maybe_migrate(state)
            if i == args.warmup:
                first = tally.mark()
            held = max(held, pot.stats()["n_held"])
        sync()
    wall = (time.perf_counter() - t0) / args.steps
    st, c1 = pot.stats(count_within=True), pot.state.counters
    n = args.steps
    return {"rank": manager.rank, "n_owned": st["n_owned"], "n_ghost": st["n_ghost"],
            "n_held": st["n_held"], "n_held_max": held, "n_edges": st["n_edges"],
            "n_edges_within": st.get("n_edges_within"), "n_edges_start": edges,
            "n_send": st.get("n_send", 0),
            "n_recv": st.get("n_recv", 0), "n_peers": st.get("n_peers", 0),
            "grid": st.get("grid"), "mode": pot.mode, "halo_width": pot.halo_width,
            "sync_points": len(list(model.sync_points)) if pot.layout.syncs else 0,
            "num_interactions": int(model.num_interactions),
            "feature_width": feature_size(model), "dtype_bytes": torch.finfo(dtype).bits // 8,
            "n_params": sum(p.numel() for p in model.parameters()),
            "rebuilds": c1.rebuilds - c0.rebuilds, "migrations": c1.migrations - c0.migrations,
            "step_s": wall,
            "cuda_peak_bytes": (torch.cuda.max_memory_allocated(device)
                                if device.type == "cuda" else None),
            "seconds_per_step": {k: tally.seconds.get(k, 0.0) / n for k in SECTIONS},
            "per_step": {k: {q: v / n for q, v in d.items()}
                         for k, d in _calls(tally.calls(since=mark)).items()},
            "first_step_calls": [[c.kind, c.bytes_sent, c.bytes_recv, c.messages, c.section]
                                 for c in tally.calls(since=mark)[: first - mark]]}


# ---------------------------------------------------------------------------- ranks


def _rank_entry(rank, world, port, out_dir, args, model_name, n_atoms, scale):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DD_MD_SPAWNED="1")
    torch.set_num_threads(args.threads)
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(device=args.device)
    try:
        write_rank_json(out_dir, rank, lambda: run_point(manager, args, model_name, n_atoms, scale))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def point(args, manager, world, model_name, n_atoms, scale) -> list[dict]:
    if manager is None:
        from benchmarks.common import spawn_json_ranks

        return spawn_json_ranks(_rank_entry, world, (args, model_name, n_atoms, scale),
                                args.timeout)
    import torch.distributed as dist

    try:
        mine = run_point(manager, args, model_name, n_atoms, scale)
    except Exception as e:  # noqa: BLE001 - reported in the JSON row
        mine = {"rank": manager.rank, "error": f"{type(e).__name__}: {e}"}
    every = [None] * manager.world_size
    dist.all_gather_object(every, mine)
    return every


def summarize(per_rank: list[dict], model_name: str, world: int, n_target: int,
              scale: float) -> dict:
    row = {"model": model_name, "ranks": world, "n_atoms_target": n_target, "scale": scale}
    errors = [r for r in per_rank if "error" in r]
    if errors:
        return {**row, "error": errors[0]["error"], "errors": errors}
    r0 = per_rank[0]
    row.update({k: r0[k] for k in ("mode", "grid", "halo_width", "sync_points",
                                   "num_interactions", "feature_width", "dtype_bytes",
                                   "n_params")})
    row.update(n_atoms=sum(r["n_owned"] for r in per_rank),
               step_s=max(r["step_s"] for r in per_rank),
               rebuilds=max(r["rebuilds"] for r in per_rank),
               migrations=max(r["migrations"] for r in per_rank), per_rank=per_rank)
    row["atom_steps_per_s"] = row["n_atoms"] / row["step_s"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    manager = None
    if "WORLD_SIZE" in os.environ and os.environ.get("DD_MD_SPAWNED") != "1":
        from xnn.distributed import DistributedManager

        torch.set_num_threads(args.threads)
        manager = DistributedManager.initialize(device=args.device)
        args.ranks = [manager.world_size]
    rows, settings = [], {k: v for k, v in vars(args).items() if k != "json"}
    if args.append and Path(args.json).exists():
        rows = json.loads(Path(args.json).read_text()).get("rows", [])
    for model_name in args.models:
        for n in args.sizes:
            for scale in args.scales:
                for world in args.ranks:
                    row = summarize(point(args, manager, world, model_name, n, scale),
                                    model_name, world, n, scale)
                    row.update(steps=args.steps, warmup=args.warmup)  # calls differ in a file
                    rows.append(row)
                    if manager is None or manager.is_main:
                        print(f"{model_name} N={row.get('n_atoms', n)} x{scale} P={world}: "
                              + (row["error"] if "error" in row else
                                 f"step {row['step_s'] * 1e3:.1f} ms"), flush=True)
                        write_json(args.json, {"benchmark": "dd_components",
                                               "settings": settings, "rows": rows},
                                   device=args.device)
    if manager is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
