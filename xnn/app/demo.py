"""The demo applications behind ``xnn demo``.

``demo_train(out_dir, minutes_budget=2.5)``: EMT Cu data → a small model trained for a few
minutes on CPU → errors and plots; its config is :data:`DEMO_YAML` (identical to
``examples/train_emt.yaml`` apart from the data path). ``demo_md(model_file, ...)``: a short
NVT run with the trained model.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_YAML = """\
# A small SchNet on ASE-EMT copper (xnn data emt --out emt_cu.xyz --n 200).
# Loaded 2-core CPU, 2.5 min (3 epochs): test MAE ~90 meV/atom, ~60 meV/Å, ~4 meV/Å³.
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
# compile: true   # on a GPU: compiled training steps (1.4x on an H200; first steps compile)
output_dir: runs/emt_cu
"""


def demo_config(data_path: str | os.PathLike, out_dir: str | os.PathLike,
                minutes_budget: float, overrides=()):
    """The demo's :class:`~xnn.config.train.TrainConfig` for a data file and run folder."""
    import tempfile

    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(DEMO_YAML)
        name = f.name
    try:
        return load_config(TrainConfig, name, [
            f"data.datasets.0.path={data_path}", f"output_dir={out_dir}",
            f"time_limit_min={minutes_budget}", "overwrite=true", *overrides,
        ])
    finally:
        os.unlink(name)


def demo_train(out_dir: str | os.PathLike, minutes_budget: float = 2.5,
               n_structures: int = 200, seed: int = 0, overrides=()) -> dict:
    """Generate EMT Cu data, train the demo model within ``minutes_budget``, evaluate.

    Args:
        out_dir: folder for everything: ``emt_cu.xyz``, ``train/`` (checkpoints, metrics.csv,
            learning_curves.png, parity_test.png, model.pt, summary.json).
        minutes_budget: wall-time limit of the training loop (the run stops at the limit and
            keeps the best validated weights).
        n_structures: EMT structures to generate.
        seed: data and training seed.
        overrides: extra ``key=value`` config overrides.
    Returns:
        the run summary, with ``"model"`` (path of the trained model), ``"data"`` and
        ``"out_dir"``.
    """
    from xnn.app.train import train
    from xnn.data.emt import write_emt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "emt_cu.xyz"
    if not data.is_file():
        write_emt(data, n_structures, ["Cu"], seed=seed)
    cfg = demo_config(data, out / "train", minutes_budget, [f"seed={seed}", *overrides])
    summary = train(cfg)
    summary.update(data=str(data), out_dir=str(out / "train"))
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
