"""Exploration for ``xnn learn``: starting structures drawn from the current dataset, run
through the workflow stages (:func:`xnn.app.workflow.run_workflow`) with the round's
committee, and the sampled frames scored as candidates.

The workflow runs in ``round_NNN/explore``; a loop killed during it resumes the campaign
from its checkpoint (``checkpoint.pt``), or starts it again when none was written.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xnn.config.learn import LearnConfig


def draw_starts(cfg: LearnConfig, dataset: Sequence, round_index: int) -> list:
    """``explore.starts`` structures of ``dataset`` (without their labels), drawn without
    replacement (with replacement when the dataset is smaller), seeded by (seed, round)."""
    rng = np.random.default_rng([cfg.seed, round_index])
    n = cfg.explore.starts
    idx = rng.choice(len(dataset), size=n, replace=n > len(dataset))
    out = []
    for i in idx:
        a = dataset[int(i)].copy()
        a.calc = None
        a.info = {"learn_start": int(i)}
        out.append(a)
    return out


def workflow_config(cfg: LearnConfig, starts: Path, model: Path, folder: Path,
                    round_index: int):
    """The workflow of a round's exploration (resumed when ``folder`` holds a checkpoint)."""
    from xnn.config.model import ModelConfig
    from xnn.config.workflow import WorkflowConfig, WorkflowOutputConfig

    ex = cfg.explore
    checkpoint = folder / "checkpoint.pt"
    stages = [dataclasses.replace(s, trajectory_every=ex.sample_every) for s in ex.stages]
    return WorkflowConfig(
        structure=str(starts), model=ModelConfig(file=str(model), device=ex.device),
        stages=stages, slots=ex.slots, seed=cfg.seed + round_index,
        pressure_unit=ex.pressure_unit, max_force=ex.max_force,
        output=WorkflowOutputConfig(dir=str(folder), trajectory_every=ex.sample_every,
                                    progress=False, log_every=10**6),
        resume=str(checkpoint) if checkpoint.is_file() else None)


def explore(cfg: LearnConfig, starts: Path, model: Path, folder: Path, round_index: int) -> None:
    """Run (or finish) the round's exploration campaign in ``folder``."""
    from xnn.app.workflow import run_workflow

    if (folder / "summary.json").is_file():
        return
    if folder.exists() and not (folder / "checkpoint.pt").is_file():
        shutil.rmtree(folder)
    run_workflow(workflow_config(cfg, starts, model, folder, round_index))


def sampled_frames(folder: Path) -> list:
    """Every frame of the campaign's trajectories but each system's first (its start, a
    structure of the dataset), in system order, tagged with ``learn_source``."""
    import ase.io

    out = []
    for path in sorted((folder / "trajectories").glob("sys_*.xyz")):
        frames = ase.io.read(str(path), index=":", format="extxyz")
        for k, a in enumerate(frames[1:], start=1):
            a.calc = None
            a.info = {"learn_source": f"{path.stem}:{k}",
                      "stage": str(a.info.get("stage", ""))}
            a.arrays.pop("momenta", None)
            out.append(a)
    return out


def with_scores(frames: list, model) -> list:
    """``frames`` with the committee's uncertainty in their info: ``score`` (largest
    per-atom calibrated forces_std, eV/Å), ``score_raw`` (the same spread before the
    committee's forces calibration factor), ``forces_std_mean`` (calibrated, eV/Å),
    ``energy_std`` (calibrated, eV)."""
    from xnn.app.learn_train import forces_factor, predict

    factor = forces_factor(model)
    for a, p in zip(frames, predict(model, frames), strict=True):
        std = p["forces_std"]
        a.info["score"] = float(std.max()) if len(std) else 0.0
        a.info["score_raw"] = a.info["score"] / factor
        a.info["forces_std_mean"] = float(std.mean()) if len(std) else 0.0
        a.info["energy_std"] = p["energy_std"]
    return frames
