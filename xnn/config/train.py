"""The training configuration: ``xnn train CONFIG.yaml [key.sub=value ...]``.

Every option has a default and a help text (``xnn train --help`` prints them all); the
sections mirror the steps of a run: model, data, loss, optimizer, schedule, EMA, stopping,
checkpoints, parallelism and logging. Choices are validated by the loader; ranges and
cross-field rules in ``__post_init__``.
"""

from __future__ import annotations

from dataclasses import dataclass

from xnn.config.loader import ConfigError, check_range, check_seed, field, validate
from xnn.config.model import ModelConfig, model_field, train_model_default
from xnn.config.parallel import ParallelConfig, parallel_field
from xnn.data.sources import FORMATS as DATASET_FORMATS

PRECISIONS = ("fp32", "tf32", "bf16_mixed", "fp64")
LOSS_TYPES = ("mse", "mae", "huber")
METRICS = (
    "val_loss", "val_energy_mae", "val_energy_rmse", "val_forces_mae", "val_forces_rmse",
    "val_stress_mae", "val_stress_rmse",
)


@dataclass
class DatasetConfig:
    path: str = field("", "a file (extxyz or any ASE format, .db, .aselmdb/.lmdb, xnn HDF5), "
                      "a folder of shards or a glob ('omat/*.aselmdb')")
    format: str | None = field(None, "file format (null: from the suffix; ase: any other "
                               "format ASE reads, into memory)",
                               choices=(None, *DATASET_FORMATS))
    weight: float = field(1.0, "loss weight of every structure of this dataset")
    energy_key: str = field("energy", "key of the energy label (eV)")
    forces_key: str = field("forces", "key of the force label (eV/Å)")
    stress_key: str = field("stress", "key of the stress label (eV/Å³, ASE sign)")
    virial_key: str = field("virial", "key of the virial label (eV), used when no stress")
    head: str | None = field(None, "finetune.heads: the readout head this entry trains and "
                             "validates (null: default for data.datasets/val/test, replay for "
                             "data.replay)")

    def __post_init__(self):
        check_range("data.datasets.weight", self.weight, 0.0)


@dataclass
class DataConfig:
    datasets: list[DatasetConfig] = field([], "training files (each with its weight and keys)")
    val: list[DatasetConfig] = field([], "validation files; empty: carve val_fraction out of "
                                     "the training files")
    test: list[DatasetConfig] = field([], "test files; empty: carve test_fraction out of the "
                                      "training files")
    val_fraction: float = field(0.1, "fraction of each training file used for validation "
                                "(when data.val is empty)")
    test_fraction: float = field(0.0, "fraction of each training file used for testing "
                                 "(when data.test is empty)")
    batch_size: int | None = field(8, "structures per global batch (null: use "
                                   "max_atoms_per_batch)")
    max_atoms_per_batch: int | None = field(None, "atoms per global batch (replaces "
                                            "batch_size); with parallel.dd > 1 the budget of "
                                            "ONE dd group's share (a global batch holds up to "
                                            "dp shares) and a structure with more atoms is "
                                            "refused")
    val_batch_size: int | None = field(None, "structures per validation batch (null: "
                                       "batch_size, or max_atoms_per_batch)")
    shuffle: bool = field(True, "shuffle the training set every epoch (seeded)")
    overfit: int | None = field(None, "debug: train and validate on the first N training "
                                "structures only")
    cache_edges: bool | None = field(None, "keep neighbor lists in memory after their first "
                                     "use (null: auto, on for data read into memory or of at "
                                     "most 250,000 atoms, off for larger lazy files, whose "
                                     "edges are then built on the fly at every use)")
    num_workers: int = field(0, "DataLoader worker processes that read, give edges to and "
                             "collate each rank's training shares (0: in the training "
                             "process); the batches and losses are the same for any number")
    balance: str = field("none", "atoms: pack each global batch as data-parallel shares "
                         "balanced by atoms from a seeded look-ahead window (needs "
                         "max_atoms_per_batch, split evenly between the shares); none: "
                         "batches cut in order and shared greedily by atoms",
                         choices=("none", "atoms"))
    balance_bins: int | None = field(None, "data.balance=atoms: shares per global batch "
                                     "(null: the number of data-parallel replicas; set it "
                                     "to train one process on the global batches of N "
                                     "ranks)")
    balance_lookahead: int | None = field(None, "data.balance=atoms: structures of the "
                                          "look-ahead window the shares are packed from "
                                          "(null: 64 per share)")
    samples_per_epoch: int | None = field(None, "structures per epoch, drawn with replacement "
                                          "with probability proportional to their dataset's "
                                          "weight, seeded by (seed, epoch) (null: every "
                                          "training structure once per epoch)")
    replay: list[DatasetConfig] = field([], "fine-tuning: replay files from the pretraining "
                                        "distribution (same entries as data.datasets), trained "
                                        "with finetune.replay_weight and validated on their "
                                        "own (val_replay_* metrics)")

    def __post_init__(self):
        check_range("data.val_fraction", self.val_fraction, 0.0, 0.99)
        check_range("data.test_fraction", self.test_fraction, 0.0, 0.99)
        check_range("data.batch_size", self.batch_size, 1)
        check_range("data.val_batch_size", self.val_batch_size, 1)
        check_range("data.max_atoms_per_batch", self.max_atoms_per_batch, 1)
        check_range("data.overfit", self.overfit, 1)
        check_range("data.samples_per_epoch", self.samples_per_epoch, 1)
        check_range("data.num_workers", self.num_workers, 0)
        check_range("data.balance_bins", self.balance_bins, 1)
        check_range("data.balance_lookahead", self.balance_lookahead, 1)
        if self.balance == "atoms" and self.max_atoms_per_batch is None:
            raise ConfigError("data.balance=atoms splits data.max_atoms_per_batch between the "
                              "shares of a global batch; set data.max_atoms_per_batch")
        if self.max_atoms_per_batch is not None:
            self.batch_size = None
        if self.batch_size is None and self.max_atoms_per_batch is None:
            raise ConfigError("set data.batch_size or data.max_atoms_per_batch")


@dataclass
class FinetuneConfig:
    freeze: list[str] = field([], "named parts of the pretrained model kept fixed "
                              "(requires_grad=false), e.g. [embedding, interactions.0]; the "
                              "model's part names are listed when one is unknown")
    lr: dict[str, float] = field({}, "learning-rate factor per named part, e.g. "
                                 "{interactions: 0.1, readout: 1.0}: optimizer param groups, "
                                 "all scaled by the schedule")
    replay_weight: float = field(1.0, "loss weight of every data.replay structure")
    replay_fraction: float | None = field(None, "share of the training structures of an "
                                          "epoch taken from data.replay (a seeded selection, "
                                          "repeated when replay has fewer; null: every "
                                          "replay training structure once)")
    replay_from_pretrained: int | None = field(
        None, "replay structures made from the training structures (rattled, strained) and "
        "labelled by the pretrained model itself, written to the run folder as "
        "replay_pretrained.xyz and used as a data.replay file (0/null: off)")
    replay_rattle: float = field(0.05, "standard deviation (Å) of the Gaussian displacement "
                                 "of every atom of a replay_from_pretrained structure")
    replay_strain: float = field(0.02, "largest strain component of a replay_from_pretrained "
                                 "structure (uniform in [-s, s], symmetric; periodic only)")
    heads: bool = field(False, "multi-head fine-tuning: one shared body, one readout (with its "
                        "own E0s, scale and shift) per head; every data entry trains its head "
                        "(data.*.head; default: default, replay for data.replay and "
                        "replay_from_pretrained), each head starts as a copy of the "
                        "pretrained readout; a new-data head's E0s add the least-squares "
                        "per-element fit of the pretrained model's energy error on its data; "
                        "model.pt keeps every head (default: the first)")

    def __post_init__(self):
        check_range("finetune.replay_weight", self.replay_weight, 0.0)
        check_range("finetune.replay_from_pretrained", self.replay_from_pretrained, 0)
        check_range("finetune.replay_rattle", self.replay_rattle, 0.0)
        check_range("finetune.replay_strain", self.replay_strain, 0.0, 0.5)
        check_range("finetune.replay_fraction", self.replay_fraction, 0.0, 0.95,
                    low_inclusive=False)
        for part, factor in self.lr.items():
            check_range(f"finetune.lr.{part}", factor, 0.0)
        if len(set(self.freeze)) != len(self.freeze):
            raise ConfigError(f"finetune.freeze lists a part twice: {self.freeze}")


@dataclass
class PropertyLoss:
    weight: float = field(1.0, "weight of this term in the total loss")
    type: str = field("mse", "loss function", choices=LOSS_TYPES)
    delta: float = field(0.01, "Huber delta (units of the property)")

    def __post_init__(self):
        check_range("loss weight", self.weight, 0.0)
        check_range("loss delta", self.delta, 0.0, low_inclusive=False)


@dataclass
class LossConfig:
    energy: PropertyLoss = field(PropertyLoss(1.0), "energy per atom (eV/atom)")
    forces: PropertyLoss = field(PropertyLoss(10.0), "force components (eV/Å)")
    stress: PropertyLoss = field(PropertyLoss(0.0), "stress components (eV/Å³)")

    def __post_init__(self):
        if max(self.energy.weight, self.forces.weight, self.stress.weight) <= 0:
            raise ConfigError("every loss weight is 0: set loss.energy.weight, "
                              "loss.forces.weight or loss.stress.weight > 0")


@dataclass
class OptimConfig:
    name: str = field("adam", "optimizer", choices=("adam", "adamw"))
    lr: float = field(1e-3, "learning rate")
    weight_decay: float = field(0.0, "weight decay (decoupled for adamw)")
    amsgrad: bool = field(False, "AMSGrad variant of Adam/AdamW (mace_run_train always uses it)")
    grad_clip: float | None = field(10.0, "clip the global gradient norm to this (null: off)")

    def __post_init__(self):
        check_range("optim.lr", self.lr, 0.0, low_inclusive=False)
        check_range("optim.weight_decay", self.weight_decay, 0.0)
        check_range("optim.grad_clip", self.grad_clip, 0.0, low_inclusive=False)


@dataclass
class ScheduleConfig:
    name: str = field("none", "learning-rate schedule", choices=("none", "cosine", "plateau"))
    warmup_steps: int = field(0, "linear warm-up from 0 over this many steps")
    total_steps: int | None = field(None, "cosine: steps to reach min_lr_factor (null: "
                                    "max_steps, else max_epochs × steps per epoch)")
    min_lr_factor: float = field(0.01, "cosine: final lr / lr; plateau: lowest lr / lr")
    factor: float = field(0.5, "plateau: lr multiplier when the metric stalls")
    patience: int = field(5, "plateau: epochs without improvement before reducing the lr")

    def __post_init__(self):
        check_range("schedule.warmup_steps", self.warmup_steps, 0)
        check_range("schedule.total_steps", self.total_steps, 1)
        check_range("schedule.min_lr_factor", self.min_lr_factor, 0.0, 1.0)
        check_range("schedule.factor", self.factor, 0.0, 1.0, low_inclusive=False)
        check_range("schedule.patience", self.patience, 0)


@dataclass
class EMAConfig:
    enabled: bool = field(True, "keep an exponential moving average of the weights (used for "
                          "validation and the saved model)")
    decay: float = field(0.99, "EMA decay per step")

    def __post_init__(self):
        check_range("ema.decay", self.decay, 0.0, 1.0)


@dataclass
class EarlyStoppingConfig:
    patience: int | None = field(None, "stop after this many epochs without improving the "
                                 "checkpoint metric (null: never)")
    min_delta: float = field(0.0, "smallest improvement that counts")

    def __post_init__(self):
        check_range("early_stopping.patience", self.patience, 0)


@dataclass
class MemoryConfig:
    offload_activations: bool = field(False, "keep the tensors saved for backward in host "
                                      "memory (pinned on CUDA) instead of on the device; with "
                                      "model.activation_checkpointing, those are the blocks' "
                                      "inputs")
    profile_prefix: str | None = field(None, "CUDA only: record the allocator history of the "
                                       "first profile_steps training steps and write "
                                       "PREFIX_rank{r}.pickle per rank (open it at "
                                       "https://pytorch.org/memory_viz)")
    profile_steps: int = field(3, "training steps the memory profile records")
    profile_max_entries: int = field(100000, "allocation events the memory profile keeps "
                                     "(the oldest are dropped beyond this)")

    def __post_init__(self):
        check_range("memory.profile_steps", self.profile_steps, 1)
        check_range("memory.profile_max_entries", self.profile_max_entries, 1)
        if self.profile_prefix is not None and not self.profile_prefix.strip():
            raise ConfigError("memory.profile_prefix is empty; give a path prefix or null")


@dataclass
class LoggingConfig:
    tensorboard: bool = field(False, "write TensorBoard events (needs the tensorboard package)")
    csv: bool = field(True, "write metrics.csv")
    progress_bar: bool = field(True, "tqdm bar per epoch (only on a terminal)")
    plots: bool = field(True, "PNG learning curves and parity plots at the end")
    every_n_steps: int | None = field(None, "also log the step loss, lr and the epoch's "
                                      "training metrics so far every N optimizer steps "
                                      "(steps.csv, TensorBoard steps/*; null: per epoch only)")

    def __post_init__(self):
        check_range("logging.every_n_steps", self.every_n_steps, 1)


@dataclass
class CommitteeConfig:
    size: int = field(1, "members K trained together as one committee (one model file; its "
                      "mean is the prediction, its spread the uncertainty: "
                      "docs/committees.md); 1: one model")
    seeds: list[int] | None = field(None, "one weight-initialisation seed per member "
                                    "(null: seed, seed + 1, ...); member k starts as the "
                                    "model a run with seed=seeds[k] builds")
    bootstrap: bool = field(False, "each member trains on its own bootstrap resample of the "
                            "training set: integer weights per structure drawn from a "
                            "seeded multinomial (the batches are shared)")
    calibrate: bool = field(True, "after training, fit one factor per property (energy, "
                            "forces, stress) on the validation set so that the predicted "
                            "spread matches the observed error, stored in model.pt")

    def __post_init__(self):
        check_range("committee.size", self.size, 1)
        if self.seeds is not None:
            if len(self.seeds) != self.size or len(set(self.seeds)) != self.size:
                raise ConfigError(f"committee.seeds={self.seeds} must be committee.size="
                                  f"{self.size} distinct seeds (one per member)")
            for s in self.seeds:
                check_seed("committee.seeds", s)
        if self.size == 1 and self.bootstrap:
            raise ConfigError("committee.bootstrap=true needs committee.size >= 2")


@dataclass
class TrainConfig:
    model: ModelConfig = model_field(train_model_default(), "the model built and trained "
                                     "(model.name with its cutoff and hyperparameters)")
    data: DataConfig = field(DataConfig(), "datasets, splits and batching")
    loss: LossConfig = field(LossConfig(), "loss terms")
    optim: OptimConfig = field(OptimConfig(), "optimizer")
    schedule: ScheduleConfig = field(ScheduleConfig(), "learning-rate schedule")
    ema: EMAConfig = field(EMAConfig(), "moving average of weights")
    early_stopping: EarlyStoppingConfig = field(EarlyStoppingConfig(), "early stopping")
    parallel: ParallelConfig = parallel_field()
    logging: LoggingConfig = field(LoggingConfig(), "what the run writes and shows")
    memory: MemoryConfig = field(MemoryConfig(), "activation offload and CUDA memory profile")
    finetune: FinetuneConfig = field(FinetuneConfig(), "fine-tuning a pretrained model: "
                                     "frozen parts, per-part learning rates, replay")
    committee: CommitteeConfig = field(CommitteeConfig(), "train K models at once: "
                                       "uncertainty from their spread")
    max_epochs: int = field(100, "epochs to train")
    max_steps: int | None = field(None, "stop after this many optimizer steps (null: no limit)")
    time_limit_min: float | None = field(None, "stop training after this many minutes of wall "
                                         "time (null: no limit)")
    eval_every: int = field(1, "validate every N epochs")
    checkpoint_every_steps: int | None = field(None, "also write checkpoints/last.pt every N "
                                               "optimizer steps, mid-epoch included (a run "
                                               "killed later resumes there exactly; null: "
                                               "at the end of each epoch)")
    accumulate_grad_batches: int = field(1, "global batches per optimizer step (gradient "
                                         "accumulation: one forward/backward each, one "
                                         "gradient reduction and step; the same update as "
                                         "one batch of the summed size)")
    precision: str = field("fp32", "arithmetic precision", choices=PRECISIONS)
    compile: bool = field(False, "train through compiled kernels: energy, forces and stress "
                          "are traced into one graph and compiled by torch.compile (dynamic "
                          "shapes, checked against eager autograd first); the first steps "
                          "compile for about a minute. xnn models; not with bf16_mixed")
    device: str = field("auto", "cpu, cuda or auto (cuda when available)")
    deterministic: bool = field(False, "deterministic CUDA kernels "
                                "(torch.use_deterministic_algorithms): on a GPU, a resumed or "
                                "repeated run is then bitwise equal to the uninterrupted one "
                                "(CPU runs always are); somewhat slower")
    seed: int = field(0, "seed of the split, the initial weights and the batch order "
                      "(an integer >= 0)")
    output_dir: str = field("runs/xnn", "folder of checkpoints, logs, plots and the final model")
    overwrite: bool = field(False, "replace a previous run in output_dir: it is kept until "
                            "the new run completes (written meanwhile to "
                            "output_dir/.xnn-new-run, resumable with resume=auto)")
    resume: str | None = field(None, "checkpoint to continue from (exactly; 'auto': "
                               "output_dir/checkpoints/last.pt)")
    pretrained: str | None = field(None, "model file or checkpoint whose weights start the run "
                                   "(fine-tuning); model.cutoff and model.hyperparameters "
                                   "must match the pretrained model's")
    validation_only: bool = field(False, "evaluate the model (pretrained/resume) on "
                                  "validation and test sets without training")
    checkpoint_metric: str = field("val_loss", "validation metric that selects the best "
                                   "checkpoint (and early stopping)", choices=METRICS)
    checkpoint_mode: str = field("min", "whether a smaller (min) or larger (max) "
                                 "checkpoint_metric is better", choices=("min", "max"))

    def __post_init__(self):
        validate(self)  # every number finite, every choice valid (also when built in Python)
        self.model.check_train()
        check_seed("seed", self.seed)
        check_range("max_epochs", self.max_epochs, 0)
        check_range("max_steps", self.max_steps, 0)
        check_range("time_limit_min", self.time_limit_min, 0.0)
        check_range("eval_every", self.eval_every, 1)
        check_range("checkpoint_every_steps", self.checkpoint_every_steps, 1)
        check_range("accumulate_grad_batches", self.accumulate_grad_batches, 1)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device!r} is not a valid choice; choose one of "
                              "['auto', 'cpu', 'cuda', 'cuda:N']")
        if self.compile and self.precision == "bf16_mixed":
            raise ConfigError("compile=true does not support precision=bf16_mixed; choose "
                              "fp32, tf32 or fp64, or compile=false")
        if self.compile and self.parallel.dd > 1:
            raise ConfigError(f"compile=true does not support parallel.dd={self.parallel.dd} "
                              "(domain-decomposed training runs eager); set compile=false or "
                              "parallel.dd=1")
        self._check_committee()
        if self.validation_only and not (self.pretrained or self.resume):
            raise ConfigError("validation_only=true needs pretrained=PATH or resume=PATH")
        ft = self.finetune
        if (ft.freeze or ft.lr or self.data.replay or ft.replay_from_pretrained) \
                and not self.pretrained:
            raise ConfigError("finetune.freeze, finetune.lr, data.replay and "
                              "finetune.replay_from_pretrained fine-tune a pretrained model: "
                              "set pretrained=PATH (or a name: 7net-0)")
        _check_heads(self)
        if ft.replay_fraction is not None and not (self.data.replay
                                                   or ft.replay_from_pretrained):
            raise ConfigError("finetune.replay_fraction needs data.replay files or "
                              "finetune.replay_from_pretrained")

    def _check_committee(self) -> None:
        """Refuse a committee with what it does not support (yet)."""
        size = self.committee.size
        if size == 1:
            return
        if self.parallel.dd > 1:
            raise ConfigError(f"committee.size={size} trains data-parallel only: set "
                              f"parallel.dd=1 (got {self.parallel.dd})")
        if self.compile:
            raise ConfigError(f"committee.size={size} trains eager: set compile=false")
        if self.pretrained:
            raise ConfigError(f"committee.size={size} builds a new committee; to go on "
                              "training a committee, give its model file as pretrained= "
                              "without committee.size")


def _check_heads(cfg: TrainConfig) -> None:
    """Refuse ``data.*.head`` without ``finetune.heads``, and ``finetune.heads`` without a
    pretrained model (one line each). Multi-head runs train under ``parallel.dd > 1`` (each
    structure's ``head`` travels with its decomposed atoms) and ``compile`` (the ``head``
    field is an input of the trace)."""
    d = cfg.data
    parts = (("datasets", d.datasets), ("val", d.val), ("test", d.test), ("replay", d.replay))
    named = [f"data.{part}.{k}.head" for part, entries in parts
             for k, e in enumerate(entries) if e.head is not None]
    if not cfg.finetune.heads:
        if named:
            raise ConfigError(f"{named[0]} names a readout head: set finetune.heads=true "
                              "(multi-head fine-tuning) or remove it")
        return
    if not cfg.pretrained:
        raise ConfigError("finetune.heads=true adds readout heads to a pretrained model: set "
                          "pretrained=PATH")
