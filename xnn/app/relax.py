"""``run_relax(config)``: the application behind ``xnn relax``.

FIRE (batched, optionally with the cell) writes ``relax.csv``, the relaxation trajectory,
``relaxed.xyz``, ``checkpoint.pt`` and ``summary.json`` under ``output.dir``, and resumes from
``resume=checkpoint.pt`` bitwise on CPU (with the checkpoint's model and settings,
:mod:`xnn.app.md_resume`). It ends with one line: systems converged, the largest force,
speed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from xnn.app.md_common import (
    RunOutputs,
    already_complete,
    launched_on_several_ranks,
    open_folder,
    results,
    run_distributed,
    setup_run,
)
from xnn.app.md_hooks import RunHooks, hook_failed, hooks_from_config
from xnn.app.md_progress import (
    Progress,
    relax_summary,
    relax_summary_line,
    wall_clock,
    write_summary,
)
from xnn.app.md_resume import check_resume, relax_settings, resume_identity
from xnn.app.md_setup import (
    check_species,
    check_uncertainty,
    load_structure,
    pressure_to_internal,
)
from xnn.config.md import RelaxConfig
from xnn.dynamics import fire
from xnn.dynamics.hooks import HookError
from xnn.dynamics.safety import (
    check_forces,
)
from xnn.dynamics.state import MDState
from xnn.dynamics.thermo import UNCERTAINTY_COLUMNS, uncertainty_columns
from xnn.errors import DataFileError, InputError
from xnn.io import md_checkpoint as ckpt
from xnn.io.trajectory import write_extxyz


class _RelaxLog:
    """``relax.csv``, one row per system per logged step, appended as the run goes.

    Args:
        path: CSV file.
        truncate_to: on resume, the size (bytes) to cut the file to; ``None``: a new file.
    """

    HEADER = "step,system,energy_eV,fmax_eV_A,volume_A3\n"

    def __init__(self, path: Path, truncate_to: int | None, committee: bool = False):
        self.path = path
        if truncate_to is None:
            extra = "".join("," + c for c in UNCERTAINTY_COLUMNS) if committee else ""
            path.write_text(self.HEADER[:-1] + extra + "\n")
        elif not path.is_file() or path.stat().st_size < truncate_to:
            raise DataFileError(f"cannot resume: {path} is missing or shorter than the "
                                "checkpoint says")
        else:
            os.truncate(path, truncate_to)

    def write(self, state: MDState, fm: torch.Tensor,
              uncertainty: dict[str, torch.Tensor] | None = None) -> None:
        """One row per system; ``uncertainty``: a committee's
        :func:`~xnn.dynamics.thermo.uncertainty_columns`, appended in their order."""
        cols = [state.energy.tolist(), fm.tolist(), state.graph.volume().tolist(),
                *(uncertainty[c].tolist() for c in UNCERTAINTY_COLUMNS if uncertainty)]
        with open(self.path, "a") as fh:
            fh.writelines(f"{state.step},{s}," + ",".join(repr(float(v)) for v in row) + "\n"
                          for s, row in enumerate(zip(*cols)))

    def position(self) -> int:
        return self.path.stat().st_size


class _RelaxOutputs(RunOutputs):
    """``relax.csv``, the relaxation trajectory, ``checkpoint.pt`` and decomposition lines
    of one relaxation (files written by rank 0; the methods are collective under domain
    decomposition)."""

    def __init__(self, cfg: RelaxConfig, par, n_atoms: int, meta: dict | None,
                 directory: Path, identity: dict | None):
        super().__init__(cfg, par, n_atoms, meta, directory, "relax", "relax_trajectory")
        self.log = None
        self.hooks: RunHooks | None = None  # set by _run_relax
        self.identity = identity  # the model and settings, checked on resume (rank 0)
        if self.enabled:
            self.log = _RelaxLog(self.dir / "relax.csv", self.files.get("log_bytes"),
                                 par.model.committee_size > 1)

    def meta(self, done: torch.Tensor) -> dict:
        """The checkpoint meta: model and settings, per-system convergence, output sizes
        (before this step's rows and frame, which a resumed run writes again)."""
        files = {"log_bytes": self.log.position(), **self.file_sizes()} if self.enabled \
            else {}
        out = {"kind": "relax", "resume_check": self.identity,
               "converged": done.tolist(), "files": files}
        if self.hooks:
            out.update(self.hooks.meta())
        return out

    def record(self, state: MDState, fm: torch.Tensor, force: bool,
               frame: bool = False) -> None:
        """The rows (every ``log_every`` steps, or now: ``force``), the trajectory frame
        (every ``trajectory_every`` steps, or now: ``frame``) and hooks of ``state``."""
        if force or state.step % self.cfg.output.log_every == 0:
            spread = uncertainty_columns(state.graph, self.par.reduce)  # collective
            if self.log is not None:
                self.log.write(state, fm, spread)
            self.report(state.step)
        self.frame(state, frame)
        if self.hooks:
            self.hooks(state)

    def record_checked(self, state: MDState, fm: torch.Tensor, force: bool,
                       meta: dict) -> None:
        """:meth:`record` after the committee's uncertainty guard (``safety.
        max_force_uncertainty``), as in ``xnn md``: a warning once per excursion (rank 0),
        or a stop that first writes this step's rows, trajectory frame, ``uncertain.xyz``
        and ``checkpoint.pt`` (with ``meta``, the sizes before the rows, as every relaxation
        checkpoint). Collective."""
        self.check_uncertainty(state, lambda: self.record(state, fm, force=True, frame=True),
                               lambda: self.save(state, meta), velocities=False)
        self.record(state, fm, force)


def _check_relax_resume(cfg: RelaxConfig, state: MDState, meta: dict, graph,
                        identity: dict) -> None:
    if state.n_systems != graph.n_systems or not torch.equal(state.graph.numbers,
                                                             graph.numbers):
        raise InputError(f"checkpoint {cfg.resume} holds {state.n_systems} structures "
                         f"({state.graph.n_atoms} atoms), but structure={cfg.structure} "
                         f"index={cfg.index} selects {graph.n_systems} ({graph.n_atoms} atoms)")
    check_resume(cfg, meta, identity, "relax")


def _relax_start(cfg: RelaxConfig, par, device, dtype, model):
    """The FIRE state (fresh, or from ``cfg.resume``), the checkpoint meta (``None``: fresh)
    and the run's identity (model fingerprint and settings; rank 0)."""
    graph = state = meta = identity = None
    with par.guarded("reading the structure"):
        if par.main:
            graph = load_structure(cfg.structure, cfg.index, device, dtype)
            check_species(par.model, graph)
            identity = resume_identity(cfg, model, relax_settings(cfg))
            if cfg.resume:
                state, meta = ckpt.load_checkpoint(cfg.resume, device,
                                                   par.checkpoint_potential, kind="relax")
                _check_relax_resume(cfg, state, meta, graph, identity)
    if cfg.resume:
        meta = par.broadcast(meta)
        return par.scatter_state(state, meta), meta, identity
    graph = par.scatter_graph(graph)
    return fire.init(graph, par.potential, relax_cell=cfg.relax_cell, maxstep=cfg.maxstep,
                     pressure=pressure_to_internal(cfg.pressure, cfg.pressure_unit),
                     reduce=par.reduce), None, identity


def _complete(cfg: RelaxConfig, par, folder, state: MDState) -> Path | None:
    """A resumed relaxation with nothing left to do (every system below ``fmax``, or
    ``max_steps`` reached): say so and return its folder; ``None``: there is. Collective."""
    done = fire.fmax(state, par.reduce) < cfg.fmax
    if bool(done.all()):
        return already_complete(cfg, par, folder, "relax", f"every system is below "
                                f"fmax={cfg.fmax} eV/Å at step {state.step}",
                                "a smaller fmax")
    if state.step >= cfg.max_steps:
        return already_complete(cfg, par, folder, "relax", f"it is at step {state.step} "
                                f"and max_steps={cfg.max_steps} ({int(done.sum())} of "
                                f"{state.n_systems} systems converged)", "a larger max_steps "
                                f"(e.g. max_steps={state.step + max(cfg.max_steps, 1)})")
    return None


def run_relax(config: RelaxConfig | str | Path, overrides: Sequence[str] = (),
              hooks: Sequence = ()) -> Path:
    """Relax every selected frame with FIRE (batched); writes ``relaxed.xyz``, ``relax.csv``,
    ``checkpoint.pt`` (every ``output.checkpoint_every`` steps and at the end) and
    ``summary.json``, and prints a summary line.

    With ``resume=checkpoint.pt`` (same output folder, model and settings) the relaxation
    continues (up to the new ``max_steps``, or to a smaller ``fmax``) and its outputs are
    bitwise identical to an uninterrupted run on CPU; a relaxation with nothing left to do
    says so and writes nothing.
    Launched on several ranks (torchrun), the system (one) is decomposed as in ``xnn md``.

    Args:
        hooks: observers run with those of the config's ``hooks:`` list (as in ``run_md``;
            ``time_fs`` is NaN).

    Returns:
        the output folder.
    """
    if launched_on_several_ranks():
        return run_distributed(RelaxConfig, config, overrides,
                               functools.partial(_run_relax, extra_hooks=hooks))
    return _run_relax(config, overrides, None, hooks)


def _run_relax(config, overrides: Sequence[str], manager, extra_hooks: Sequence = ()) -> Path:
    began = wall_clock()
    cfg, device, dtype, par, folder, model = setup_run(RelaxConfig, config, overrides, manager)
    check_uncertainty(cfg, par.model)
    hooks = [*hooks_from_config(cfg.hooks), *extra_hooks]
    state, meta, identity = _relax_start(cfg, par, device, dtype, model)
    if meta is not None:
        complete = _complete(cfg, par, folder, state)
        if complete is not None:
            return complete
    run_hooks = RunHooks(hooks, par, None, meta)
    state = run_hooks.prepare(state)  # checked before any file; per-atom fields added
    out_dir = open_folder(cfg, folder, manager)
    n_atoms = int(par.reduce.count_per_system(state.graph.batch, state.n_systems).sum())
    outputs = _RelaxOutputs(cfg, par, n_atoms, meta, out_dir, identity)
    # a relaxation checkpoint is taken before its step's rows: keep the rows before it
    outputs.hooks = run_hooks.open(out_dir, None if meta is None else state.step - 1)
    start, t0 = state.step, wall_clock()
    state = _relax_loop(cfg, state, outputs)
    loop_s = wall_clock() - t0
    full = par.gather(state)
    if par.main:
        write_extxyz(out_dir / "relaxed.xyz", full.graph.replace(velocities=None), state.step,
                     results(full))
    fm = fire.fmax(state, par.reduce).tolist()
    figures = relax_summary(cfg, fm, n_atoms, start, state.step, loop_s, wall_clock() - began)
    if write_summary(out_dir / "summary.json", par, figures) is not None:
        print(relax_summary_line(figures), flush=True)
    if par.main:
        folder.commit()
    return folder.final


def _postfix(fm: torch.Tensor) -> dict:
    return {"fmax": f"{float(fm.max()):.3g}"}


def _progress_line(fm: torch.Tensor, done: torch.Tensor, step: int) -> str:
    return (f"{int(done.sum())} of {done.numel()} systems converged, largest force "
            f"{float(fm.max()):.3g} eV/Å (step {step})")


def _relax_loop(cfg: RelaxConfig, state: MDState, outputs: _RelaxOutputs) -> MDState:
    """FIRE steps until every system is below ``cfg.fmax`` or ``cfg.max_steps``; checkpoints
    are taken at the top of a step, before its rows are written."""
    every, start, saved, par = cfg.output.checkpoint_every, state.step, None, outputs.par
    progress = Progress(cfg.output, cfg.max_steps, start, "relax", "relax", par.main)
    try:
        while True:
            fm = fire.fmax(state, par.reduce)
            done = fm < cfg.fmax
            meta = outputs.meta(done)
            if every and state.step % every == 0 and state.step != start:
                outputs.save(state, meta)
                saved = state.step
            try:
                outputs.record_checked(state, fm, bool(done.all()), meta)
            except HookError as err:  # checkpoint before the rows: resumed, they run again
                outputs.save(state, meta)
                raise hook_failed(err, outputs.dir / "checkpoint.pt") from err
            if bool(done.all()) or state.step >= cfg.max_steps:
                break
            check_forces(state, float("inf"), par.reduce)
            state = fire.step(state, par.potential, cfg.fmax, reduce=par.reduce)
            state = par.after_step(state)
            progress.update(state.step, functools.partial(_postfix, fm),
                            functools.partial(_progress_line, fm, done, state.step - 1))
    finally:
        progress.close()
        outputs.close()
    if saved != state.step:
        outputs.save(state, meta)
    return state
