"""Model construction for a run: species, data statistics, pretrained weights, precision."""

from __future__ import annotations

import inspect
import json
import math

import torch
from torch import nn

from xnn.config.train import ModelConfig, TrainConfig
from xnn.errors import InputError
from xnn.models.registry import build, model_class, rebuild

PRECISION_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16_mixed": torch.float32,
                    "fp64": torch.float64}


def pick_device(name: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' requested but CUDA is not available")
    return dev


def configure_precision(precision: str) -> tuple[torch.dtype, torch.dtype | None]:
    """``(parameter dtype, autocast dtype or None)``; ``tf32`` enables TF32 matmuls."""
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    autocast = torch.bfloat16 if precision == "bf16_mixed" else None
    return PRECISION_DTYPES[precision], autocast


def _accepts(name: str, arg: str) -> bool:
    params = inspect.signature(model_class(name).__init__).parameters
    return arg in params


def model_hyperparameters(cfg: ModelConfig, species: list[int], avg_neighbors=None) -> dict:
    """Keyword arguments for ``xnn.models.build``: config hyperparameters plus species, cutoff
    and (for models that take it, unless set) the average number of neighbours."""
    hp = dict(cfg.hyperparameters)
    for key in ("species", "cutoff"):
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


def load_pretrained(path: str) -> nn.Module:
    """The model (architecture and weights) of a model file or a training checkpoint.

    Both are read as data (``weights_only=True``): no code from the file runs. A checkpoint
    gives its EMA weights when it has them. The run fine-tunes this model; the ``model``
    section of the config must agree with it (:func:`check_pretrained_config`).

    Raises:
        InputError: the file does not exist.
        ModelFileError: it is neither an xnn model file nor a training checkpoint.
    """
    from pathlib import Path

    from xnn.errors import ModelFileError
    from xnn.models.serialization import load_model
    from xnn.training.checkpoint import load_checkpoint, require_fields

    if not Path(path).is_file():
        raise InputError(f"pretrained={path!r} does not exist")
    try:
        payload = load_checkpoint(path)
    except ModelFileError:
        try:
            return load_model(path).train()
        except ModelFileError as err:
            raise ModelFileError(f"pretrained={path!r} is neither an xnn model file nor an "
                                 f"xnn training checkpoint ({err})") from None
    require_fields(payload, path, keys=("model",))
    model = rebuild(payload["model"]["name"], payload["model"]["hparams"])
    state = dict(payload["model"]["state_dict"])
    if payload.get("ema") is not None:
        state.update(payload["ema"]["shadow"])
    model.load_state_dict(state, strict=True)
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
