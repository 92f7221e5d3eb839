"""``run_md(config)``: the application behind ``xnn md``.

It reads a structure (every selected frame is a system of the batch), builds or loads the
model, and integrates, writing under ``output.dir``: ``config.yaml``, ``thermo.csv``
(+ ``thermo.png``), ``trajectory.xyz``/``.h5``, ``checkpoint.pt``. A run started with
``resume=checkpoint.pt`` continues bitwise identically on CPU (integrator, thermostat and
RNG state, neighbor list and output files are restored) when the model and the physics are
the checkpoint's (:mod:`xnn.app.md_resume`). Safety checks stop a diverging run with a clear
message after writing ``last_good.xyz`` and ``checkpoint_last_good.pt``. Progress shows as a
bar on a terminal, else as a line every ``output.progress_every_s`` seconds; the run ends
with a summary line and ``summary.json`` (:mod:`xnn.app.md_progress`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from xnn.app.md_common import (
    RunOutputs,
    already_complete,
    launched_on_several_ranks,
    open_folder,
    results,
    resume_state,
    run_distributed,
    setup_run,
)
from xnn.app.md_hooks import RunHooks, hook_failed, hooks_from_config
from xnn.app.md_progress import (
    Progress,
    ThermoMeans,
    md_summary,
    md_summary_line,
    ns_per_day,
    wall_clock,
    write_summary,
)
from xnn.app.md_resume import check_resume, md_settings, resume_identity
from xnn.app.md_setup import (
    check_compile,
    check_compile_cells,
    check_kinetic_dof,
    check_species,
    check_uncertainty,
    compiled_integrator,
    initial_velocities,
    integrator_args,
    load_structure,
    target_temperatures,
    velocities_from_file,
)
from xnn.config.md import MDConfig
from xnn.dynamics.hooks import HookError
from xnn.dynamics.registry import get_integrator
from xnn.dynamics.safety import (
    DriftMonitor,
    SimulationError,
    check_distances,
    check_forces,
    check_temperature,
)
from xnn.dynamics.state import MDState
from xnn.dynamics.thermo import columns as thermo_columns
from xnn.dynamics.thermo import observables
from xnn.errors import InputError
from xnn.io.thermo import ThermoLog, plot_log
from xnn.io.trajectory import write_extxyz


class _Outputs(RunOutputs):
    """Trajectory, thermo log, checkpoints and decomposition lines of one MD run (files
    written by rank 0 only; the methods are collective under domain decomposition)."""

    def __init__(self, cfg: MDConfig, par, counts: torch.Tensor, meta: dict | None,
                 directory: Path, identity: dict | None):
        super().__init__(cfg, par, int(counts.sum()), meta, directory, "md")
        self.log = None
        self.hooks: RunHooks | None = None  # set by _run_md
        self.identity = identity  # the model and physics, checked on resume (rank 0)
        self.drift = DriftMonitor(cfg.safety.max_drift, counts)  # from this run's first row
        self.means = ThermoMeans()  # this run's thermo rows, for the summary
        if self.enabled:
            self.log = ThermoLog(self.dir / "thermo.csv",
                                 self.files.get("log_rows") if meta else None,
                                 thermo_columns(par.model.committee_size > 1))

    def meta(self, ensemble: str) -> dict:
        files = {"log_rows": self.log.rows, **self.file_sizes()} if self.enabled else {}
        out = {"kind": "md", "ensemble": ensemble, "files": files,
               "resume_check": self.identity}
        if self.hooks:
            out.update(self.hooks.meta())
        return out

    def record(self, state: MDState, integrator, force: bool = False) -> None:
        """The thermo row, frame and hooks of ``state``'s step; when a hook fails, a
        checkpoint (its resumed run calls that step's hooks again) and a one-line
        :class:`~xnn.dynamics.hooks.HookError`."""
        try:
            self._record(state, integrator, force)
        except HookError as err:
            self.checkpoint(state)
            raise hook_failed(err, self.dir / "checkpoint.pt") from err

    def _record(self, state: MDState, integrator, force: bool) -> None:
        step = state.step
        if force or step % self.cfg.output.log_every == 0:
            values = observables(state, integrator.conserved, self.par.reduce)
            self.means.add(values)
            if self.enabled:
                self.log.write(step, self.cfg.timestep, values)
                self.drift.update(step * self.cfg.timestep, values["conserved_eV"])
            self.report(step)
        self.frame(state, force)
        if self.hooks:
            self.hooks(state)

    def checkpoint(self, state: MDState, name: str = "checkpoint.pt",
                   meta: dict | None = None) -> Path | None:
        return self.save(state, meta or self.meta(self.cfg.ensemble), name)

    def record_checked(self, state: MDState, integrator, force: bool = False) -> None:
        """:meth:`record` after the committee's uncertainty guard (``safety.
        max_force_uncertainty``): a warning once per excursion (rank 0), or a stop that first
        writes this step's thermo row, trajectory frame, ``uncertain.xyz`` and checkpoint.
        Collective."""
        self.check_uncertainty(state, lambda: self.record(state, integrator, force=True),
                               lambda: self.checkpoint(state))
        self.record(state, integrator, force)


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
        write_extxyz(d / "last_good.xyz", full.graph, good.step, results(full))
    outputs.save(good, meta, "checkpoint_last_good.pt", with_neighbors=False)
    return SimulationError(f"{err}; stopped. Last good frame (step {good.step}) written to "
                           f"{d / 'last_good.xyz'} and {d / 'checkpoint_last_good.pt'}", err.step)


def _start(cfg: MDConfig, par, device, dtype, model):
    """The integrator, the initial state (fresh or resumed), the checkpoint meta (``None``
    when fresh) and the run's identity (model fingerprint and physics; rank 0)."""
    integrator = get_integrator(cfg.ensemble)
    if cfg.compile or cfg.cuda_graph:
        integrator = compiled_integrator(cfg, par)
    identity = None
    if cfg.resume:
        state, meta = resume_state(cfg, par, device, "md")
        with par.guarded("checking the checkpoint"):
            if par.main:
                identity = resume_identity(cfg, model, md_settings(cfg, state.n_systems))
                check_resume(cfg, meta, identity, "md")
            if meta.get("ensemble") != cfg.ensemble:
                raise InputError(f"checkpoint {cfg.resume} is a {meta.get('ensemble')!r} "
                                 f"run, not {cfg.ensemble!r}")
            check_species(par.model, state.graph)
            check_compile_cells(cfg, state.graph)
        return integrator, state, meta, identity
    graph, from_file = None, None
    with par.guarded("reading the structure"):
        if par.main:
            graph = load_structure(cfg.structure, cfg.index, device, dtype)
            check_species(par.model, graph)
            check_compile_cells(cfg, graph)
            identity = resume_identity(cfg, model, md_settings(cfg, graph.n_systems))
            temps = target_temperatures(cfg, graph.n_systems, graph.positions)
            check_kinetic_dof(cfg, graph, temps)
            from_file = velocities_from_file(cfg, graph)
    from_file = par.broadcast(from_file)
    graph = par.scatter_graph(graph)
    temps = target_temperatures(cfg, graph.n_systems, graph.positions)
    graph = initial_velocities(cfg, graph, temps, par.reduce, from_file)
    state = integrator.init(graph, par.potential, reduce=par.reduce,  # chosen by the scatter
                            **integrator_args(cfg, temps))
    return integrator, state, None, identity


def run_md(config: MDConfig | str | Path, overrides: Sequence[str] = (),
           hooks: Sequence = ()) -> Path:
    """Run molecular dynamics from a config (object or YAML path + dotlist overrides).

    Launched on several ranks (torchrun, srun), the system (one) is decomposed over the
    ranks: rank 0 reads the structure and scatters it, each rank integrates the atoms of
    its box, atoms migrate between ranks, and rank 0 writes the outputs (gathered in
    atom-id order) and ``summary.json``. The trajectory equals a single-process run to
    round-off, and checkpoints (the global state by atom id) resume on any number of ranks.

    Args:
        hooks: observers (:mod:`xnn.dynamics.observers`) run with those of the config's
            ``hooks:`` list; their results stay in them (``hook.result()``, on rank 0).

    Returns:
        the output folder (with ``thermo.csv``, ``thermo.png``, trajectory, ``checkpoint.pt``,
        ``hooks/*.csv``).
    Raises:
        SimulationError: the run diverged (after writing the last good frame and a checkpoint).
    """
    if launched_on_several_ranks():
        return run_distributed(MDConfig, config, overrides,
                               functools.partial(_run_md, extra_hooks=hooks))
    return _run_md(config, overrides, None, hooks)


def _run_md(config, overrides: Sequence[str], manager, extra_hooks: Sequence = ()) -> Path:
    began = wall_clock()
    cfg, device, dtype, par, folder, model = setup_run(MDConfig, config, overrides, manager,
                                                       check_compile)
    check_uncertainty(cfg, par.model)
    hooks = [*hooks_from_config(cfg.hooks), *extra_hooks]  # user targets imported first
    integrator, state, meta, identity = _start(cfg, par, device, dtype, model)
    if meta is not None and state.step >= cfg.steps:
        return already_complete(cfg, par, folder, "md", f"it is at step {state.step} and "
                                f"steps={cfg.steps}", f"a larger steps (e.g. "
                                f"steps={state.step + max(cfg.steps, 1)})")
    run_hooks = RunHooks(hooks, par, cfg.timestep, meta)
    state = run_hooks.prepare(state)  # checked before any file; per-atom fields added
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
    out_dir = open_folder(cfg, folder, manager)
    counts = par.reduce.count_per_system(state.graph.batch, state.n_systems)
    outputs = _Outputs(cfg, par, counts, meta, out_dir, identity)
    outputs.hooks = run_hooks.open(out_dir, None if meta is None else state.step)
    if meta is None:
        try:
            outputs.record_checked(state, integrator, force=True)
        except SimulationError:
            outputs.close()  # the guard stopped at step 0 (its frame written)
            raise
    else:
        outputs.hooks.resume(state)
    start, t0 = state.step, wall_clock()
    state = _loop(cfg, integrator, state, outputs, max_t)
    loop_s = wall_clock() - t0
    figures = md_summary(cfg, outputs.means, int(counts.sum()), start, state.step, loop_s,
                         wall_clock() - began)
    if outputs.guard.threshold is not None:
        figures["uncertainty_warnings"] = outputs.guard.excursions
    if write_summary(out_dir / "summary.json", par, figures) is not None:
        print(md_summary_line(figures), flush=True)
    if cfg.output.plot and par.main:
        plot_log(outputs.log.path, out_dir / "thermo.png", title=f"xnn md: {cfg.ensemble}",
                 targets=plot_targets(cfg, targets))
    if par.main:
        folder.commit()
    return folder.final


def plot_targets(cfg: MDConfig, temperatures: torch.Tensor) -> dict[str, list[float]]:
    """The thermostat's target temperatures (K) and the barostat's target pressure (GPa) of a
    run, for dashed lines on its thermo plot (none for NVE)."""
    if cfg.ensemble == "nve":
        return {}
    out = {"temperature_K": temperatures.tolist()}
    if cfg.ensemble == "npt":
        from xnn.app.md_setup import pressure_to_internal
        from xnn.units import EV_PER_A3_TO_GPA

        gpa = pressure_to_internal(cfg.pressure, cfg.pressure_unit) * EV_PER_A3_TO_GPA
        out["pressure_GPa"] = [float(gpa)]
    return out


def _loop(cfg: MDConfig, integrator, state: MDState, outputs: _Outputs, max_t) -> MDState:
    par = outputs.par
    n_atoms, start = int(outputs.drift.n_atoms.sum()), state.step
    good, good_meta, t0 = state, outputs.meta(cfg.ensemble), time.perf_counter()
    progress = Progress(cfg.output, cfg.steps, start, "md", f"md {cfg.ensemble}",
                        outputs.enabled, cfg.timestep)
    every = cfg.output.checkpoint_every

    def speed() -> dict:
        done, el = state.step - start, max(time.perf_counter() - t0, 1e-9)
        return {"ns_day": f"{ns_per_day(done, cfg.timestep, el):.3g}",
                "atom_steps_s": f"{n_atoms * done / el:.3g}"}

    def line() -> str:
        latest = outputs.means.latest
        temps = latest.get("T", [])
        thermo = (f", T {sum(temps) / len(temps):.1f} K, Epot "
                  f"{sum(latest['epot']) / n_atoms:.6g} eV/atom" if temps else "")
        return f"{state.step * cfg.timestep / 1000:.4g} ps{thermo}"
    try:
        while state.step < cfg.steps:
            new = integrator.step(state, par.potential, cfg.timestep, reduce=par.reduce)
            try:
                _check(new, par, cfg, max_t)
            except SimulationError as err:
                raise _fail(err, good, good_meta, outputs) from None
            state = par.after_step(new)
            outputs.record_checked(state, integrator)
            if state.step % cfg.safety.check_every == 0:
                good, good_meta = state, outputs.meta(cfg.ensemble)
            if every and state.step % every == 0:
                outputs.checkpoint(state)
            progress.update(state.step, speed, line)
    finally:
        progress.close()
        outputs.close()
    if not (every and state.step % every == 0):
        outputs.checkpoint(state)
    return state
