"""One ``xnn run`` campaign (of one rank's share under torchrun): the stages' pools of
slots, the queue, refill and retirement, the loop, its rows, frames and checkpoints.

Each stage has a *pool*: one batched integrator state (:mod:`xnn.dynamics.slots`) advanced
by one model call per step. At most ``slots`` systems are in flight; when one finishes a
stage (converged, steps done, or failed) it leaves its pool and enters the next stage's
pool at once, or leaves the campaign and the next system of the queue takes its place
(in-flight refill). A checkpoint is written after every batch step in which a system
finished a stage, and every ``output.checkpoint_every`` steps.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from xnn.app import workflow_files as wf
from xnn.app import workflow_ranks as wr
from xnn.app import workflow_stages as ws
from xnn.app.md_setup import no_kinetic_dof
from xnn.app.workflow_guard import SystemGuards
from xnn.config.workflow import StageConfig, WorkflowConfig
from xnn.distributed import collectives as C
from xnn.dynamics import slots
from xnn.dynamics.checkpoint import restore_neighbor_state
from xnn.dynamics.state import MDState
from xnn.errors import InputError


@dataclasses.dataclass
class Pool:
    """The systems in one stage: their batched state, ids (in batch order), wall times (s),
    the systems refused at entry (id: why), which leave at once with that reason, and their
    uncertainty guards (``safety.max_force_uncertainty``)."""

    stage: StageConfig
    index: int
    potential: object
    guards: SystemGuards
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
            "trajectory_every": cfg.output.trajectory_every,
            # only when set: a campaign without the guard resumes checkpoints older than it
            **({"safety": dataclasses.asdict(cfg.safety)}
               if cfg.safety.max_force_uncertainty is not None else {})}


def check_settings(cfg: WorkflowConfig, n_systems: int, path, meta: dict, n_pools: int) -> None:
    """Refuse a checkpoint (``meta``, ``n_pools`` stages) written with other settings."""
    want = fingerprint(cfg, n_systems)
    diff = [k for k in want if meta["settings"].get(k) != want[k]]
    if diff or n_pools != len(cfg.stages):
        raise InputError(f"checkpoint {path} was written with other settings "
                         f"({', '.join(diff) or 'stages'}); resume with the same config")


class Campaign:
    """The systems, pools and files of one ``xnn run`` (of one rank's share under torchrun:
    :mod:`xnn.app.workflow_ranks`); :meth:`run` is the loop.

    Args:
        systems: ``{id: single-system graph}`` of the systems this process runs.
        n_systems: the number of systems of the whole campaign.
        ranks: this process's rank, the number of ranks and the run folder.
    """

    def __init__(self, cfg: WorkflowConfig, systems: dict, n_systems: int, potential,
                 ranks: wr.Ranks):
        self.cfg, self.systems, self.n_systems, self.ranks = cfg, systems, n_systems, ranks
        self.dir, self.queue = ranks.folder, sorted(systems)
        self.pools = [Pool(s, i, _copy_potential(potential, cfg),
                           SystemGuards(cfg.safety.max_force_uncertainty,
                                        cfg.safety.on_uncertainty, s.name))
                      for i, s in enumerate(cfg.stages)]
        self.next_input, self.iteration, self.stages_done = 0, 0, 0
        self.results: wf.ResultsTable | None = None

    # ------------------------------------------------------------------ start / resume
    def fresh(self) -> None:
        (self.dir / "trajectories").mkdir(exist_ok=True)
        (self.dir / "final").mkdir(exist_ok=True)
        self.results = wf.ResultsTable(self.ranks.results(), None)

    def resume(self, path: str, device) -> None:
        """Continue from this rank's checkpoint (``path``: the campaign's checkpoint.pt)."""
        path = str(self.ranks.checkpoint(resume=path))
        pools, meta = wf.load_campaign(path, device)
        check_settings(self.cfg, self.n_systems, path, meta, len(pools))
        self.next_input, self.iteration = meta["next_input"], meta["iteration"]
        self.stages_done = meta["stages_done"]
        self.results = wf.ResultsTable(self.ranks.results(), meta["results_bytes"])
        for pool, saved in zip(self.pools, pools):
            if saved is None:
                continue
            pool.state, pool.ids, neighbors = saved
            pool.wall = {i: meta["wall"][str(i)] for i in pool.ids}
            pool.guards.load({k: v for k, v in meta.get("guards", {}).items()
                              if int(k) in pool.ids})
            restore_neighbor_state(pool.potential, neighbors, device)
        for i, size in meta["trajectories"].items():
            wf.truncate(self._traj(int(i)), size)

    def take_over(self, hand: wr.Handover) -> None:
        """Continue the in-flight systems of ``hand`` (from a campaign on another number of
        ranks) in new files; rank 0 copies the finished rows into the new generation."""
        self.iteration = hand.iteration
        for pool, saved in zip(self.pools, hand.pools):
            if saved is not None:
                pool.state, pool.ids, wall = saved
                pool.wall = dict(zip(pool.ids, wall))
                pool.guards.load({k: v for k, v in hand.guards.items() if int(k) in pool.ids})
        for i, size in hand.trajectories.items():
            wf.truncate(self._traj(i), size)
        self.ranks.results().parent.mkdir(exist_ok=True)  # ranks/: after one process's files
        if self.ranks.main:
            rows = [r for path, size in hand.tables for r in wf.read_rows(path, size)]
            wf.write_rows(self.ranks.done(), rows)
            self.stages_done = wf.stages_done(rows, len(self.pools))
        self.results = wf.ResultsTable(self.ranks.results(), None)

    def save(self) -> None:
        in_flight = [i for p in self.pools for i in p.ids]
        meta = {"settings": fingerprint(self.cfg, self.n_systems),
                "next_input": self.next_input, "iteration": self.iteration,
                "stages_done": self.stages_done, "results_bytes": self.results.position(),
                "wall": {str(i): p.wall[i] for p in self.pools for i in p.ids},
                "guards": {k: v for p in self.pools for k, v in p.guards.state_dict(p.ids).items()},
                "trajectories": {str(i): self._traj(i).stat().st_size for i in in_flight
                                 if self._traj(i).is_file()}}
        wf.save_campaign(self.ranks.checkpoint(), self.pools, meta)

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
        while self.in_flight() < self.cfg.slots and self.next_input < len(self.queue):
            i = self.queue[self.next_input]
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
            stops = pool.guards.check(pool.state, pool.ids)
            if pool.refused or stops:
                out = torch.tensor([i in pool.refused or k in stops
                                    for k, i in enumerate(pool.ids)], device=done.device)
                done, conv, failed = done | out, conv & ~out, failed | out
            if not bool(done.any()):
                continue
            moved = True
            pos = torch.nonzero(done).flatten().tolist()
            self._finish(pool, pos, conv, failed, stops)
            pool.keep([k for k in range(len(pool.ids)) if not bool(done[k])])
        return moved

    def _finish(self, pool: Pool, pos: list[int], conv, failed, stops: dict[int, str]) -> None:
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
                         "reason": _why(pool, i, stops.get(k), _reason(state, j, failed[k])),
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
                text = self._texts(pool, one, [0], [i])[0]
                wf.write_final(self.dir, i, text)
                if k in stops:
                    wf.write_final(self.dir, i, text, "uncertain")

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
    def run(self, bar, device, started=None) -> None:
        """Step, retire and refill until every system (of every rank) is done.

        Under torchrun the ranks meet once per batch step (whether a rank failed, then the
        counts of :meth:`counts`), so ``bar`` and the log lines (rank 0) follow the whole
        campaign, and every rank leaves the loop at the same step.

        Args:
            started: called once every rank has written its first checkpoint.
        """
        every, log_every = self.cfg.output.checkpoint_every, self.cfg.output.log_every
        step = wr.all_max(self.iteration, device)  # the campaign's batch step, on every rank
        saved, stepped = None, False
        while True:
            with C.guarded(None, f"batch step {step} of xnn run"):
                if stepped and self.in_flight():
                    self.step()
                changed = self.settle()
                if saved is None or saved != self.iteration and (
                        changed or (every and self.iteration % every == 0)):
                    self.save()
                    saved = self.iteration
            counts = self.counts(device)
            if started is not None:
                started()
                started = None
            bar.update(counts["done"] - bar.n)
            if stepped and step % log_every == 0 and self.ranks.main:
                bar.write(self.log_line(step, counts))
            if counts["in_flight"] + counts["queued"] == 0:
                break
            stepped, step = True, step + 1

    def counts(self, device) -> dict:
        """Stages done, systems in flight (and per stage), queued and started, summed over
        the ranks."""
        pools = [len(p.ids) for p in self.pools]
        values = wr.all_sum([self.stages_done, self.in_flight(),
                             len(self.queue) - self.next_input, *pools], device)
        return dict(zip(("done", "in_flight", "queued"), values)) | {
            "started": self.n_systems - values[2], "pools": values[3:]}

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

    def log_line(self, step: int, counts: dict) -> str:
        pools = ", ".join(f"{p.stage.name} {n}" for p, n in zip(self.pools, counts["pools"]))
        return (f"xnn run: step {step}: {counts['in_flight']} in flight ({pools}); "
                f"{counts['done']}/{self.n_systems * len(self.pools)} stages done, "
                f"{counts['started']}/{self.n_systems} systems started")

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


def _why(pool: Pool, system_id: int, stop: str | None, failure: str) -> str:
    """The reason of a system's row: refused at entry, stopped by the uncertainty guard,
    failed, or the note of its guard's warnings (the system leaves the pool's guards)."""
    note = pool.guards.leave(system_id)
    return pool.refused.pop(system_id, "") or stop or failure or note


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
