"""Decomposed MD: atoms held and peak memory per rank, owned domains vs the old replicated layout.

Runs velocity-Verlet NVE of an FCC crystal (argon for ``--model lj``, copper for the ML
models) over 1, 2, 4, 8 ranks. By default the script spawns its own ranks
(``torch.multiprocessing``), one fresh set of processes, with its own process group, for every
(size, ranks, layout) point, so that each process's peak RSS belongs to one point only::

    python benchmarks/dd_md.py --json benchmarks/results/dd_md_cpu.json --sizes 32000,256000
    python benchmarks/dd_md.py --json /tmp/dd_md.json --device cuda --model equivariant \
        --ranks 1 --sizes 100000                          # NCCL, fp32, one GPU per rank
    torchrun --nproc-per-node 4 benchmarks/dd_md.py --json /tmp/x.json   # ranks = world size

(Under torchrun all points run in the same processes one after the other; CUDA peaks are
reset per point, CPU peaks are reset through ``/proc/self/clear_refs`` where allowed.)

``--compile`` adds the layout ``compiled``: the domain layout stepped by the compiled
decomposed step (:class:`xnn.distributed.domain.compiled.CompiledDomainVerlet`, backend
``--compile-backend``), with its first (compiling) step time, recompiles after that step,
and compiled regions / communication points (graph breaks) per step; the ratios compare it
with ``domain`` (speed-up, conserved-energy difference)::

    python benchmarks/dd_md.py --compile --ranks 2 --sizes 2000 --layouts domain \
        --json benchmarks/results/dd_md_compiled_cpu.json

Layouts, both measured in the same run:

* ``domain``: :class:`xnn.distributed.DecomposedPotential`. Rank 0 builds the crystal and scatters
  it; each rank then holds its owned atoms and ghosts only, integrates its owned atoms
  (``nve.step(..., reduce=pot.reducer)``) and migrates atoms between steps
  (``pot.maybe_migrate``).
* ``replicated``: an emulation of the removed ``DecomposedPotential`` (commit c3cbffd): every
  rank builds the whole system, keeps a whole-system Verlet list (its safety check), runs the
  integrator on all N atoms, evaluates the model on its share of the atoms (the same domain
  code, fixed ownership) and all-gathers the N forces every step.
* ``domain_whole`` (not by default): ``domain`` with ``pot.filters = False``, the model given
  the whole local Verlet list (``cutoff + skin``) instead of its edges within the cutoff;
  ``filter_speedup`` is its step time over ``domain``'s.
* ``domain_unpaired`` (not by default): ``domain`` with ``pot.paired = False``, the local
  edges as built instead of reverse pairs (a model with ``pairs_edges`` does its radial work
  per edge); ``pairing_speedup`` is its step time over ``domain``'s.

Per point: atoms held per rank (owned + ghost; max over steps and ranks), min/max owned,
migrations, per-rank peak memory (RSS high-water mark ``ru_maxrss``, absolute and minus the
process's value before the system was built; on CUDA ``torch.cuda.max_memory_allocated``),
MD time per step (slowest rank) and atom-steps/s, and the final conserved energy (the two
layouts must agree). Goals, reported not asserted: at the most ranks, atoms held <= 1.4 N/P
and peak memory over baseline <= 0.2 x that of one rank.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import write_json, write_rank_json
except ImportError:  # run as `python benchmarks/dd_md.py` / `torchrun benchmarks/dd_md.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import write_json, write_rank_json

LAYOUTS = ("domain", "replicated", "compiled", "domain_whole", "domain_unpaired")
AR = {"symbol": "Ar", "a": 5.26, "mass": 39.948}  # LJ argon near its 0 K lattice constant
CU = {"symbol": "Cu", "a": 3.61, "mass": 63.546}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mode", default="spatial", choices=("spatial", "halo", "sync"),
                   help="mode of the eager domain layouts (spatial: sync for models with "
                        "sync points, else halo)")
    p.add_argument("--model", default="lj", choices=("lj", "equivariant", "schnet", "mace"))
    p.add_argument("--sizes", default="4000", help="comma list of target atom counts")
    p.add_argument("--ranks", default="1,2,4,8", help="comma list of rank counts")
    p.add_argument("--layouts", default="domain,replicated",
                   help="domain, replicated, domain_whole (domain with the model given the "
                        "whole local Verlet list: no filter to the cutoff)")
    p.add_argument("--replicated-max-atoms", type=int, default=None,
                   help="skip the replicated layout above this many atoms (memory)")
    p.add_argument("--steps", type=int, default=20, help="timed MD steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed MD steps first")
    p.add_argument("--dt", type=float, default=5.0, help="time step (fs)")
    p.add_argument("--temperature", type=float, default=80.0, help="initial temperature (K)")
    p.add_argument("--cutoff", type=float, default=6.0, help="model cutoff (Å; lj, equivariant)")
    p.add_argument("--skin", type=float, default=1.0, help="Verlet skin (Å)")
    p.add_argument("--dtype", default=None, choices=("float32", "float64"),
                   help="default: float64 on CPU, float32 on CUDA")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per point")
    p.add_argument("--compile", action="store_true",
                   help="also run the compiled decomposed step (layout compiled)")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of --compile (inductor, aot_eager)")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = ("dd_md" + ("" if args.model == "lj" else f"_{args.model}")
                + ("_compiled" if args.compile else "")
                + ("_replicated" if args.layouts == "replicated" else ""))
        args.json = results_path(name, args.device, 1)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.ranks = [int(s) for s in args.ranks.split(",") if s.strip()]
    args.layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    if args.compile and "compiled" not in args.layouts:
        args.layouts.append("compiled")
    bad = [s for s in args.layouts if s not in LAYOUTS]
    if bad:
        p.error(f"unknown layouts {bad}; choose from {list(LAYOUTS)}")
    args.dtype = args.dtype or ("float32" if args.device == "cuda" else "float64")
    return args


# ---------------------------------------------------------------------------- memory


def max_rss() -> int:
    """Peak resident set size of this process (bytes): ``ru_maxrss``."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb) * (1 if sys.platform == "darwin" else 1024)


def reset_max_rss() -> bool:
    """Reset the RSS high-water mark (Linux ``clear_refs``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes(device: torch.device) -> int:
    """CUDA: peak bytes allocated on ``device``; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return max_rss()


# ---------------------------------------------------------------------------- systems


def build_model(args, device, dtype):
    from xnn.models import build

    torch.manual_seed(0)
    if args.model == "lj":
        model = build("lj", sigma=3.405, epsilon=0.0104, cutoff=args.cutoff)
    elif args.model in ("equivariant", "schnet"):
        model = build(args.model, species=[29], cutoff=args.cutoff)
    else:
        from benchmarks.models import build_mace

        model = build("mace", model=build_mace(avg_num_neighbors=40.0))
    return model.to(device=device, dtype=dtype).eval()


def crystal(n_atoms: int, model: str, dtype):
    """FCC supercell (``k×k×k`` cubic cells, the count closest to ``n_atoms``), ids 0..N-1."""
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph

    el = AR if model == "lj" else CU
    k = max(1, round((n_atoms / 4) ** (1 / 3)))
    atoms = bulk(el["symbol"], "fcc", a=el["a"], cubic=True).repeat((k, k, k))
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   dtype=dtype)


class Replicated:
    """The old replicated layout: whole system on every rank, model decomposed, N forces
    all-gathered per step (what ``DecomposedPotential`` of commit c3cbffd held)."""

    def __init__(self, model, manager, skin: float):
        from xnn.distributed import parallelize
        from xnn.neighbors import VerletList

        self.pot = parallelize(model, manager, "halo", skin=skin)
        self.neighbors = VerletList(float(model.cutoff), skin)  # whole-system safety list
        self.rows = None

    def setup(self, whole):
        """Fix each rank's share of the (replicated) ``whole`` graph: its box at start."""
        owned = self.pot.scatter(whole if self.pot.rank == 0 else None)
        self.rows = owned.atom_id.to(whole.device)  # ids are 0..N-1: rows of ``whole``

    def __call__(self, graph, forces: bool = True, stress: bool = True, training=False):
        from xnn.data import keys as K
        from xnn.distributed import collectives as C

        self.neighbors(graph)
        out = self.pot(graph.select_atoms(self.rows), forces, stress)
        ids = C.gather_rows(out[K.ATOM_ID], self.pot.group)
        res = {k: out[k] for k in (K.ENERGY, K.STRESS, K.VIRIAL) if k in out}
        for name in (K.ENERGIES, K.FORCES):
            if name in out:
                rows = C.gather_rows(out[name], self.pot.group)
                full = rows.new_empty((graph.n_atoms, *rows.shape[1:]))
                full[ids] = rows
                res[name] = full
        return res

    def stats(self, n_atoms: int) -> dict:
        st = self.pot.stats()
        # the whole system plus the ghost copies of the model's domain
        return {**st, "n_held": n_atoms + st.get("n_ghost", 0)}


# ---------------------------------------------------------------------------- one point


def _md(state, pot, reduce, args, device, migrate, stats, step=None, done: int = 0):
    """Warm-up and timed NVE steps (``step(state)``: the compiled step; ``done``: warm-up
    steps already taken); returns (state, seconds per step, max atoms held)."""
    from xnn.distributed import collectives as C
    from xnn.dynamics import nve

    held = stats()["n_held"]
    for i in range(done, args.warmup + args.steps):
        if i == args.warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            C.all_reduce_sum(torch.zeros(1, device=device), getattr(pot, "group", None))
            t0 = time.perf_counter()
            if step is not None:  # communication time of the timed steps only
                step.mark = (step.stepper.comm_s, step.stepper.n_steps)
        state = step(state) if step else nve.step(state, pot, args.dt, reduce=reduce)
        if migrate:
            state = pot.maybe_migrate(state)
        held = max(held, stats()["n_held"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return state, (time.perf_counter() - t0) / max(args.steps, 1), held


def run_point(manager, args, n_atoms: int, layout: str) -> dict:
    """One (size, layout) point on this rank; every rank returns its own figures."""
    from xnn.distributed import parallelize
    from xnn.dynamics import nve
    from xnn.dynamics.reduce import LOCAL
    from xnn.dynamics.state import maxwell_boltzmann

    device, dtype = manager.device, getattr(torch, args.dtype)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fresh = reset_max_rss() if os.environ.get("DD_MD_SPAWNED") != "1" else True
    base = peak_bytes(device)
    model = build_model(args, device, dtype)
    t0 = time.perf_counter()
    if layout in ("domain", "compiled", "domain_whole", "domain_unpaired"):
        pot = parallelize(model, manager, "halo" if layout == "compiled" else args.mode,
                          skin=args.skin)
        pot.layout.filters = pot.filters and layout != "domain_whole"
        pot.layout.paired = pot.layout.paired and layout != "domain_unpaired"
        graph = crystal(n_atoms, args.model, dtype).to(device) if manager.is_main else None
        owned = pot.scatter(graph)
        del graph
        reduce = pot.reducer
        owned = maxwell_boltzmann(owned, args.temperature, seed=1, reduce=reduce)
        state = nve.init(owned, pot, reduce=reduce)
        stats = pot.stats
    else:
        pot = Replicated(model, manager, args.skin)
        whole = crystal(n_atoms, args.model, dtype).to(device)
        pot.setup(whole)
        reduce = LOCAL
        whole = maxwell_boltzmann(whole, args.temperature, seed=1)
        state = nve.init(whole, pot)
        stats = lambda: pot.stats(whole.n_atoms)  # noqa: E731
    gc.collect()
    setup_s = time.perf_counter() - t0
    e0 = float(nve.conserved(state, reduce))
    step, done, compiled = None, 0, {}
    if layout == "compiled":
        step, compiled = _compiled_step(pot, args, device)
        state, done = step(state), 1  # the first step compiles
        compiled["first_step_s"] = time.perf_counter() - compiled.pop("t0")
    state, step_s, held = _md(state, pot, reduce, args, device,
                              layout in ("domain", "domain_whole", "domain_unpaired"), stats,
                              step, done)
    e1 = float(nve.conserved(state, reduce))
    st = stats()
    if layout == "compiled":
        compiled = _compiled_figures(step, compiled)
    return {"rank": manager.rank, **compiled, "n_owned": st["n_owned"], "n_ghost": st["n_ghost"],
            "n_held_max": held, "migrations": st["migrations"], "grid": st["grid"],
            "paired": st.get("paired", False),
            "step_s": step_s, "setup_s": setup_s, "baseline_bytes": base,
            "peak_bytes": peak_bytes(device), "peak_fresh": fresh,
            "conserved_start_eV": e0, "conserved_end_eV": e1}


def _compiled_step(pot, args, device):
    """``step(state)`` of the compiled decomposed step, and the start time of its first
    call (taken by the caller)."""
    from xnn.distributed.domain.compiled import CompiledDomainVerlet

    stepper = CompiledDomainVerlet(pot, backend=args.compile_backend)

    def step(state):
        return stepper.step(state, args.dt)

    step.stepper = stepper
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step, {"t0": time.perf_counter()}


def _compiled_figures(step, figures: dict) -> dict:
    """Recompiles after the first step, the per-step counts of the compiled step and the
    host time of its communication points per timed step."""
    from xnn.distributed.domain.compiled import REGIONS_PER_STEP, steps_summary

    stepper = step.stepper
    s = steps_summary(stepper)
    comm0, n0 = getattr(step, "mark", (0.0, 0))
    s["comm_s_per_step"] = (stepper.comm_s - comm0) / max(stepper.n_steps - n0, 1)
    return {**figures, "compiles": s["compiles"],
            "recompiles_after_first_step": s["compiles"] - REGIONS_PER_STEP,
            "replans": s["replans"], "regions_per_step": s["regions_per_step"],
            "exchanges_per_step": s["exchanges_per_step"],
            "collectives_per_step": s["collectives_per_step"],
            "breaks_per_step": s["breaks_per_step"], "comm_s_per_step": s["comm_s_per_step"],
            "capacities": s["capacities"]}


# ---------------------------------------------------------------------------- ranks


def _rank_entry(rank, world, port, out_dir, args, n_atoms, layout):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DD_MD_SPAWNED="1")
    torch.set_num_threads(args.threads)
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(device=args.device)
    try:
        write_rank_json(out_dir, rank, lambda: run_point(manager, args, n_atoms, layout))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_point(args, world: int, n_atoms: int, layout: str) -> list[dict]:
    """Per-rank results of one point on ``world`` freshly spawned ranks."""
    from benchmarks.common import spawn_json_ranks

    return spawn_json_ranks(_rank_entry, world, (args, n_atoms, layout), args.timeout)


def torchrun_point(manager, args, n_atoms: int, layout: str) -> list[dict]:
    """Per-rank results of one point in the processes torchrun started (on every rank)."""
    import torch.distributed as dist

    try:
        mine = run_point(manager, args, n_atoms, layout)
    except Exception as e:  # noqa: BLE001 - reported in the JSON row
        mine = {"rank": manager.rank, "error": f"{type(e).__name__}: {e}"}
    if not dist.is_initialized():
        return [mine]
    every = [None] * manager.world_size
    dist.all_gather_object(every, mine)
    return every


# ---------------------------------------------------------------------------- report


def summarize(per_rank: list[dict], n_atoms_target: int, world: int, layout: str) -> dict:
    """One JSON row from the ranks' results."""
    row = {"layout": layout, "ranks": world, "n_atoms_target": n_atoms_target}
    errors = [r for r in per_rank if "error" in r]
    if errors:
        row["error"] = errors[0]["error"]
        row["errors"] = errors
        return row
    n = sum(r["n_owned"] for r in per_rank)
    step = max(r["step_s"] for r in per_rank)
    growth = [r["peak_bytes"] - r["baseline_bytes"] for r in per_rank]
    row.update(
        n_atoms=n, grid=per_rank[0]["grid"], paired=per_rank[0].get("paired", False),
        held_max=max(r["n_held_max"] for r in per_rank),
        owned_min=min(r["n_owned"] for r in per_rank),
        owned_max=max(r["n_owned"] for r in per_rank),
        ghost_max=max(r["n_ghost"] for r in per_rank),
        migrations=max(r["migrations"] for r in per_rank),
        step_s=step, atom_steps_per_s=n / step,
        setup_s=max(r["setup_s"] for r in per_rank),
        peak_bytes_max=max(r["peak_bytes"] for r in per_rank),
        peak_over_baseline_bytes_max=max(growth),
        baseline_bytes_max=max(r["baseline_bytes"] for r in per_rank),
        conserved_start_eV=per_rank[0]["conserved_start_eV"],
        conserved_end_eV=per_rank[0]["conserved_end_eV"],
        peak_reset_ok=all(r["peak_fresh"] for r in per_rank),
        per_rank=[{k: r[k] for k in ("rank", "n_owned", "n_ghost", "n_held_max",
                                     "migrations", "step_s", "baseline_bytes", "peak_bytes")}
                  for r in per_rank])
    row["held_over_ideal"] = row["held_max"] / (n / world)
    if layout == "compiled":
        for key in ("first_step_s", "recompiles_after_first_step", "compiles", "replans",
                    "comm_s_per_step"):
            row[key] = max(r[key] for r in per_rank)
        for key in ("regions_per_step", "exchanges_per_step", "collectives_per_step",
                    "breaks_per_step"):
            row[key] = per_rank[0][key]
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """Per size and layout: each rank count against 1 rank; domain against replicated."""
    ok = [r for r in rows if "error" not in r]
    out = []
    for r in ok:
        one = next((q for q in ok if q["n_atoms_target"] == r["n_atoms_target"]
                    and q["layout"] == r["layout"] and q["ranks"] == 1), None)
        rep = next((q for q in ok if q["n_atoms_target"] == r["n_atoms_target"]
                    and q["layout"] == "replicated" and q["ranks"] == r["ranks"]), None)
        d = {"n_atoms": r["n_atoms"], "layout": r["layout"], "ranks": r["ranks"],
             "held_over_ideal": r["held_over_ideal"],
             "goal_held_le_1.4": r["held_over_ideal"] <= 1.4}
        if one is not None:
            d["peak_over_baseline_vs_1_rank"] = (r["peak_over_baseline_bytes_max"]
                                                 / max(one["peak_over_baseline_bytes_max"], 1))
            d["peak_abs_vs_1_rank"] = r["peak_bytes_max"] / max(one["peak_bytes_max"], 1)
            d["goal_peak_le_0.2"] = d["peak_over_baseline_vs_1_rank"] <= 0.2
            d["speedup_vs_1_rank"] = one["step_s"] / r["step_s"]
        dom = next((q for q in ok if q["n_atoms_target"] == r["n_atoms_target"]
                    and q["layout"] == "domain" and q["ranks"] == r["ranks"]), None)
        if dom is not None and r["layout"] == "compiled":
            d["speedup_vs_eager_domain"] = dom["step_s"] / r["step_s"]
            d["conserved_end_diff_vs_domain_eV"] = abs(r["conserved_end_eV"]
                                                      - dom["conserved_end_eV"])
        if dom is not None and r["layout"] == "domain_whole":
            d["filter_speedup"] = r["step_s"] / dom["step_s"]  # whole list over filtered
            d["conserved_end_diff_vs_domain_eV"] = abs(r["conserved_end_eV"]
                                                      - dom["conserved_end_eV"])
        if dom is not None and r["layout"] == "domain_unpaired":
            d["pairing_speedup"] = r["step_s"] / dom["step_s"]  # per edge over paired
            d["conserved_end_diff_vs_domain_eV"] = abs(r["conserved_end_eV"]
                                                      - dom["conserved_end_eV"])
        if rep is not None and r["layout"] == "domain":
            d["peak_over_baseline_vs_replicated"] = (r["peak_over_baseline_bytes_max"]
                                                     / max(rep["peak_over_baseline_bytes_max"], 1))
            d["held_vs_replicated"] = r["held_max"] / rep["held_max"]
            d["conserved_end_diff_vs_replicated_eV"] = abs(r["conserved_end_eV"]
                                                           - rep["conserved_end_eV"])
        out.append(d)
    return out


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"{row['layout']:10s} N~{row['n_atoms_target']} P={row['ranks']}: {row['error']}"
    mib = 2**20
    return (f"{row['layout']:10s} N={row['n_atoms']} P={row['ranks']} grid={row['grid']} "
            f"held_max={row['held_max']} ({row['held_over_ideal']:.2f} N/P) "
            f"owned {row['owned_min']}-{row['owned_max']} mig={row['migrations']} "
            f"peak={row['peak_bytes_max'] / mib:.0f} MiB "
            f"(+{row['peak_over_baseline_bytes_max'] / mib:.0f}) "
            f"step={row['step_s'] * 1e3:.1f} ms {row['atom_steps_per_s']:.3g} atom-steps/s"
            + (f" first step {row['first_step_s']:.1f} s, recompiles "
               f"{row['recompiles_after_first_step']}, {row['breaks_per_step']:.2f} breaks/step "
               f"({row['comm_s_per_step'] * 1e3:.2f} ms/step in them)"
               if row["layout"] == "compiled" else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    under_torchrun = "WORLD_SIZE" in os.environ and os.environ.get("DD_MD_SPAWNED") != "1"
    manager = None
    if under_torchrun:
        from xnn.distributed import DistributedManager

        torch.set_num_threads(args.threads)
        manager = DistributedManager.initialize(device=args.device)
        rank_counts = [manager.world_size]
    else:
        rank_counts = args.ranks
    main_rank = manager is None or manager.is_main
    rows = []
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    for n in args.sizes:
        for world in rank_counts:
            for layout in args.layouts:
                if layout == "replicated" and args.replicated_max_atoms \
                        and n > args.replicated_max_atoms:
                    continue
                per_rank = (torchrun_point(manager, args, n, layout) if under_torchrun
                            else spawn_point(args, world, n, layout))
                row = summarize(per_rank, n, world, layout)
                rows.append(row)
                if main_rank:
                    print(_fmt(row), flush=True)
                    write_json(args.json, {
                        "benchmark": "dd_md", "settings": settings,
                        "fresh_processes_per_point": not under_torchrun,
                        "rows": rows, "ratios": ratios(rows)}, device=args.device)
    if under_torchrun:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
