"""Configuration of ``xnn run workflow.yaml``: many structures through a sequence of stages
(relax → NVT → NPT ...), batched, with in-flight refill (see ``xnn run --help``).

Units: temperature K, time fs, pressure in ``pressure_unit`` (GPa or bar), lengths Å,
forces eV/Å.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from xnn.config.loader import ConfigError, check_range, check_seed, field, validate
from xnn.config.md import PRESSURE_UNITS, UncertaintySafetyConfig, resume_field
from xnn.config.model import ModelConfig, model_field
from xnn.config.parallel import ParallelConfig, parallel_field

STAGE_TYPES = ("relax", "nve", "nvt", "npt")
THERMOSTATS = ("langevin", "csvr", "nhc")
VELOCITIES = ("auto", "maxwell", "keep")

#: options of each stage type and their defaults (``None``: not set)
STAGE_OPTIONS = {
    "relax": dict(fmax=0.05, max_steps=1000, relax_cell=False, pressure=0.0, maxstep=0.2),
    "nve": dict(steps=1000, timestep=1.0, initial_temperature=None, velocities="auto"),
    "nvt": dict(steps=1000, timestep=1.0, temperature=300.0, initial_temperature=None,
                velocities="auto", thermostat="langevin", friction=0.01, tau=100.0,
                chain_length=3),
    "npt": dict(steps=1000, timestep=1.0, temperature=300.0, initial_temperature=None,
                velocities="auto", pressure=0.0, tau=100.0, tau_p=1000.0,
                compressibility=0.1, anisotropic=False),
}
_COMMON = ("type", "name", "trajectory_every")


@dataclass
class StageConfig:
    type: str = field("relax", "relax (FIRE), nve, nvt (thermostat) or npt", choices=STAGE_TYPES)
    name: str | None = field(None, "the stage's name in results.csv and the trajectories "
                             "(default: its type; names must be unique)")
    trajectory_every: int | None = field(None, "a frame every N steps of this stage (null: "
                                         "output.trajectory_every; 0: first and last only)")
    # relax
    fmax: float | None = field(None, "relax: done when every force (and cell force) is "
                               "below this (eV/Å); default 0.05")
    max_steps: int | None = field(None, "relax: stop after this many FIRE steps (the row "
                                  "says converged=False); default 1000")
    relax_cell: bool | None = field(None, "relax: also relax the cell toward pressure")
    maxstep: float | None = field(None, "relax: largest FIRE move per step (Å); default 0.2")
    # md
    steps: int | None = field(None, "nve/nvt/npt: number of steps; default 1000")
    timestep: float | None = field(None, "nve/nvt/npt: time step (fs); default 1")
    temperature: float | None = field(None, "nvt/npt: target temperature (K); default 300")
    initial_temperature: float | None = field(None, "nve/nvt/npt: temperature of the "
                                              "Maxwell–Boltzmann velocities (null: the target)")
    velocities: str | None = field(None, "nve/nvt/npt: auto (draw Maxwell–Boltzmann velocities "
                                   "when the system is at rest, e.g. after a relaxation), "
                                   "maxwell (always draw), keep; default auto")
    thermostat: str | None = field(None, "nvt: langevin, csvr or nhc; default langevin")
    friction: float | None = field(None, "nvt langevin: friction γ (1/fs); default 0.01")
    tau: float | None = field(None, "nvt csvr/nhc, npt: thermostat time constant (fs)")
    chain_length: int | None = field(None, "nvt nhc: Nosé–Hoover chain length; default 3")
    # npt (and relax_cell)
    pressure: float | None = field(None, "npt, relax with relax_cell: target pressure "
                                   "(pressure_unit); default 0")
    tau_p: float | None = field(None, "npt: barostat relaxation time (fs); default 1000")
    compressibility: float | None = field(None, "npt: compressibility estimate (1/GPa); "
                                          "default 0.1")
    anisotropic: bool | None = field(None, "npt: all six cell components fluctuate")

    def resolve(self, key: str) -> None:
        """Refuse options another stage type uses; fill the defaults of this type."""
        options = STAGE_OPTIONS[self.type]
        for f in fields(self):
            if f.name in _COMMON or f.name in options:
                continue
            if getattr(self, f.name) is not None:
                raise ConfigError(f"{key}.{f.name} is not an option of a {self.type} stage; "
                                  f"its options: {', '.join(sorted(options))}")
        for name, default in options.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        if self.name is None:
            self.name = self.type
        for name in ("fmax", "maxstep", "timestep", "friction", "tau", "tau_p",
                     "compressibility"):
            check_range(f"{key}.{name}", getattr(self, name), 0.0, low_inclusive=False)
        for name in ("max_steps", "steps", "temperature", "initial_temperature",
                     "trajectory_every"):
            check_range(f"{key}.{name}", getattr(self, name), 0)
        check_range(f"{key}.chain_length", self.chain_length, 1)
        for name, choices in (("thermostat", THERMOSTATS), ("velocities", VELOCITIES)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ConfigError(f"{key}.{name}={value!r} is not a valid choice; choose one "
                                  f"of {list(choices)}")
        if self.type == "nvt" and self.thermostat == "nhc" and self.temperature <= 0:
            raise ConfigError(f"{key}: an nhc thermostat needs temperature > 0")


@dataclass
class WorkflowOutputConfig:
    dir: str = field("workflow_output", "run folder (created): results.csv, summary.json, "
                     "final.xyz, trajectories/sys_NNNNN.xyz, checkpoint.pt")
    trajectory_every: int = field(100, "a frame of each system every N steps of a stage, "
                                  "plus its first and last (0: first and last only)")
    checkpoint_every: int = field(200, "also checkpoint every N batch steps (checkpoints are "
                                  "always written when a system finishes a stage); 0: only then")
    log_every: int = field(100, "a log line every N batch steps")
    progress: bool = field(True, "show a progress bar of finished stages (on a terminal)")
    overwrite: bool = field(False, "replace a previous run in dir (kept until the new run "
                            "completes)")

    def __post_init__(self):
        for k in ("trajectory_every", "checkpoint_every"):
            check_range(f"output.{k}", getattr(self, k), 0)
        check_range("output.log_every", self.log_every, 1)


@dataclass
class WorkflowConfig:
    structure: str = field("", "structure file (extxyz or any ASE format): each selected "
                           "frame is one system (its id: its position in the selection)")
    index: str = field(":", "frames of the structure file: ASE index, kept as typed (: or "
                       "all: every frame, -1: the last, 0:100, ::2; quote '-3:' in YAML)")
    model: ModelConfig = model_field()
    stages: list[StageConfig] = field([], "the stages every system goes through, in order, "
                                      "e.g. [{type: relax, fmax: 0.05}, {type: nvt, "
                                      "temperature: 300, steps: 1000}]")
    slots: int = field(16, "systems advanced together (the batch size; per rank under "
                       "torchrun); a finished system's slot is refilled at once with the next "
                       "system of the queue")
    seed: int = field(0, "seed of the velocities and thermostat noise (each system draws "
                      "its own numbers, keyed by its id: independent of its slot)")
    pressure_unit: str = field("GPa", "unit of the stages' pressures", choices=PRESSURE_UNITS)
    max_force: float = field(100.0, "a system whose largest force exceeds this (eV/Å), or "
                             "whose energy is not finite, fails: its row says so and it "
                             "leaves the campaign")
    safety: UncertaintySafetyConfig = field(UncertaintySafetyConfig(), "a committee's "
                                            "uncertainty guard (as xnn md's and xnn "
                                            "relax's), per system in every stage")
    output: WorkflowOutputConfig = field(WorkflowOutputConfig(), "files written")
    parallel: ParallelConfig = parallel_field()
    resume: str | None = resume_field()

    def __post_init__(self):
        validate(self)
        self.model.check_run()
        self.parallel.check_workflow()
        if not self.stages:
            raise ConfigError("a workflow needs at least one stage (stages=[{type: relax}, "
                              "...])")
        for i, stage in enumerate(self.stages):
            stage.resolve(f"stages.{i}")
        names = [s.name for s in self.stages]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConfigError(f"two stages are named {dup!r}; give each a unique name "
                              "(stages.N.name)")
        check_range("slots", self.slots, 1)
        check_seed("seed", self.seed)
        check_range("max_force", self.max_force, 0.0, low_inclusive=False)
