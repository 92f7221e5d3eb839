"""The model of a training run from the config: hyperparameters, data statistics, a new
model, or a check that a pretrained model agrees with the config's ``model`` section."""

from __future__ import annotations

import inspect
import json
import math

import torch
from torch import nn

from xnn.config.train import ModelConfig, TrainConfig
from xnn.errors import InputError
from xnn.models.registry import build, model_class


def _accepts(name: str, arg: str) -> bool:
    params = inspect.signature(model_class(name).__init__).parameters
    return arg in params


def model_hyperparameters(cfg: ModelConfig, species: list[int], avg_neighbors=None) -> dict:
    """Keyword arguments for ``xnn.models.build``: config hyperparameters plus species, cutoff
    and (for models that take it, unless set) the average number of neighbours."""
    hp = dict(cfg.hyperparameters)
    for key in ("species", "cutoff", "activation_checkpointing"):
        if key in hp:
            raise InputError(f"set model.{key} rather than model.hyperparameters.{key}")
    hp["species"] = list(species)
    hp["cutoff"] = float(cfg.cutoff)
    if avg_neighbors is not None and "avg_num_neighbors" not in hp \
            and _accepts(cfg.name, "avg_num_neighbors"):
        hp["avg_num_neighbors"] = float(avg_neighbors)
    return hp


def data_statistics(cfg: ModelConfig, species: list[int], structures: list) -> dict:
    """E0s, shift, scale and average neighbours from training structures (see ModelConfig)."""
    from xnn.models import statistics as S

    out: dict = {"avg_num_neighbors": S.average_num_neighbors(structures, cfg.cutoff)}
    e0 = S.fit_e0(structures, species) if cfg.e0 == "fit" else {z: 0.0 for z in species}
    out["e0"] = e0
    if cfg.scale_shift:
        out["shift"] = S.energy_per_atom_stats(structures, e0)["mean"]
        rms = S.force_rms(structures)
        out["scale"] = rms if rms > 1e-8 else 1.0
    return out


def build_model(cfg: TrainConfig, species: list[int], statistics: dict | None) -> nn.Module:
    """Build the configured model (seeded) and apply the statistics."""
    torch.manual_seed(cfg.seed)
    stats = statistics or {}
    hp = model_hyperparameters(cfg.model, species, stats.get("avg_num_neighbors"))
    model = build(cfg.model.name, **hp)
    setter = getattr(model, "set_statistics", None)
    if statistics and callable(setter):
        setter(e0=stats.get("e0"), scale=stats.get("scale"), shift=stats.get("shift"))
    return model


def _canonical(value):
    """``value`` as JSON would give it back (tuples as lists, int keys as strings)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def check_pretrained_config(cfg: ModelConfig, model: nn.Module, path: str) -> None:
    """Refuse ``model.cutoff`` or ``model.hyperparameters`` that differ from the pretrained
    model's (fine-tuning keeps its architecture; the data's neighbor lists use
    ``model.cutoff``), listing every differing key.

    Raises:
        InputError: one line naming the differing keys and both values.
    """
    hparams = _canonical(getattr(model, "hparams", None) or {})
    diffs = []
    if not math.isclose(float(cfg.cutoff), float(model.cutoff), rel_tol=1e-12):
        diffs.append(f"model.cutoff {float(cfg.cutoff):g} vs {float(model.cutoff):g}")
    for key, value in sorted(cfg.hyperparameters.items()):
        if key not in hparams:
            diffs.append(f"model.hyperparameters.{key} (the pretrained model has none)")
        elif _canonical(value) != hparams[key]:
            diffs.append(f"model.hyperparameters.{key} {_canonical(value)!r} vs "
                         f"{hparams[key]!r}")
    if diffs:
        raise InputError(f"pretrained={path!r}: the config's model section differs from the "
                         f"pretrained model (config vs pretrained: {'; '.join(diffs)}); "
                         "fine-tuning keeps the pretrained architecture: set these to the "
                         f"pretrained values or remove them (model.cutoff defaults to "
                         f"{ModelConfig().cutoff:g})")
