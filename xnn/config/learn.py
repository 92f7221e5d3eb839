"""Configuration of ``xnn learn loop.yaml``: the active-learning loop (train a committee →
explore with workflow stages → select the most uncertain, diverse structures → label them →
append → next round).

Units: forces and force uncertainties eV/Å, lengths Å, temperatures K, time fs.

The training settings are a train config (the schema of ``xnn train``): a YAML file
(``train.file``) and/or an inline mapping (``train.config``, applied on top), checked when
the loop's config is loaded. The loop sets the training data (the initial file plus every
round's labels), the output folder and the seeds; everything else is the user's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xnn.config.loader import ConfigError, check_range, check_seed, field, validate
from xnn.config.workflow import StageConfig

TRAIN_MODES = ("scratch", "finetune")
#: train-config keys the loop sets itself (refused in train.config / train.file)
LOOP_KEYS = ("output_dir", "resume", "pretrained", "overwrite", "validation_only")


@dataclass
class LearnTrainConfig:
    mode: str = field("scratch", "scratch: every round trains a new committee; finetune: "
                      "round r goes on training round r-1's committee file (round 0 from "
                      "scratch)", choices=TRAIN_MODES)
    committee: int = field(3, "committee members K, trained together in one xnn train run "
                           "(committee.size=K, member k seeded seed + k) and calibrated on its "
                           "validation set; the run's model file is round_NNN/model.pt")
    bootstrap: bool = field(False, "each member trains on its own bootstrap resample of the "
                            "round's training set (xnn train's committee.bootstrap); "
                            "train.mode=scratch only")
    file: str | None = field(None, "a train config YAML (the schema of xnn train); its "
                             "data.datasets are replaced by the loop's data")
    config: dict[str, Any] = field({}, "train config keys applied on top of train.file, e.g. "
                                   "{model: {name: schnet, cutoff: 4.0}, max_epochs: 30}")
    members: int | None = field(None, "removed: write train.committee (refused when set)")

    def __post_init__(self):
        if self.members is not None:
            raise ConfigError(f"train.members={self.members} was replaced: write "
                              f"train.committee: {self.members} (one xnn train run with "
                              "committee.size=K)")
        check_range("train.committee", self.committee, 2)
        if self.bootstrap and self.mode == "finetune":
            raise ConfigError("train.bootstrap=true needs train.mode=scratch (xnn train goes "
                              "on training a pretrained committee on the shared data only)")
        bad = [k for k in LOOP_KEYS if k in self.config]
        if bad:
            raise ConfigError(f"train.config.{bad[0]} is set by the loop (each round trains "
                              "in round_NNN/train); remove it")


@dataclass
class ExploreConfig:
    starts: int = field(8, "starting structures per round, drawn (seeded by seed and round) "
                        "from the current dataset")
    stages: list[StageConfig] = field([], "workflow stages every start goes through (xnn "
                                      "run's stages: relax, nve, nvt, npt at their "
                                      "temperatures and pressures), e.g. [{type: nvt, "
                                      "temperature: 600, steps: 200}]")
    sample_every: int = field(20, "a candidate frame every N steps of each stage (the "
                              "workflow's trajectory_every; the first frame of a start, a "
                              "structure of the dataset, is not a candidate)")
    slots: int = field(16, "systems advanced together")
    max_force: float = field(50.0, "a system whose largest force exceeds this (eV/Å) leaves "
                             "the exploration (its frames so far stay candidates)")
    pressure_unit: str = field("GPa", "unit of the stages' pressures", choices=("GPa", "bar"))
    device: str = field("auto", "device of exploration and scoring (cpu, cuda, auto)")

    def __post_init__(self):
        check_range("explore.starts", self.starts, 1)
        check_range("explore.sample_every", self.sample_every, 1)
        check_range("explore.slots", self.slots, 1)
        check_range("explore.max_force", self.max_force, 0.0, low_inclusive=False)


@dataclass
class SelectConfig:
    threshold: float | None = field(None, "a candidate is eligible when its score, the "
                                    "largest per-atom calibrated committee force std (eV/Å, "
                                    "as xnn md/eval/the calculator report it), exceeds this; "
                                    "null: every candidate is eligible (the budget and the "
                                    "farthest-point ranking decide)")
    ceiling: float | None = field(None, "an upper trust level (eV/Å, same score): a "
                                  "candidate scored above it is taken as failed exploration "
                                  "(the committee too far outside its data for the frame to "
                                  "be trusted) and not selected; null: no ceiling")
    budget: int = field(10, "structures selected (and labelled) per round at most")
    r_max: float = field(5.0, "descriptor: largest pair distance of the radial histograms (Å)")
    bins: int = field(20, "descriptor: Gaussian bins per element pair")

    def __post_init__(self):
        if self.threshold is not None:
            check_range("select.threshold", self.threshold, 0.0)
        check_range("select.budget", self.budget, 1)
        if self.ceiling is not None:
            check_range("select.ceiling", self.ceiling, 0.0, low_inclusive=False)
        check_range("select.r_max", self.r_max, 0.0, low_inclusive=False)
        check_range("select.bins", self.bins, 2)


@dataclass
class LabelConfig:
    calculator: str = field("emt", "emt (ASE's EMT, built in) or 'package.module:factory', a "
                            "function returning an ASE calculator (e.g. your DFT code's), "
                            "imported only with label.trust=true")
    trust: bool = field(False, "allow importing and running label.calculator (its module's "
                        "code runs); only for code you trust")
    stress: bool = field(True, "also label the stress of structures periodic along all axes")

    def __post_init__(self):
        if self.calculator != "emt" and ":" not in self.calculator:
            raise ConfigError(f"label.calculator={self.calculator!r}: give emt or "
                              "'package.module:factory'")


@dataclass
class LearnConfig:
    initial: str = field("", "the initial labelled dataset: an extxyz file with energy and "
                         "forces (and stress, if the training uses it)")
    test: str | None = field(None, "a held-back labelled test set (extxyz): each round's "
                             "committee "
                             "mean is evaluated on it (learning_curve.csv); never trained on")
    rounds: int = field(3, "acquisition rounds; a last training round on the final data "
                        "follows (round_NNN with NNN = rounds)")
    seed: int = field(0, "seed of the starts, the exploration and the committee (its member "
                      "k: seed + k, in every round)")
    train: LearnTrainConfig = field(LearnTrainConfig(), "training of the committee")
    explore: ExploreConfig = field(ExploreConfig(), "exploration through workflow stages")
    select: SelectConfig = field(SelectConfig(), "selection of the structures to label")
    label: LabelConfig = field(LabelConfig(), "the labeller")
    output: str = field("learn_output", "the loop's folder: round_NNN/, journal.jsonl, "
                        "learning_curve.csv/png; running again continues a loop found there")
    resume: bool = field(True, "continue the loop found in output (same settings); false: "
                         "refuse to run into a folder that holds one")

    def __post_init__(self):
        validate(self)
        if not self.initial:
            raise ConfigError("initial is empty; give the initial labelled dataset, e.g. "
                              "initial=data.xyz")
        check_range("rounds", self.rounds, 0)
        check_seed("seed", self.seed)
        if not self.explore.stages:
            raise ConfigError("explore.stages is empty; give at least one stage, e.g. "
                              "[{type: nvt, temperature: 600, steps: 200}]")
        for i, stage in enumerate(self.explore.stages):
            stage.resolve(f"explore.stages.{i}")
        names = [s.name for s in self.explore.stages]
        if len(set(names)) != len(names):
            raise ConfigError(f"explore.stages: two stages share a name ({names}); give each "
                              "a unique name")
