"""xnn against torch-sim and nvalchemi-toolkit: MACE NVT on one device, same weights, one run
(issue 20, deliverable 5).

Cases (FCC Cu, rattled 0.05 Å, Langevin BAOAB NVT at 300 K, friction 0.01/fs, dt 1 fs,
energy + forces only, one force call per step):

* ``mace``: the random-weight mace-torch ``ScaleShiftMACE`` of ``benchmarks/models.py``
  (128x0e+128x1o, l_max 3, correlation 3, 2 layers, r_c 6 Å), one ``state_dict`` copied
  into every framework: xnn (``xnn.models.build("mace", model=...)``, Verlet list, skin
  1 Å), torch-sim (``MaceModel``, its ``nvt_langevin_*``), nvalchemi-toolkit
  (``MACEWrapper``, ``NVTLangevin``, ``NeighborListHook`` with skin 1 Å);
* ``equivariant``: xnn's own equivariant model of about MACE's size (no peer).

Each at ``--sizes`` atoms (one system) and at ``--batched B×n`` (B systems of ~n atoms in
one batch). Frameworks (``--frameworks``; ``--compile`` adds the ``xnn_*compiled`` ones):

* ``xnn``: eager; ``xnn_compiled``: ``Potential(compile=True)`` (mace-torch's compile
  preparation, ``torch.compile``), Langevin; ``xnn_step_compiled``: the compiled Langevin
  step of ``md.compile`` (:class:`xnn.dynamics.compiled_thermo.CompiledIntegrator`; an
  untraceable model is recorded as an error); ``xnn_step_graph``: the same step replayed as
  a CUDA graph (``md.cuda_graph``; CUDA only);
* ``torch_sim`` / ``torch_sim_compiled`` (``MaceModel(compile_mode="default")``);
* ``nvalchemi`` / ``nvalchemi_compiled`` (the MACE module through ``torch.compile``, as
  ``MACEWrapper.from_checkpoint(compile_model=True)`` does).

Per case and framework: ``atom_steps_per_s`` (median over ``--blocks`` timed blocks after
``--warmup`` steps), ``time_to_first_step_s`` (from a fresh model object: wrapper, first
force call, first step; compilation included), peak memory (CUDA: ``max_memory_allocated``,
reset before each framework; CPU: the process peak RSS, not reset), and the forces of the
starting configuration against xnn's eager ones (``force_max_abs_diff_eV_A``;
``forces_match``): a speed-up of a wrong computation does not count. Ratios xnn/peer per
row; ``goals`` compares them with the issue's goals. Every framework runs in its own try
block under ``--budget-s`` (an alarm): failures are recorded as ``skipped: ...``,
``error: ...`` or ``out of memory``; the JSON is rewritten after every framework. Peers are
imported lazily, inside their functions: all three can live in one Python (>= 3.12 for
torch-sim 0.6).

Usage::

    python benchmarks/peers.py --json /tmp/peers_cpu.json --quick
    python benchmarks/peers.py --json out.json --device cuda --dtype float32 \\
        --sizes 1000,10000,100000 --batched 64x100 --steps 9 --budget-s 150 \\
        --frameworks xnn,xnn_compiled,torch_sim,nvalchemi --compile-cases 10000
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from benchmarks.common import peak_memory, reset_peak_memory, synchronize, write_json
except ImportError:  # run as `python benchmarks/peers.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import peak_memory, reset_peak_memory, synchronize, write_json

from benchmarks.peers_frameworks import (  # noqa: E402
    DT_FS,
    FRICTION,
    SKIN,
    T_K,
    XNN,
    base_model,
    start,
    start_velocities,
    systems,
)

SIZES, QUICK_SIZES = (1_000, 10_000, 100_000), (32,)
BATCHED, QUICK_BATCHED = "64x100", "2x32"
PEERS = ("torch_sim", "torch_sim_compiled", "nvalchemi", "nvalchemi_compiled")
GOALS = (  # (measure, model, batched, peer, goal): xnn / peer atom-steps/s
    ("MACE MD vs torch-sim newest, 10k atoms", "mace", False, "torch_sim", 2.0),
    ("MACE MD vs nvalchemi 0.2, 10k atoms, 1 GPU", "mace", False, "nvalchemi", 1.3),
    ("batched 64 x 100-atom MD vs torch-sim batched", "mace", True, "torch_sim", 1.5),
)


def _base(fw: str) -> str:
    """The framework of a name, without a ``@fusion+radial`` variant (``--variants``)."""
    return fw.split("@")[0]


class _Variant:
    """Sets xnn's MACE fusion, radial and index-dtype switches for one
    ``name@fusion+radial[+int32]`` framework and restores them after (a name without ``@``
    leaves them as they are)."""

    def __init__(self, fw: str):
        self.settings = fw.split("@")[1].split("+") if "@" in fw else None

    def __enter__(self):
        if self.settings:
            from xnn.models import equivariant
            from xnn.models.external import _mace_pairs

            self.modules = _mace_pairs, equivariant
            self.old = (_mace_pairs.FUSION, _mace_pairs.RADIAL, _mace_pairs.INDEX_DTYPE,
                        equivariant.RADIAL_KERNEL)
            fusion, radial, *index = self.settings
            self._set(fusion, radial, getattr(torch, index[0]) if index else torch.int64, radial)

    def __exit__(self, *exc):
        if self.settings:
            self._set(*self.old)

    def _set(self, fusion, radial, index_dtype, radial_kernel):
        mace, equivariant = self.modules
        mace.FUSION, mace.RADIAL, mace.INDEX_DTYPE = fusion, radial, index_dtype
        equivariant.RADIAL_KERNEL = radial_kernel


class OverBudget(Exception):
    """The per-framework time budget (``--budget-s``) ran out."""


# --------------------------------------------------------------------------- measuring
def _alarm(signum, frame):
    raise OverBudget


def measure(launch, n_atoms, steps, warmup, blocks, budget_s, device) -> tuple[dict, torch.Tensor]:
    """Time ``launch() -> (forces0, advance, info)``; returns (row, forces0 on the CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak_memory(device)
    t0 = time.perf_counter()
    forces0, advance, info = launch()
    advance(1)
    synchronize(device)
    row = {**info, "time_to_first_step_s": time.perf_counter() - t0}
    advance(warmup)
    per, rates = max(1, steps // blocks), []
    for _ in range(blocks):
        synchronize(device)
        t = time.perf_counter()
        advance(per)
        synchronize(device)
        rates.append(n_atoms * per / (time.perf_counter() - t))
        if time.perf_counter() - t0 > 0.8 * budget_s:
            row["note"] = "timed blocks cut short by --budget-s"
            break
    peak = peak_memory(device)
    row.update(atom_steps_per_s=statistics.median(rates), block_rates=rates,
               steps_per_block=per, warmup_steps=warmup, peak_bytes=peak,
               peak_bytes_per_atom=None if peak is None else peak / n_atoms,
               peak_kind="cuda max_memory_allocated" if device.type == "cuda"
               else "process peak RSS (not reset)")
    return row, forces0.detach().to("cpu", torch.float64)


def guarded(launch, n_atoms, args, device) -> tuple[dict, torch.Tensor | None]:
    """:func:`measure` in a try block under the time budget: never raises."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, args.budget_s)
    try:
        return measure(launch, n_atoms, args.steps, args.warmup, args.blocks, args.budget_s,
                       device)
    except OverBudget:
        return {"error": f"over budget ({args.budget_s:g} s, --budget-s)"}, None
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}, None
    except ImportError as e:
        return {"skipped": f"not importable: {e}"}, None
    except Exception as e:  # a peer's API or a model that does not trace: record, go on
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return {"error": f"{type(e).__name__}: {first}"}, None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def force_check(row: dict, forces: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    """Add the starting-configuration force difference from xnn's eager forces to ``row``."""
    diff = float((forces - ref).abs().max())
    scale = max(float(ref.abs().max()), 1e-12)
    tol = 1e-4 if dtype == torch.float32 else 1e-9  # relative to max |F|
    row.update(force_max_abs_diff_eV_A=diff, force_max_abs_ref_eV_A=scale,
               forces_match=diff <= tol * scale)


def ratios(frameworks: dict) -> dict:
    """``"x/p"``: atom-steps/s of each xnn variant over each peer (both measured)."""
    ok = {k: r["atom_steps_per_s"] for k, r in frameworks.items() if "atom_steps_per_s" in r}
    return {f"{x}/{p}": ok[x] / ok[p] for x in ok if _base(x) in XNN for p in PEERS if p in ok}


def goals(rows: list) -> list:
    """The issue's goals: best xnn variant / best variant of the peer, both with forces
    matching xnn's eager ones (``ratio`` None where a side is missing or differs)."""
    out = []
    for measure_, kind, batched, peer, goal in GOALS:
        cand = [r for r in rows if "frameworks" in r and r["model"] == kind
                and (r["n_systems"] > 1) == batched]
        if not batched:  # the row closest to 10k atoms
            cand = sorted(cand, key=lambda r: abs(r["n_atoms"] - 10_000))[:1]
        entry = {"measure": measure_, "goal": goal, "ratio": None, "met": None}
        for r in cand:
            fw = r["frameworks"]
            xs = {k: fw[k]["atom_steps_per_s"] for k in fw if _base(k) in XNN
                  and "atom_steps_per_s" in fw[k] and fw[k].get("forces_match", True)}
            ps = {k: fw[k]["atom_steps_per_s"] for k in PEERS if k.startswith(peer)
                  and "atom_steps_per_s" in fw.get(k, {}) and fw[k].get("forces_match")}
            if xs and ps:
                x, p = max(xs, key=xs.get), max(ps, key=ps.get)
                entry.update(n_atoms=r["n_atoms"], xnn=x, peer=p, ratio=xs[x] / ps[p],
                             met=xs[x] / ps[p] >= goal)
        out.append(entry)
    return out


# --------------------------------------------------------------------------- driver
def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("torch", "torch-sim-atomistic", "nvalchemi-toolkit", "nvalchemi-toolkit-ops",
              "mace-torch", "e3nn", "warp-lang", "cuequivariance-torch", "vesin"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            out[d] = None
    return out


def cases(args) -> list[tuple[str, int, int]]:
    """``(model, atoms per system, n_systems)`` in run order."""
    shapes = [(n, 1) for n in args.sizes]
    if args.batched:
        b, n = (int(x) for x in args.batched.lower().split("x"))
        shapes.append((n, b))
    return [(m, n, b) for m in args.models for n, b in shapes]


def run_case(model_name, base, n, b, args, device, dtype, on_update) -> dict:
    atoms_list = systems(n, b)
    n_atoms = sum(len(a) for a in atoms_list)
    row = {"model": model_name, "n_systems": b, "atoms_per_system": len(atoms_list[0]),
           "n_atoms": n_atoms, "frameworks": {}}
    v = start_velocities(atoms_list, dtype)
    ref = None
    tag = "batched" if b > 1 else str(n)
    for fw in args.frameworks:
        if model_name != "mace" and _base(fw) not in XNN:
            continue  # no peer runs xnn's own model
        if _base(fw).endswith("compiled") and args.compile_cases and tag not in args.compile_cases:
            continue
        with _Variant(fw):
            res, forces = guarded(lambda fw=fw: start(_base(fw), model_name, base, atoms_list, v,
                                                      device, dtype, args.cueq),
                                  n_atoms, args, device)
        if forces is not None:
            if ref is None and fw == "xnn":
                ref = forces
            if ref is not None and fw != "xnn":
                force_check(res, forces, ref, dtype)
        row["frameworks"][fw] = res
        row["ratios_xnn_over_peer"] = ratios(row["frameworks"])
        print(model_name, n_atoms, fw, {k: v_ for k, v_ in res.items() if k != "block_rates"},
              flush=True)
        on_update(row)
    return row


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--sizes", default=None, help="atom counts of one-system cases "
                   "(default 1000,10000,100000; --quick 32); '' for none")
    p.add_argument("--batched", default=None, help="BxN: B systems of ~N atoms (default "
                   "64x100; --quick 2x32); 'none' to skip")
    p.add_argument("--models", default="mace,equivariant", help="mace,equivariant")
    p.add_argument("--frameworks", default="xnn,torch_sim,nvalchemi",
                   help=f"comma-separated of {','.join(XNN + PEERS)}")
    p.add_argument("--compile", action="store_true",
                   help="add xnn_compiled, xnn_step_compiled (and xnn_step_graph on CUDA)")
    p.add_argument("--cueq", action="store_true", help="every framework on its "
                   "cuEquivariance path (xnn backend=cueq, torch-sim/nvalchemi enable_cueq)")
    p.add_argument("--mace-fusion", default=None, choices=("index", "split", "concat"),
                   help="with --cueq, xnn's paired MACE step: how cuEquivariance's fused "
                        "convolution gets the half-size radial weights (default: "
                        "xnn.models.external._mace_pairs.FUSION)")
    p.add_argument("--radial", default=None, choices=("torch", "ieee", "tf32x3"),
                   help="xnn's radial MLPs on CUDA: their torch layers, or the fused Triton "
                        "kernel in fp32 / 3xTF32 (sets _mace_pairs.RADIAL: MACE with --cueq, "
                        "paired; and equivariant.RADIAL_KERNEL; default: as they are)")
    p.add_argument("--variants", default="", help="FUSION+RADIAL[+INDEX],...: xnn_step_graph "
                   "(CUDA) or xnn_step_compiled once per combination of _mace_pairs.FUSION "
                   "(index, split, concat), the radial path (torch, ieee, tf32x3) and the "
                   "edge-index dtype (int64 default, int32), in one run against the same "
                   "peers, e.g. index+torch,split+tf32x3,split+tf32x3+int32")
    p.add_argument("--compile-cases", default="", help="cases where *_compiled run: atom "
                   "counts and/or 'batched' (default: all)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 12; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first "
                   "(default 2; quick 1)")
    p.add_argument("--blocks", type=int, default=None, help="timed blocks (default 3; quick 2)")
    p.add_argument("--budget-s", type=float, default=240.0, help="time limit per case and "
                   "framework, compilation included (s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--small-models", action="store_true", help="8-channel MACE and "
                   "equivariant models instead of the reference size (tests)")
    a = p.parse_args(argv)
    if a.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        a.json = results_path("peers", a.device)
    a.sizes = tuple(int(x) for x in (a.sizes if a.sizes is not None else ",".join(
        map(str, QUICK_SIZES if a.quick else SIZES))).split(",") if x)
    a.batched = None if (a.batched or "").lower() == "none" else \
        a.batched or (QUICK_BATCHED if a.quick else BATCHED)
    a.models = [m for m in a.models.split(",") if m]
    a.frameworks = [f for f in a.frameworks.split(",") if f]
    if a.compile:
        extra = ("xnn_compiled", "xnn_step_compiled") + (("xnn_step_graph",)
                                                        if a.device == "cuda" else ())
        a.frameworks += [f for f in extra if f not in a.frameworks]
    step = "xnn_step_graph" if a.device == "cuda" else "xnn_step_compiled"
    for v in (x for x in a.variants.split(",") if x):
        fusion, radial, *index = v.split("+") + [""]
        if (fusion not in ("index", "split", "concat") or radial not in ("torch", "ieee", "tf32x3")
                or index not in ([""], ["int32", ""], ["int64", ""])):
            p.error(f"--variants: {v!r} is not FUSION+RADIAL[+int32|int64]")
        a.frameworks.append(f"{step}@{v}")
    unknown = sorted({_base(f) for f in a.frameworks} - set(XNN + PEERS)) + sorted(
        set(a.models) - {"mace", "equivariant"})
    if unknown:
        p.error(f"unknown framework/model {unknown}")
    if "xnn" not in a.frameworks:  # the force reference: without it no ratio counts
        a.frameworks.append("xnn")
    a.frameworks.sort(key=lambda f: f != "xnn")  # xnn first: the force reference
    a.compile_cases = {x for x in a.compile_cases.split(",") if x}
    a.steps = a.steps or (2 if a.quick else 12)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 2)
    a.blocks = a.blocks or (2 if a.quick else 3)
    return a


def main(argv=None) -> int:
    args = parse(argv)
    if args.mace_fusion:
        from xnn.models.external import _mace_pairs

        _mace_pairs.FUSION = args.mace_fusion
    if args.radial:
        from xnn.models import equivariant
        from xnn.models.external import _mace_pairs

        _mace_pairs.RADIAL = equivariant.RADIAL_KERNEL = args.radial
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows: list = []
    head = {"benchmark": "peers", "dtype": args.dtype, "dt_fs": DT_FS, "temperature_K": T_K,
            "friction_per_fs": FRICTION, "skin_A": SKIN, "steps": args.steps,
            "warmup": args.warmup, "blocks": args.blocks, "budget_s": args.budget_s,
            "quick": args.quick, "small_models": args.small_models, "cueq": args.cueq,
            "mace_fusion": args.mace_fusion,
            "radial": args.radial, "variants": args.variants,
            "versions": _versions(),
            "force_check": "max |F - F_xnn| at the start; forces_match: <= 1e-4 (fp32) / "
                           "1e-9 (fp64) of max |F_xnn|"}

    def save(current=None):
        done = rows + ([current] if current is not None else [])
        write_json(args.json, {**head, "results": done, "goals": goals(done)},
                   device=str(device))

    bases: dict = {}
    for model_name, n, b in cases(args):
        if model_name not in bases:
            try:
                bases[model_name] = base_model(model_name, args.small_models)
            except ImportError as e:
                bases[model_name] = None
                rows.append({"model": model_name, "skipped": f"not importable: {e}"})
                save()
        if bases[model_name] is not None:
            rows.append(run_case(model_name, bases[model_name], n, b, args, device, dtype, save))
            save()
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
