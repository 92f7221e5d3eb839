"""Accuracy class: xnn's ``equivariant`` model vs mace-torch's MACE of the same size, same data.

Both tools train on the same built-in EMT Cu data and are scored by one evaluator:

1. ``write_emt`` (what ``xnn data emt`` runs) generates ``--n`` structures (seed ``--seed``);
   a seeded permutation splits them 80/10/10 into ``train.xyz``, ``val.xyz``, ``test.xyz``
   with labels ``REF_energy`` (eV), ``REF_forces`` (eV/Å) and ``REF_stress`` (eV/Å³, ASE sign,
   3x3). Both tools read these same three files.
2. ``xnn train`` trains ``equivariant`` (channels C, l_max 2, hidden_l_max 1, correlation 3,
   2 interactions, r_c 5 Å) and ``mace_run_train`` trains ``ScaleShiftMACE`` (num_channels C,
   max_L 1, max_ell 2, correlation 3, 2 interactions, r_max 5 Å): same loss (MSE, energy per
   atom 1, forces 10, stress 1), batch size, epochs, learning rate, gradient clip 10, EMA 0.99
   (both warm the decay up as ``min(d, (1+n)/(10+n))``), least-squares E0s, scale = force
   RMS and shift = mean per-atom energy, fp32, the best validation-loss epoch kept. What the
   tools do not allow to match: mace-torch always uses AMSGrad (xnn: Adam) and a
   ReduceLROnPlateau schedule (patience 50 epochs: never fires in these runs; xnn: constant).
3. ASE evaluates both saved models on ``test.xyz`` in float64 (``xnn.Calculator``,
   ``mace.calculators.MACECalculator``); MAEs and RMSEs are computed here with numpy:
   energy meV/atom, force components meV/Å, stress components meV/Å³.

Usage::

    python benchmarks/accuracy_vs_mace.py --quick --json /tmp/acc.json      # < 2 min, CPU
    python benchmarks/accuracy_vs_mace.py --json benchmarks/results/accuracy_vs_mace_cpu.json
    python benchmarks/accuracy_vs_mace.py --device cuda --epochs 200 --json gpu.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json  # noqa: E402

CUTOFF = 5.0
WEIGHTS = {"energy": 1.0, "forces": 10.0, "stress": 1.0}
SPLIT = (0.8, 0.1, 0.1)
KEYS = {"energy": "REF_energy", "forces": "REF_forces", "stress": "REF_stress"}


# --------------------------------------------------------------------------- data
def write_splits(work: Path, n: int, seed: int) -> dict[str, Path]:
    """Generate ``n`` EMT Cu structures and write the seeded train/val/test split.

    Returns:
        ``{"train": path, "val": path, "test": path}`` (extxyz with ``REF_*`` labels).
    """
    from ase import Atoms
    from ase.io import read, write

    from xnn.data.emt import write_emt

    raw = work / "emt_cu_all.xyz"
    write_emt(raw, n, ["Cu"], seed=seed)
    frames = read(raw, ":")
    perm = np.random.default_rng(seed).permutation(len(frames))
    n_train = int(round(SPLIT[0] * len(frames)))
    n_val = int(round(SPLIT[1] * len(frames)))
    parts = {"train": perm[:n_train], "val": perm[n_train:n_train + n_val],
             "test": perm[n_train + n_val:]}
    paths = {}
    for name, idx in parts.items():
        out = []
        for i in idx:
            a = frames[int(i)]
            b = Atoms(numbers=a.numbers, positions=a.positions, cell=a.cell, pbc=a.pbc)
            b.info[KEYS["energy"]] = float(a.get_potential_energy())
            b.info[KEYS["stress"]] = a.get_stress(voigt=False).reshape(9)
            b.arrays[KEYS["forces"]] = a.get_forces()
            out.append(b)
        paths[name] = work / f"{name}.xyz"
        write(paths[name], out, format="extxyz")
    return paths


# --------------------------------------------------------------------------- training
def _run(cmd: list[str], cwd: Path, log: Path) -> float:
    """Run ``cmd`` (output to ``log``); return its wall time in seconds."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        res = subprocess.run(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, text=True)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        tail = log.read_text()[-1500:]
        raise RuntimeError(f"{cmd[0]} failed (rc {res.returncode}):\n{tail}")
    return dt


def train_xnn(paths: dict, work: Path, args) -> tuple[Path, float]:
    """Train xnn's equivariant model with ``xnn train``; return (model file, wall s)."""
    hp = dict(channels=args.channels, l_max=2, hidden_l_max=1, correlation=3,
              num_interactions=2)
    hp_yaml = "{" + ", ".join(f"{k}: {v}" for k, v in hp.items()) + "}"
    out = work / "xnn_run"
    sets = []
    for split, label in (("train", "datasets"), ("val", "val")):
        sets += [f"data.{label}.0.path={paths[split]}",
                 f"data.{label}.0.energy_key={KEYS['energy']}",
                 f"data.{label}.0.forces_key={KEYS['forces']}",
                 f"data.{label}.0.stress_key={KEYS['stress']}"]
    cmd = [sys.executable, "-m", "xnn", "train", *sets, "data.test_fraction=0.0",
           f"output_dir={out}", "overwrite=true", "model.name=equivariant",
           f"model.cutoff={CUTOFF}", f"model.hyperparameters={hp_yaml}", "model.e0=fit",
           "model.scale_shift=true", f"data.batch_size={args.batch_size}",
           f"data.val_batch_size={args.batch_size}", f"max_epochs={args.epochs}",
           f"device={args.device}", "precision=fp32", f"seed={args.seed}",
           f"loss.energy.weight={WEIGHTS['energy']}", f"loss.forces.weight={WEIGHTS['forces']}",
           f"loss.stress.weight={WEIGHTS['stress']}", "loss.energy.type=mse",
           "loss.forces.type=mse", "loss.stress.type=mse", "optim.name=adam",
           f"optim.lr={args.lr}", "optim.weight_decay=0.0", "optim.grad_clip=10.0",
           "schedule.name=none", "ema.enabled=true", "ema.decay=0.99",
           "checkpoint_metric=val_loss", "logging.plots=false", "logging.progress_bar=false"]
    wall = _run(cmd, work, work / "xnn_train.log")
    return out / "model.pt", wall


def train_mace(paths: dict, work: Path, args) -> tuple[Path, float]:
    """Train a ScaleShiftMACE of the same size with ``mace_run_train``; return (model, wall s)."""
    exe = shutil.which("mace_run_train") or str(Path(sys.executable).with_name("mace_run_train"))
    out = work / "mace_run"
    cmd = [exe, "--name", "mace_emt", "--work_dir", str(out),
           "--train_file", str(paths["train"]), "--valid_file", str(paths["val"]),
           "--energy_key", KEYS["energy"], "--forces_key", KEYS["forces"],
           "--stress_key", KEYS["stress"], "--E0s", "average", "--model", "ScaleShiftMACE",
           "--scaling", "rms_forces_scaling", "--num_channels", str(args.channels),
           "--max_L", "1", "--max_ell", "2", "--correlation", "3", "--num_interactions", "2",
           "--r_max", str(CUTOFF), "--batch_size", str(args.batch_size),
           "--valid_batch_size", str(args.batch_size), "--max_num_epochs", str(args.epochs),
           "--device", args.device, "--default_dtype", "float32", "--seed", str(args.seed),
           "--loss", "stress", "--energy_weight", str(WEIGHTS["energy"]),
           "--forces_weight", str(WEIGHTS["forces"]), "--stress_weight", str(WEIGHTS["stress"]),
           "--optimizer", "adam", "--lr", str(args.lr), "--weight_decay", "0.0",
           "--clip_grad", "10.0", "--ema", "--ema_decay", "0.99", "--eval_interval", "1",
           "--save_cpu"]
    wall = _run(cmd, work, work / "mace_train.log")
    models = sorted(out.glob("*.model"), key=lambda p: ("compiled" in p.name, p.name))
    if not models:
        raise RuntimeError(f"mace_run_train wrote no .model file in {out}")
    return models[0], wall


def xnn_epoch_times(log: Path) -> list[float]:
    """Seconds per epoch (training + validation) from the ``xnn train`` log table."""
    rows = [ln.split() for ln in log.read_text().splitlines()]
    return [float(r[-1]) for r in rows if len(r) == 9 and r[0].isdigit() and r[1].isdigit()]


def mace_epoch_times(log: Path) -> list[float]:
    """Seconds per epoch (training + validation) from the timestamps of the MACE log."""
    import datetime as dt

    stamps = []
    for ln in log.read_text().splitlines():
        if " INFO: Initial:" in ln or re.search(r" INFO: Epoch \d+:", ln):
            stamps.append(dt.datetime.strptime(ln[:23], "%Y-%m-%d %H:%M:%S.%f"))
    return [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]


# --------------------------------------------------------------------------- evaluation
def evaluate(calc, test_path: Path) -> dict:
    """Energy/force/stress errors of ``calc`` on the labelled structures of ``test_path``."""
    from ase.io import read

    de, df, ds = [], [], []
    for a in read(test_path, ":"):
        ref_e = float(a.info[KEYS["energy"]])
        ref_f = np.asarray(a.arrays[KEYS["forces"]])
        ref_s = np.asarray(a.info[KEYS["stress"]]).reshape(3, 3)
        b = a.copy()
        b.calc = calc
        de.append((b.get_potential_energy() - ref_e) / len(a))
        df.append((b.get_forces() - ref_f).ravel())
        ds.append((b.get_stress(voigt=False) - ref_s).ravel())
    de, df, ds = np.asarray(de), np.concatenate(df), np.concatenate(ds)

    def mae(x):
        return float(np.mean(np.abs(x)) * 1000.0)

    def rmse(x):
        return float(np.sqrt(np.mean(x**2)) * 1000.0)

    return {"energy_mae_meV_per_atom": mae(de), "energy_rmse_meV_per_atom": rmse(de),
            "forces_mae_meV_per_A": mae(df), "forces_rmse_meV_per_A": rmse(df),
            "stress_mae_meV_per_A3": mae(ds), "stress_rmse_meV_per_A3": rmse(ds),
            "test_structures": int(len(de))}


def evaluate_xnn(model_path: Path, test: Path) -> tuple[dict, int]:
    from xnn import Calculator, load_model

    model = load_model(model_path)
    n_params = sum(p.numel() for p in model.parameters())
    return evaluate(Calculator(model, device="cpu", dtype=torch.float64), test), n_params


def evaluate_mace(model_path: Path, test: Path) -> tuple[dict, int]:
    from mace.calculators import MACECalculator

    calc = MACECalculator(model_paths=str(model_path), device="cpu", default_dtype="float64")
    n_params = sum(p.numel() for p in calc.models[0].parameters())
    return evaluate(calc, test), n_params


# --------------------------------------------------------------------------- main
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu", help="cpu or cuda (training device)")
    p.add_argument("--quick", action="store_true", help="small data, model and run (< 2 min)")
    p.add_argument("--n", type=int, default=None, help="EMT structures (default 300; quick 30)")
    p.add_argument("--epochs", type=int, default=None,
                   help="epochs for both tools (default 5; quick 1)")
    p.add_argument("--channels", type=int, default=None, help="channels (default 32; quick 8)")
    p.add_argument("--batch-size", type=int, default=8, help="structures per batch")
    p.add_argument("--lr", type=float, default=0.005, help="learning rate of both tools")
    p.add_argument("--seed", type=int, default=0, help="data, split and training seed")
    p.add_argument("--keep", default=None, help="keep the run folders here (default: temp)")
    args = p.parse_args(argv)
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("accuracy_vs_mace", args.device)
    args.n = args.n or (30 if args.quick else 300)
    args.epochs = args.epochs or (1 if args.quick else 5)
    args.channels = args.channels or (8 if args.quick else 32)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        paths = write_splits(work, args.n, args.seed)
        sizes = {k: sum(1 for ln in open(v) if ln.strip().isdigit()) for k, v in paths.items()}
        print(f"data: {sizes}", flush=True)
        xnn_model, xnn_wall = train_xnn(paths, work, args)
        print(f"xnn trained in {xnn_wall:.1f} s", flush=True)
        mace_model, mace_wall = train_mace(paths, work, args)
        print(f"mace trained in {mace_wall:.1f} s", flush=True)
        xnn_err, xnn_params = evaluate_xnn(xnn_model, paths["test"])
        mace_err, mace_params = evaluate_mace(mace_model, paths["test"])
        xnn_epochs = xnn_epoch_times(work / "xnn_train.log")
        mace_epochs = mace_epoch_times(work / "mace_train.log")

    ratios = {k.replace("_meV", "").split("_per")[0] + "_xnn_over_mace": xnn_err[k] / mace_err[k]
              for k in xnn_err if k.endswith(("A", "atom", "A3")) and mace_err[k] > 0}
    result = {
        "quick": args.quick, "device": args.device,
        "data": {"generator": "xnn.data.emt.write_emt (xnn data emt)", "elements": ["Cu"],
                 "structures": args.n, "seed": args.seed, "split": sizes},
        "settings": {"cutoff_A": CUTOFF, "channels": args.channels, "l_max": 2,
                     "hidden_l_max": 1, "correlation": 3, "interactions": 2,
                     "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                     "loss_weights": WEIGHTS, "loss": "mse (energy per atom)", "ema_decay": 0.99,
                     "grad_clip": 10.0, "precision": "fp32 training, fp64 evaluation",
                     "optimizer": {"xnn": "adam", "mace": "adam (amsgrad, always on in mace)"},
                     "schedule": {"xnn": "none", "mace": "ReduceLROnPlateau(patience 50)"},
                     "torch_threads_env": os.environ.get("OMP_NUM_THREADS")},
        "xnn": {"model": "equivariant", "parameters": xnn_params, "train_wall_s": xnn_wall,
                "epoch_s": xnn_epochs, "test": xnn_err},
        "mace": {"model": "ScaleShiftMACE (mace-torch " + _mace_version() + ")",
                 "parameters": mace_params, "train_wall_s": mace_wall,
                 "epoch_s": mace_epochs, "test": mace_err},
        "ratios_xnn_over_mace": {**ratios, "parameters": xnn_params / mace_params,
                                 "train_wall": xnn_wall / mace_wall,
                                 "median_epoch_s": float(np.median(xnn_epochs)
                                                         / np.median(mace_epochs))},
    }
    for tool in ("xnn", "mace"):
        r, e = result[tool], result[tool]["test"]
        print(f"{tool}: {r['parameters']:,} params, {r['train_wall_s']:.0f} s,"
              f" E {e['energy_mae_meV_per_atom']:.2f} meV/atom, F {e['forces_mae_meV_per_A']:.1f}"
              f" meV/Å, S {e['stress_mae_meV_per_A3']:.2f} meV/Å³", flush=True)
    print(f"ratios xnn/mace: {result['ratios_xnn_over_mace']}")
    if args.json:
        write_json(args.json, result, device=args.device)
        print(f"wrote {args.json}")
    return 0


def _mace_version() -> str:
    from importlib.metadata import version

    return version("mace-torch")


if __name__ == "__main__":
    sys.exit(main())
