"""``run_workflow(config)``: the application behind ``xnn run workflow.yaml``.

Every selected frame of the structure file is a system (id = its position in the selection)
that goes through the stages in order. Each stage has a *pool*: one batched integrator state
(:mod:`xnn.dynamics.slots`) advanced by one model call per step. At most ``slots`` systems
are in flight; when one finishes a stage (converged, steps done, or failed) it leaves its
pool and enters the next stage's pool at once, or leaves the campaign and the next system
of the queue takes its place (in-flight refill). The random numbers of a system are keyed
by its id, so its trajectory does not depend on its slot or on its neighbours in the batch.

A checkpoint is written after every batch step in which a system finished a stage, and
every ``output.checkpoint_every`` steps; ``resume=DIR/checkpoint.pt`` continues a killed
campaign bitwise (CPU), without running any system's stage again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from xnn.app import workflow_files as wf
from xnn.app import workflow_stages as ws
from xnn.app.md_setup import check_species, load_potential, load_structure, no_kinetic_dof
from xnn.config.loader import load_config
from xnn.config.workflow import StageConfig, WorkflowConfig
from xnn.dynamics import slots
from xnn.dynamics.checkpoint import restore_neighbor_state
from xnn.dynamics.state import MDState
from xnn.errors import InputError


@dataclasses.dataclass
class Pool:
    """The systems in one stage: their batched state, ids (in batch order), wall times (s),
    and the systems refused at entry (id: why), which leave at once with that reason."""

    stage: StageConfig
    index: int
    potential: object
    state: MDState | None = None
    ids: list[int] = dataclasses.field(default_factory=list)
    wall: dict[int, float] = dataclasses.field(default_factory=dict)
    refused: dict[int, str] = dataclasses.field(default_factory=dict)

    def add(self, state: MDState, system_id: int, wall: float = 0.0, refused: str = "") -> None:
        self.state = state if self.state is None else slots.concat([self.state, state])
        self.ids.append(system_id)
        self.wall[system_id] = wall
        if refused:
            self.refused[system_id] = refused
        self.potential.neighbors.reset()

    def keep(self, positions: list[int]) -> None:
        gone = [i for k, i in enumerate(self.ids) if k not in set(positions)]
        for i in gone:
            self.wall.pop(i)
        self.ids = [self.ids[k] for k in positions]
        self.state = slots.select(self.state, positions) if positions else None
        self.potential.neighbors.reset()


def fingerprint(cfg: WorkflowConfig, n_systems: int) -> dict:
    """The settings a resumed campaign must share with the one that wrote the checkpoint."""
    return {"structure": cfg.structure, "index": cfg.index, "n_systems": n_systems,
            "model": dataclasses.asdict(cfg.model), "slots": cfg.slots, "seed": cfg.seed,
            "stages": [dataclasses.asdict(s) for s in cfg.stages], "max_force": cfg.max_force,
            "pressure_unit": cfg.pressure_unit,
            "trajectory_every": cfg.output.trajectory_every}


class Campaign:
    """The systems, pools and files of one ``xnn run``; :meth:`run` is the loop."""

    def __init__(self, cfg: WorkflowConfig, systems: list, potential, folder: Path):
        self.cfg, self.systems, self.dir = cfg, systems, folder
        self.pools = [Pool(s, i, _copy_potential(potential, cfg)) for i, s in
                      enumerate(cfg.stages)]
        self.next_input, self.iteration, self.stages_done = 0, 0, 0
        self.results: wf.ResultsTable | None = None
        self.total = len(systems) * len(cfg.stages)

    # ------------------------------------------------------------------ start / resume
    def fresh(self) -> None:
        (self.dir / "trajectories").mkdir(exist_ok=True)
        (self.dir / "final").mkdir(exist_ok=True)
        self.results = wf.ResultsTable(self.dir / "results.csv", None)

    def resume(self, path: str, device) -> None:
        pools, meta = wf.load_campaign(path, device)
        want = fingerprint(self.cfg, len(self.systems))
        diff = [k for k in want if meta["settings"].get(k) != want[k]]
        if diff or len(pools) != len(self.pools):
            raise InputError(f"checkpoint {path} was written with other settings "
                             f"({', '.join(diff) or 'stages'}); resume with the same config")
        self.next_input, self.iteration = meta["next_input"], meta["iteration"]
        self.stages_done = meta["stages_done"]
        self.results = wf.ResultsTable(self.dir / "results.csv", meta["results_bytes"])
        for pool, saved in zip(self.pools, pools):
            if saved is None:
                continue
            pool.state, pool.ids, neighbors = saved
            pool.wall = {i: meta["wall"][str(i)] for i in pool.ids}
            restore_neighbor_state(pool.potential, neighbors, device)
        for i, size in meta["trajectories"].items():
            wf.truncate(self._traj(int(i)), size)

    def save(self) -> None:
        in_flight = [i for p in self.pools for i in p.ids]
        meta = {"settings": fingerprint(self.cfg, len(self.systems)),
                "next_input": self.next_input, "iteration": self.iteration,
                "stages_done": self.stages_done, "results_bytes": self.results.position(),
                "wall": {str(i): p.wall[i] for p in self.pools for i in p.ids},
                "trajectories": {str(i): self._traj(i).stat().st_size for i in in_flight
                                 if self._traj(i).is_file()}}
        wf.save_campaign(self.dir / "checkpoint.pt", self.pools, meta)

    # ------------------------------------------------------------------ refill
    def in_flight(self) -> int:
        return sum(len(p.ids) for p in self.pools)

    def enter(self, index: int, graph, system_id: int) -> None:
        """Start stage ``index`` for one system (a single-system graph) and add it to its pool
        (refused, to fail at once, when the stage asks a temperature > 0 of a system without
        kinetic degrees of freedom: the check of ``xnn md``)."""
        pool = self.pools[index]
        t0 = time.perf_counter()
        asked = torch.tensor([ws.asked_temperature(pool.stage, graph)])
        problem = no_kinetic_dof(graph, asked)
        state = ws.start(pool.stage, index, graph, pool.potential, system_id, self.cfg.seed,
                         self.cfg.pressure_unit)
        self._frames(pool, state, [0], [system_id], new=index == 0)
        pool.add(state, system_id, time.perf_counter() - t0, problem[1] if problem else "")

    def admit(self) -> bool:
        """Refill free slots with the next systems of the queue (stage 0)."""
        added = False
        while self.in_flight() < self.cfg.slots and self.next_input < len(self.systems):
            i = self.next_input
            self.next_input += 1
            self.enter(0, self.systems[i], i)
            added = True
        return added

    def retire(self) -> bool:
        """Move every system done with its stage to the next stage (or out); True if any."""
        moved = False
        for pool in self.pools:
            if pool.state is None:
                continue
            done, conv, failed = ws.status(pool.stage, pool.state, self.cfg.max_force)
            if pool.refused:
                refused = torch.tensor([i in pool.refused for i in pool.ids], device=done.device)
                done, conv, failed = done | refused, conv & ~refused, failed | refused
            if not bool(done.any()):
                continue
            moved = True
            pos = torch.nonzero(done).flatten().tolist()
            self._finish(pool, pos, conv, failed)
            pool.keep([k for k in range(len(pool.ids)) if not bool(done[k])])
        return moved

    def _finish(self, pool: Pool, pos: list[int], conv, failed) -> None:
        state = slots.select(pool.state, pos)
        ids = [pool.ids[k] for k in pos]
        own = slots.own_steps(state).tolist()
        every = self._every(pool.stage)
        last = [j for j, n in enumerate(own) if n and not (every and n % every == 0)]
        if last:
            self._frames(pool, state, last, ids)
        values = ws.row_values(pool.stage, state)
        rows = []
        for j, (i, k) in enumerate(zip(ids, pos)):
            rows.append({"id": i, "stage_index": pool.index, "stage": pool.stage.name,
                         "type": pool.stage.type,
                         "status": "failed" if bool(failed[k]) else "ok",
                         "converged": bool(conv[k]),
                         "n_atoms": int((state.graph.batch == j).sum()),
                         "wall_s": round(pool.wall[i], 6),
                         "reason": pool.refused.pop(i, "") or _reason(state, j, failed[k]),
                         **{c: v[j] for c, v in values.items()}})
        self.results.append(rows)
        self.stages_done += len(rows)
        nxt = pool.index + 1
        for j, (i, k) in enumerate(zip(ids, pos)):
            one = slots.select(state, [j])
            if nxt < len(self.pools) and not bool(failed[k]):
                self.enter(nxt, one.graph, i)
            else:
                self.stages_done += 0 if nxt >= len(self.pools) else len(self.pools) - nxt
                wf.write_final(self.dir, i, self._texts(pool, one, [0], [i])[0])

    def settle(self) -> bool:
        """Retire and refill until nothing changes; True if anything did."""
        changed = False
        while True:
            moved = self.retire()
            added = self.admit()
            if not (moved or added):
                return changed
            changed = True

    # ------------------------------------------------------------------ the loop
    def run(self, bar) -> None:
        every, log_every = self.cfg.output.checkpoint_every, self.cfg.output.log_every
        saved = None
        while True:
            changed = self.settle()
            if saved != self.iteration and (changed or (every and self.iteration % every == 0)):
                self.save()
                saved = self.iteration
            bar.update(self.stages_done - bar.n)
            if self.in_flight() == 0:
                break
            self.step()
            if self.iteration % log_every == 0:
                bar.write(self.log_line())

    def step(self) -> None:
        """One step of every non-empty pool, then the frames due."""
        self.iteration += 1
        for pool in self.pools:
            if pool.state is None:
                continue
            t0 = time.perf_counter()
            pool.state = ws.advance(pool.stage, pool.state, pool.potential)
            dt = time.perf_counter() - t0
            for i in pool.ids:
                pool.wall[i] += dt
            every = self._every(pool.stage)
            if every:
                own = slots.own_steps(pool.state).tolist()
                due = [k for k, n in enumerate(own) if n % every == 0]
                if due:
                    self._frames(pool, pool.state, due, [pool.ids[k] for k in due])

    def log_line(self) -> str:
        pools = ", ".join(f"{p.stage.name} {len(p.ids)}" for p in self.pools)
        return (f"xnn run: step {self.iteration}: {self.in_flight()} in flight ({pools}); "
                f"{self.stages_done}/{self.total} stages done, {self.next_input}/"
                f"{len(self.systems)} systems started")

    # ------------------------------------------------------------------ frames
    def _every(self, stage: StageConfig) -> int:
        e = stage.trajectory_every
        return self.cfg.output.trajectory_every if e is None else e

    def _traj(self, system_id: int) -> Path:
        return self.dir / "trajectories" / wf.system_name(system_id)

    def _texts(self, pool: Pool, state: MDState, pos: list[int], ids: list[int]) -> list[str]:
        from xnn.data import keys as K
        from xnn.data.ase_io import to_ase

        sub = slots.select(state, pos)
        g = ws.carried(sub.graph).replace(
            {K.ENERGY: sub.energy, K.FORCES: sub.forces, K.STRESS: sub.stress})
        own = slots.own_steps(sub).tolist()
        info = [{"system_id": i, "stage": pool.stage.name, "stage_index": pool.index,
                 "stage_type": pool.stage.type, "step": n} for i, n in zip(ids, own)]
        return wf.frame_text(to_ase(g), info)

    def _frames(self, pool: Pool, state: MDState, pos: list[int], ids: list[int],
                new: bool = False) -> None:
        for i, text in zip(ids, self._texts(pool, state, pos, ids)):
            wf.append_text(self._traj(i), text, new)


def _reason(state: MDState, j: int, failed) -> str:
    """Why system ``j`` of ``state`` failed ("" when it did not)."""
    if not bool(failed):
        return ""
    fm = float(ws.max_force(state)[j])
    if not (torch.isfinite(state.energy[j]) and fm == fm and fm != float("inf")):
        return "non-finite energy or forces"
    return f"force {fm:.3g} eV/A above max_force"


def _copy_potential(potential, cfg: WorkflowConfig):
    """A potential of the same model with its own neighbor list (one per pool)."""
    from xnn.models import Potential

    return Potential(potential.model, skin=cfg.model.skin, backend=cfg.model.neighbor_backend,
                     compile=cfg.model.compile)


def read_systems(cfg: WorkflowConfig, potential, device, dtype) -> list:
    """One single-system graph per selected frame, atom ids ``0..n-1`` in each."""
    from xnn.data import keys as K
    from xnn.data.graph import AtomicGraph

    graph = load_structure(cfg.structure, cfg.index, device, dtype)
    check_species(potential, graph)
    ptr = graph.ptr.tolist()
    out = []
    for s in range(graph.n_systems):  # slices: linear in the number of atoms
        lo, hi = ptr[s], ptr[s + 1]
        fields = {k: v[lo:hi] if K.scope_of(k) == K.ATOM else v[s:s + 1]
                  for k, v in graph.fields.items() if K.scope_of(k) in (K.ATOM, K.SYSTEM)}
        fields[K.BATCH] = torch.zeros(hi - lo, dtype=torch.long, device=device)
        fields[K.ATOM_ID] = torch.arange(hi - lo, device=device)
        out.append(AtomicGraph(fields, validate=False))
    check_systems(cfg, out)
    return out


def check_systems(cfg: WorkflowConfig, systems: list) -> None:
    """Refuse, before anything runs, a system that a stage cannot take: a cell stage
    (``npt``, ``relax_cell``) needs a cell periodic along all axes, ``npt`` no fixed atoms."""
    from xnn.data import keys as K

    for i, stage in enumerate(cfg.stages):
        cell = stage.type == "npt" or bool(stage.relax_cell)
        for sid, g in enumerate(systems):
            if cell and not bool(g.pbc.all()):
                raise InputError(f"stages.{i} ({stage.name}) changes the cell, but system "
                                 f"{sid} of {cfg.structure} is not periodic along all axes; "
                                 "select periodic frames only (index=...)")
            if stage.type == "npt" and K.FIXED in g and bool(g[K.FIXED].any()):
                raise InputError(f"stages.{i} ({stage.name}) is npt, but system {sid} has "
                                 "fixed atoms (a barostat cannot move them)")


def summary(cfg: WorkflowConfig, folder: Path, n_systems: int, wall: float) -> dict:
    """``summary.json``: per stage the systems done, converged and failed, mean steps."""
    rows = wf.read_results(folder / "results.csv")
    stages = []
    for i, st in enumerate(cfg.stages):
        mine = [r for r in rows if int(r["stage_index"]) == i]
        steps = [int(r["steps"]) for r in mine]
        stages.append({"name": st.name, "type": st.type, "systems": len(mine),
                       "converged": sum(r["converged"] == "True" for r in mine),
                       "failed": sum(r["status"] == "failed" for r in mine),
                       "mean_steps": sum(steps) / len(steps) if steps else 0.0})
    failed = sorted({int(r["id"]) for r in rows if r["status"] == "failed"})
    atom_steps = sum(int(r["steps"]) * int(r["n_atoms"]) for r in rows)
    return {"command": "run", "systems": n_systems, "slots": cfg.slots, "stages": stages,
            "failed_ids": failed, "completed": n_systems - len(failed),
            "wall_s": round(wall, 3), "atom_steps": atom_steps,
            "atom_steps_per_s": round(atom_steps / wall, 1) if wall > 0 else None,
            "results": "results.csv", "final": "final.xyz"}


def run_workflow(config: WorkflowConfig | str | Path, overrides: Sequence[str] = ()) -> Path:
    """Run every selected structure through the workflow's stages, batched with refill.

    Args:
        config: a :class:`WorkflowConfig` or a YAML path (then ``overrides``: ``key=value``).
    Returns:
        the run folder (``results.csv``, ``summary.json``, ``final.xyz``, trajectories).
    """
    from tqdm import tqdm

    from xnn._files import atomic_write
    from xnn.app.md_common import DTYPES
    from xnn.config.loader import save_config
    from xnn.io.calculator import resolve_device
    from xnn.io.run_folder import plan_run_folder

    cfg = config if isinstance(config, WorkflowConfig) else load_config(
        WorkflowConfig, config, overrides)
    folder = plan_run_folder(cfg.output.dir, wf.RUN_FILES, resume=cfg.resume,
                             overwrite=cfg.output.overwrite, key="output.dir",
                             overwrite_key="output.overwrite",
                             resume_hint=f"resume={Path(cfg.output.dir) / 'checkpoint.pt'}")
    device, dtype = resolve_device(cfg.model.device), DTYPES[cfg.model.dtype]
    potential = load_potential(cfg.model, device, dtype)
    systems = read_systems(cfg, potential, device, dtype)
    campaign = Campaign(cfg, systems, potential, folder.work)
    if cfg.resume:
        campaign.resume(cfg.resume, device)
    else:
        folder.create()
        atomic_write(folder.work / "config.yaml", lambda tmp: save_config(cfg, tmp))
        campaign.fresh()
    t0 = time.perf_counter()
    print(f"xnn run: {len(systems)} systems through {' -> '.join(s.name for s in cfg.stages)}"
          f", {cfg.slots} slots, on {device}" + (f" (resumed at batch step "
                                                  f"{campaign.iteration})" if cfg.resume else ""),
          flush=True)
    bar = tqdm(total=campaign.total, initial=campaign.stages_done, desc="run", unit="stage",
               dynamic_ncols=True, disable=None if cfg.output.progress else True,
               mininterval=0.5)
    try:
        campaign.run(bar)
    finally:
        bar.close()
    wf.gather_final(folder.work, len(systems))
    info = summary(cfg, folder.work, len(systems), time.perf_counter() - t0)
    atomic_write(folder.work / "summary.json",
                 lambda tmp: tmp.write_text(json.dumps(info, indent=2) + "\n"))
    folder.commit()
    n_failed = len(info["failed_ids"])
    if n_failed:
        print(f"xnn run: {n_failed} of {len(systems)} systems failed (status=failed in "
              "results.csv)")
    return folder.final
