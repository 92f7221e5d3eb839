"""Domain decomposition applied from outside to an ``xnn md`` / ``xnn relax`` run.

:class:`DomainRun` wraps a :class:`~xnn.distributed.domain.DomainPotential`: rank 0 reads the
structure (or the checkpoint, which holds the global state by atom id) and scatters it, each
rank integrates its owned atoms with the cross-rank reducer, atoms migrate after every step,
and states are gathered on rank 0 (in global-id order) for output and checkpoints. The
runner calls the same methods on :class:`~xnn.dynamics.parallel.SerialRun` in one process.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.potential import DomainPotential
from xnn.dynamics.parallel import SerialRun
from xnn.dynamics.state import MDState
from xnn.errors import InputError


class DomainRun(SerialRun):
    """Several ranks, each owning the atoms of its box (see the module docstring).

    Args:
        model: the model of the loaded potential (with ``cutoff``).
        manager: the run's :class:`~xnn.distributed.DistributedManager`.
        skin: Verlet skin (Å). backend: neighbor-list backend.
    """

    def __init__(self, model, manager, skin: float, backend: str):
        self.potential = DomainPotential(model, manager, skin=skin, mode="auto",
                                         backend=backend)
        self.reduce = self.potential.reducer
        self.main = manager.is_main
        self.size, self.rank = manager.world_size, manager.rank
        self.checkpoint_potential = None  # the ghost plan is rebuilt on resume
        self._owner = None

    def guarded(self, phase: str):
        return C.guarded(None, phase)

    def broadcast(self, obj):
        return C.broadcast_object(obj)

    def scatter_graph(self, graph):
        """This rank's owned atoms of rank 0's ``graph`` (one system)."""
        with C.guarded(None, "checking the structure"):
            if self.main and graph.n_systems != 1:
                raise InputError(f"a decomposed run (torchrun) simulates one system, the "
                                 f"structure selects {graph.n_systems}; pick one frame "
                                 "(index=-1) or run in one process")
        return self.potential.scatter(graph if self.main else None)

    def scatter_state(self, state: MDState | None, meta: dict | None) -> MDState:
        """Rank 0's global ``state`` (from a checkpoint) split over the ranks: atoms go to
        the ranks that owned them when it was written by as many ranks, else to their box."""
        owner = graph = None
        if self.main:
            dom = (meta or {}).get("domain") or {}
            if dom.get("ranks") == self.size and dom.get("owner") is not None:
                owner = torch.as_tensor(dom["owner"], device=state.positions.device)
            graph = state.graph.replace({K.FORCES: state.forces})
        head = self.broadcast(None if not self.main else {
            "energy": state.energy.cpu(), "stress": state.stress.cpu(), "step": state.step,
            "vars": {k: v.cpu() for k, v in state.vars.items()},
            "rng": None if state.rng is None else state.rng.cpu(),
            "compute_stress": state.compute_stress})
        with C.guarded(None, "checking the checkpoint"):
            if self.main and graph.n_systems != 1:
                raise InputError(f"checkpoint holds {graph.n_systems} systems; a decomposed "
                                 "run simulates one (resume it in one process)")
        owned = self.potential.scatter(graph if self.main else None, owner=owner)
        dev = owned.positions.device
        forces = owned[K.FORCES]
        owned = AtomicGraph({k: v for k, v in owned.fields.items() if k != K.FORCES},
                            validate=False)
        return MDState(owned, forces, head["energy"].to(dev), head["stress"].to(dev),
                       head["step"], {k: v.to(dev) for k, v in head["vars"].items()},
                       head["rng"], head["compute_stress"])

    def gather(self, state: MDState) -> MDState | None:
        """The global state on rank 0 (atoms by id, with each atom's rank), ``None`` else."""
        rank = torch.full((state.graph.n_atoms,), self.rank, dtype=torch.int64,
                          device=state.positions.device)
        full, extra = self.potential.gather(state.graph, {K.FORCES: state.forces,
                                                          "owner": rank})
        if full is None:
            return None
        self._owner = extra["owner"].cpu()
        return state.replace(graph=full, forces=extra[K.FORCES])

    def meta(self, state: MDState) -> dict:
        """Checkpoint meta of the last :meth:`gather` (rank 0): the rank count and owners."""
        return {"domain": {"ranks": self.size, "owner": self._owner.tolist()}}

    def after_step(self, state: MDState) -> MDState:
        return self.potential.maybe_migrate(state)

    def write_summary(self, path: Path) -> None:
        """``summary.json`` (rank 0): ranks, grid, owned/ghost atoms per rank (min/max),
        migrations, rebuilds and per-rank peak memory (MiB). Collective: one all-gather."""
        s = self.potential.stats()
        dev = self.potential.device or torch.device("cpu")
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        mine = torch.tensor([s.get("n_owned", 0), s.get("n_ghost", 0), s.get("n_held", 0),
                             s.get("migrations", 0), s.get("rebuilds", 0), peak],
                            dtype=torch.float64, device=dev)
        every = C.all_gather_tensor(mine).cpu()
        if not self.main:
            return
        cols = every.T.tolist()

        def span(values):
            return {"min": min(values), "max": max(values), "per_rank": values}

        out = {"ranks": self.size, "grid": s.get("grid"), "n_atoms": self.potential.n_total,
               "owned": span([int(v) for v in cols[0]]),
               "ghost": span([int(v) for v in cols[1]]),
               "held": span([int(v) for v in cols[2]]),
               "migrations": int(max(cols[3])), "rebuilds": int(max(cols[4])),
               "peak_memory_MiB": span([round(v, 1) for v in cols[5]]),
               "memory_kind": "cuda max_memory_allocated" if dev.type == "cuda"
               else "process maxrss"}
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
