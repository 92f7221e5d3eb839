"""The demo applications behind ``xnn demo``.

``demo_train(out_dir, epochs=40, max_minutes=15)``: EMT Cu data → a small model trained for a
fixed number of epochs on CPU → errors and plots; its config is :data:`DEMO_YAML` (identical
to ``examples/train_emt.yaml`` apart from the data path and the epoch count). The wall-clock
cap only guards against a machine far slower than expected: when it stops the training
before the last epoch, the results depend on the machine's speed and load, and the demo
says so loudly (:func:`time_cap_warning`). ``demo_md(model_file, ...)``: a short NVT run
with the trained model. :func:`run_demo`: every step of ``xnn demo`` (the Lennard-Jones
relaxation of argon through :class:`xnn.Calculator`, training, MD) into one folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from xnn.errors import InputError

DEMO_YAML = """\
# A small SchNet on ASE-EMT copper (xnn data emt --out emt_cu.xyz --n 200).
# 2-core CPU at load ~4: 4.7 s per epoch; xnn demo's 40 epochs: test MAE 20 meV/atom,
# 27 meV/Å, 4.3 meV/Å³; the 60 epochs of this file take about 7 minutes.
# Run: xnn data emt --out emt_cu.xyz && xnn train examples/train_emt.yaml
model:
  name: schnet
  cutoff: 4.0
  hyperparameters: {num_features: 32, num_filters: 32, num_interactions: 2, num_basis: 16}
data:
  datasets:
    - {path: emt_cu.xyz}
  val_fraction: 0.1
  test_fraction: 0.1
  batch_size: 8
loss:
  energy: {weight: 50.0, type: mse}
  forces: {weight: 10.0, type: mse}
  stress: {weight: 10.0, type: mse}
optim: {name: adam, lr: 0.005, grad_clip: 10.0}
schedule: {name: cosine, warmup_steps: 20, min_lr_factor: 0.02}
ema: {enabled: true, decay: 0.99}
max_epochs: 60
# compile: true   # on a GPU: compiled training steps (benchmarks/results/README.md, Training)
output_dir: runs/emt_cu
"""


def demo_config(data_path: str | os.PathLike, out_dir: str | os.PathLike, epochs: int,
                max_minutes: float, overrides=()):
    """The demo's :class:`~xnn.config.train.TrainConfig` for a data file and run folder:
    ``epochs`` epochs, stopped early only by the ``max_minutes`` wall-clock cap."""
    import tempfile

    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(DEMO_YAML)
        name = f.name
    try:
        return load_config(TrainConfig, name, [
            f"data.datasets.0.path={data_path}", f"output_dir={out_dir}",
            f"max_epochs={epochs}", f"time_limit_min={max_minutes}", "overwrite=true",
            *overrides,
        ])
    finally:
        os.unlink(name)


def time_cap_warning(summary: dict, epochs: int, max_minutes: float) -> str | None:
    """The warning to print when the wall-clock cap stopped the training before its last
    epoch (``None`` when the training ran all ``epochs``)."""
    if summary.get("stopped_by") != "time_limit":
        return None
    return (f"WARNING: the training stopped at the --max-minutes {max_minutes:g} cap after "
            f"{summary.get('epochs', 0)} of {epochs} epochs: this machine is slower or busier "
            "than the demo expects, so the errors are worse than with all epochs and differ "
            "from run to run. Rerun with a larger --max-minutes (or on an idle machine; "
            "README: threads on shared machines) for the result of the full training.")


def demo_train(out_dir: str | os.PathLike, epochs: int = 40, max_minutes: float = 15.0,
               n_structures: int = 200, seed: int = 0, overrides=()) -> dict:
    """Generate EMT Cu data, train the demo model for ``epochs`` epochs, evaluate.

    Args:
        out_dir: folder for everything: ``emt_cu.xyz``, ``train/`` (checkpoints, metrics.csv,
            learning_curves.png, parity_test.png, model.pt, split.json, split.npy, summary.json).
        epochs: training epochs (a fixed count: the result does not depend on the machine).
        max_minutes: wall-clock cap of the training loop; when it binds, the run stops early
            (keeping the best validated weights) and a warning is printed to stderr and
            returned in the summary as ``"warning"``.
        n_structures: EMT structures to generate.
        seed: data and training seed.
        overrides: extra ``key=value`` config overrides.
    Returns:
        the run summary, with ``"model"`` (path of the trained model), ``"data"``,
        ``"out_dir"``, ``"epochs_planned"`` and, when the cap bound, ``"warning"``.
    """
    from xnn.app.train import train
    from xnn.data.emt import write_emt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "emt_cu.xyz"
    if not data.is_file():
        write_emt(data, n_structures, ["Cu"], seed=seed)
    cfg = demo_config(data, out / "train", epochs, max_minutes, [f"seed={seed}", *overrides])
    summary = train(cfg)
    summary.update(data=str(data), out_dir=str(out / "train"), epochs_planned=epochs)
    warning = time_cap_warning(summary, epochs, max_minutes)
    if warning:
        print(warning, file=sys.stderr, flush=True)
        summary["warning"] = warning
    return summary


def demo_md(
    model_file: str | Path, structure: str | Path, out_dir: str | Path, temperature: float = 300.0,
    steps: int = 500, timestep: float = 1.0, ensemble: str = "csvr", device: str = "auto",
) -> Path:
    """A short NVT run with a trained model file, for ``xnn demo``.

    Args:
        model_file: a model saved by ``xnn train`` / :func:`xnn.save_model`.
        structure: structure file (its last frame is simulated).
        out_dir: output folder (gets ``thermo.csv``, ``thermo.png``, ``trajectory.xyz``).
        temperature: K. steps: number of steps. timestep: fs.
        ensemble: ``csvr`` (default), ``langevin`` or ``nhc``.
    Returns:
        ``out_dir``; ``out_dir / "thermo.png"`` is the plot.
    """
    from xnn.app.md import run_md
    from xnn.config.loader import load_config
    from xnn.config.md import MDConfig

    cfg = load_config(MDConfig, None, [
        f"structure={structure}", f"model.file={model_file}", f"model.device={device}",
        f"ensemble={ensemble}", f"temperature={temperature}", f"steps={steps}",
        f"timestep={timestep}", f"output.dir={out_dir}", "output.overwrite=true",
        "output.progress=false",
        f"output.trajectory_every={max(1, steps // 20)}",
        f"output.log_every={max(1, steps // 200)}",
        f"output.checkpoint_every={steps}",
    ])
    return run_md(cfg)


#: Lennard-Jones argon (Rowley et al. style parameters): σ (Å), ε (eV), cutoff 2.5σ (Å)
AR_SIGMA, AR_EPSILON, AR_CUTOFF = 3.405, 0.010323, 8.5125
AR_LATTICE = 5.26  # Å, a slightly off-equilibrium start


def prepare_output(out: str | os.PathLike) -> Path:
    """Create the output folder; refuse a path that is an existing file."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise InputError(f"--out {path} exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (temporary file, then rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def step_lj_relax(out: Path, fmax: float = 1e-4, steps: int = 500, repeat: int = 2) -> dict:
    """Relax a rattled ``repeat``³ argon FCC supercell (4 repeat³ atoms), positions and cell.

    Returns:
        a summary dict: energy per atom (eV), max force (eV/Å), stress (Voigt, GPa),
        lattice constant (Å), number of optimizer steps.
    """
    from ase.build import bulk
    from ase.filters import UnitCellFilter
    from ase.optimize import FIRE

    from xnn.io.calculator import Calculator
    from xnn.models.classical import LennardJones
    from xnn.units import EV_PER_A3_TO_GPA

    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    atoms = bulk("Ar", "fcc", a=AR_LATTICE, cubic=True) * (repeat, repeat, repeat)
    atoms.rattle(0.02, seed=0)
    atoms.calc = Calculator(LennardJones(AR_SIGMA, AR_EPSILON, AR_CUTOFF), device="cpu")
    e_start = atoms.get_potential_energy() / len(atoms)
    opt = FIRE(UnitCellFilter(atoms), logfile=str(out / "lj_relax.log"))
    converged = bool(opt.run(fmax=fmax, steps=steps))
    forces = atoms.get_forces()
    stress = atoms.get_stress()
    summary = {
        "system": f"Ar fcc {repeat}x{repeat}x{repeat}, Lennard-Jones",
        "n_atoms": len(atoms),
        "converged": converged,
        "optimizer_steps": int(opt.nsteps),
        "energy_per_atom_start_eV": float(e_start),
        "energy_per_atom_eV": float(atoms.get_potential_energy() / len(atoms)),
        "max_force_eV_per_A": float(abs(forces).max()),
        "stress_voigt_GPa": [float(s) * EV_PER_A3_TO_GPA for s in stress],
        "lattice_constant_A": float(atoms.get_volume() / repeat**3) ** (1.0 / 3.0),
        "model_calls": atoms.calc.n_model_calls,
    }
    atoms.write(out / "lj_relaxed.xyz")
    return summary


def step_train(out: Path, epochs: int, max_minutes: float, n_structures: int) -> dict:
    """EMT Cu data → train the default model for ``epochs`` epochs (capped at
    ``max_minutes``) → test-set errors and plots."""
    summary = demo_train(out, epochs=epochs, max_minutes=max_minutes,
                         n_structures=n_structures)
    metrics = summary.get("metrics", {})
    keep = {k: v for k, v in metrics.items() if k.startswith("test_") or k.startswith("val_")}
    return {
        "model": str(summary["model"]),
        "data": str(summary["data"]),
        "plots": [str(p) for p in summary.get("plots", [])],
        "epochs": summary["epochs"],
        "epochs_planned": epochs,
        "stopped_by": summary["stopped_by"],
        **({"warning": summary["warning"]} if "warning" in summary else {}),
        **{k: float(v) for k, v in keep.items() if isinstance(v, (int, float))},
    }


def step_md(out: Path, model_file: str, steps: int, temperature: float) -> dict:
    """NVT MD (CSVR) of a 3×3×3 FCC Cu crystal (108 atoms) with the trained model."""
    import csv

    from ase.build import bulk

    md_dir = out / "md"
    md_dir.mkdir(parents=True, exist_ok=True)
    start = md_dir / "start.xyz"
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True) * (3, 3, 3)
    atoms.rattle(0.02, seed=1)
    atoms.write(start)
    demo_md(model_file, start, md_dir, temperature=temperature, steps=steps, ensemble="csvr")
    with open(md_dir / "thermo.csv") as f:
        rows = list(csv.DictReader(f))
    temps = [float(r["temperature_K"]) for r in rows[len(rows) // 2 :] if "temperature_K" in r]
    return {
        "folder": str(md_dir),
        "steps": steps,
        "target_temperature_K": temperature,
        "mean_temperature_second_half_K": sum(temps) / len(temps) if temps else float("nan"),
        "thermo_plot": str(md_dir / "thermo.png"),
    }


def run_demo(out: str | os.PathLike, fmax: float = 1e-4, steps: int = 500, repeat: int = 2,
             only_lj: bool = False, epochs: int = 40, max_minutes: float = 15.0,
             n_structures: int = 200, md_steps: int = 400,
             temperature: float = 300.0) -> tuple[Path, dict]:
    """The whole demo into ``out``: the LJ relaxation, then (unless ``only_lj``) EMT data,
    training and NVT MD; ``summary.json`` holds every step's summary.

    Returns:
        the output folder and ``{step: summary}`` (``lj_relax``, ``train``, ``md``).
    """
    folder = prepare_output(out)
    results = {"lj_relax": step_lj_relax(folder, fmax, steps, repeat)}
    if not only_lj:
        results["train"] = step_train(folder, epochs, max_minutes, n_structures)
        results["md"] = step_md(folder, results["train"]["model"], md_steps, temperature)
    write_json(folder / "summary.json", results)
    return folder, results
