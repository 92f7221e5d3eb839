"""Fine-tuning with and without replay: does replay keep the pretrained accuracy?

Usage::

    python benchmarks/finetune_replay.py --pretrained standin --json out.json
    python benchmarks/finetune_replay.py --pretrained 7net-0 --json out.json

Data (all generated here, CPU only):

* new data: Cu-Au alloy structures (``xnn data emt --elements Cu,Au``), labelled by the
  "new reference": EMT for ``7net-0``; EMT plus a Lennard-Jones pair term for the stand-in
  (a reference the pretrained model does not know). For ``7net-0`` the EMT energies are
  first re-referenced by per-element offsets fitted (least squares) to SevenNet-0's own
  energies of those structures: EMT's zero of energy is ~3.6 eV/atom from PBE's, which is
  a shift of the E0s, not something to learn.
* pretraining-like data: pure Cu and pure Au structures (strained, rattled, vacancy,
  surface, MD snapshots), labelled by the pretraining reference: SevenNet-0 itself (its DFT
  data is not here), or EMT for the stand-in, an xnn SchNet pretrained here on such
  structures. One set is the replay file (``data.replay``), another (other seeds) is held
  back for evaluation only.

Runs: the pretrained model, fine-tuned without replay, fine-tuned with replay
(``finetune.replay_fraction=0.5``); each reports energy (meV/atom) and force (meV/Å) MAE
on held-out new data and on the held-back pretraining-like data. The check: with replay the
held-back force error stays within 1.2x the pretrained model's while the new-data force error
falls. For ``7net-0`` the pretrained model's held-back error is 0 by construction (the labels
are its own predictions); the report then gives the errors themselves.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import generate_emt

CUTOFF = 4.0
STANDIN = ("model.name=schnet", "model.hyperparameters={num_features: 32, num_filters: 32, "
           "num_interactions: 2, num_basis: 16}", "model.species=[29, 79]")


def _lj():
    from ase.calculators.lj import LennardJones

    return LennardJones(sigma=2.4, epsilon=0.03, rc=CUTOFF, smooth=True)


def _label(atoms_list, calc_fn) -> list:
    """Copies of ``atoms_list`` with energy/forces/stress of ``calc_fn(atoms)`` stored as
    ``info``/``arrays`` labels (extxyz)."""
    out = []
    for a in atoms_list:
        a = a.copy()
        e, f, s = calc_fn(a)
        a.calc = None
        a.info = {"energy": float(e), "config_type": a.info.get("config_type", "")}
        a.arrays["forces"] = np.asarray(f, dtype=float)
        a.info["stress"] = np.asarray(s, dtype=float).reshape(3, 3)
        out.append(a)
    return out


def _emt(a, extra_lj: bool):
    from ase.calculators.emt import EMT

    e, f, s = 0.0, 0.0, 0.0
    for calc in [EMT(), *([_lj()] if extra_lj else [])]:
        b = a.copy()
        b.calc = calc
        e += b.get_potential_energy()
        f = f + b.get_forces()
        s = s + b.get_stress(voigt=False)
    return e, f, s


def _model_labels(model):
    """``calc_fn`` labelling with ``model`` (xnn's ASE calculator)."""
    from xnn.io.calculator import Calculator

    calc = Calculator(model, device="cpu", dtype=next(model.parameters()).dtype)

    def fn(a):
        b = a.copy()
        b.calc = calc
        return b.get_potential_energy(), b.get_forces(), b.get_stress(voigt=False)
    return fn


def _write(path: Path, atoms_list) -> Path:
    import ase.io

    ase.io.write(str(path), atoms_list, format="extxyz")
    return path


def _pure(n: int, seed: int) -> list:
    half = n // 2
    return generate_emt(half, ["Cu"], seed) + generate_emt(n - half, ["Au"], seed + 1)


def _rereference(atoms_list, calc_fn) -> list:
    """Shift energies by per-element offsets fitted to ``calc_fn``'s energies."""
    zs = sorted({int(z) for a in atoms_list for z in a.numbers})
    counts = np.array([[np.sum(a.numbers == z) for z in zs] for a in atoms_list], float)
    diff = np.array([calc_fn(a)[0] - a.info["energy"] for a in atoms_list])
    offsets, *_ = np.linalg.lstsq(counts, diff, rcond=None)
    for a, c in zip(atoms_list, counts):
        a.info["energy"] += float(c @ offsets)
    return atoms_list


def errors(model, path: Path) -> dict[str, float]:
    """Energy MAE (meV/atom) and force MAE (meV/Å per component) of ``model`` on a file."""
    from xnn.data.graph import AtomicGraph
    from xnn.data.sources import read_structures
    from xnn.models.derivatives import compute_properties
    from xnn.neighbors.datasets import WithEdges

    ds = WithEdges(read_structures(str(path)), float(model.cutoff))
    dtype = next(model.parameters()).dtype
    e = f = 0.0
    n_f = 0
    for i in range(len(ds)):
        g = AtomicGraph.concat([ds[i]]).to(dtype=dtype)
        out = compute_properties(model, g, True, False)
        e += float((out["energy"] - g.energy).abs().sum()) / g.n_atoms
        f += float((out["forces"] - g.forces).abs().sum())
        n_f += g.forces.numel()
    return {"energy_mae": 1000 * e / len(ds), "forces_mae": 1000 * f / n_f}


def _train(args: list[str]) -> float:
    from xnn.app.train import train

    t0 = time.perf_counter()
    train(load_config(TrainConfig, None, [
        "logging.plots=false", "logging.progress_bar=false", "overwrite=true", *args]))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pretrained", default="standin", help="standin or 7net-0")
    p.add_argument("--work", default="runs/finetune_replay")
    p.add_argument("--n-new", type=int, default=40)
    p.add_argument("--n-replay", type=int, default=40)
    p.add_argument("--n-held", type=int, default=20)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--pretrain-n", type=int, default=120, help="stand-in: pretraining set")
    p.add_argument("--pretrain-epochs", type=int, default=60, help="stand-in: its epochs")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--freeze", default="", help="finetune.freeze parts, comma-separated")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings = {}
    sevenn = a.pretrained != "standin"
    new_atoms = generate_emt(a.n_new + a.n_held, ["Cu", "Au"], seed=11)
    if sevenn:
        from xnn.training.setup import load_pretrained

        pretrained_model = load_pretrained(a.pretrained).eval()
        old_ref = _model_labels(pretrained_model)
        new = _rereference(_label(new_atoms, lambda x: _emt(x, False)), old_ref)
        pretrained = a.pretrained
        extra, precision = [], "fp32"
    else:
        old_ref = lambda x: _emt(x, False)  # noqa: E731
        new = _label(new_atoms, lambda x: _emt(x, True))
        pre_file = _write(work / "pretrain.xyz", _label(_pure(a.pretrain_n, seed=100), old_ref))
        timings["pretrain_s"] = _train([
            f"data.datasets.0.path={pre_file}", f"output_dir={work / 'pretrained'}",
            f"model.cutoff={CUTOFF}", *STANDIN, f"max_epochs={a.pretrain_epochs}",
            "data.batch_size=8", "optim.lr=3e-3", "schedule.name=cosine", "precision=fp64"])
        pretrained = str(work / "pretrained" / "model.pt")
        from xnn.models.serialization import load_model

        pretrained_model = load_model(pretrained)
        extra, precision = [f"model.cutoff={CUTOFF}"], "fp64"
    new_train = _write(work / "new_train.xyz", new[:a.n_new])
    new_test = _write(work / "new_test.xyz", new[a.n_new:])
    replay = _write(work / "replay.xyz", _label(_pure(a.n_replay, seed=200), old_ref))
    held = _write(work / "held_back.xyz", _label(_pure(a.n_held, seed=300), old_ref))
    timings["data_s"] = time.perf_counter() - t0 - timings.get("pretrain_s", 0.0)
    common = [f"pretrained={pretrained}", f"data.datasets.0.path={new_train}", *extra,
              f"max_epochs={a.epochs}", "data.batch_size=4", f"optim.lr={a.lr}",
              "schedule.name=cosine", f"precision={precision}", "data.val_fraction=0.1",
              "loss.stress.weight=0", f"finetune.freeze=[{a.freeze}]"]
    runs = {"no_replay": [], "replay": [f"data.replay.0.path={replay}",
                                        "finetune.replay_fraction=0.5"]}
    report = {"pretrained": {"new": errors(pretrained_model, new_test),
                             "held_back": errors(pretrained_model, held)}}
    from xnn.models.serialization import load_model

    for name, opts in runs.items():
        out = work / name
        timings[f"{name}_s"] = _train([*common, *opts, f"output_dir={out}"])
        model = load_model(out / "model.pt")
        report[name] = {"new": errors(model, new_test), "held_back": errors(model, held)}
    pre, rep = report["pretrained"], report["replay"]
    check = {
        "held_back_forces_ratio_replay": rep["held_back"]["forces_mae"]
        / max(pre["held_back"]["forces_mae"], 1e-12),
        "held_back_forces_ratio_no_replay": report["no_replay"]["held_back"]["forces_mae"]
        / max(pre["held_back"]["forces_mae"], 1e-12),
        "new_forces_fell": rep["new"]["forces_mae"] < pre["new"]["forces_mae"],
    }
    check["replay_within_1.2x"] = check["held_back_forces_ratio_replay"] <= 1.2
    result = {"pretrained": a.pretrained, "n_new_train": a.n_new, "n_new_test": a.n_held,
              "n_replay": a.n_replay, "n_held_back": a.n_held, "epochs": a.epochs,
              "lr": a.lr, "freeze": a.freeze,
              "units": {"energy_mae": "meV/atom", "forces_mae": "meV/Å"},
              "errors": report, "check": check, "timings_s": timings,
              "total_s": time.perf_counter() - t0,
              "device": f"cpu ({torch.get_num_threads()} threads)"}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
