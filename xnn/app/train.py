"""The application behind ``xnn train``: ``train(cfg, reducer, parallel)`` runs one training
from a resolved config, single process, data parallel or context parallel (``dp × dd``);
``run_train(cfg)`` launches it (one process, torchrun or srun) with the parallel layer of
:func:`~xnn.distributed.entries.parallelize_train`.

Steps: plan the output folder → read and split the data → statistics → build the model
(or load ``pretrained``) → optimizer, schedule, EMA → resume → create the output folder →
epochs → final model from the best checkpoint (EMA weights) → test metrics, plots and
``summary.json``. Nothing is written before the folder is created, so a run refused for its
config, data, model or resume file changes no file; a run that replaces a previous one
(``overwrite=true``) is written to a staging folder and swapped in when it completes
(:mod:`xnn.io.run_folder`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from xnn._files import require_file
from xnn._torch_files import check_complete
from xnn.app.train_data import build_splits, data_files
from xnn.app.train_model import (
    build_model,
    check_native,
    check_pretrained_config,
    check_trainable,
    data_statistics,
    multihead_model,
    stored_statistics,
)
from xnn.app.train_replay import run_heads
from xnn.app.train_replay_gen import PretrainedReplay
from xnn.config.loader import to_yaml
from xnn.config.train import TrainConfig
from xnn.devices import resolve_device
from xnn.errors import InputError
from xnn.io.run_folder import RunFolder, plan_run_folder, staging_dir
from xnn.io.train_checkpoint import save_checkpoint
from xnn.io.train_log import RunLogger
from xnn.models.base import as_model
from xnn.models.cueq import set_kernel_backend
from xnn.models.registry import species_numbers
from xnn.models.trust import granted
from xnn.training.checkpoint import check_same_architecture, load_checkpoint, require_fields
from xnn.training.data import structures_for_statistics
from xnn.training.ema import EMA
from xnn.training.finetune import describe as describe_finetune
from xnn.training.finetune import freeze, param_groups
from xnn.training.loop import LoopSettings, TrainingLoop, describe_model, seed_everything
from xnn.training.losses import TermSpec
from xnn.training.memory import MemoryTools, build_memory_tools, set_activation_checkpointing
from xnn.training.reducer import LocalReducer
from xnn.training.schedule import LRSchedule, build_optimizer
from xnn.training.setup import configure_precision, is_pretrained_name, load_pretrained
from xnn.training.trainer import Trainer

#: what a run folder given as ``resume=`` / ``pretrained=`` most likely meant
SUGGEST = {"resume": ("checkpoints/last.pt",), "pretrained": ("model.pt",)}
RUN_FILES = ("config.yaml", "checkpoints", "metrics.csv", "steps.csv", "summary.json", "model.pt",
             "learning_curves.png", "parity_test.png", "parity_val.png", "tensorboard",
             "split.json", "split.npy", "replay_pretrained.xyz", "calibration_val.png")


def resolve_resume(cfg: TrainConfig) -> str | None:
    """The checkpoint to continue from: ``cfg.resume``, or for ``auto`` the last checkpoint
    of an interrupted run that replaces the run in ``output_dir`` (with ``overwrite=true``),
    else ``output_dir/checkpoints/last.pt`` (``None`` when there is none)."""
    if cfg.resume == "auto":
        candidates = [Path(cfg.output_dir) / "checkpoints" / "last.pt"]
        if cfg.overwrite:
            candidates.insert(0, staging_dir(cfg.output_dir) / "checkpoints" / "last.pt")
        return next((str(p) for p in candidates if p.is_file()), None)
    return cfg.resume


def plan_output(cfg: TrainConfig, resume: str | None) -> RunFolder:
    """Where the run writes (nothing is written): ``output_dir``, or with ``overwrite=true``
    over a previous run a staging folder that replaces it when the run completes.

    Raises:
        InputError: ``output_dir`` is a file, or holds a previous run and neither
            ``overwrite`` nor ``resume`` is set.
    """
    return plan_run_folder(cfg.output_dir, RUN_FILES, resume=resume, overwrite=cfg.overwrite,
                           keep=cfg.validation_only)


def _check_inputs(cfg: TrainConfig, resume: str | None) -> None:
    """Checkpoint and pretrained files exist and are complete (before anything is built)."""
    for key, path in (("resume", resume), ("pretrained", cfg.pretrained)):
        if path and not (key == "pretrained" and is_pretrained_name(path)):
            require_file(path, f"{key}=", InputError, suggest=SUGGEST[key])
            check_complete(path, "checkpoint" if key == "resume" else "pretrained file")


def check_hyperparameter_names(cfg: TrainConfig) -> None:
    """Refuse ``model.hyperparameters`` that ``model.name`` does not take, before the data
    are read, saying how to drop a YAML's settings of another model.

    Raises:
        InputError: one line naming the unknown and the valid hyperparameters, or a
            ``model.species`` that is not a list of distinct elements (as
            :func:`xnn.models.build` checks a model's ``species``).
    """
    import inspect

    from xnn.models.registry import model_class, species_numbers

    if cfg.model.species is not None:
        species_numbers(cfg.model.species, "model.species")
    if cfg.model.name == "sum" or cfg.pretrained:
        return  # a sum's terms are checked when built; a pretrained model keeps its own
    params = inspect.signature(model_class(cfg.model.name).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(cfg.model.hyperparameters) - set(params))
    if unknown:
        valid = [n for n in params if n not in ("self", "species", "cutoff")]
        raise InputError(f"model {cfg.model.name!r} has no hyperparameter(s) {unknown} "
                         f"(valid: {valid}); if they are another model's settings from the "
                         f"YAML, clear them: model.name={cfg.model.name} "
                         "model.hyperparameters=null")


def loss_specs(cfg: TrainConfig) -> dict[str, TermSpec]:
    return {name: TermSpec(t.weight, t.type, t.delta)
            for name in ("energy", "forces", "stress")
            for t in [getattr(cfg.loss, name)]}


def loop_settings(cfg: TrainConfig, dp: int = 1) -> LoopSettings:
    """The epoch loop's settings from the config (``dp``: data-parallel replicas, the
    shares of a balanced global batch unless ``data.balance_bins`` says)."""
    d, es = cfg.data, cfg.early_stopping
    bins = (d.balance_bins or dp) if d.balance == "atoms" else None
    return LoopSettings(
        seed=cfg.seed, batch_size=d.batch_size, max_atoms_per_batch=d.max_atoms_per_batch,
        shuffle=d.shuffle, val_batch_size=d.val_batch_size, max_epochs=cfg.max_epochs,
        max_steps=cfg.max_steps, time_limit_min=cfg.time_limit_min, eval_every=cfg.eval_every,
        checkpoint_metric=cfg.checkpoint_metric, patience=es.patience,
        min_delta=es.min_delta, validation_only=cfg.validation_only,
        checkpoint_mode=cfg.checkpoint_mode, samples_per_epoch=d.samples_per_epoch,
        every_n_steps=cfg.logging.every_n_steps, precision=cfg.precision,
        accumulate_grad_batches=cfg.accumulate_grad_batches, balance_bins=bins,
        balance_lookahead=d.balance_lookahead, num_workers=d.num_workers,
        checkpoint_every=cfg.checkpoint_every_steps)


def _model_for_run(cfg: TrainConfig, splits, logger, reducer) -> torch.nn.Module:
    # model.trust_file: the caller's trust in every file the config names (pretrained=,
    # model_file terms), for every load below (xnn.models.trust.granted)
    with granted(cfg.model.trust_file):
        return _pretrained_or_new(cfg, splits, logger, reducer)


def _pretrained_or_new(cfg: TrainConfig, splits, logger, reducer) -> torch.nn.Module:
    if cfg.pretrained:
        model = load_pretrained(cfg.pretrained)
        # checkpoints store native hyperparameters + weights; wrappers of external models
        # (mace, sevenn) have neither: refuse now rather than after an epoch
        check_native(model, f"pretrained={cfg.pretrained!r}")
        check_pretrained_config(cfg.model, model, cfg.pretrained)
        known = set(as_model(model, f"pretrained={cfg.pretrained!r}").species
                    or splits.species)
        missing = sorted(set(splits.species) - known)
        if missing:
            raise InputError(f"the training data hold species {missing} unknown to the "
                             f"pretrained model {cfg.pretrained!r}")
        logger.print(f"fine-tuning {describe_model(model)} from {cfg.pretrained}")
        ft = cfg.finetune
        if ft.heads:
            model, line = multihead_model(model, run_heads(cfg.data, _generates(cfg)), splits,
                                          f"pretrained={cfg.pretrained!r}")
            logger.print(line)
        frozen = freeze(model, ft.freeze)
        param_groups(model, ft.lr)  # unknown part names are refused before anything runs
        if ft.freeze or ft.lr:
            logger.print(describe_finetune(model, frozen, ft.lr))
        return model
    sample = structures_for_statistics(splits.raw_train)  # coincident atoms refused there
    # prepared data at model.cutoff store them: no pass over the data (the same numbers)
    stats = stored_statistics(cfg.model, splits.species, sample, splits.isolated_e0)
    if stats is None:
        stats = data_statistics(cfg.model, splits.species,
                                [sample[i] for i in range(len(sample))], reducer,
                                sample.origin, splits.isolated_e0)
    else:
        logger.print("statistics: from the counts stored with the prepared data")
    model = build_model(cfg, splits.species, stats)
    logger.print(f"model: {describe_model(model)}; E0 ({describe_e0_convention(cfg, splits)}) "
                 f"{format_e0(stats['e0'])}, avg neighbours {stats['avg_num_neighbors']:.1f}")
    return model


def _generates(cfg: TrainConfig) -> bool:
    """Whether the run makes replay structures with the pretrained model."""
    return bool(cfg.pretrained and cfg.finetune.replay_from_pretrained)


def uses_isolated_atoms(cfg: TrainConfig) -> bool:
    """Whether the run takes its E0s from isolated-atom entries (``model.e0=isolated`` for
    a new model; a fine-tuned model keeps its own E0s): they then leave the training data."""
    return cfg.model.e0_convention() == "isolated" and not cfg.pretrained


def describe_e0_convention(cfg: TrainConfig, splits) -> str:
    """How the E0s were chosen, for the log: ``isolated: IsolatedAtom entries of 2
    elements, left out of training``, ``fit``, ``given`` (a map)..."""
    convention = cfg.model.e0_convention()
    if splits.isolated_e0 is not None:
        return (f"{convention}: IsolatedAtom entries of {len(splits.isolated_e0)} elements, "
                "left out of training")
    return convention


def format_e0(e0: dict) -> str:
    """Reference energies by element symbol: ``"Cu -3.5123 eV, O -4.2 eV"``."""
    from xnn.training.data import symbols

    return ", ".join(f"{symbols([z])[0]} {v:.4f} eV" for z, v in sorted(e0.items()))


def _memory(cfg: TrainConfig, device, rank: int) -> MemoryTools | None:
    """Offload and CUDA profile of ``cfg.memory`` (checked before anything is read)."""
    from xnn.io.memory_profile import MemoryProfile

    m = cfg.memory
    profile = None
    if m.profile_prefix is not None:
        profile = MemoryProfile(m.profile_prefix, rank, device, m.profile_steps,
                                m.profile_max_entries)
    return build_memory_tools(m.offload_activations, profile, device, cfg.compile)


def _trainer(cfg: TrainConfig, model, parallel, device, memory=None) -> Trainer:
    check_trainable(cfg, model)
    reducer = parallel.reducer
    dtype, autocast = configure_precision(cfg.precision)
    set_activation_checkpointing(model, cfg.model.activation_checkpointing, cfg.model.name,
                                 cfg.compile)
    if cfg.model.kernel_backend != "saved":  # saved: as the pretrained file (new: reference)
        set_kernel_backend(model, cfg.model.kernel_backend, cfg.model.name)
    model = model.to(device=device, dtype=dtype)
    reducer.broadcast_module(model)
    groups = param_groups(model, cfg.finetune.lr) if cfg.finetune.lr else None
    optimizer = build_optimizer(model, cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay,
                                cfg.optim.amsgrad, groups)
    s = cfg.schedule
    schedule = LRSchedule(optimizer, s.name, cfg.optim.lr, s.warmup_steps, s.total_steps,
                          s.min_lr_factor, s.factor, s.patience)
    ema = EMA(model, cfg.ema.decay) if cfg.ema.enabled else None
    specs = loss_specs(cfg)
    predictor = parallel.predictor(model, device, dtype, autocast, cfg.compile,
                                   specs["forces"].weight > 0, specs["stress"].weight > 0)
    return Trainer(model, specs, optimizer, schedule, ema, reducer, device, dtype, autocast,
                   cfg.optim.grad_clip, predictor=predictor, memory=memory)


def _horizon(cfg: TrainConfig, loop: TrainingLoop) -> int:
    if cfg.schedule.total_steps is not None:
        return cfg.schedule.total_steps
    if cfg.max_steps is not None:
        return cfg.max_steps
    return max(cfg.max_epochs * loop.steps_per_epoch(), 1)


def train(cfg: TrainConfig, reducer=None, parallel=None) -> dict:
    """Run training as configured; returns the summary (also written to ``summary.json``).

    Args:
        cfg: a resolved :class:`~xnn.config.train.TrainConfig`.
        reducer: cross-rank operations of plain data parallelism (default: one process);
            ignored with ``parallel``.
        parallel: the :class:`~xnn.distributed.entries.TrainParallel` of the run (from
            :func:`~xnn.distributed.entries.parallelize_train`): reducer, sharding and
            prediction function; ``None``: data parallel by ``reducer``.
    """
    from xnn.distributed.entries import local_train_parallel

    parallel = parallel or local_train_parallel(reducer or LocalReducer())
    reducer = parallel.reducer
    t_start = time.perf_counter()
    resume = resolve_resume(cfg)
    folder = plan_output(cfg, resume)  # checks only: nothing is created or removed yet
    _check_inputs(cfg, resume)
    check_hyperparameter_names(cfg)
    out = folder.work
    logger = RunLogger(out, reducer.is_main, cfg.logging.csv, False, cfg.logging.progress_bar)
    device = resolve_device(cfg.device)
    if cfg.deterministic:
        _deterministic()
    memory = _memory(cfg, device, reducer.rank)
    seed_everything(cfg.seed, reducer.rank)
    # the statistics' neighbor lists check their training sample for coincident atoms; a
    # fine-tuned model has no statistics: build_splits checks that sample then
    species = (None if cfg.model.species is None
               else species_numbers(cfg.model.species, "model.species"))
    gen = PretrainedReplay(cfg, out, resume, reducer) if _generates(cfg) else None
    heads = run_heads(cfg.data, gen is not None)[0] if cfg.finetune.heads else None
    splits = build_splits(cfg.data, cfg.loss, cfg.model.cutoff, cfg.seed, species,
                          reducer, check_train=bool(cfg.pretrained),
                          isolated_atoms=uses_isolated_atoms(cfg),
                          replay=(cfg.finetune.replay_weight, cfg.finetune.replay_fraction),
                          make_replay=None if gen is None else (
                              lambda new: (gen.entry(), gen.dataset(new))),
                          bootstrap=((cfg.committee.size, cfg.seed) if cfg.committee.bootstrap
                                     else None), heads=heads)
    logger.print(f"data: {len(splits.train)} training, "
                 f"{len(splits.val) if splits.val else 0} validation, "
                 f"{len(splits.test) if splits.test else 0} test structures"
                 + (f" (replay: {len(splits.val_replay)} validation)" if splits.val_replay
                    else ""))
    model = _model_for_run(cfg, splits, logger, reducer)  # seeded: the same on every rank
    seed_everything(cfg.seed, reducer.rank)
    trainer = _trainer(cfg, model, parallel, device, memory)
    loop = TrainingLoop(loop_settings(cfg, parallel.sharding.dp), trainer, splits, out, logger,
                        parallel.sharding, save_checkpoint)
    loop.check_batches()  # a structure over a dd group's budget is refused now
    loop.config_yaml = to_yaml(cfg)
    trainer.schedule.total_steps = _horizon(cfg, loop)
    if resume:
        payload = load_checkpoint(resume)
        require_fields(payload, resume)  # what restore reads: one line, not a KeyError
        check_same_architecture(payload, trainer.model, resume)
        loop.restore(payload, resume)
        logger.print(f"resumed from {resume} at epoch {loop.progress.epoch}, "
                     f"step {loop.progress.step}")
    logger = loop.logger = _open_folder(cfg, folder, reducer, logger)
    if gen is not None:
        gen.write()  # rank 0, into the folder just created (a resumed run's file stays)
        reducer.barrier()
    reason = "validation_only"
    if not cfg.validation_only:
        reason = loop.run()
        if memory is not None:
            memory.close()  # a profile of more steps than the run made
    from xnn.app.train_finish import finish_run

    summary = finish_run(cfg, loop, reason, time.perf_counter() - t_start)
    logger.close()
    if reducer.is_main:
        folder.commit()  # a run that replaces another: swap the files in now that it is done
    reducer.barrier()
    return summary


def _deterministic() -> None:
    """Deterministic kernels: atomics-free index_add/scatter, fixed cuBLAS workspaces."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def _open_folder(cfg: TrainConfig, folder: RunFolder, reducer, logger) -> RunLogger:
    """Everything is validated: create the run folder (rank 0), write ``config.yaml``; the
    logger (with TensorBoard, which writes at once, when configured)."""
    reducer.barrier()  # every rank has checked the folder before rank 0 changes it
    if reducer.is_main:
        folder.create()
        if folder.staged:
            logger.print(f"overwrite=true: this run is written to {folder.work} and replaces "
                         f"the previous run in {folder.final} when it completes")
        if not cfg.validation_only:
            (folder.work / "config.yaml").write_text(to_yaml(cfg))
            if cfg.compile:
                logger.print("compile=true: the first training steps trace, check and "
                             "compile the model (about a minute)")
    reducer.barrier()
    if cfg.logging.tensorboard:
        return RunLogger(folder.work, reducer.is_main, cfg.logging.csv, True,
                         cfg.logging.progress_bar)
    return logger


def run_train(cfg: TrainConfig) -> dict:
    """Launch ``train(cfg)`` in one process or on the ranks of a torchrun / srun job (every
    rank checks first that all run the same job), on the configured ``dp × dd`` mesh (built
    once here; ``dd > 1``: each structure decomposed over its dd group).

    Returns:
        the run summary (as :func:`train`).
    """
    from xnn.config.parallel import TIMEOUT_KEY
    from xnn.distributed.agreement import check_ranks_agree, run_fingerprint
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    device = resolve_device(cfg.device)
    manager = DistributedManager.initialize(timeout_s=cfg.parallel.timeout_s, device=device.type,
                                            timeout_key=TIMEOUT_KEY)
    try:
        if manager.is_distributed:  # the first collective: every rank runs the same job
            files = {**data_files(cfg.data), "pretrained": cfg.pretrained,
                     "resume": resolve_resume(cfg)}
            check_ranks_agree(run_fingerprint(cfg, files))
        if device.type == "cuda" and manager.is_distributed:
            cfg.device = str(manager.device)
        parallel = parallelize_train(manager, cfg.parallel.dp, cfg.parallel.dd, cfg.compile,
                                     mode=cfg.parallel.mode, balance=cfg.parallel.balance,
                                     exchange=cfg.parallel.exchange)
        if manager.is_distributed and manager.is_main:
            print(manager.describe(), flush=True)
        return train(cfg, parallel=parallel)
    except RuntimeError as e:  # a collective that timed out: one line naming it and the ranks
        raise manager.explain(e) from None
    finally:
        manager.cleanup()


__all__ = ["train", "run_train", "plan_output", "resolve_resume", "loop_settings"]
