"""Configuration of ``xnn md`` and ``xnn relax`` (YAML + dotlist overrides, see ``--help``).

Units: temperature K, time fs, pressure in ``pressure_unit`` (GPa or bar), lengths Å.
"""

from __future__ import annotations

from dataclasses import dataclass

from xnn.config.loader import ConfigError, check_range, check_seed, field, validate
from xnn.config.model import ModelConfig, model_field
from xnn.config.parallel import ParallelConfig, md_parallel, parallel_field

ENSEMBLES = ("nve", "langevin", "nhc", "csvr", "npt")
PRESSURE_UNITS = ("GPa", "bar")


@dataclass
class ThermostatConfig:
    tau: float = field(100.0, "time constant of the nhc/csvr/npt thermostat (fs)")
    friction: float = field(0.01, "Langevin friction γ (1/fs)")
    chain_length: int = field(3, "Nosé–Hoover chain length")

    def __post_init__(self):
        check_range("thermostat.tau", self.tau, 0.0, low_inclusive=False)
        check_range("thermostat.friction", self.friction, 0.0, low_inclusive=False)
        check_range("thermostat.chain_length", self.chain_length, 1)


@dataclass
class BarostatConfig:
    tau_p: float = field(1000.0, "barostat relaxation time (fs)")
    compressibility: float = field(0.1, "estimate of the isothermal compressibility (1/GPa); "
                                   "sets only the barostat's speed")
    anisotropic: bool = field(False, "let all six cell strain components fluctuate "
                              "(triclinic); false: isotropic")

    def __post_init__(self):
        check_range("barostat.tau_p", self.tau_p, 0.0, low_inclusive=False)
        check_range("barostat.compressibility", self.compressibility, 0.0, low_inclusive=False)


@dataclass
class OutputConfig:
    dir: str = field("md_output", "output folder (created)")
    trajectory_every: int = field(100, "write a frame every N steps (0: never)")
    trajectory_format: str = field("auto", "auto: extxyz below 10,000 atoms, else HDF5; "
                                   "under torchrun above 100,000 atoms sharded; sharded: "
                                   "each rank writes its atoms to trajectory.d/rank-RRRR.h5 "
                                   "(no gather; xnn traj merge reads them in id order)",
                                   choices=("auto", "extxyz", "hdf5", "sharded"))
    log_every: int = field(10, "thermo log row every N steps")
    checkpoint_every: int = field(1000, "checkpoint every N steps (0: only at the end)")
    checkpoint_format: str = field("auto", "gathered: one file checkpoint.pt written by rank "
                                   "0; sharded: each rank writes its atoms to "
                                   "checkpoint.pt.d/ (no gather, index written last); auto: "
                                   "sharded under torchrun above 100,000 atoms; resume reads "
                                   "either on any number of ranks",
                                   choices=("auto", "gathered", "sharded"))
    plot: bool = field(True, "write thermo.png at the end")
    progress: bool = field(True, "show progress: a bar on a terminal; in a batch job or a "
                           "log file (not a terminal) one line every progress_every_s "
                           "seconds (step, time, T, energy, speed); false: neither (the "
                           "final summary line stays)")
    progress_every_s: float = field(60.0, "seconds of wall clock between two progress lines "
                                    "when not on a terminal (the first comes after at most "
                                    "10 s)")
    log_rebuilds: bool = field(True, "under torchrun: with the next log row after ghost-plan "
                               "rebuilds, print one line on the decomposition (rebuilds and "
                               "migrations since the last line, owned/ghost atoms per rank, "
                               "peak memory); false: only summary.json")
    overwrite: bool = field(False, "replace a previous run in dir: it is kept until the new "
                            "run completes (written meanwhile to dir/.xnn-new-run; resume "
                            "an interrupted one with resume=dir/.xnn-new-run/checkpoint.pt)")

    def __post_init__(self):
        for k in ("trajectory_every", "checkpoint_every"):
            check_range(f"output.{k}", getattr(self, k), 0)
        check_range("output.log_every", self.log_every, 1)
        check_range("output.progress_every_s", self.progress_every_s, 0.0, low_inclusive=False)


HOOK_NAMES = ("rdf", "msd", "species_temperature", "callable")
HOOK_SCOPES = {"rdf": ("rank0",), "msd": ("global",), "species_temperature": ("global",),
               "callable": ("rank0", "owned", "global")}


@dataclass
class HookConfig:
    name: str = field("rdf", "the observer: rdf (g(r) averaged over the calls), msd (mean "
                      "squared displacement from the first call, per species), "
                      "species_temperature (kinetic temperature per species) or callable "
                      "(target, a user function)", choices=HOOK_NAMES)
    every: int = field(10, "run at the steps that are multiples of N")
    scope: str | None = field(None, "callable only: rank0 (the gathered frame), owned "
                              "(per-atom values of each rank's atoms, assembled by id) or "
                              "global (partial sums summed over the ranks); null: the "
                              "hook's own (rdf and the callable: rank0; msd, "
                              "species_temperature: global)")
    r_max: float = field(6.0, "rdf: largest distance (Å)")
    bins: int = field(200, "rdf: number of bins")
    partials: bool = field(False, "rdf: also the partial g(r) of every species pair")
    max_pairs: int = field(50_000_000, "rdf: refuse an r_max whose atom pairs per frame "
                           "(expected from the density, periodic images included; about 180 "
                           "bytes each in memory) exceed N")
    target: str | None = field(None, "callable: 'package.module:function'")
    format: str = field("ase", "callable in scope rank0: the frame as ase.Atoms (one call "
                        "per system) or as the xnn graph (graph)", choices=("ase", "graph"))
    label: str | None = field(None, "the file name hooks/LABEL.csv (default: the name; a "
                              "callable: its function's name)")

    def __post_init__(self):
        check_range("hooks.every", self.every, 1)
        check_range("hooks.r_max", self.r_max, 0.0, low_inclusive=False)
        check_range("hooks.bins", self.bins, 1)
        check_range("hooks.max_pairs", self.max_pairs, 1)
        if self.name not in HOOK_NAMES:
            return  # validate() names the valid choices
        scopes = HOOK_SCOPES[self.name]
        if self.scope is not None and self.scope not in scopes:
            raise ConfigError(f"hooks: {self.name} runs in scope {list(scopes)}, not "
                              f"{self.scope!r}")
        if (self.name == "callable") != (self.target is not None):
            raise ConfigError("hooks: a callable hook needs target: 'package.module:function'"
                              if self.name == "callable" else
                              f"hooks: target is only for name: callable, not {self.name}")


def _check_hooks(hooks: list) -> None:
    names = [h.label or (h.target.rpartition(":")[2] if h.target else h.name) for h in hooks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"hooks: two hooks write hooks/{dup[0]}.csv; give each a label")


def hooks_field():
    """The ``hooks`` option of ``xnn md`` and ``xnn relax``."""
    return field([], "observers run during the run, each {name: rdf|msd|species_temperature|"
                 "callable, every: N, ...} with keys name, every, scope (callable: rank0, "
                 "owned or global), r_max, bins, partials (rdf), target "
                 "('package.module:function'), format (ase or graph), label; e.g. "
                 "hooks.0.name=msd hooks.0.every=5; results in output.dir/hooks/NAME.csv")


def resume_field(checks: str = ""):
    """The ``resume`` option of ``xnn md`` and ``xnn relax`` (one definition for both);
    ``checks``: what the command checks against the checkpoint, appended to the help."""
    return field(None, "checkpoint (output.dir/checkpoint.pt) to continue from, writing into "
                 "the same output.dir; bitwise identical to an uninterrupted run on CPU"
                 + checks)


#: what ``xnn md`` / ``xnn relax`` check on resume (their ``resume`` help)
RESUME_CHECKS = ("; the model and every setting that changes the physics must be those of "
                 "the run that wrote it (refused otherwise, naming what differs), the length "
                 "of the run (steps; max_steps, fmax) and the outputs may change; a run that "
                 "is already complete says so and stops")


@dataclass
class UncertaintySafetyConfig:
    """A committee's force-uncertainty guard: the ``safety`` section of ``xnn relax`` and
    ``xnn run``, and the first keys of ``xnn md``'s (one definition for the three)."""

    max_force_uncertainty: float | None = field(None, "committee models: act when the "
                                                "largest per-atom force uncertainty "
                                                "(forces_std, the members' spread) exceeds "
                                                "this (eV/Å); null: never")
    on_uncertainty: str = field("stop", "what max_force_uncertainty does: stop (write the "
                                "frame to the trajectory, uncertain.xyz and a checkpoint, "
                                "then stop the run; xnn run: the system fails its stage and "
                                "leaves, the others go on) or warn (once per excursion above "
                                "it)", choices=("stop", "warn"))

    def __post_init__(self):
        check_range("safety.max_force_uncertainty", self.max_force_uncertainty, 0.0,
                    low_inclusive=False)


#: ``xnn relax``'s safety section (the committee's uncertainty guard of ``xnn md``)
RelaxSafetyConfig = UncertaintySafetyConfig


@dataclass
class SafetyConfig(UncertaintySafetyConfig):
    min_distance: float = field(0.5, "stop when two atoms come closer than this (Å)")
    max_force: float = field(100.0, "stop when a force exceeds this (eV/Å)")
    max_temperature: float | None = field(None, "stop above this temperature (K); "
                                          "null: 10 × target + 1000 K")
    check_every: int = field(1, "run the distance/temperature checks every N steps")
    max_drift: float | None = field(1e-3, "warn (once) when the conserved quantity drifts "
                                    "faster than this (eV/atom/ps; below 1 ps: when it "
                                    "changed by more than this × 1 ps); null: never")

    def __post_init__(self):
        super().__post_init__()
        check_range("safety.min_distance", self.min_distance, 0.0)
        check_range("safety.max_drift", self.max_drift, 0.0, low_inclusive=False)
        check_range("safety.max_force", self.max_force, 0.0, low_inclusive=False)
        check_range("safety.check_every", self.check_every, 1)
        check_range("safety.max_temperature", self.max_temperature, 0.0, low_inclusive=False)


@dataclass
class MDConfig:
    structure: str = field("", "structure file (extxyz or any ASE format); every selected "
                           "frame is an independent system, all advanced together")
    index: str = field("-1", "frames of the structure file: ASE index (-1: last, : or all: "
                       "every frame, 0:4)")
    model: ModelConfig = model_field()
    ensemble: str = field("langevin", "integrator", choices=ENSEMBLES)
    temperature: float = field(300.0, "target temperature (K)")
    temperatures: list[float] | None = field(None, "per-system target temperatures (K), one "
                                             "per frame; overrides temperature")
    initial_temperature: float | None = field(None, "Maxwell–Boltzmann temperature of the "
                                              "initial velocities (null: the target)")
    velocities: str = field("auto", "initial velocities: auto (from the file if present), "
                            "file, or maxwell", choices=("auto", "file", "maxwell"))
    pressure: float | None = field(None, "target pressure for npt, in pressure_unit")
    pressure_unit: str = field("GPa", "unit of pressure", choices=PRESSURE_UNITS)
    timestep: float = field(1.0, "time step (fs)")
    steps: int = field(1000, "total number of steps (a resumed run continues up to it)")
    seed: int = field(0, "seed of the initial velocities and of thermostat/barostat noise")
    thermostat: ThermostatConfig = field(ThermostatConfig(), "thermostat settings")
    barostat: BarostatConfig = field(BarostatConfig(), "barostat settings (npt)")
    output: OutputConfig = field(OutputConfig(), "files written")
    safety: SafetyConfig = field(SafetyConfig(), "checks that stop a diverging run")
    hooks: list[HookConfig] = hooks_field()
    compile: bool = field(False, "compile each MD step (kick, drift, model, forces, stress, "
                          "kick) into one torch.compile graph with fixed-capacity neighbor "
                          "lists (ensembles nve, langevin, csvr, nhc in one process; nve under "
                          "torchrun: the decomposed step, parallel.mode spatial; the first "
                          "step compiles)")
    cuda_graph: bool = field(False, "replay the compiled step as a CUDA graph (implies compile; "
                             "CUDA devices only)")
    resume: str | None = resume_field(RESUME_CHECKS)
    parallel: ParallelConfig = parallel_field(md_parallel())

    def __post_init__(self):
        validate(self)  # every number finite, every choice valid (also when built in Python)
        self.model.check_run()
        self.parallel.check_md()
        _check_hooks(self.hooks)
        check_range("temperature", self.temperature, 0.0)
        for t in self.temperatures or []:
            check_range("temperatures", t, 0.0)
        check_range("initial_temperature", self.initial_temperature, 0.0)
        check_range("timestep", self.timestep, 0.0, low_inclusive=False)
        check_range("steps", self.steps, 0)
        check_seed("seed", self.seed)
        if self.ensemble == "npt" and self.pressure is None:
            raise ConfigError("ensemble=npt needs a target pressure (pressure=..., in "
                              "pressure_unit)")
        if self.ensemble != "npt" and self.pressure is not None:
            raise ConfigError(f"pressure is only used by ensemble=npt, not {self.ensemble!r}")
        if self.ensemble == "nhc" and self.temperature <= 0 and not self.temperatures:
            raise ConfigError("ensemble=nhc needs temperature > 0")


@dataclass
class RelaxConfig:
    structure: str = field("", "structure file; every selected frame is relaxed (batched)")
    index: str = field("-1", "frames of the structure file: ASE index (-1: last, : or all: "
                       "every frame, 0:4)")
    model: ModelConfig = model_field()
    fmax: float = field(0.05, "converged when every force (and cell force) is below (eV/Å)")
    max_steps: int = field(1000, "stop after this many FIRE steps")
    relax_cell: bool = field(False, "also relax the cell toward pressure")
    pressure: float = field(0.0, "target pressure for relax_cell, in pressure_unit")
    pressure_unit: str = field("GPa", "unit of pressure", choices=PRESSURE_UNITS)
    maxstep: float = field(0.2, "largest FIRE move per step (Å)")
    output: OutputConfig = field(OutputConfig(dir="relax_output", trajectory_every=10,
                                              log_every=1, checkpoint_every=0),
                                 "files written (checkpoint.pt every checkpoint_every "
                                 "steps and at the end)")
    safety: UncertaintySafetyConfig = field(UncertaintySafetyConfig(), "a committee's "
                                            "uncertainty guard (as xnn md's)")
    hooks: list[HookConfig] = hooks_field()
    resume: str | None = resume_field(RESUME_CHECKS)
    parallel: ParallelConfig = parallel_field(md_parallel())

    def __post_init__(self):
        validate(self)
        self.model.check_run()
        self.parallel.check_md()
        _check_hooks(self.hooks)
        check_range("fmax", self.fmax, 0.0, low_inclusive=False)
        check_range("max_steps", self.max_steps, 0)
        check_range("maxstep", self.maxstep, 0.0, low_inclusive=False)
