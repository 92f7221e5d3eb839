"""Training and evaluation for ``xnn learn``: the round's train config, its run (resumed
from its checkpoint after a kill), the committee model file, and the committee's predictions
(scores of candidates, errors on the test set).

A round trains its committee as one ``xnn train`` run in ``round_NNN/train`` with
``committee.size = train.committee`` (member k seeded ``seed + k``; ``train.bootstrap``:
``committee.bootstrap``), calibrated on its validation set; ``train.mode=finetune`` goes on
training the previous round's committee file (``pretrained``). The run's ``model.pt`` is
copied to ``round_NNN/model.pt``.

Scores are calibrated spreads (the committee file's factors applied, as every evaluation path
reports them); :func:`forces_factor` divides the factor out again for the logs' raw scores.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from xnn.config.learn import LearnConfig
from xnn.config.loader import ConfigError
from xnn.config.train import DatasetConfig, TrainConfig
from xnn.errors import InputError

#: committee keys the loop sets (from train.committee, train.bootstrap and seed)
COMMITTEE_KEYS = ("size", "bootstrap", "seeds")


def train_config(cfg: LearnConfig, datasets: Sequence[str], output_dir: str | Path,
                 pretrained: str | None = None, resume: str | None = None) -> TrainConfig:
    """The train config of a round: ``train.file`` ← ``train.config`` ← the loop's data
    (``datasets``), folder, seed, committee (``committee.size = train.committee``,
    ``committee.bootstrap = train.bootstrap``; with ``pretrained``, a committee file trained
    on as it is: size 1 in the train config) and pretrained/resume.

    Raises:
        ConfigError: an invalid train config (named as ``train.config``/``train.file``), or
            one that sets the committee's size, seeds or bootstrap itself.
    """
    base = OmegaConf.structured(TrainConfig)
    try:
        if cfg.train.file:
            base = OmegaConf.merge(base, OmegaConf.load(cfg.train.file))
        base = OmegaConf.merge(base, OmegaConf.create(dict(cfg.train.config)))
        default = OmegaConf.structured(TrainConfig).committee
        for key in COMMITTEE_KEYS:
            if base.committee[key] != default[key]:
                raise ConfigError(f"train config (train.file / train.config) sets "
                                  f"committee.{key}: the loop sets it; write train.committee: "
                                  "K (and train.bootstrap: true)")
        base.data.datasets = [DatasetConfig(path=str(p)) for p in datasets]
        base.output_dir = str(output_dir)
        base.seed = cfg.seed
        base.resume = resume
        base.pretrained = pretrained
        if pretrained is None:
            base.committee.size = cfg.train.committee
            base.committee.bootstrap = cfg.train.bootstrap
        else:  # fine-tuning keeps the pretrained committee's architecture and size
            base.model.hyperparameters = {}
        base.overwrite = False
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        key = e.full_key or ""
        raise ConfigError(f"train config (train.file / train.config) key {key!r}: "
                          f"{str(e).splitlines()[0]}") from None


def _complete(folder: Path) -> bool:
    """Whether a run finished (its ``summary.json`` is written after ``model.pt``)."""
    return (folder / "model.pt").is_file() and (folder / "summary.json").is_file()


def train_committee(cfg: LearnConfig, datasets: Sequence[str], folder: Path,
                    pretrained: str | None) -> Path:
    """Train (or finish training) the committee in ``folder``; returns its ``model.pt``.

    A run killed after a checkpoint resumes from ``checkpoints/last.pt`` (xnn train's resume,
    exact on CPU); one killed before its first checkpoint starts again.

    Raises:
        InputError: the run's model file is not a committee of ``train.committee``.
    """
    from xnn.app.train import run_train
    from xnn.models.serialization import load_model

    if not _complete(folder):
        last = folder / "checkpoints" / "last.pt"
        resume = str(last) if last.is_file() else None
        if resume is None and folder.exists():
            shutil.rmtree(folder)
        run_train(train_config(cfg, datasets, folder, pretrained, resume))
    size = load_model(folder / "model.pt").committee_size
    if size != cfg.train.committee:
        raise InputError(f"{folder / 'model.pt'} is a committee of {size}, not "
                         f"train.committee={cfg.train.committee} (a pretrained committee "
                         "keeps its size)")
    return folder / "model.pt"


def load_committee(path: Path, device: torch.device):
    """A round's committee in float64 for evaluation."""
    from xnn.models.serialization import load_model

    return load_model(path).to(device=device, dtype=torch.float64).eval()


def predict(model, frames: Sequence, batch: int = 16) -> list[dict[str, np.ndarray]]:
    """The committee's prediction for each structure: ``energy`` (eV), ``forces``
    ``[n_atoms, 3]`` (eV/Å) and ``forces_std`` ``[n_atoms]`` (eV/Å), ``energy_std`` (eV)."""
    from xnn.data.ase_io import from_ase
    from xnn.models.derivatives import compute_properties
    from xnn.neighbors import with_edges

    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(frames), batch):
        chunk = list(frames[lo:lo + batch])
        g = with_edges(from_ase(chunk, None, None, None, None, device=device), model.cutoff)
        res = compute_properties(model, g, forces=True, stress=False)
        ptr = g.ptr.tolist()
        for s in range(len(chunk)):
            a, b = ptr[s], ptr[s + 1]
            out.append({"energy": float(res["energy"][s]),
                        "energy_std": float(res["energy_std"][s]),
                        "forces": res["forces"][a:b].detach().cpu().numpy(),
                        "forces_std": res["forces_std"][a:b].detach().cpu().numpy()})
    return out


def forces_factor(model) -> float:
    """The committee's forces calibration factor (its calibrated ``forces_std`` is the raw
    spread times this)."""
    return float(model.calibration["forces"])


def score(model, frames: Sequence) -> np.ndarray:
    """The uncertainty of each structure: its largest per-atom calibrated committee force
    standard deviation ``max_i forces_std[i]`` (eV/Å), ``[n_frames]``."""
    preds = predict(model, frames)
    return np.array([float(p["forces_std"].max()) if len(p["forces_std"]) else 0.0
                     for p in preds])


def test_errors(model, frames: Sequence) -> dict[str, float]:
    """The committee mean's errors on labelled ``frames``: energy MAE per atom (meV/atom),
    force-component MAE (meV/Å), mean and largest per-atom calibrated force uncertainty
    (meV/Å)."""
    if not frames:
        return {}
    preds = predict(model, frames)
    e_err = [abs(p["energy"] - a.get_potential_energy()) / len(a)
             for p, a in zip(preds, frames, strict=True)]
    f_err = np.concatenate([np.abs(p["forces"] - a.get_forces()).ravel()
                            for p, a in zip(preds, frames, strict=True)])
    std = np.concatenate([p["forces_std"] for p in preds])
    return {"test_energy_mae_meV_atom": 1000.0 * float(np.mean(e_err)),
            "test_forces_mae_meV_A": 1000.0 * float(np.mean(f_err)),
            "test_forces_std_mean_meV_A": 1000.0 * float(std.mean()),
            "test_forces_std_max_meV_A": 1000.0 * float(std.max())}
