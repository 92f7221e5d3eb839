"""The epoch loop: batches, validation, checkpoints, early stopping, exact resume.

The sampler position is ``(epoch, batch_in_epoch)``: the batches of an epoch and every
rank's share of them are a pure function of ``(seed, epoch)`` (a seeded permutation of the
training set, or with ``samples_per_epoch`` a seeded draw by dataset weight,
:mod:`xnn.training.sampling`; shares balanced by atoms with ``balance_bins``,
:mod:`xnn.training.plan`), so a resumed run skips the ``batch_in_epoch`` batches already done
and continues with exactly the batches the uninterrupted run would have seen, whether they
are read here or by DataLoader workers (:mod:`xnn.training.loader`). With
``checkpoint_every`` that position is saved every few steps, so a run killed at any moment
resumes exactly.

Random streams: the global torch, numpy and python generators are reseeded at the start of
every epoch and after every optimizer step from :func:`stream_seed` ``(seed, rank, epoch,
step)`` (the step about to run), so that the random numbers a training step draws (dropout,
augmentation) are a function of where it is: different on every rank, epoch and step, and
the same in a resumed run as in the uninterrupted one (no rank replays another's stream or
its own after a restart). The weights are initialised before, from ``seed`` and the rank
(:func:`seed_everything`).

``best.pt`` holds the epoch with the best ``checkpoint_metric`` (smallest for
``checkpoint_mode="min"``, largest for ``"max"``); early stopping and the plateau schedule
follow the same metric and direction.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from xnn.errors import DataFileError, InputError
from xnn.training.checkpoint import model_identity, rng_state, set_rng_state
from xnn.training.metrics import MetricSums
from xnn.training.plan import BatchPlan
from xnn.training.seeding import seed_everything, seed_streams, stream_seed  # noqa: F401
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
        checkpoint_mode: ``"min"`` (smaller is better) or ``"max"``.
        patience: epochs without improvement before early stopping (``None``: never).
        min_delta: the improvement that counts.
        validation_only: evaluate a model, never train (``metrics.csv`` is not touched).
        samples_per_epoch: structures per epoch drawn by dataset weight (``None``: each
            training structure once).
        every_n_steps: log a ``steps.csv`` row every this many steps (``None``: never).
        precision: the run's precision (recorded in checkpoints; a resume must match).
        accumulate_grad_batches: consecutive global batches per optimizer step (one
            forward/backward each, one gradient reduction and step, the label counts summed).
        balance_bins: pack each global batch as this many shares balanced by atoms
            (:mod:`xnn.training.balance`; with ``max_atoms_per_batch``, whose budget the
            shares split); rank ``dp_rank`` trains share ``dp_rank`` (so it must equal the
            number of replicas), one process their union. ``None``: batches cut in order
            and shared greedily by atoms (:func:`~xnn.data.datasets.shard_batch`).
        balance_lookahead: structures of the balanced packing's window (``None``: 64 per
            share).
        num_workers: DataLoader workers that read, give edges to and collate this rank's
            shares (:mod:`xnn.training.loader`); 0: read in the training process.
        checkpoint_every: also write ``last.pt`` every this many optimizer steps, mid-epoch
            included (``None``: at the end of each epoch only).
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
    checkpoint_mode: str = "min"
    samples_per_epoch: int | None = None
    every_n_steps: int | None = None
    precision: str = "fp32"
    accumulate_grad_batches: int = 1
    balance_bins: int | None = None
    balance_lookahead: int | None = None
    num_workers: int = 0
    checkpoint_every: int | None = None


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
    best_metric: str | None = None  # what best_value measures (None: an earlier xnn's)
    best_mode: str | None = None


class TrainingLoop:
    """Run epochs of ``trainer`` over ``splits`` as ``cfg`` says.

    Args:
        cfg: the run's :class:`LoopSettings`.
        trainer: a :class:`~xnn.training.trainer.Trainer`.
        splits: a :class:`~xnn.training.data.DataSplits`.
        out_dir: run folder (checkpoints in ``out_dir/checkpoints``).
        logger: a :class:`~xnn.io.train_log.RunLogger`.
        sharding: ``sharding(batch, n_atoms, max_atoms) -> this rank's indices`` with a
            ``groups`` attribute (the ``groups`` of ``make_batches``) and
            ``load(dataset, indices) -> graphs``, from
            :func:`~xnn.distributed.entries.parallelize_train`; ``None``: by the
            reducer's rank among its ranks.
        write_checkpoint: ``write_checkpoint(payload, path) -> path``, what writes a
            checkpoint (:func:`xnn.io.train_checkpoint.save_checkpoint`); ``None``: the loop
            writes none.
    """

    def __init__(self, cfg: LoopSettings, trainer: Trainer, splits, out_dir: Path, logger,
                 sharding=None, write_checkpoint=None):
        self.cfg = cfg
        self.trainer = trainer
        self.splits = splits
        self.reducer = trainer.reducer
        self.out_dir = Path(out_dir)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.logger = logger
        self.write_checkpoint = write_checkpoint
        self.progress = Progress(best_value=_worst(cfg.checkpoint_mode),
                                 best_metric=cfg.checkpoint_metric, best_mode=cfg.checkpoint_mode)
        self.config_yaml = ""
        self.t_start = time.perf_counter()
        self.stop_reason = ""
        self._partial = None  # metric sums of the epoch so far (all ranks), saved mid-epoch
        if sharding is None:
            from xnn.training.sharding import BatchSharding

            sharding = BatchSharding(self.reducer.rank, self.reducer.world_size)
        self.sharding = sharding
        self._plan: BatchPlan | None = None
        self._loader = None  # the DataLoader workers (num_workers > 0), made at first use

    # ------------------------------------------------------------------ batches
    @property
    def plan(self) -> BatchPlan:
        """The run's :class:`~xnn.training.plan.BatchPlan` (made at first use)."""
        if self._plan is None:
            self._plan = BatchPlan(self.cfg, self.splits.train, self.sharding)
        return self._plan

    def train_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch``: a pure function of ``(seed, epoch)``."""
        return self.plan.global_batches(epoch)

    def train_shares(self, epoch: int) -> tuple[list[list[int]], list[list[int]]]:
        """``(global batches, this rank's share of each)`` of ``epoch``."""
        return self.plan.shares(epoch)

    def eval_batches(self, dataset) -> list[list[int]]:
        return self.plan.eval_batches(dataset)

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
        # the module's own state dict: an external wrapper's payload holds its network's
        state = {k: v.detach().cpu() for k, v in t.model.state_dict().items()}
        return {
            "model": {"name": model["name"], "hparams": model.get("hparams") or {},
                      "state_dict": state},
            "ema": t.ema.state_dict() if t.ema is not None else None,
            "optimizer": t.optimizer.state_dict(),
            "schedule": t.schedule.state_dict() if t.schedule is not None else None,
            "progress": asdict(self.progress),
            "rng": rng_state(),
            "precision": self.cfg.precision,
            "epoch_metrics": (self._partial.cpu() if self._partial is not None
                              and self.progress.batch_in_epoch else None),
            "config": self.config_yaml,
        }

    def save(self, name: str) -> Path | None:
        if not self.reducer.is_main or self.write_checkpoint is None:
            return None
        return self.write_checkpoint(self.payload(), self.ckpt_dir / f"{name}.pt")

    def check_resumable(self, payload: dict, path) -> None:
        """Raise a one-line :class:`InputError` when the config changes what an exact
        resume needs: the precision, or the metric and mode that chose ``best.pt``."""
        cfg, saved = self.cfg, payload.get("precision")
        if saved is not None and saved != cfg.precision:
            raise InputError(
                f"checkpoint {str(path)!r} was trained with precision={saved}, the config says "
                f"precision={cfg.precision}; resume with precision={saved}, or start a new run "
                f"from its weights with pretrained={path} precision={cfg.precision}")
        p = payload["progress"]
        metric, mode = p.get("best_metric"), p.get("best_mode")
        if metric is not None and (metric, mode) != (cfg.checkpoint_metric,
                                                     cfg.checkpoint_mode):
            raise InputError(
                f"checkpoint {str(path)!r} picks best.pt by checkpoint_metric={metric} "
                f"checkpoint_mode={mode}, the config by checkpoint_metric="
                f"{cfg.checkpoint_metric} checkpoint_mode={cfg.checkpoint_mode}; resume with "
                f"the checkpoint's, or start a new run with pretrained={path}")

    def restore(self, payload: dict, path: str = "last.pt") -> None:
        """Load model, EMA, optimizer, schedule, progress and RNG state from a checkpoint;
        ``metrics.csv`` (and ``steps.csv``) are rewritten to hold exactly the epochs (steps)
        of the checkpoint.

        Raises:
            InputError: to train on, the config changes the precision or the checkpoint
                metric or mode (:meth:`check_resumable`).
        """
        if not self.cfg.validation_only:
            self.check_resumable(payload, path)
        t = self.trainer
        t.model.load_state_dict(payload["model"]["state_dict"], strict=True)
        if t.ema is not None and payload.get("ema") is not None:
            t.ema.load_state_dict(payload["ema"])
        t.optimizer.load_state_dict(payload["optimizer"])
        if t.schedule is not None and payload.get("schedule") is not None:
            t.schedule.load_state_dict(payload["schedule"])
        progress = dict(payload["progress"])
        if progress.get("best_metric") is None:  # a checkpoint of an earlier xnn
            progress.update(best_metric=self.cfg.checkpoint_metric,
                            best_mode=self.cfg.checkpoint_mode)
        self.progress = Progress(**progress)
        if not self.cfg.validation_only:  # metrics.csv = the rows of the checkpoint
            self.logger.restore_csv(self.progress.history)
            self.logger.restore_steps_csv(self.progress.step)
        if self.reducer.rank == 0:
            set_rng_state(payload["rng"])
            self._partial = payload.get("epoch_metrics")  # counted once: by rank 0
        self.reseed()  # the stream of the next step (the same as rank 0's saved state)

    def reseed(self) -> None:
        """Reseed the random streams for the next step: :func:`seed_streams` of ``(seed,
        rank, epoch, step)``."""
        p = self.progress
        seed_streams(self.cfg.seed, self.reducer.rank, p.epoch, p.step)

    # ------------------------------------------------------------------ validation
    def validate(self, dataset, prefix: str, collect: bool = False):
        """Metrics ``{prefix + name: value}`` over a dataset (and parity data if ``collect``)."""
        if dataset is None or len(dataset) == 0:
            return {}, None
        sums, parity = self.trainer.evaluate(dataset, self.eval_batches(dataset),
                                             self.plan.shard(dataset,
                                                             self.plan.eval_max_atoms()),
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

    def _load(self, dataset, shares: list[list[int]]) -> tuple[list, DataFileError | None]:
        """This rank's structures of ``shares`` (one list of indices per global batch), or
        empty shares and the error when a structure cannot be used (coincident atoms, found
        when its neighbor list is first built): the step then stops every rank (see
        :meth:`Trainer.train_step`) instead of leaving the others in its collective."""
        try:
            return [self.sharding.load(dataset, share) for share in shares], None
        except DataFileError as e:
            return [[] for _ in shares], e

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
        batches, shares = self.train_shares(p.epoch)
        data = self.splits.train
        k = self.cfg.accumulate_grad_batches
        reads = self._reads(shares[p.batch_in_epoch:])
        bar = self.logger.bar(len(batches), p.batch_in_epoch, f"epoch {p.epoch + 1}")
        try:
            while p.batch_in_epoch < len(batches):
                if self._stop_for_steps():
                    return False
                step_batches = batches[p.batch_in_epoch : p.batch_in_epoch + k]
                graphs, refused = self._step_graphs(reads, len(step_batches))
                counts = data.batch_label_counts([i for b in step_batches for i in b])
                loss = self.trainer.train_step(graphs, p.step, metrics, stop_vote=self._late(),
                                               counts=counts, refused=refused)
                p.step += 1
                p.batch_in_epoch += len(step_batches)
                self._step_done(loss, metrics)
                bar.update(len(step_batches))
                bar.set_postfix(loss=f"{loss:.4g}", refresh=False)
        finally:
            bar.close()
            reads.close()
        return True

    def _reads(self, shares: list[list[int]]):
        """``(graphs, refusal)`` of each of this rank's ``shares`` in order: read here
        (:meth:`_load`), or by the DataLoader workers (``num_workers > 0``)."""
        data = self.splits.train
        if self.cfg.num_workers == 0:
            for share in shares:
                graphs, refused = self._load(data, [share])
                yield graphs[0], refused
            return
        if self._loader is None:
            from xnn.training.loader import ShareLoader

            self._loader = ShareLoader(data, self.sharding.load, self.cfg.num_workers,
                                       collate=not self.sharding.without_edges)
        yield from self._loader.read(shares)

    @staticmethod
    def _step_graphs(reads, n: int) -> tuple[list, DataFileError | None]:
        """The next ``n`` shares of ``reads`` as one step's micro-batches, or empty shares
        and the first refusal (see :meth:`_load`)."""
        got = [next(reads) for _ in range(n)]
        refused = next((e for _, e in got if e is not None), None)
        if refused is not None:
            return [[] for _ in got], refused
        return [g for g, _ in got], None

    def _step_done(self, loss: float, metrics: MetricSums) -> None:
        """After each optimizer step: a ``steps.csv`` row every ``every_n_steps`` steps (the
        step's loss, the lr and the epoch's training metrics so far, all-reduced: every rank
        calls this), then reseed the random streams for the next step."""
        p, n = self.progress, self.cfg.every_n_steps
        if n is not None and p.step % n == 0:
            row: dict = {"epoch": p.epoch + 1, "step": p.step,
                         "lr": self.trainer.optimizer.param_groups[0]["lr"], "loss": loss}
            sums = MetricSums(self.trainer.device)
            sums.values = self.reducer.all_reduce_sum(metrics.values)
            row.update(sums.finalize("train_"))
            row["time_s"] = time.perf_counter() - self.t_start
            self.logger.step(row)
        self.reseed()
        every = self.cfg.checkpoint_every
        if every is not None and p.step % every == 0:
            self._save_mid_epoch(metrics)

    def _save_mid_epoch(self, metrics: MetricSums) -> None:
        """``last.pt`` after this step, holding the epoch's metric sums so far (all-reduced:
        every rank calls this), so that a run killed later resumes here exactly."""
        self._partial = self.reducer.all_reduce_sum(metrics.values)
        self.save("last")
        self._partial = None

    def _epoch_metrics(self) -> MetricSums:
        """The training metric sums of the epoch starting (or resumed) now: zeros, or after a
        mid-epoch resume the sums of the batches before it (on rank 0)."""
        metrics = MetricSums(self.trainer.device)
        if self._partial is not None and self.progress.batch_in_epoch > 0:
            metrics.values += self._partial.to(metrics.values)
        self._partial = None
        return metrics

    def _improved(self, value: float) -> bool:
        """``value`` beats the best so far by more than ``min_delta`` (in the mode's
        direction)."""
        best, delta = self.progress.best_value, self.cfg.min_delta
        if self.cfg.checkpoint_mode == "max":
            return value > best + delta
        return value < best - delta

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
            row.update(self.validate(self.splits.val_replay, "val_replay_")[0])
            value = val.get(cfg.checkpoint_metric)
            if self.trainer.schedule is not None:  # the plateau schedule minimises
                sign = -1.0 if cfg.checkpoint_mode == "max" else 1.0
                self.trainer.schedule.epoch_end(None if value is None else sign * value)
            if value is not None and self._improved(value):
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
            DataFileError: a rank met a structure it cannot use (coincident atoms), on every
                rank; the bad step changed nothing, the last checkpoint is intact.
        """
        self.t_start = time.perf_counter()
        if self.cfg.precision == "tf32" and self.trainer.device.type != "cuda":
            self.logger.print("precision=tf32 selects TF32 matmuls on CUDA; on "
                              f"{self.trainer.device.type} this run trains in fp32")
        if not (self.ckpt_dir / "last.pt").is_file():
            self.save("last")
        p = self.progress
        while p.epoch < self.cfg.max_epochs:
            t0 = time.perf_counter()
            metrics = self._epoch_metrics()
            self.reseed()  # epoch start (or the resumed position): (seed, rank, epoch, step)
            try:
                finished = self._train_epoch(metrics)
            except NonFiniteLossError as e:
                raise NonFiniteLossError(
                    f"{e} (epoch {p.epoch + 1}); training stopped, the last good checkpoint is "
                    f"{self.ckpt_dir / 'last.pt'}"
                ) from None
            except DataFileError as e:
                raise DataFileError(
                    f"{e} (met at step {p.step + 1}, epoch {p.epoch + 1}; training stopped, "
                    f"the last checkpoint is {self.ckpt_dir / 'last.pt'})") from None
            if not finished:  # mid-epoch: the checkpoint keeps the epoch's metric sums
                self._partial = self.reducer.all_reduce_sum(metrics.values)
                self.save("last")
                return self.stop_reason
            if self._end_epoch(metrics, t0):
                return "early_stopping"
            if self._stop_for_steps():
                return self.stop_reason
        return "max_epochs"


def _worst(mode: str) -> float:
    """The best value before any epoch: +inf when minimising, -inf when maximising."""
    return -math.inf if mode == "max" else math.inf


def describe_model(model) -> str:
    name, hp = model_identity(model)
    n = sum(p.numel() for p in model.parameters())
    return f"{name} with {n:,} parameters"
