"""The runners behind ``xnn md`` and ``xnn relax``.

``run_md(config)`` reads a structure (every selected frame is a system of the batch), builds
or loads the model, and integrates, writing under ``output.dir``: ``config.yaml``,
``thermo.csv`` (+ ``thermo.png``), ``trajectory.xyz``/``.h5``, ``checkpoint.pt``. A run
started with ``resume=checkpoint.pt`` continues bitwise identically on CPU (integrator,
thermostat and RNG state, neighbor list and output files are restored). ``run_relax``
(FIRE) writes ``relax.csv``, ``relax_trajectory``, ``relaxed.xyz`` and ``checkpoint.pt``
and resumes the same way. Safety checks stop
a diverging run with a clear message after writing ``last_good.xyz`` and
``checkpoint_last_good.pt``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from xnn._torch_files import check_complete
from xnn.config.loader import load_config, save_config
from xnn.config.md import MDConfig, RelaxConfig
from xnn.data import keys as K
from xnn.dynamics import checkpoint as ckpt
from xnn.dynamics import fire
from xnn.dynamics.registry import get_integrator
from xnn.dynamics.safety import (
    DriftMonitor,
    SimulationError,
    check_distances,
    check_forces,
    check_temperature,
)
from xnn.dynamics.setup import (
    check_kinetic_dof,
    check_species,
    initial_velocities,
    integrator_args,
    load_potential,
    load_structure,
    pressure_to_internal,
    resolve_device,
    target_temperatures,
    velocities_from_file,
)
from xnn.dynamics.state import MDState
from xnn.dynamics.thermo import ThermoLog, observables, plot_log
from xnn.errors import DataFileError, InputError
from xnn.io.run_folder import RunFolder, plan_run_folder
from xnn.io.trajectory import ExtxyzWriter, open_trajectory

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
# what xnn md and xnn relax write into output.dir (a previous run is recognised by these)
RUN_FILES = ("config.yaml", "checkpoint.pt", "thermo.csv", "thermo.png", "trajectory.xyz",
             "trajectory.h5", "last_good.xyz", "checkpoint_last_good.pt", "relax.csv",
             "relax_trajectory.xyz", "relax_trajectory.h5", "relaxed.xyz", "summary.json")


def _progress(cfg_out, total: int, initial: int, desc: str, enabled: bool = True):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True,
                disable=None if cfg_out.progress and enabled else True, mininterval=0.5)


def _results(state: MDState) -> dict:
    return {K.ENERGY: state.energy, K.FORCES: state.forces, K.STRESS: state.stress}


class _Outputs:
    """Trajectory, thermo log and checkpoints of one run (files written by rank 0 only;
    the methods are collective under domain decomposition)."""

    def __init__(self, cfg: MDConfig, par, counts: torch.Tensor, meta: dict | None,
                 directory: Path):
        self.cfg, self.par = cfg, par
        self.dir = Path(directory)
        self.enabled = par.main  # False on ranks other than 0 of a decomposed run
        files = (meta or {}).get("files", {})
        self.traj = None
        self.log = None
        self.drift = DriftMonitor(cfg.safety.max_drift, counts)  # from this run's first row
        if not self.enabled:
            return
        if cfg.output.trajectory_every:
            self.traj = open_trajectory(self.dir, cfg.output.trajectory_format,
                                        int(counts.sum()),
                                        files.get("trajectory") if meta else None)
        self.log = ThermoLog(self.dir / "thermo.csv", files.get("log_rows") if meta else None)

    def meta(self, ensemble: str) -> dict:
        if not self.enabled:
            return {"kind": "md", "ensemble": ensemble, "files": {}}
        files = {"log_rows": self.log.rows}
        if self.traj is not None:
            files["trajectory"] = self.traj.position()
        return {"kind": "md", "ensemble": ensemble, "files": files}

    def record(self, state: MDState, integrator, force: bool = False) -> None:
        out, step = self.cfg.output, state.step
        if force or step % out.log_every == 0:
            values = observables(state, integrator.conserved, self.par.reduce)
            if self.enabled:
                self.log.write(step, self.cfg.timestep, values)
                self.drift.update(step * self.cfg.timestep, values["conserved_eV"])
        if out.trajectory_every and (force or step % out.trajectory_every == 0):
            full = self.par.gather(state)
            if self.traj is not None:
                self.traj.write(full.graph, step, _results(full))

    def checkpoint(self, state: MDState, name: str = "checkpoint.pt",
                   meta: dict | None = None) -> Path | None:
        full = self.par.gather(state)
        if not self.enabled:
            return None
        path = self.dir / name
        meta = {**(meta or self.meta(self.cfg.ensemble)), **self.par.meta(full)}
        ckpt.save_checkpoint(path, full, meta, self.par.checkpoint_potential)
        return path


def _check(state: MDState, par, cfg: MDConfig, max_t: torch.Tensor) -> None:
    periodic = state.step % cfg.safety.check_every == 0
    if periodic:
        check_distances(state, par.potential, cfg.safety.min_distance, par.reduce)
    check_forces(state, cfg.safety.max_force, par.reduce)
    if periodic:
        check_temperature(state, max_t, par.reduce)


def _fail(err: SimulationError, good: MDState, meta: dict, outputs: _Outputs) -> SimulationError:
    """Write the last good frame and its checkpoint (with the output sizes at that step)."""
    d, full = outputs.dir, outputs.par.gather(good)
    if outputs.enabled:
        ExtxyzWriter(d / "last_good.xyz").write(full.graph, good.step, _results(full))
        ckpt.save_checkpoint(d / "checkpoint_last_good.pt", full,
                             {**meta, **outputs.par.meta(full)}, None)
    return SimulationError(f"{err}; stopped. Last good frame (step {good.step}) written to "
                           f"{d / 'last_good.xyz'} and {d / 'checkpoint_last_good.pt'}", err.step)


def _setup(schema, config, overrides: Sequence[str], manager=None):
    """The config (object or YAML path + dotlist overrides), device, dtype, the run's
    parallel layer (holding the potential) and output folder plan (checked, nothing
    written) of an ``xnn md`` / ``xnn relax`` run.

    With a multi-rank ``manager`` the system is decomposed over its ranks
    (:class:`~xnn.distributed.md_run.DomainRun`: each rank owns the atoms of its box) and
    only rank 0 writes files."""
    cfg = config if isinstance(config, schema) else load_config(schema, config, overrides)
    folder = plan_run_folder(cfg.output.dir, RUN_FILES, resume=cfg.resume,
                             overwrite=cfg.output.overwrite, key="output.dir",
                             overwrite_key="output.overwrite",
                             resume_hint=f"resume={Path(cfg.output.dir) / 'checkpoint.pt'}")
    if cfg.resume and Path(cfg.resume).is_file():
        check_complete(cfg.resume, "checkpoint")
    device, dtype = resolve_device(cfg.model.device), _DTYPES[cfg.model.dtype]
    if manager is not None:
        device = manager.device
    potential = load_potential(cfg.model, device, dtype)
    if manager is None:
        from xnn.dynamics.parallel import SerialRun

        return cfg, device, dtype, SerialRun(potential), folder
    from xnn.distributed.md_run import DomainRun

    par = DomainRun(potential.model, manager, skin=cfg.model.skin,
                    backend=cfg.model.neighbor_backend)
    return cfg, device, dtype, par, folder


def _open_folder(cfg, folder: RunFolder, manager=None) -> Path:
    """The run is validated: create its folder (rank 0) with ``config.yaml``; returns the
    folder it writes to (the staging folder of a run that replaces a previous one)."""
    if manager is not None:
        manager.barrier()  # every rank has checked the folder before rank 0 changes it
    if manager is None or manager.is_main:
        folder.create()
        save_config(cfg, folder.work / "config.yaml")
        if folder.staged:
            print(f"output.overwrite=true: this run is written to {folder.work} and replaces "
                  f"the previous run in {folder.final} when it completes", flush=True)
    return folder.work


def _launched_on_several_ranks() -> bool:
    from xnn.distributed.manager import detect_launch

    return detect_launch().world_size > 1


def _resume(cfg, par, device, kind: str):
    """The checkpoint's state split over the ranks (rank 0 reads it) and its meta."""
    state = meta = None
    with par.guarded("reading the checkpoint"):
        if par.main:
            state, meta = ckpt.load_checkpoint(cfg.resume, device, par.checkpoint_potential,
                                               kind=kind)
    meta = par.broadcast(meta)
    return par.scatter_state(state, meta), meta


def _start(cfg: MDConfig, par, device, dtype):
    """The initial state (fresh or resumed) and the checkpoint meta (``None`` when fresh)."""
    integrator, potential = get_integrator(cfg.ensemble), par.potential
    if cfg.resume:
        state, meta = _resume(cfg, par, device, "md")
        with par.guarded("checking the checkpoint"):
            if meta.get("ensemble") != cfg.ensemble:
                raise InputError(f"checkpoint {cfg.resume} is a {meta.get('ensemble')!r} "
                                 f"run, not {cfg.ensemble!r}")
            check_species(potential, state.graph)
        return integrator, state, meta
    graph, from_file = None, None
    with par.guarded("reading the structure"):
        if par.main:
            graph = load_structure(cfg.structure, cfg.index, device, dtype)
            check_species(potential, graph)
            temps = target_temperatures(cfg, graph.n_systems, graph.positions)
            check_kinetic_dof(cfg, graph, temps)
            from_file = velocities_from_file(cfg, graph)
    from_file = par.broadcast(from_file)
    graph = par.scatter_graph(graph)
    temps = target_temperatures(cfg, graph.n_systems, graph.positions)
    graph = initial_velocities(cfg, graph, temps, par.reduce, from_file)
    state = integrator.init(graph, potential, reduce=par.reduce,
                            **integrator_args(cfg, temps))
    return integrator, state, None


def run_md(config: MDConfig | str | Path, overrides: Sequence[str] = ()) -> Path:
    """Run molecular dynamics from a config (object or YAML path + dotlist overrides).

    Launched on several ranks (torchrun, srun), the system (one) is decomposed over the
    ranks: rank 0 reads the structure and scatters it, each rank integrates the atoms of
    its box, atoms migrate between ranks, and rank 0 writes the outputs (gathered in
    atom-id order) and ``summary.json``. The trajectory equals a single-process run to
    round-off, and checkpoints (the global state by atom id) resume on any number of ranks.

    Returns:
        the output folder (with ``thermo.csv``, ``thermo.png``, trajectory, ``checkpoint.pt``).
    Raises:
        SimulationError: the run diverged (after writing the last good frame and a checkpoint).
    """
    if _launched_on_several_ranks():
        return _distributed(MDConfig, config, overrides, _run_md)
    return _run_md(config, overrides, None)


def _distributed(schema, config, overrides, body) -> Path:
    """Run ``body(cfg, (), manager)`` on the ranks of a torchrun / srun launch."""
    from xnn.distributed import DistributedManager
    from xnn.distributed.agreement import check_ranks_agree, run_fingerprint

    cfg = config if isinstance(config, schema) else load_config(schema, config, overrides)
    manager = DistributedManager.initialize(device=resolve_device(cfg.model.device).type)
    try:
        with manager.watch():  # a collective that times out: one line naming the ranks
            files = {"structure": cfg.structure, "model.file": cfg.model.file,
                     "resume": cfg.resume}
            check_ranks_agree(run_fingerprint(cfg, files))  # the first collective
            return body(cfg, (), manager)
    finally:
        manager.cleanup()


def _run_md(config, overrides: Sequence[str], manager) -> Path:
    cfg, device, dtype, par, folder = _setup(MDConfig, config, overrides, manager)
    integrator, state, meta = _start(cfg, par, device, dtype)
    targets = state.vars.get("temperature", target_temperatures(cfg, state.n_systems,
                                                                 state.positions))
    max_t = (torch.full_like(targets, cfg.safety.max_temperature)
             if cfg.safety.max_temperature is not None else 10 * targets + 1000.0)
    if meta is None:
        try:
            check_distances(state, par.potential, cfg.safety.min_distance, par.reduce)
            check_forces(state, cfg.safety.max_force, par.reduce)
        except SimulationError as err:
            raise SimulationError(f"the initial structure is unsafe: {err}", 0) from None
    out_dir = _open_folder(cfg, folder, manager)
    counts = par.reduce.count_per_system(state.graph.batch, state.n_systems)
    outputs = _Outputs(cfg, par, counts, meta, out_dir)
    if meta is None:
        outputs.record(state, integrator, force=True)
    _loop(cfg, integrator, state, outputs, max_t)
    par.write_summary(out_dir / "summary.json")
    if cfg.output.plot and par.main:
        plot_log(outputs.log.path, out_dir / "thermo.png", title=f"xnn md: {cfg.ensemble}")
    if par.main:
        folder.commit()
    return folder.final


def _loop(cfg: MDConfig, integrator, state: MDState, outputs: _Outputs, max_t) -> MDState:
    par = outputs.par
    n_atoms, start = int(outputs.drift.n_atoms.sum()), state.step
    good, good_meta, t0 = state, outputs.meta(cfg.ensemble), time.perf_counter()
    bar = _progress(cfg.output, cfg.steps, start, f"md {cfg.ensemble}", outputs.enabled)
    every = cfg.output.checkpoint_every
    try:
        while state.step < cfg.steps:
            new = integrator.step(state, par.potential, cfg.timestep, reduce=par.reduce)
            try:
                _check(new, par, cfg, max_t)
            except SimulationError as err:
                raise _fail(err, good, good_meta, outputs) from None
            state = par.after_step(new)
            outputs.record(state, integrator)
            if state.step % cfg.safety.check_every == 0:
                good, good_meta = state, outputs.meta(cfg.ensemble)
            if every and state.step % every == 0:
                outputs.checkpoint(state)
            bar.update(1)
            if state.step % cfg.output.log_every == 0:
                done, el = state.step - start, time.perf_counter() - t0
                bar.set_postfix(ns_day=f"{done * cfg.timestep * 1e-6 * 86400 / el:.3g}",
                                atom_steps_s=f"{n_atoms * done / el:.3g}", refresh=False)
    finally:
        bar.close()
        if outputs.traj is not None:
            outputs.traj.close()
    if not (every and state.step % every == 0):
        outputs.checkpoint(state)
    return state


class _RelaxLog:
    """``relax.csv``, one row per system per logged step, appended as the run goes.

    Args:
        path: CSV file.
        truncate_to: on resume, the size (bytes) to cut the file to; ``None``: a new file.
    """

    HEADER = "step,system,energy_eV,fmax_eV_A,volume_A3\n"

    def __init__(self, path: Path, truncate_to: int | None):
        self.path = path
        if truncate_to is None:
            path.write_text(self.HEADER)
        elif not path.is_file() or path.stat().st_size < truncate_to:
            raise DataFileError(f"cannot resume: {path} is missing or shorter than the "
                                "checkpoint says")
        else:
            os.truncate(path, truncate_to)

    def write(self, state: MDState, fm: torch.Tensor) -> None:
        cols = zip(state.energy.tolist(), fm.tolist(), state.graph.volume().tolist())
        with open(self.path, "a") as fh:
            fh.writelines(f"{state.step},{s},{e!r},{f!r},{v!r}\n"
                          for s, (e, f, v) in enumerate(cols))

    def position(self) -> int:
        return self.path.stat().st_size


class _RelaxOutputs:
    """``relax.csv``, the relaxation trajectory and ``checkpoint.pt`` of one relaxation
    (files written by rank 0; the methods are collective under domain decomposition)."""

    def __init__(self, cfg: RelaxConfig, par, n_atoms: int, meta: dict | None,
                 directory: Path):
        self.cfg, self.dir, self.par = cfg, Path(directory), par
        files = meta["files"] if meta else {}
        self.log = self.traj = None
        if not par.main:
            return
        self.log = _RelaxLog(self.dir / "relax.csv", files.get("log_bytes"))
        if cfg.output.trajectory_every:
            self.traj = open_trajectory(self.dir, cfg.output.trajectory_format, n_atoms,
                                        files.get("trajectory") if meta else None,
                                        name="relax_trajectory")

    def meta(self, done: torch.Tensor) -> dict:
        """The checkpoint meta: settings, per-system convergence, output sizes (before this
        step's rows and frame, which a resumed run writes again)."""
        files = {"log_bytes": self.log.position()} if self.log is not None else {}
        if self.traj is not None:
            files["trajectory"] = self.traj.position()
        return {"kind": "relax", "settings": _relax_settings(self.cfg),
                "converged": done.tolist(), "files": files}

    def record(self, state: MDState, fm: torch.Tensor, force: bool) -> None:
        out = self.cfg.output
        if self.log is not None and (force or state.step % out.log_every == 0):
            self.log.write(state, fm)
        if out.trajectory_every and state.step % out.trajectory_every == 0:
            full = self.par.gather(state)
            if self.traj is not None:
                self.traj.write(full.graph, full.step, _results(full))

    def save(self, state: MDState, meta: dict, name: str = "checkpoint.pt") -> int:
        full = self.par.gather(state)
        if self.par.main:
            ckpt.save_checkpoint(self.dir / name, full, {**meta, **self.par.meta(full)},
                                 self.par.checkpoint_potential)
        return state.step

    def close(self) -> None:
        if self.traj is not None:
            self.traj.close()


def _relax_settings(cfg: RelaxConfig) -> dict:
    """The options a resumed relaxation must share with the run that wrote the checkpoint."""
    return {"relax_cell": cfg.relax_cell, "maxstep": cfg.maxstep, "dtype": cfg.model.dtype,
            "pressure_eV_A3": pressure_to_internal(cfg.pressure, cfg.pressure_unit)}


def _check_relax_resume(cfg: RelaxConfig, state: MDState, meta: dict, graph) -> None:
    if state.n_systems != graph.n_systems or not torch.equal(state.graph.numbers,
                                                             graph.numbers):
        raise InputError(f"checkpoint {cfg.resume} holds {state.n_systems} structures "
                         f"({state.graph.n_atoms} atoms), but structure={cfg.structure} "
                         f"index={cfg.index} selects {graph.n_systems} ({graph.n_atoms} atoms)")
    want, got = _relax_settings(cfg), meta["settings"]
    diff = [f"{k}={got[k]!r}" for k in want if want[k] != got[k]]
    if diff:
        raise InputError(f"checkpoint {cfg.resume} was written with {', '.join(diff)}; "
                         "resume with the same settings")


def _relax_start(cfg: RelaxConfig, par, device, dtype) -> tuple[MDState, dict | None]:
    """The FIRE state (fresh, or from ``cfg.resume``) and the checkpoint meta (``None``: fresh)."""
    graph = state = meta = None
    with par.guarded("reading the structure"):
        if par.main:
            graph = load_structure(cfg.structure, cfg.index, device, dtype)
            check_species(par.potential, graph)
            if cfg.resume:
                state, meta = ckpt.load_checkpoint(cfg.resume, device,
                                                   par.checkpoint_potential, kind="relax")
                _check_relax_resume(cfg, state, meta, graph)
    if cfg.resume:
        meta = par.broadcast(meta)
        return par.scatter_state(state, meta), meta
    graph = par.scatter_graph(graph)
    return fire.init(graph, par.potential, relax_cell=cfg.relax_cell, maxstep=cfg.maxstep,
                     pressure=pressure_to_internal(cfg.pressure, cfg.pressure_unit),
                     reduce=par.reduce), None


def run_relax(config: RelaxConfig | str | Path, overrides: Sequence[str] = ()) -> Path:
    """Relax every selected frame with FIRE (batched); writes ``relaxed.xyz``, ``relax.csv``
    and ``checkpoint.pt`` (every ``output.checkpoint_every`` steps and at the end).

    With ``resume=checkpoint.pt`` (same output folder) the relaxation continues (up to the
    new ``max_steps``) and its outputs are bitwise identical to an uninterrupted run on CPU.
    Launched on several ranks (torchrun), the system (one) is decomposed as in ``xnn md``.

    Returns:
        the output folder.
    """
    if _launched_on_several_ranks():
        return _distributed(RelaxConfig, config, overrides, _run_relax)
    return _run_relax(config, overrides, None)


def _run_relax(config, overrides: Sequence[str], manager) -> Path:
    cfg, device, dtype, par, folder = _setup(RelaxConfig, config, overrides, manager)
    state, meta = _relax_start(cfg, par, device, dtype)
    out_dir = _open_folder(cfg, folder, manager)
    n_atoms = int(par.reduce.count_per_system(state.graph.batch, state.n_systems).sum())
    outputs = _RelaxOutputs(cfg, par, n_atoms, meta, out_dir)
    state = _relax_loop(cfg, state, outputs)
    full = par.gather(state)
    if par.main:
        ExtxyzWriter(out_dir / "relaxed.xyz").write(full.graph.replace(velocities=None),
                                                   state.step, _results(full))
    par.write_summary(out_dir / "summary.json")
    if par.main:
        folder.commit()
    n_bad = int((fire.fmax(state, par.reduce) >= cfg.fmax).sum())
    if n_bad and par.main:
        print(f"xnn relax: {n_bad} of {state.n_systems} systems did not reach fmax={cfg.fmax} "
              f"eV/Å in {cfg.max_steps} steps")
    return folder.final


def _relax_loop(cfg: RelaxConfig, state: MDState, outputs: _RelaxOutputs) -> MDState:
    """FIRE steps until every system is below ``cfg.fmax`` or ``cfg.max_steps``; checkpoints
    are taken at the top of a step, before its rows are written."""
    every, start, saved, par = cfg.output.checkpoint_every, state.step, None, outputs.par
    bar = _progress(cfg.output, cfg.max_steps, min(start, cfg.max_steps), "relax", par.main)
    try:
        while True:
            fm = fire.fmax(state, par.reduce)
            done = fm < cfg.fmax
            meta = outputs.meta(done)
            if every and state.step % every == 0 and state.step != start:
                saved = outputs.save(state, meta)
            outputs.record(state, fm, force=bool(done.all()))
            if bool(done.all()) or state.step >= cfg.max_steps:
                break
            check_forces(state, float("inf"), par.reduce)
            state = fire.step(state, par.potential, cfg.fmax, reduce=par.reduce)
            state = par.after_step(state)
            bar.update(1)
            bar.set_postfix(fmax=f"{float(fm.max()):.3g}", refresh=False)
    finally:
        bar.close()
        outputs.close()
    if saved != state.step:
        outputs.save(state, meta)
    return state


def demo_md(
    model_file: str | Path, structure: str | Path, out_dir: str | Path, temperature: float = 300.0,
    steps: int = 500, timestep: float = 1.0, ensemble: str = "csvr", device: str = "auto",
) -> Path:
    """A short NVT run with a trained model file, for ``xnn demo``.

    Args:
        model_file: a model saved by ``xnn train`` / :func:`xnn.save_model`.
        structure: structure file (its last frame is simulated).
        out_dir: output folder (gets ``thermo.csv``, ``thermo.png``, ``trajectory.xyz``).
        temperature: K. steps: number of steps. timestep: fs.
        ensemble: ``csvr`` (default), ``langevin`` or ``nhc``.
    Returns:
        ``out_dir``; ``out_dir / "thermo.png"`` is the plot.
    """
    cfg = load_config(MDConfig, None, [
        f"structure={structure}", f"model.file={model_file}", f"model.device={device}",
        f"ensemble={ensemble}", f"temperature={temperature}", f"steps={steps}",
        f"timestep={timestep}", f"output.dir={out_dir}", "output.progress=false",
        f"output.trajectory_every={max(1, steps // 20)}",
        f"output.log_every={max(1, steps // 200)}",
        f"output.checkpoint_every={steps}",
    ])
    return run_md(cfg)
