"""The epoch loop: batches, validation, checkpoints, early stopping, exact resume.

The sampler position is ``(epoch, batch_in_epoch)``: the batches of an epoch are a pure
function of ``(seed, epoch)``, so a resumed run skips the ``batch_in_epoch`` batches already
done and continues with exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from xnn.data.datasets import make_batches
from xnn.training.checkpoint import model_identity, rng_state, save_checkpoint, set_rng_state
from xnn.training.metrics import MetricSums
from xnn.training.trainer import NonFiniteLossError, Trainer


@dataclass(frozen=True)
class LoopSettings:
    """What the epoch loop needs to know of a run (built from the config by the app layer).

    Attributes:
        seed: batch-order and per-rank seed.
        batch_size: structures per training batch (``None``: by ``max_atoms_per_batch``).
        max_atoms_per_batch: atoms per batch (``None``: by ``batch_size``).
        shuffle: shuffle the training batches each epoch.
        val_batch_size: structures per evaluation batch (``None``: as for training).
        max_epochs: epochs to train.
        max_steps: optimizer steps to stop at (``None``: no limit).
        time_limit_min: wall-time limit of the loop in minutes (``None``: none).
        eval_every: validate every this many epochs.
        checkpoint_metric: the validation metric that picks ``best.pt``.
        patience: epochs without improvement before early stopping (``None``: never).
        min_delta: the improvement that counts.
        validation_only: evaluate a model, never train (``metrics.csv`` is not touched).
        accumulate_grad_batches: consecutive global batches per optimizer step (one
            forward/backward each, one gradient reduction and step, the label counts summed).
    """

    seed: int = 0
    batch_size: int | None = 8
    max_atoms_per_batch: int | None = None
    shuffle: bool = True
    val_batch_size: int | None = None
    max_epochs: int = 1
    max_steps: int | None = None
    time_limit_min: float | None = None
    eval_every: int = 1
    checkpoint_metric: str = "val_loss"
    patience: int | None = None
    min_delta: float = 0.0
    validation_only: bool = False
    accumulate_grad_batches: int = 1


@dataclass
class Progress:
    """Where the run is: next epoch to (continue to) train, steps done, best metric."""

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    best_value: float = math.inf
    best_epoch: int = -1
    bad_epochs: int = 0
    history: list = field(default_factory=list)


def seed_everything(seed: int, rank: int = 0, step: int = 0) -> None:
    """Seed torch, numpy and random with a value offset by rank and step."""
    s = int(seed) + 1_000_003 * int(rank) + 7_919 * int(step)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


class TrainingLoop:
    """Run epochs of ``trainer`` over ``splits`` as ``cfg`` says.

    Args:
        cfg: the run's :class:`LoopSettings`.
        trainer: a :class:`~xnn.training.trainer.Trainer`.
        splits: a :class:`~xnn.training.data.DataSplits`.
        out_dir: run folder (checkpoints in ``out_dir/checkpoints``).
        logger: a :class:`~xnn.training.loggers.RunLogger`.
        sharding: ``sharding(batch, n_atoms, max_atoms) -> this rank's indices`` with a
            ``groups`` attribute (the ``groups`` of ``make_batches``) and
            ``load(dataset, indices) -> graphs``, from
            :func:`~xnn.distributed.parallelize.parallelize_train`; ``None``: by the
            reducer's rank among its ranks.
    """

    def __init__(self, cfg: LoopSettings, trainer: Trainer, splits, out_dir: Path, logger,
                 sharding=None):
        self.cfg = cfg
        self.trainer = trainer
        self.splits = splits
        self.reducer = trainer.reducer
        self.out_dir = Path(out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.logger = logger
        self.progress = Progress()
        self.config_yaml = ""
        self.t_start = time.perf_counter()
        self.stop_reason = ""
        if sharding is None:
            from xnn.distributed.cp_train import BatchSharding

            sharding = BatchSharding(self.reducer.rank, self.reducer.world_size)
        self.sharding = sharding

    # ------------------------------------------------------------------ batches
    def _shard(self, dataset, max_atoms: int | None):
        """``shard(batch) -> this rank's indices`` for batches made with ``max_atoms``."""
        n_atoms, sharding = dataset.n_atoms, self.sharding
        return lambda batch: sharding(batch, n_atoms, max_atoms)

    def _eval_max_atoms(self) -> int | None:
        d = self.cfg
        return None if d.val_batch_size else d.max_atoms_per_batch

    def train_batches(self, epoch: int) -> list[list[int]]:
        d = self.cfg
        return make_batches(self.splits.train.n_atoms, d.batch_size, d.max_atoms_per_batch,
                            shuffle=d.shuffle, seed=self.cfg.seed, epoch=epoch,
                            groups=self.sharding.groups)

    def eval_batches(self, dataset) -> list[list[int]]:
        d = self.cfg
        max_atoms = self._eval_max_atoms()
        size = None if max_atoms is not None else d.val_batch_size or d.batch_size
        return make_batches(dataset.n_atoms, size, max_atoms, groups=self.sharding.groups)

    def check_batches(self) -> None:
        """Make every split's batches once (refuses a structure too large for a group's
        budget at start-up rather than at the first validation)."""
        self.train_batches(0)
        for ds in (self.splits.val, self.splits.test):
            if ds is not None and len(ds):
                self.eval_batches(ds)

    def steps_per_epoch(self) -> int:
        k = self.cfg.accumulate_grad_batches
        return -(-len(self.train_batches(0)) // k)

    # ------------------------------------------------------------------ checkpoints
    def payload(self) -> dict:
        from xnn.models.serialization import model_payload

        t = self.trainer
        model = model_payload(t.model)
        return {
            "model": {"name": model["name"], "hparams": model["hparams"],
                      "state_dict": model["state_dict"]},
            "ema": t.ema.state_dict() if t.ema is not None else None,
            "optimizer": t.optimizer.state_dict(),
            "schedule": t.schedule.state_dict() if t.schedule is not None else None,
            "progress": asdict(self.progress),
            "rng": rng_state(),
            "config": self.config_yaml,
        }

    def save(self, name: str) -> Path | None:
        if not self.reducer.is_main:
            return None
        return save_checkpoint(self.payload(), self.ckpt_dir / f"{name}.pt")

    def restore(self, payload: dict) -> None:
        """Load model, EMA, optimizer, schedule, progress and RNG state from a checkpoint;
        ``metrics.csv`` is rewritten to hold exactly the epochs of the checkpoint."""
        t = self.trainer
        t.model.load_state_dict(payload["model"]["state_dict"], strict=True)
        if t.ema is not None and payload.get("ema") is not None:
            t.ema.load_state_dict(payload["ema"])
        t.optimizer.load_state_dict(payload["optimizer"])
        if t.schedule is not None and payload.get("schedule") is not None:
            t.schedule.load_state_dict(payload["schedule"])
        self.progress = Progress(**payload["progress"])
        if not self.cfg.validation_only:  # metrics.csv = the rows of the checkpoint
            self.logger.restore_csv(self.progress.history)
        if self.reducer.rank == 0:
            set_rng_state(payload["rng"])
        else:
            seed_everything(self.cfg.seed, self.reducer.rank, self.progress.step)

    # ------------------------------------------------------------------ validation
    def validate(self, dataset, prefix: str, collect: bool = False):
        """Metrics ``{prefix + name: value}`` over a dataset (and parity data if ``collect``)."""
        if dataset is None or len(dataset) == 0:
            return {}, None
        sums, parity = self.trainer.evaluate(dataset, self.eval_batches(dataset),
                                             self._shard(dataset, self._eval_max_atoms()),
                                             collect=collect, load=self.sharding.load)
        return sums.finalize(prefix), parity

    # ------------------------------------------------------------------ epochs
    def _stop_for_steps(self) -> bool:
        m = self.cfg.max_steps
        if m is not None and self.progress.step >= m:
            self.stop_reason = "max_steps"
            return True
        if self.trainer.stop_votes > 0:  # see _late
            self.stop_reason = "time_limit"
            return True
        return False

    def _late(self) -> bool:
        """Rank 0's vote to stop for the time limit: every rank must take the same branch, so
        the vote travels with the step's loss all-reduce and every rank reads the sum."""
        limit = self.cfg.time_limit_min
        return (limit is not None and self.reducer.rank == 0
                and time.perf_counter() - self.t_start > 60.0 * limit)

    def _train_epoch(self, metrics: MetricSums) -> bool:
        """Train the rest of the current epoch; False if stopped by ``max_steps``.

        An optimizer step takes ``accumulate_grad_batches`` consecutive global batches (the
        epoch's last step may take fewer), consumed together: ``batch_in_epoch`` advances by
        a step's batches, so a resumed run continues at a step boundary."""
        p = self.progress
        batches = self.train_batches(p.epoch)
        shard = self._shard(self.splits.train, self.cfg.max_atoms_per_batch)
        data = self.splits.train
        k = self.cfg.accumulate_grad_batches
        bar = self.logger.bar(len(batches), p.batch_in_epoch, f"epoch {p.epoch + 1}")
        try:
            while p.batch_in_epoch < len(batches):
                if self._stop_for_steps():
                    return False
                step_batches = batches[p.batch_in_epoch : p.batch_in_epoch + k]
                graphs = [self.sharding.load(data, shard(b)) for b in step_batches]
                counts = data.batch_label_counts([i for b in step_batches for i in b])
                loss = self.trainer.train_step(graphs, p.step, metrics, stop_vote=self._late(),
                                               counts=counts)
                p.step += 1
                p.batch_in_epoch += len(step_batches)
                bar.update(len(step_batches))
                bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        finally:
            bar.close()
        return True

    def _end_epoch(self, train_metrics: MetricSums, t0: float) -> bool:
        """Validate, log, checkpoint; True when early stopping says stop."""
        p, cfg = self.progress, self.cfg
        p.epoch += 1
        p.batch_in_epoch = 0
        train_metrics.values = self.reducer.all_reduce_sum(train_metrics.values)
        row: dict = {"epoch": p.epoch, "step": p.step,
                     "lr": self.trainer.optimizer.param_groups[0]["lr"]}
        row.update(train_metrics.finalize("train_"))
        improved, stop = False, False
        if p.epoch % cfg.eval_every == 0 and self.splits.val is not None:
            val, _ = self.validate(self.splits.val, "val_")
            row.update(val)
            value = val.get(cfg.checkpoint_metric)
            if self.trainer.schedule is not None:
                self.trainer.schedule.epoch_end(value)
            if value is not None and value < p.best_value - cfg.min_delta:
                p.best_value, p.best_epoch, p.bad_epochs, improved = value, p.epoch, 0, True
            elif value is not None:
                p.bad_epochs += 1
                patience = cfg.patience
                stop = patience is not None and p.bad_epochs > patience
        row["time_s"] = time.perf_counter() - t0
        p.history.append(row)
        self.save("last")
        if improved:
            self.save("best")
        self.logger.epoch(row)  # after the checkpoint that holds it (see restore)
        return stop

    def run(self) -> str:
        """Train until ``max_epochs``, ``max_steps`` or early stopping.

        Returns:
            why it stopped: ``"max_epochs"``, ``"max_steps"``, ``"time_limit"`` or
            ``"early_stopping"``.
        Raises:
            NonFiniteLossError: NaN/inf loss; the last checkpoint is the last good state.
        """
        self.t_start = time.perf_counter()
        if not (self.ckpt_dir / "last.pt").is_file():
            self.save("last")
        p = self.progress
        while p.epoch < self.cfg.max_epochs:
            t0 = time.perf_counter()
            metrics = MetricSums(self.trainer.device)
            try:
                finished = self._train_epoch(metrics)
            except NonFiniteLossError as e:
                raise NonFiniteLossError(
                    f"{e} (epoch {p.epoch + 1}); training stopped, the last good checkpoint is "
                    f"{self.ckpt_dir / 'last.pt'}"
                ) from None
            if not finished:
                self.save("last")
                return self.stop_reason
            if self._end_epoch(metrics, t0):
                return "early_stopping"
            if self._stop_for_steps():
                return self.stop_reason
        return "max_epochs"


def describe_model(model) -> str:
    name, hp = model_identity(model)
    n = sum(p.numel() for p in model.parameters())
    return f"{name} with {n:,} parameters"
