"""``train(config)``: one training run from a resolved config, single process or data parallel.

Steps: prepare the output folder → read and split the data → statistics → build the model
(or load ``pretrained``) → optimizer, schedule, EMA → resume → epochs → final model from the
best checkpoint (EMA weights) → test metrics, plots and ``summary.json``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from xnn.config.loader import to_yaml
from xnn.config.train import TrainConfig
from xnn.errors import InputError
from xnn.training.checkpoint import (
    check_same_architecture,
    load_checkpoint,
    require_fields,
)
from xnn.training.data import build_splits, structures_for_statistics
from xnn.training.ema import EMA
from xnn.training.loggers import RunLogger
from xnn.training.loop import TrainingLoop, describe_model, seed_everything
from xnn.training.losses import TermSpec
from xnn.training.reducer import LocalReducer
from xnn.training.schedule import LRSchedule, build_optimizer
from xnn.training.setup import (
    build_model,
    check_pretrained_config,
    configure_precision,
    data_statistics,
    load_pretrained,
    pick_device,
)
from xnn.training.trainer import Trainer

RUN_FILES = ("config.yaml", "checkpoints", "metrics.csv", "summary.json", "model.pt",
             "learning_curves.png", "parity_test.png", "parity_val.png", "tensorboard")


def resolve_resume(cfg: TrainConfig) -> str | None:
    if cfg.resume == "auto":
        path = Path(cfg.output_dir) / "checkpoints" / "last.pt"
        return str(path) if path.is_file() else None
    return cfg.resume


def prepare_output(cfg: TrainConfig, resume: str | None, is_main: bool) -> Path:
    """Create the run folder; refuse one holding a previous run unless overwrite/resume."""
    out = Path(cfg.output_dir)
    previous = [name for name in RUN_FILES if (out / name).exists()]
    if previous and not resume and not cfg.validation_only:
        if not cfg.overwrite:
            raise InputError(f"output folder {str(out)!r} holds a previous run ({previous[0]}); "
                             "set overwrite=true, resume=auto, or another output_dir")
        if is_main:
            for name in previous:
                target = out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
    return out


def loss_specs(cfg: TrainConfig) -> dict[str, TermSpec]:
    return {name: TermSpec(t.weight, t.type, t.delta)
            for name in ("energy", "forces", "stress")
            for t in [getattr(cfg.loss, name)]}


def _model_for_run(cfg: TrainConfig, splits, logger) -> torch.nn.Module:
    if cfg.pretrained:
        model = load_pretrained(cfg.pretrained)
        if not isinstance(getattr(model, "hparams", None), dict):
            # checkpoints store native hyperparameters + weights; wrappers of external
            # models (mace, sevenn) have neither: refuse now rather than after an epoch
            raise InputError(f"pretrained={cfg.pretrained!r} holds a {type(model).__name__}; "
                             "xnn train fine-tunes native xnn models only (for a mace-torch "
                             "model use mace_run_train's fine-tuning)")
        check_pretrained_config(cfg.model, model, cfg.pretrained)
        known = set(getattr(model, "species", None) or splits.species)
        missing = sorted(set(splits.species) - known)
        if missing:
            raise InputError(f"the training data hold species {missing} unknown to the "
                             f"pretrained model {cfg.pretrained!r}")
        logger.print(f"fine-tuning {describe_model(model)} from {cfg.pretrained}")
        return model
    stats = data_statistics(cfg.model, splits.species,
                            structures_for_statistics(splits.raw_train))
    model = build_model(cfg, splits.species, stats)
    logger.print(f"model: {describe_model(model)}; E0 "
                 f"{ {k: round(v, 4) for k, v in stats['e0'].items()} } eV, "
                 f"avg neighbours {stats['avg_num_neighbors']:.1f}")
    return model


def _trainer(cfg: TrainConfig, model, reducer, device) -> Trainer:
    dtype, autocast = configure_precision(cfg.precision)
    model = model.to(device=device, dtype=dtype)
    reducer.broadcast_module(model)
    optimizer = build_optimizer(model, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay,
                                cfg.optim.amsgrad)
    s = cfg.schedule
    schedule = LRSchedule(optimizer, s.name, cfg.optim.lr, s.warmup_steps, s.total_steps,
                          s.min_lr_factor, s.factor, s.patience)
    ema = EMA(model, cfg.ema.decay) if cfg.ema.enabled else None
    return Trainer(model, loss_specs(cfg), optimizer, schedule, ema, reducer, device, dtype,
                   autocast, cfg.optim.grad_clip, compile=cfg.compile)


def _horizon(cfg: TrainConfig, loop: TrainingLoop) -> int:
    if cfg.schedule.total_steps is not None:
        return cfg.schedule.total_steps
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(cfg.max_epochs * loop.steps_per_epoch(), 1)


def train(cfg: TrainConfig, reducer=None) -> dict:
    """Run training as configured; returns the summary (also written to ``summary.json``).

    Args:
        cfg: a resolved :class:`~xnn.config.train.TrainConfig`.
        reducer: cross-rank operations (default: a single process).
    """
    reducer = reducer or LocalReducer()
    t_start = time.perf_counter()
    resume = resolve_resume(cfg)
    out = prepare_output(cfg, resume, reducer.is_main)
    reducer.barrier()
    logger = RunLogger(out, reducer.is_main, cfg.logging.csv, cfg.logging.tensorboard,
                       cfg.logging.progress_bar)
    device = pick_device(cfg.device)
    seed_everything(cfg.seed, reducer.rank)
    splits = build_splits(cfg.data, cfg.loss, cfg.model.cutoff, cfg.seed, cfg.model.species)
    logger.print(f"data: {len(splits.train)} training, "
                 f"{len(splits.val) if splits.val else 0} validation, "
                 f"{len(splits.test) if splits.test else 0} test structures")
    model = _model_for_run(cfg, splits, logger)  # seeded with cfg.seed: same on every rank
    seed_everything(cfg.seed, reducer.rank)
    trainer = _trainer(cfg, model, reducer, device)
    loop = TrainingLoop(cfg, trainer, splits, out, logger)
    loop.config_yaml = to_yaml(cfg)
    trainer.schedule.total_steps = _horizon(cfg, loop)
    if resume:
        payload = load_checkpoint(resume)
        require_fields(payload, resume)  # what restore reads: one line, not a KeyError
        check_same_architecture(payload, trainer.model, resume)
        loop.restore(payload)
        logger.print(f"resumed from {resume} at epoch {loop.progress.epoch}, "
                     f"step {loop.progress.step}")
    if reducer.is_main and not cfg.validation_only:
        (out / "config.yaml").write_text(loop.config_yaml)
        if cfg.compile:
            logger.print("compile=true: the first training steps trace, check and compile "
                         "the model (about a minute)")
    reason = "validation_only"
    if not cfg.validation_only:
        reason = loop.run()
    from xnn.training.finish import finish_run

    summary = finish_run(cfg, loop, reason, time.perf_counter() - t_start)
    logger.close()
    return summary


__all__ = ["train", "prepare_output", "resolve_resume", "json"]
