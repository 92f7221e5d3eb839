"""Training throughput: structures/s per model, DDP efficiency, and mace_run_train for comparison.

All models train on the same ASE-EMT Cu data (energy + forces + stress loss, double backward):

* ``models.<name>.structures_per_s``: steady-state optimizer steps (after warm-up) of the
  xnn :class:`~xnn.training.trainer.Trainer` with batches of ``--batch-size`` structures.
* ``epoch_time``: seconds per epoch of one ``xnn train`` run of the ``equivariant`` model and
  one ``mace_run_train`` (mace-torch CLI) run training a ``ScaleShiftMACE`` of similar size
  (64 channels, hidden L=1, max_ell 2, correlation 3, 2 interactions, same cutoff, loss
  weights, EMA, batch size and data), each the median period between consecutive epoch-end
  log lines (timed as they arrive): training + validation + logging + checkpoints, start-up
  excluded. Skipped (recorded as such) when ``mace_run_train`` is not installed.
* under ``torchrun --nproc-per-node N``: ``models.<name>`` holds the step time with data
  parallelism (global batch = N × batch size) and, right before or after each such step on
  every rank (they take turns at going first), the step time of that rank's share alone (a
  second model, no communication);
  ``ddp_efficiency`` = mean over ranks of the median alone time / of the median data-parallel
  time (weak scaling: one GPU with batches of ``--batch-size`` vs N GPUs). Both steps start
  right after a barrier (a step that follows a cross-rank wait runs ~1.5 ms slower, as
  every real data-parallel step does). ``phases_ms_per_rank`` splits both steps into the
  host time of their parts (:data:`PHASES`), to locate the extra time of the data-parallel
  step.

Usage::

    python benchmarks/training.py --quick --json out.json                 # CPU, small
    python benchmarks/training.py --device cuda --json gpu.json
    torchrun --nproc-per-node 2 benchmarks/training.py --device cuda --json ddp.json --no-mace
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import synchronize, write_json  # noqa: E402
from xnn.data.datasets import make_batches, shard_batch  # noqa: E402
from xnn.data.emt import write_emt  # noqa: E402
from xnn.data.sources import read_structures
from xnn.models import build  # noqa: E402
from xnn.neighbors.datasets import WithEdges  # noqa: E402
from xnn.training.losses import TermSpec  # noqa: E402
from xnn.training.reducer import LocalReducer  # noqa: E402
from xnn.training.trainer import Trainer  # noqa: E402

CUTOFF = 5.0
SPECS = {"energy": TermSpec(1.0), "forces": TermSpec(10.0), "stress": TermSpec(1.0)}


def model_hparams(name: str, quick: bool) -> dict:
    small = quick
    return {
        "schnet": dict(num_features=32 if small else 128, num_filters=32 if small else 128,
                       num_interactions=2 if small else 3),
        "painn": dict(num_features=32 if small else 128, num_interactions=2 if small else 3),
        "equivariant": dict(channels=16 if small else 64, l_max=2, hidden_l_max=1,
                            num_interactions=2, correlation=3),
    }[name]


def make_trainer(name: str, quick: bool, device, reducer, avg_neighbors: float,
                 compile: bool = False) -> Trainer:
    torch.manual_seed(0)
    hp = model_hparams(name, quick)
    if name == "equivariant":
        hp["avg_num_neighbors"] = avg_neighbors
    model = build(name, species=[29], cutoff=CUTOFF, **hp).to(device)
    reducer.broadcast_module(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return Trainer(model, SPECS, opt, reducer=reducer, device=device, dtype=torch.float32,
                   grad_clip=10.0, compile=compile)


def time_steps(trainer: Trainer, ds, batches, rank: int, world: int, device,
               alone: Trainer | None = None, gc_every: int = 0,
               barrier_alone: bool = False, alternate: bool = True) -> dict:
    """Seconds per optimizer step over ``batches`` (the first, warm-up step not counted):
    ``{"ddp": timings, "alone": timings or None}`` with ``timings`` the step's per-step
    seconds (``"steps"``) and median parts (``"phases_ms"``, see :data:`PHASES`; also
    ``"phases_ms_first"``/``"_second"`` over the steps taken first/second). With ``alone``,
    that trainer (no communication) takes the same step right before or after each one, so
    that drifts of the machine's speed affect both alike; ``alternate``: the two take turns
    at going first (else the data-parallel step always does), so that neither gains from
    its place. ``gc_every``: Python's automatic garbage collection off, ``gc.collect(1)``
    before every that many steps (same steps on every rank, inside the timed step). A
    barrier starts the data-parallel step (under ``world > 1``) and, with ``barrier_alone``,
    the alone step too, so that both start alike, right after a cross-rank wait."""
    runs = {"ddp": (trainer, world > 1)}
    if alone is not None:
        runs["alone"] = (alone, barrier_alone)
    rows: dict[str, list] = {kind: [] for kind in runs}
    marks = {kind: _mark_phases(t) for kind, (t, _) in runs.items()}
    if gc_every:
        gc.disable()
    for k, b in enumerate(batches):
        graphs = [ds[i] for i in shard_batch(b, ds.n_atoms, rank, world)]
        if gc_every and k % gc_every == 0:
            gc.collect(1)
        order = list(runs.items())
        if alternate and k % 2:
            order.reverse()
        for position, (kind, (t, barrier)) in enumerate(order):
            if barrier:
                trainer.reducer.barrier()
            synchronize(device)
            marks[kind][0].clear()
            t0 = time.perf_counter()
            t.train_step(graphs, k, counts=ds.batch_label_counts(b))
            synchronize(device)
            if k > 0:
                rows[kind].append((time.perf_counter() - t0, position,
                                   *_phases(t0, marks[kind][0])))
    if gc_every:
        gc.enable()
    for _, undo in marks.values():
        undo()
    out: dict = {"alone": None}
    for kind, r in rows.items():
        out[kind] = {"steps": [x[0] for x in r]}
        for suffix, keep in (("", (0, 1)), ("_first", (0,)), ("_second", (1,))):
            sel = [x for x in r if x[1] in keep]
            out[kind]["phases_ms" + suffix] = {
                name: round(float(np.nanmedian([x[i + 2] for x in sel])) * 1e3, 3) if sel
                else None for i, name in enumerate(PHASES)}
    return out


#: parts of a timed step, each the host time from the previous mark: collate and copy the
#: batch; the global label counts (copied to the device); predict (forward and force
#: derivative); loss and backward up to the gradients' collective; the collective's call;
#: the wait for the device (reading the loss), clipping and schedule; the optimizer step;
#: the rest (to the final synchronisation)
PHASES = ("batch", "counts", "predict", "loss_backward", "collective_call", "wait",
          "optimizer", "rest")

#: the calls whose end (or start, ``True``) marks a phase boundary: (owner, attribute)
_MARKED = (("trainer", "_batch", False), ("trainer", "_global_counts", False),
           ("trainer", "_predict", False), ("reducer", "all_reduce_grads", True),
           ("reducer", "all_reduce_grads", False), ("optimizer", "step", True),
           ("optimizer", "step", False))


def _mark_phases(trainer: Trainer) -> tuple[list[float], callable]:
    """Record the host clock at the boundaries of :data:`PHASES` in ``trainer``'s step;
    returns the list the marks go to (cleared by the caller per step) and an undo."""
    marks: list[float] = []
    owners = {"trainer": trainer, "reducer": trainer.reducer, "optimizer": trainer.optimizer}
    wrapped = []
    for owner, attr in dict.fromkeys((o, a) for o, a, _ in _MARKED):
        obj = owners[owner]
        inner = getattr(obj, attr)
        at_start = any(o == owner and a == attr and s for o, a, s in _MARKED)

        def timed(*args, _inner=inner, _start=at_start, **kwargs):
            if _start:
                marks.append(time.perf_counter())
            out = _inner(*args, **kwargs)
            marks.append(time.perf_counter())
            return out

        setattr(obj, attr, timed)
        wrapped.append((obj, attr))

    def undo():
        for obj, attr in wrapped:
            delattr(obj, attr)  # the class's method again

    return marks, undo


def _phases(t0: float, marks: list[float]) -> list[float]:
    """Durations of :data:`PHASES` from the step's start ``t0`` and its marks (NaN for a step
    whose marks are incomplete, e.g. one without a batch)."""
    points = [t0, *marks, time.perf_counter()]
    if len(points) != len(PHASES) + 1:
        return [float("nan")] * len(PHASES)
    return [b - a for a, b in zip(points[:-1], points[1:])]


def compile_check(trainer: Trainer, ds, batch, reducer, device) -> dict:
    """Seconds of the first compiled call (trace, float64 check, compile, backward) and the
    relative difference of its weight gradients from eager autograd on the same batch."""
    from xnn.models.derivatives import compute_properties

    graphs = [ds[i] for i in shard_batch(batch, ds.n_atoms, reducer.rank, reducer.world_size)]
    from xnn.data.datasets import collate

    g = collate(graphs).to(trainer.device, trainer.dtype)
    compiled_fn = trainer.predictor.compiled
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def grads(out):
        loss = sum(out[k].float().square().sum() for k in ("energy", "forces", "stress"))
        return torch.autograd.grad(loss, params, allow_unused=True)

    synchronize(device)
    t0 = time.perf_counter()
    compiled = grads(compiled_fn(g))
    synchronize(device)
    seconds = time.perf_counter() - t0
    eager = grads(compute_properties(trainer.model, g, True, True, training=True))
    again = grads(compute_properties(trainer.model, g, True, True, training=True))
    scale = max(float(b.abs().max()) for b in eager if b is not None)

    def rel(x, y):
        return max(float((a - b).abs().max()) for a, b in zip(x, y) if b is not None) / scale

    # the second eager evaluation differs from the first by the order of atomic additions
    return {"first_compiled_call_s": seconds, "compiled_vs_eager_grad_rel_diff":
            rel(compiled, eager), "eager_vs_eager_grad_rel_diff": rel(again, eager),
            "eager_batches": compiled_fn.eager_calls}


def profile_steps(trainer: Trainer, ds, batches, rank: int, world: int, device, path) -> None:
    """torch.profiler table (CPU and device time per op) of a few steps, written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for k, b in enumerate(batches[:6]):
            trainer.train_step([ds[i] for i in shard_batch(b, ds.n_atoms, rank, world)], k,
                               counts=ds.batch_label_counts(b))
        synchronize(device)
    if path is None:
        return
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    ka = prof.key_averages()
    Path(path).write_text(ka.table(sort_by=key, row_limit=40)
                          + "\n\nby CPU total:\n" + ka.table(sort_by="cpu_time_total", row_limit=40)
                          + "\n\nby self CPU:\n"
                          + ka.table(sort_by="self_cpu_time_total", row_limit=40))


def bench_models(names, ds, args, device, reducer) -> dict:
    from xnn.models.statistics import average_num_neighbors

    avg = average_num_neighbors([ds.dataset[i] for i in range(min(len(ds), 50))], CUTOFF)
    world = reducer.world_size
    global_bs = args.batch_size * world
    batches, epoch = [], 0  # full global batches of successive epochs
    while len(batches) < args.steps + 1:
        batches += [b for b in make_batches(ds.n_atoms, batch_size=global_bs, shuffle=True,
                                            seed=epoch) if len(b) == global_bs]
        epoch += 1
    batches = batches[: args.steps + 1]
    out = {}
    for name in names:
        row: dict = {"hyperparameters": model_hparams(name, args.quick)}
        trainer = make_trainer(name, args.quick, device, reducer, avg, args.compile)
        row["parameters"] = sum(p.numel() for p in trainer.model.parameters())
        alone = make_trainer(name, args.quick, device, LocalReducer(), avg, args.compile) \
            if world > 1 else None  # the same per-rank work without communication
        if args.compile:
            row.update(compile_check(trainer, ds, batches[0], reducer, device))
        timed = time_steps(trainer, ds, batches, reducer.rank, world, device, alone,
                           args.gc_every, args.barrier_alone, not args.ddp_first)
        if args.profile:  # every rank steps (collectives); rank 0 writes
            profile_steps(trainer, ds, batches, reducer.rank, world, device,
                          f"{args.profile}.{name}.txt" if reducer.is_main else None)
        t = float(np.median(timed["ddp"]["steps"]))
        if world > 1:
            ranks = reducer.gather_objects(timed)
            row["step_ms_per_rank_and_step"] = {
                kind: [[round(x * 1e3, 3) for x in r[kind]["steps"]] for r in ranks]
                for kind in ("ddp", "alone")}
            row["phases_ms_per_rank"] = [{f"{kind}{suffix}": r[kind]["phases_ms" + suffix]
                                          for kind in ("ddp", "alone")
                                          for suffix in ("", "_first", "_second")}
                                         for r in ranks]
            per_rank = [float(np.median(r["ddp"]["steps"])) for r in ranks]
            alone_per_rank = [float(np.median(r["alone"]["steps"])) for r in ranks]
            t, t1 = float(np.mean(per_rank)), float(np.mean(alone_per_rank))
            row.update(step_s_per_rank=per_rank, step_s_alone=t1,
                       step_s_alone_per_rank=alone_per_rank, ddp_efficiency=t1 / t,
                       world_size=world)
        row.update(step_s=t, structures_per_s=global_bs / t)
        out[name] = row
        if reducer.is_main:
            print(f"{name}: {row['parameters']:,} parameters, {row['structures_per_s']:.1f} "
                  f"structures/s" + (f", DDP efficiency {row['ddp_efficiency']:.1%}"
                                     if world > 1 else ""), flush=True)
    return out


# --------------------------------------------------------------------------- epoch timings
def _epoch_ends(cmd: list[str], cwd: Path, is_row) -> tuple[list[float], str]:
    """Run ``cmd``; return the arrival times (s) of its output lines for which ``is_row(line)``
    and the whole output. The period between two rows is one full epoch as the user waits for
    it: training, validation, logging and checkpoint writing."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    stamps, lines = [], []
    for line in proc.stdout:
        lines.append(line)
        if is_row(line):
            stamps.append(time.perf_counter())
    if proc.wait() != 0:
        raise RuntimeError(f"{cmd[0]} failed: {''.join(lines)[-800:]}")
    return stamps, "".join(lines)


def _is_xnn_row(line: str) -> bool:
    parts = line.split()
    return len(parts) == 9 and parts[0].isdigit() and parts[1].isdigit()


def _is_mace_row(line: str) -> bool:
    return " INFO: Epoch " in line and "head:" in line


def xnn_epoch_periods(data: Path, work: Path, epochs: int, args) -> list[float]:
    hp = model_hparams("equivariant", args.quick)
    hp_yaml = "{" + ", ".join(f"{k}: {v}" for k, v in hp.items()) + "}"
    cmd = [sys.executable, "-m", "xnn", "train", f"data.datasets.0.path={data}",
           f"output_dir={work / 'xnn'}", "model.name=equivariant",
           f"model.cutoff={CUTOFF}", f"model.hyperparameters={hp_yaml}",
           f"data.batch_size={args.batch_size}", f"data.val_batch_size={args.batch_size}",
           f"max_epochs={epochs}", f"device={args.device}", "loss.stress.weight=1.0",
           "loss.forces.weight=10.0", "ema.enabled=true", "ema.decay=0.99", "logging.plots=false",
           "logging.progress_bar=false", "overwrite=true", "data.val_fraction=0.1",
           f"compile={str(args.compile).lower()}"]
    stamps, _ = _epoch_ends(cmd, work, _is_xnn_row)
    return [float(x) for x in np.diff(stamps)]


def write_mace_data(ds, path: Path) -> None:
    from ase import Atoms
    from ase.io import write

    frames = []
    for i in range(len(ds)):
        g = ds[i]
        a = Atoms(numbers=g.numbers.numpy(), positions=g.positions.numpy(),
                  cell=g.cell[0].numpy(), pbc=g.pbc[0].numpy())
        a.info["REF_energy"] = float(g.energy[0])
        a.info["REF_stress"] = g.stress[0].numpy().reshape(9)
        a.arrays["REF_forces"] = g.forces.numpy()
        frames.append(a)
    write(path, frames, format="extxyz")


def mace_epoch_periods(ds, work: Path, epochs: int, args) -> list[float] | None:
    exe = shutil.which("mace_run_train")
    if exe is None:
        return None
    data = work / "mace_train.xyz"
    write_mace_data(ds, data)
    channels = model_hparams("equivariant", args.quick)["channels"]
    cmd = [exe, "--name", "mace", "--train_file", str(data), "--valid_fraction", "0.1",
           "--E0s", "average", "--model", "ScaleShiftMACE", "--num_channels", str(channels),
           "--max_L", "1", "--max_ell", "2", "--correlation", "3", "--num_interactions", "2",
           "--r_max", str(CUTOFF), "--batch_size", str(args.batch_size),
           "--valid_batch_size", str(args.batch_size), "--max_num_epochs", str(epochs),
           "--device", args.device, "--default_dtype", "float32", "--seed", "0",
           "--energy_key", "REF_energy", "--forces_key", "REF_forces", "--stress_key",
           "REF_stress", "--loss", "stress", "--stress_weight", "1.0", "--forces_weight",
           "10.0", "--energy_weight", "1.0", "--ema", "--ema_decay", "0.99",
           "--work_dir", str(work / "mace"), "--eval_interval", "1"]
    stamps, _ = _epoch_ends(cmd, work, _is_mace_row)
    return [float(x) for x in np.diff(stamps)]


def bench_epochs(ds, data: Path, args) -> dict:
    """Median epoch period of ``xnn train`` and ``mace_run_train`` over one run each (the
    first epoch, with one-off warm-up, is not part of any period)."""
    epochs = 3 if args.quick else args.epochs
    n_train = len(ds) - int(round(0.1 * len(ds)))
    out: dict = {"epochs": epochs, "train_structures": n_train,
                 "method": "median period between consecutive epoch-end log lines of one run "
                           "(training + validation + logging + checkpoints)"}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        xnn = xnn_epoch_periods(data, work, epochs, args)
        out["xnn_epoch_periods_s"] = xnn
        out["xnn_equivariant_s_per_epoch"] = float(np.median(xnn))
        out["xnn_equivariant_structures_per_s"] = n_train / float(np.median(xnn))
        try:
            mace = mace_epoch_periods(ds, work, epochs, args)
        except RuntimeError as e:
            mace, out["mace_error"] = None, str(e)
    if mace is None:
        out["mace"] = "skipped: mace_run_train not installed" if "mace_error" not in out \
            else "failed"
    else:
        out["mace_epoch_periods_s"] = mace
        out["mace_s_per_epoch"] = float(np.median(mace))
        out["mace_structures_per_s"] = n_train / float(np.median(mace))
        out["speedup_xnn_vs_mace"] = float(np.median(mace)) / float(np.median(xnn))
    return out


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="small data and models (CPU check)")
    p.add_argument("--models", default="schnet,painn,equivariant")
    p.add_argument("--batch-size", type=int, default=None, help="structures per rank and step")
    p.add_argument("--steps", type=int, default=None, help="timed steps per model")
    p.add_argument("--n", type=int, default=None, help="EMT structures to generate")
    p.add_argument("--no-mace", action="store_true", help="skip the epoch-time comparison")
    p.add_argument("--profile", default=None,
                   help="write torch.profiler tables of a few steps to PROFILE.<model>.txt")
    p.add_argument("--gc-every", type=int, default=0,
                   help="automatic garbage collection off, gc.collect(1) every N steps")
    p.add_argument("--bind-cores", action="store_true",
                   help="under torchrun: pin each local rank to its own share of the CPU cores")
    p.add_argument("--compile", action="store_true",
                   help="compiled training steps (Trainer(compile=True), xnn train compile=true)")
    p.add_argument("--barrier-ddp-only", dest="barrier_alone", action="store_false",
                   help="under torchrun: a barrier before the data-parallel step only (the "
                        "method before session 5, which slows that step alone by ~1.5 ms; by "
                        "default both steps start right after a barrier)")
    p.add_argument("--ddp-first", action="store_true",
                   help="under torchrun: the data-parallel step always before the alone step "
                        "(the method before session 6; by default they take turns)")
    p.add_argument("--pin-main", action="store_true",
                   help="under torchrun: pin each rank's main thread (only) to its own core, "
                        "far apart, after start-up")
    p.add_argument("--epochs", type=int, default=10,
                   help="epochs of the xnn train / mace_run_train runs (epoch comparison)")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        name = ("training_ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1
                else "training_compile" if args.compile else "training")
        args.json = results_path(name, args.device)
    args.batch_size = args.batch_size or (4 if args.quick else 8)
    args.steps = args.steps or (3 if args.quick else 40)
    n = args.n or (24 if args.quick else 200)

    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    cores = None
    if args.bind_cores and "LOCAL_RANK" in os.environ:  # before any thread starts
        avail = sorted(os.sched_getaffinity(0))
        lws, lr = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        share = len(avail) // lws
        cores = avail[lr * share:(lr + 1) * share]
        os.sched_setaffinity(0, cores)
    manager = DistributedManager.initialize(device=args.device)
    device = manager.device if manager.is_distributed else torch.device(args.device)
    reducer = parallelize_train(manager).reducer
    if args.pin_main and "LOCAL_RANK" in os.environ:  # this thread only (Linux: pid 0)
        avail = sorted(os.sched_getaffinity(0))
        lws, lr = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        cores = [avail[(lr + 1) * len(avail) // (lws + 1)]]
        os.sched_setaffinity(0, cores)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data = Path(tmp) / "emt_cu.xyz"
            if reducer.is_main:
                write_emt(data, n, ["Cu"], seed=0)
            reducer.barrier()
            if not reducer.is_main:  # each rank needs the file: write its own copy
                write_emt(data, n, ["Cu"], seed=0)
            ds = WithEdges(read_structures(data), CUTOFF)
            names = [m.strip() for m in args.models.split(",") if m.strip()]
            result = {"device": str(device), "quick": args.quick, "structures": n,
                      "batch_size_per_rank": args.batch_size, "world_size": reducer.world_size,
                      "rank0_cores": cores, "pin_main": args.pin_main,
                      "barrier_alone": args.barrier_alone, "gc_every": args.gc_every,
                      "alternate": not args.ddp_first,
                      "compile": args.compile,
                      "models": bench_models(names, ds, args, device, reducer)}
            if reducer.world_size == 1 and not args.no_mace and "equivariant" in names:
                result["epoch_time"] = bench_epochs(ds, data, args)
                if reducer.is_main:
                    print(f"epoch time: {result['epoch_time']}", flush=True)
        if args.json and reducer.is_main:
            write_json(args.json, result, device=str(device))
            print(f"wrote {args.json}")
    finally:
        manager.cleanup()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    sys.exit(main())
