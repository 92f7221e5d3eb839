"""What ``xnn md`` and ``xnn relax`` share: the config → device, dtype, potential → run
layer (:func:`xnn.distributed.entries.parallelize_md`) → output folder set-up, the launch
on several ranks, resuming from a checkpoint (and stopping when there is nothing left to
run), and the trajectory and checkpoint files (:class:`RunOutputs`)."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from xnn._files import atomic_write
from xnn._torch_files import check_complete
from xnn.app.md_setup import load_model
from xnn.app.modes import check_md_degrees
from xnn.config.loader import load_config, save_config
from xnn.data import keys as K
from xnn.devices import resolve_device
from xnn.distributed.entries import parallelize_md
from xnn.dynamics.checkpoint import neighbor_payload
from xnn.dynamics.safety import SimulationError, UncertaintyGuard, UncertaintyWarning
from xnn.dynamics.state import MDState
from xnn.io import md_checkpoint as ckpt
from xnn.io import sharded_checkpoint as shards
from xnn.io.run_folder import RunFolder, plan_run_folder
from xnn.io.sharded_trajectory import ShardedTrajectoryWriter
from xnn.io.trajectory import open_trajectory, write_extxyz

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# what xnn md and xnn relax write into output.dir (a previous run is recognised by these)
RUN_FILES = ("config.yaml", "checkpoint.pt", "thermo.csv", "thermo.png", "trajectory.xyz",
             "trajectory.h5", "last_good.xyz", "checkpoint_last_good.pt", "relax.csv",
             "relax_trajectory.xyz", "relax_trajectory.h5", "relaxed.xyz", "summary.json",
             "hooks", "checkpoint.pt.d", "checkpoint_last_good.pt.d", "trajectory.d",
             "relax_trajectory.d", "uncertain.xyz")
#: ``output.checkpoint_format=auto``: decomposed runs of more atoms write sharded checkpoints
SHARDED_THRESHOLD = 100_000


def results(state: MDState) -> dict:
    """The energy, forces and stress of ``state`` keyed as a trajectory frame stores them."""
    return {K.ENERGY: state.energy, K.FORCES: state.forces, K.STRESS: state.stress}


class RunOutputs:
    """The trajectory and checkpoints of an ``xnn md`` / ``xnn relax`` run, and its
    decomposition lines: files written by rank 0 only, the methods collective under domain
    decomposition (they gather the global state on rank 0).

    Args:
        cfg: the run's config (its ``output`` section). par: the run layer.
        n_atoms: atoms of the whole run (picks the trajectory format).
        meta: the checkpoint meta of a resumed run (output sizes), ``None`` when fresh.
        directory: the output folder. command: ``"md"`` or ``"relax"``.
        trajectory: the trajectory's file name without suffix.
    """

    def __init__(self, cfg, par, n_atoms: int, meta: dict | None, directory: Path,
                 command: str, trajectory: str = "trajectory"):
        self.cfg, self.par, self.dir, self.command = cfg, par, Path(directory), command
        self.enabled = par.main  # False on ranks other than 0 of a decomposed run
        self.trajectory_name = trajectory
        self.guard = UncertaintyGuard(cfg.safety.max_force_uncertainty,
                                      cfg.safety.on_uncertainty)
        self.files = (meta or {}).get("files", {})
        self.sharded = sharded_checkpoints(cfg.output.checkpoint_format, par.size, n_atoms)
        self.traj = None
        resumed = self.files.get("trajectory") if meta else None
        fmt = cfg.output.trajectory_format
        if fmt == "auto":  # a resumed run goes on in the format its trajectory has
            fmt = (self.files.get("trajectory_format") if meta else None) or (
                "sharded" if sharded_checkpoints("auto", par.size, n_atoms) else "auto")
        self.sharded_traj = fmt == "sharded"
        if self.sharded_traj and cfg.output.trajectory_every:  # every rank writes its atoms
            self.traj = ShardedTrajectoryWriter(self.dir / f"{trajectory}.d", par.rank,
                                                par.size, resumed)
        elif self.enabled and cfg.output.trajectory_every:
            self.traj = open_trajectory(self.dir, fmt, n_atoms, resumed, name=trajectory)

    def file_sizes(self) -> dict:
        """The trajectory's size, for a checkpoint's meta (rank 0 of a gathered trajectory;
        every rank of a sharded one; ``{}`` elsewhere)."""
        if self.traj is None:
            return {}
        fmt = {".d": "sharded", ".h5": "hdf5", ".xyz": "extxyz"}[self.traj.suffix]
        return {"trajectory": self.traj.position(), "trajectory_format": fmt}

    def frame(self, state: MDState, force: bool = False) -> None:
        """A trajectory frame every ``output.trajectory_every`` steps (or now: ``force``)."""
        every = self.cfg.output.trajectory_every
        if every and (force or state.step % every == 0):
            if self.sharded_traj:
                self.traj.write(state.graph, state.step, results(state))
                return
            full = self.par.gather(state)
            if self.traj is not None:
                self.traj.write(full.graph, state.step, results(full))

    def check_uncertainty(self, state: MDState, record: Callable[[], None],
                          save: Callable[[], object], velocities: bool = True) -> None:
        """The committee's uncertainty guard (``safety.max_force_uncertainty``) on ``state``,
        the same in ``xnn md`` and ``xnn relax``: a warning once per excursion (rank 0), or a
        stop that writes this step's rows and trajectory frame (``record()``),
        ``uncertain.xyz`` (``velocities``: with the state's velocities) and the checkpoint
        (``save()``), then raises a one-line :class:`SimulationError`. Collective."""
        try:
            msg = self.guard.check(state, self.par.reduce)
        except SimulationError as err:
            record()
            full = self.par.gather(state)
            if self.enabled:
                graph = full.graph if velocities else full.graph.replace(velocities=None)
                write_extxyz(self.dir / "uncertain.xyz", graph, state.step, results(full))
            save()
            where = f"{self.trajectory_name}, " if self.traj is not None else ""
            raise SimulationError(f"{err}; stopped. The frame of step {state.step} is written "
                                  f"to {where}{self.dir / 'uncertain.xyz'} and "
                                  f"{self.dir / 'checkpoint.pt'}", err.step) from None
        if msg is not None and self.enabled:
            warnings.warn(msg, UncertaintyWarning, stacklevel=3)

    def report(self, step: int) -> None:
        """With a log row: the decomposition line after ghost-plan rebuilds (torchrun)."""
        if self.cfg.output.log_rebuilds:
            self.par.report(step, self.command)

    def save(self, state: MDState, meta: dict, name: str = "checkpoint.pt",
             with_neighbors: bool = True) -> Path | None:
        """Write checkpoint ``name`` with the global state and ``meta`` (plus the run
        layer's); ``with_neighbors``: with the neighbor list of the single-process
        potential. Gathered: rank 0 writes one file. Sharded (``output.checkpoint_format``):
        every rank writes its atoms to ``name.d/``, rank 0 the index last. Returns the path
        written (rank 0; ``None`` elsewhere). Collective."""
        path = self.dir / name
        potential = self.par.checkpoint_potential if with_neighbors else None
        if self.sharded:
            return self._save_sharded(state, meta, path, potential)
        full = self.par.gather(state)
        if not self.enabled:
            return None
        ckpt.save_checkpoint(path, full, {**meta, **self.par.meta(full)}, potential)
        if shards.sharded_path(path).is_dir():  # an older sharded form would shadow nothing
            shutil.rmtree(shards.sharded_path(path))  # but confuse a reader: one form only
        return path

    def _save_sharded(self, state: MDState, meta: dict, path: Path, potential) -> Path | None:
        """Each rank's shard, then (after every rank has written) rank 0's index."""
        local, per_atom, run_meta = self.par.checkpoint_shard(state)
        generation = self.par.broadcast(shards.new_generation(state.step) if self.enabled
                                        else None)
        payload = shards.shard_payload(local, per_atom)
        shards.write_shard(path, generation, self.par.rank, payload)
        ids = local.graph.atom_id
        mine = torch.tensor([ids.numel(), int(ids.min()) if ids.numel() else -1,
                             int(ids.max()) if ids.numel() else -1], dtype=torch.int64,
                            device=ids.device)
        counts = self.par.reduce.gather_small(mine).cpu().tolist()  # every shard is written
        if not self.enabled:
            return None
        index = shards.index_payload(local, {**meta, **run_meta}, generation, counts,
                                     neighbor_payload(potential), shards.empty_shard(payload))
        folder = shards.write_index(path, index)
        path.unlink(missing_ok=True)  # a gathered file of the same name would shadow it
        return folder

    def close(self) -> None:
        if self.traj is not None:
            self.traj.close()
            self.traj = None


def sharded_checkpoints(choice: str, ranks: int, n_atoms: int) -> bool:
    """Whether a run writes sharded checkpoints: ``output.checkpoint_format`` ``sharded``,
    or ``auto`` for a run over several ranks of more than :data:`SHARDED_THRESHOLD` atoms."""
    if choice == "auto":
        return ranks > 1 and n_atoms > SHARDED_THRESHOLD
    return choice == "sharded"


def setup_run(schema, config, overrides: Sequence[str], manager=None, check=None):
    """The config (object or YAML path + dotlist overrides), device, dtype, the run's
    parallel layer (holding the potential), output folder plan (checked, nothing
    written) and model of an ``xnn md`` / ``xnn relax`` run.

    With a multi-rank ``manager`` the system is decomposed over its ranks
    (:class:`~xnn.distributed.md_run.DomainRun`: each rank owns the atoms of its box) and
    only rank 0 writes files.

    Args:
        check: ``check(cfg, model, device, several_ranks)``, run on the loaded model before
            the run layer is built (``xnn md``: what ``compile=true`` supports).
    """
    cfg = config if isinstance(config, schema) else load_config(schema, config, overrides)
    folder = plan_run_folder(cfg.output.dir, RUN_FILES, resume=cfg.resume,
                             overwrite=cfg.output.overwrite, key="output.dir",
                             overwrite_key="output.overwrite",
                             resume_hint=f"resume={Path(cfg.output.dir) / 'checkpoint.pt'}")
    if cfg.resume and Path(cfg.resume).is_file():
        check_complete(cfg.resume, "checkpoint")
    device, dtype = resolve_device(cfg.model.device), DTYPES[cfg.model.dtype]
    if manager is not None:
        device = manager.device
    model = load_model(cfg.model, device, dtype)
    if check is not None:
        check(cfg, model, device, manager is not None)
    if manager is not None:
        check_md_degrees(cfg.parallel.dd, manager.world_size)
    par = parallelize_md(model, manager, skin=cfg.model.skin,
                         backend=cfg.model.neighbor_backend, mode=cfg.parallel.mode,
                         order=cfg.parallel.order, balance=cfg.parallel.balance,
                         exchange=cfg.parallel.exchange,
                         compile=bool(getattr(cfg, "compile", False)  # xnn md only
                                      or getattr(cfg, "cuda_graph", False)),
                         model_compile=cfg.model.compile)
    return cfg, device, dtype, par, folder, model


def open_folder(cfg, folder: RunFolder, manager=None) -> Path:
    """The run is validated: create its folder (rank 0) with ``config.yaml``; returns the
    folder it writes to (the staging folder of a run that replaces a previous one)."""
    if manager is not None:
        manager.barrier()  # every rank has checked the folder before rank 0 changes it
    if manager is None or manager.is_main:
        folder.create()
        atomic_write(folder.work / "config.yaml", lambda tmp: save_config(cfg, tmp))
        if folder.staged:
            print(f"output.overwrite=true: this run is written to {folder.work} and replaces "
                  f"the previous run in {folder.final} when it completes", flush=True)
    return folder.work


def already_complete(cfg, par, folder: RunFolder, command: str, reason: str,
                     extend: str) -> Path:
    """A resumed run with nothing left to run: say so (rank 0, one line) and how to extend
    it; nothing is written. Returns the run's folder.

    Args:
        command: ``"md"`` or ``"relax"``. reason: why it is complete (``"it is at step 1000
            and steps=1000"``). extend: what extends it (``"a larger steps (e.g. ...)"``).
    """
    if par.main:
        print(f"xnn {command}: checkpoint {cfg.resume}: {reason}: the run is already "
              f"complete, nothing was run; to extend it, resume with {extend}", flush=True)
    return folder.final


def launched_on_several_ranks() -> bool:
    """Whether this process is one of several ranks of a torchrun / srun launch."""
    from xnn.distributed.manager import detect_launch

    return detect_launch().world_size > 1


def resume_state(cfg, par, device, kind: str):
    """The checkpoint's state split over the ranks and its meta: a gathered checkpoint is
    read by rank 0 and scattered; a sharded one over several ranks is read by every rank
    (:meth:`~xnn.distributed.md_run.DomainRun.scatter_shards`: each reads only shards)."""
    if par.size > 1 and shards.is_sharded(cfg.resume):
        return _resume_sharded(cfg, par, device, kind)
    state = meta = None
    with par.guarded("reading the checkpoint"):
        if par.main:
            state, meta = ckpt.load_checkpoint(cfg.resume, device, par.checkpoint_potential,
                                               kind=kind)
    meta = par.broadcast(meta)
    return par.scatter_state(state, meta), meta


def _resume_sharded(cfg, par, device, kind: str):
    """Every rank reads the index (rank 0 checks it) and then its shards."""
    index = None
    with par.guarded("reading the checkpoint"):
        if par.main:
            index = shards.read_index(cfg.resume, f"xnn {kind} checkpoint")
            ckpt.check_kind(cfg.resume, index["meta"], kind)
            index = {k: v for k, v in index.items() if k != "neighbors"}  # one process's
    index = par.broadcast(index)

    def read(ranks):
        return shards.read_state(cfg.resume, index, ranks, device)

    return par.scatter_shards(len(index["shards"]), read, index["meta"]), index["meta"]


def run_distributed(schema, config, overrides, body) -> Path:
    """Run ``body(cfg, (), manager)`` on the ranks of a torchrun / srun launch."""
    from xnn.config.parallel import TIMEOUT_KEY
    from xnn.distributed import DistributedManager
    from xnn.distributed.agreement import check_ranks_agree, run_fingerprint

    cfg = config if isinstance(config, schema) else load_config(schema, config, overrides)
    manager = DistributedManager.initialize(device=resolve_device(cfg.model.device).type,
                                            timeout_s=cfg.parallel.timeout_s,
                                            timeout_key=TIMEOUT_KEY)
    try:
        with manager.watch():  # a collective that times out: one line naming the ranks
            files = {"structure": cfg.structure, "model.file": cfg.model.file,
                     "resume": cfg.resume}
            check_ranks_agree(run_fingerprint(cfg, files))  # the first collective
            return body(cfg, (), manager)
    finally:
        manager.cleanup()
