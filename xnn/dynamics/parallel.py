"""How an MD or relaxation run is spread over processes: the interface the application
(:mod:`xnn.app.md`, :mod:`xnn.app.relax`) calls, and its single-process implementation
:class:`SerialRun` (which does nothing).

The decomposed implementation, :class:`xnn.distributed.md_run.DomainRun`, is chosen by
:func:`xnn.distributed.entries.parallelize_md` from outside; this module imports
nothing from there.
"""

from __future__ import annotations

import contextlib
import resource

import torch

from xnn.dynamics.hooks import by_id, n_ids
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState
from xnn.models.potential import Potential


class SerialRun:
    """One process holding every atom: the potential as given, states unchanged.

    Attributes:
        potential: what the integrators evaluate (read it after :meth:`scatter_graph` or
            :meth:`scatter_state`: a decomposed run may choose it from the structure).
        model: the potential's model (species checks before the structure is scattered).
        reduce: the global reductions (here, plain per-system sums).
        main: this process writes the files.
        checkpoint_potential: whose neighbor list a checkpoint stores (``None``: none).
    """

    main = True
    size = 1
    rank = 0
    reduce: Reducer = LOCAL

    def __init__(self, potential: Potential):
        self.potential = potential
        self.checkpoint_potential = potential
        self._held: tuple[int, torch.device] | None = None  # atoms and device of the run

    @property
    def model(self):
        """The model the potential evaluates."""
        return self.potential.model

    def compiled_integrator(self, ensemble: str = "nve", cuda_graph: bool = False):
        """The integrator of ``md.compile=true`` for this run layer: here the one-process
        :class:`~xnn.dynamics.compiled_thermo.CompiledIntegrator` (the decomposed run
        layers of :func:`~xnn.distributed.entries.parallelize_md` declare theirs)."""
        from xnn.dynamics.compiled_thermo import CompiledIntegrator

        return CompiledIntegrator(ensemble, self.potential, cuda_graph=cuda_graph)

    def guarded(self, phase: str):
        """A block of rank-local work whose failure every rank learns of (here: nothing)."""
        return contextlib.nullcontext()

    def broadcast(self, obj):
        """``obj`` from rank 0 on every rank."""
        return obj

    def scatter_graph(self, graph):
        """This process's owned atoms of rank 0's graph."""
        self._held = (graph.n_atoms, graph.positions.device)
        return graph

    def scatter_state(self, state: MDState, meta: dict | None) -> MDState:
        """This process's part of rank 0's global state (read from a checkpoint)."""
        self._held = (state.graph.n_atoms, state.positions.device)
        return state

    def gather(self, state: MDState) -> MDState:
        """The global state (atoms by id) on rank 0, ``None`` elsewhere. Collective."""
        return state

    def gather_atoms(self, graph, values: torch.Tensor):
        """``(atom_id [n], values [n, k])`` of per-atom ``values [n_atoms, k]`` of
        ``graph``'s atoms in id order on the main process (``None`` elsewhere): the values
        of an ``owned`` hook (:class:`~xnn.dynamics.hooks.HookRunner`). Collective."""
        count = n_ids(graph, self.reduce)
        table = by_id(values, graph.atom_id, count, self.reduce)
        held = by_id(torch.ones_like(graph.atom_id, dtype=values.dtype), graph.atom_id, count,
                     self.reduce)
        ids = torch.nonzero(held > 0).flatten()
        return ids, table.index_select(0, ids)

    def meta(self, state: MDState) -> dict:
        """Extra checkpoint meta of the last :meth:`gather`."""
        return {}

    def checkpoint_shard(self, state: MDState) -> tuple[MDState, dict, dict]:
        """This process's part of a sharded checkpoint: its atoms' ``state``, per-atom meta
        entries and the meta's global entries (here: every atom, nothing more).
        Collective."""
        return state, {}, {}

    def after_step(self, state: MDState) -> MDState:
        """The state after an integrator step with atoms moved to their owners."""
        return state

    def report(self, step: int, command: str = "md") -> str | None:
        """At an output row: one line on the decomposition after ghost-plan rebuilds (here:
        none, one process has no decomposition)."""
        return None

    def decomposition(self) -> dict | None:
        """The run's split in the fields of the decomposed run's (one rank owning every
        atom, no ghosts, no migrations), with the neighbor-list builds and the peak memory
        (MiB: CUDA's max_memory_allocated, else the process's maxrss); ``None`` on ranks
        other than 0."""
        n, dev = self._held or (0, torch.device("cpu"))
        nl = self.potential.neighbors
        if dev.type == "cuda":
            peak, kind = torch.cuda.max_memory_allocated(dev) / 2**20, "cuda max_memory_allocated"
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            kind = "process maxrss"

        def span(v):
            return {"min": v, "max": v, "per_rank": [v]}

        return {"ranks": 1, "grid": None, "balance": None, "exchange": None,  # no boxes
                "n_atoms": n, "owned": span(n), "ghost": span(0),
                "held": span(n), "migrations": 0,
                "rebuilds": int(nl.n_builds), "migrated_atoms": 0,
                "peak_memory_MiB": span(round(peak, 1)), "memory_kind": kind}
