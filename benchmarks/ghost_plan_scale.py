"""Ghost plans at scale: per-rank counts of decomposing 10^6-10^8-atom systems (and weak
scaling up to 10^9) over 8-1,024 ranks, without a model (issue 47 item 2).

For every row, :func:`xnn.distributed.cost.plan.plan_counts` gives the owned, ghost and held
atoms, the evaluated edges, the rows sent and received per exchange and the peers of every
rank; the row keeps their extremes and means, how each was obtained (``method``) and the
seconds it took. Widths: mode halo 2 layers x 5 Å + 1 Å skin = 11 Å (the equivariant
model's and MACE's default 2 interactions of 5 Å), mode sync 5 + 1 = 6 Å, mode graph the
edges' reach 5 + 1 = 6 Å (``halo_width`` of a graph row is that reach).

    python benchmarks/ghost_plan_scale.py --json benchmarks/results/ghost_plan_scale_cpu.json

Rows run cheapest first (crystals summed factor by factor take seconds at any size; the
liquid's spatial plans sum its crystal sites factor by factor and stream only the atoms
within its 0.5 Å jitter of a box or region face, :mod:`xnn.distributed.cost.jittered`, with
edges sampled on at most 200,000 atoms by a difference estimator; graph mode streams every
atom's Morton code and samples ghosts, minutes a row at 10^8 atoms) until ``--budget``
seconds; rows left out are listed under ``skipped`` with the reason. ``--only`` runs the
named jobs alone and merges them into an existing ``--json`` (the other rows, skips and
checks kept), e.g. the graph rows at 10^8 atoms:

    python benchmarks/ghost_plan_scale.py --json benchmarks/results/ghost_plan_scale_cpu.json \\
        --budget 5000 --only "mode=graph,n=1e8"

The file also records the check against the committed 1M-atom run (``dd_md_cpu16.json``):
owned and ghost atoms of every rank, equal or not; and ``liquid_check``: the liquid's banded
plans against every atom streamed at 10^6 atoms (owned, ghost, sent and received rows, peers).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xnn.distributed.cost.plan import plan_counts  # noqa: E402
from xnn.distributed.cost.systems import make_system  # noqa: E402
from xnn.errors import InputError  # noqa: E402

CUTOFF = 5.0
WIDTHS = {"halo": 2 * CUTOFF + 1.0, "sync": CUTOFF + 1.0, "graph": CUTOFF + 1.0}
RANKS = (8, 64, 512, 1024)
SIZES = (10**6, 10**7, 10**8)
CRYSTALS = ("fcc", "slab", "cylinder")
STREAMED_LIMIT = 10**7  #: spatial modes: stream at most this many atoms (max_streamed)
KEYS = {"scaling": str, "system": str, "n": lambda v: int(float(v)),
        "ranks": lambda v: int(float(v)), "mode": str}  #: --only's keys, a job's fields


def jobs():
    """``(scaling, system, n_atoms, n_ranks, mode)`` cheapest first."""
    out = [("strong", s, n, p, m) for n in SIZES for s in CRYSTALS for m in ("halo", "sync")
           for p in RANKS]
    out += [("weak", s, per * p, p, m) for per in (250_000, 1_000_000) for s in CRYSTALS
            for m in ("halo", "sync") for p in RANKS]
    out += [("strong", "liquid", n, p, m) for n in SIZES for m in ("halo", "sync")
            for p in RANKS]
    for n in SIZES:
        out += [("strong", s, n, p, "graph") for s in ("fcc", "slab", "cylinder", "liquid")
                for p in RANKS]
    return out


def row(scaling, system, n, p, mode):
    t0 = time.perf_counter()
    c = plan_counts(system, n, p, mode=mode, cutoff=CUTOFF, halo_width=WIDTHS[mode],
                    max_streamed=STREAMED_LIMIT)
    held = c.held
    return {"scaling": scaling, "system": system, "n_atoms": c.n_atoms, "n_ranks": p,
            "atoms_per_rank": round(c.n_atoms / p), "mode": mode, "cutoff": CUTOFF,
            "halo_width": WIDTHS[mode], "grid": list(c.grid),
            "owned_min": int(c.owned.min()), "owned_max": int(c.owned.max()),
            "owned_mean": float(c.owned.mean()), "ghost_max": int(c.ghost.max()),
            "ghost_mean": float(c.ghost.mean()), "held_max": int(held.max()),
            "edges_max": int(c.edges.max()), "edges_mean": float(c.edges.mean()),
            "send_rows_max": int(c.send_rows.max()), "recv_rows_max": int(c.recv_rows.max()),
            "peers_max": int(c.peers.max()), "method": c.method,
            "seconds": time.perf_counter() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def dd_md_check(root: Path) -> dict:
    """The plan against the committed 1M-atom LJ run: owned and ghost atoms per rank."""
    data = json.loads((root / "benchmarks/results/dd_md_cpu16.json").read_text())
    out = []
    for r in data["rows"]:
        c = plan_counts("fcc", r["n_atoms"], r["ranks"], mode="halo", cutoff=6.0,
                        halo_width=7.0, lattice_constant=5.26)
        out.append({"ranks": r["ranks"], "grid": list(c.grid),
                    "owned_equal": c.owned.tolist() == [q["n_owned"] for q in r["per_rank"]],
                    "ghost_equal": c.ghost.tolist() == [q["n_ghost"] for q in r["per_rank"]],
                    "ghost_max": int(c.ghost.max())})
    return {"file": "dd_md_cpu16.json", "system": "FCC argon a=5.26 Å, 63^3 cells, LJ cutoff "
            "6 Å + skin 1 Å (mode halo)", "rows": out}


def liquid_check() -> dict:
    """The liquid's banded plans (what the rows use) against every atom streamed, 10^6
    atoms: owned, ghost, sent and received rows and peers of every rank, equal or not."""
    out = []
    for mode, p in (("halo", 8), ("halo", 1024), ("sync", 64), ("sync", 512)):
        args = dict(mode=mode, cutoff=CUTOFF, halo_width=WIDTHS[mode], sample=0.001)
        band = plan_counts("liquid", 10**6, p, **args)
        t0 = time.perf_counter()
        streamed = plan_counts("liquid", 10**6, p, stream=True, **args)
        out.append({"mode": mode, "ranks": p, "streamed_s": time.perf_counter() - t0,
                    "equal": all(bool((getattr(band, k) == getattr(streamed, k)).all())
                                 for k in ("owned", "ghost", "send_rows", "recv_rows",
                                           "peers"))})
    return {"system": "liquid, 1,000,188 atoms, seed 0", "rows": out}


def selected(only: str | None) -> list[tuple]:
    """The jobs that ``--only`` names (``key=value`` pairs, comma-separated, values joined
    by ``|``; keys :data:`KEYS`), all of them without it."""
    if not only:
        return jobs()
    want = {}
    for pair in only.split(","):
        key, _, value = pair.partition("=")
        if key not in KEYS or not value:
            raise SystemExit(f"--only: {pair!r} is not key=value with a key of {list(KEYS)}")
        want[list(KEYS).index(key)] = {KEYS[key](v) for v in value.split("|")}
    return [j for j in jobs() if all(j[k] in v for k, v in want.items())]


def run_rows(todo, budget: float) -> tuple[list, list]:
    start, rows, skipped = time.perf_counter(), [], []
    for job in todo:
        scaling, system, n, p, mode = job
        if time.perf_counter() - start > budget:
            skipped.append({"job": list(job), "reason": f"past this run's budget of "
                            f"{budget:g} s (2 shared cores)"})
            continue
        try:
            rows.append(row(*job))
        except InputError as err:  # a crystal whose extents do not factor, too big to stream
            skipped.append({"job": list(job), "reason": str(err)})
            print(f"skipped {job}: {err}", flush=True)
            continue
        r = rows[-1]
        print(f"{system:8s} {r['n_atoms']:>11,d} {p:5d} {mode:5s} ghost_max {r['ghost_max']:>9,d}"
              f" edges_max {r['edges_max']:>12,d} {r['seconds']:7.1f} s", flush=True)
    return rows, skipped


def _same(r: dict, job) -> bool:
    scaling, system, n, p, mode = job
    return (r["scaling"], r["system"], r["n_ranks"], r["mode"]) == (scaling, system, p, mode) \
        and r["n_atoms"] == make_system(system, n).n_atoms


def merge(old: dict, todo, rows: list, skipped: list, only: str, seconds: float) -> dict:
    """``old`` with the rows of the jobs ``todo`` replaced or added (in job order) and their
    ``skipped`` entries replaced by this run's; every other row and check unchanged."""
    kept = [r for r in old["rows"] if not any(_same(r, j) for j in todo)]
    order = jobs()
    rank = {id(r): next((k for k, j in enumerate(order) if _same(r, j)), len(order))
            for r in kept + rows}
    out = dict(old)
    out["rows"] = sorted(kept + rows, key=lambda r: rank[id(r)])
    out["skipped"] = [s for s in old["skipped"] if tuple(s["job"]) not in set(todo)] + skipped
    out["merged_runs"] = old.get("merged_runs", []) + [{
        "only": only, "rows": len(rows), "seconds": seconds, "threads": 1,
        "torch_version": torch.__version__,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--budget", type=float, default=900.0, help="seconds for all rows")
    ap.add_argument("--only", help="run only these jobs and merge them into --json, e.g. "
                    "mode=graph,n=1e8,system=fcc|slab,ranks=8|64 (keys: scaling, system, n, "
                    "ranks, mode); other rows and the checks are kept as they are")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    start = time.perf_counter()
    todo = selected(args.only)
    if args.only:
        old = json.loads(Path(args.json).read_text())
        rows, skipped = run_rows(todo, args.budget)
        out = merge(old, todo, rows, skipped, args.only, time.perf_counter() - start)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        return 0
    rows, skipped = run_rows(todo, args.budget)
    out = {"benchmark": "ghost_plan_scale",
           "machine": {"torch_version": torch.__version__, "python": platform.python_version(),
                       "device": "cpu", "threads": 1,
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
           "settings": {"cutoff": CUTOFF, "widths": WIDTHS, "ranks": list(RANKS),
                        "sizes": list(SIZES), "budget_s": args.budget},
           "rows": rows, "skipped": skipped, "dd_md_check": dd_md_check(root),
           "liquid_check": liquid_check(),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "total_s": time.perf_counter() - start}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
