"""Training and evaluation for ``xnn learn``: the members' train configs, their runs (resumed
from their checkpoints after a kill), the committee model file, and the committee's
predictions (scores of candidates, errors on the test set).

A round trains its K members as K ``xnn train`` runs in ``round_NNN/train/member_K`` (seed
``seed + k``; ``train.mode=finetune``: from member k of the previous round) and saves them
as one :class:`~xnn.models.committee.Committee` in ``round_NNN/model.pt``. With
``train.members=1`` the one run must train a committee itself (``xnn train``'s
``committee.size=K``, where the train config has it); its model file is the round's.
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


def train_config(cfg: LearnConfig, datasets: Sequence[str], output_dir: str | Path,
                 member: int, pretrained: str | None = None,
                 resume: str | None = None) -> TrainConfig:
    """The train config of one member: ``train.file`` ← ``train.config`` ← the loop's data
    (``datasets``), folder, seed (``seed + member``), and pretrained/resume.

    Raises:
        ConfigError: an invalid train config (named as ``train.config``/``train.file``).
    """
    base = OmegaConf.structured(TrainConfig)
    try:
        if cfg.train.file:
            base = OmegaConf.merge(base, OmegaConf.load(cfg.train.file))
        base = OmegaConf.merge(base, OmegaConf.create(dict(cfg.train.config)))
        base.data.datasets = [DatasetConfig(path=str(p)) for p in datasets]
        base.output_dir = str(output_dir)
        base.seed = cfg.seed + member
        base.resume = resume
        base.pretrained = pretrained
        if pretrained is not None:  # fine-tuning keeps the pretrained architecture
            base.model.hyperparameters = {}
            if "committee" in base:  # a committee file is trained on as it is
                base.committee.size = 1
        base.overwrite = False
        return OmegaConf.to_object(base)
    except OmegaConfBaseException as e:
        key = e.full_key or ""
        raise ConfigError(f"train config (train.file / train.config) key {key!r}: "
                          f"{str(e).splitlines()[0]}") from None


def _complete(folder: Path) -> bool:
    """Whether a member's run finished (its ``summary.json`` is written after ``model.pt``)."""
    return (folder / "model.pt").is_file() and (folder / "summary.json").is_file()


def train_member(cfg: LearnConfig, datasets: Sequence[str], folder: Path, member: int,
                 pretrained: str | None) -> Path:
    """Train (or finish training) one member in ``folder``; returns its ``model.pt``.

    A run killed after a checkpoint resumes from ``checkpoints/last.pt`` (the existing
    train resume, exact on CPU); one killed before its first checkpoint starts again.
    """
    from xnn.app.train import run_train

    if _complete(folder):
        return folder / "model.pt"
    last = folder / "checkpoints" / "last.pt"
    resume = str(last) if last.is_file() else None
    if resume is None and folder.exists():
        shutil.rmtree(folder)
    run_train(train_config(cfg, datasets, folder, member, pretrained, resume))
    return folder / "model.pt"


def save_committee(members: Sequence[Path], path: Path) -> None:
    """The members' model files as one committee model file (atomically). One member must
    itself be a committee (``xnn train committee.size=K``); its file is copied.

    Raises:
        InputError: a single member that is not a committee (it has no spread).
    """
    from xnn._files import atomic_write_bytes
    from xnn.models.committee import Committee
    from xnn.models.serialization import load_model, save_model

    models = [load_model(p) for p in members]
    if len(models) == 1:
        if models[0].committee_size < 2:
            raise InputError(f"train.members=1 trained {members[0]}, a single model: it has "
                             "no spread to score by; set train.members >= 2, or train one "
                             "committee per round (train.config: {committee: {size: K}}, "
                             "xnn train's committee)")
        atomic_write_bytes(path, Path(members[0]).read_bytes())
        return
    save_model(Committee(models), path)


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


def score(model, frames: Sequence) -> np.ndarray:
    """The uncertainty of each structure: its largest per-atom committee force standard
    deviation ``max_i forces_std[i]`` (eV/Å), ``[n_frames]``."""
    preds = predict(model, frames)
    return np.array([float(p["forces_std"].max()) if len(p["forces_std"]) else 0.0
                     for p in preds])


def test_errors(model, frames: Sequence) -> dict[str, float]:
    """The committee mean's errors on labelled ``frames``: energy MAE per atom (meV/atom),
    force-component MAE (meV/Å), mean and largest per-atom force uncertainty (meV/Å)."""
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
