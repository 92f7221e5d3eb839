"""Domain decomposition applied from outside to an ``xnn md`` / ``xnn relax`` run.

:class:`DomainRun` wraps a :class:`~xnn.distributed.potential.DecomposedPotential` (built by
:func:`~xnn.distributed.parallelize.parallelize`): rank 0 reads the
structure (or the checkpoint, which holds the global state by atom id) and scatters it, each
rank integrates its owned atoms with the cross-rank reducer, atoms migrate after every step,
and states are gathered on rank 0 (in global-id order) for output and checkpoints, or, sharded,
written by every rank (:meth:`DomainRun.checkpoint_shard`) and read back by every rank
(:meth:`DomainRun.scatter_shards`). The
applications (:mod:`xnn.app.md`, :mod:`xnn.app.relax`) call the same methods on
:class:`~xnn.dynamics.parallel.SerialRun` in one process.
"""

from __future__ import annotations

import dataclasses
import resource

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.state import Counters
from xnn.distributed.modes import MODES
from xnn.distributed.potential import model_device
from xnn.distributed.redistribute import to_owners
from xnn.dynamics.parallel import SerialRun
from xnn.dynamics.state import MDState
from xnn.errors import InputError

# per-atom fields that travel with a checkpoint's atoms to their ranks on resume
_REF, _MIGRATED = "xnn_md_rebuild_reference", "xnn_md_migration_reference"
K.register_field(_REF, K.ATOM)
K.register_field(_MIGRATED, K.ATOM)


class DomainRun(SerialRun):
    """Several ranks, each owning the atoms of its box (see the module docstring).

    Args:
        model: the model of the loaded potential (with ``cutoff``).
        manager: the run's :class:`~xnn.distributed.DistributedManager`.
        skin: Verlet skin (Å). backend: neighbor-list backend.
        mode: a key of :data:`~xnn.distributed.modes.MODES`; ``"auto"`` is chosen on the
            structure when it is scattered (:func:`~xnn.distributed.parallelize.resolve_mode`;
            the reason is printed).
        order: atom order of mode ``"graph"`` (``"morton"`` or ``"index"``).
        balance, exchange: how the spatial modes cut the boxes and send ghost rows (see
            :func:`~xnn.distributed.parallelize.parallelize`).
    """

    def __init__(self, model, manager, skin: float, backend: str, mode: str = "spatial",
                 order: str = "morton", balance: str = "none", exchange: str = "direct"):
        from xnn.distributed.reducer import GroupReducer

        if mode not in MODES:
            raise InputError(f"dd.mode must be one of {list(MODES)}, got {mode!r}")
        self.mode, self._args = mode, (model, manager, skin, backend, order)
        self.balance, self.exchange = balance, exchange
        self._potential = None  # auto: chosen when the structure is scattered (_choose)
        if mode != "auto":
            self._choose(None)
        self.reduce = GroupReducer(None)  # every rank of the run, whichever potential
        self.main = manager.is_main
        self.size, self.rank = manager.world_size, manager.rank
        self.checkpoint_potential = None  # the ghost plan is rebuilt on resume
        self._meta: dict = {}
        self._reported, self._reported_step = Counters(), 0  # as of the last report line

    @property
    def potential(self):
        """What the integrators evaluate (a
        :class:`~xnn.distributed.potential.DecomposedPotential`).

        With ``mode="auto"`` it exists once the structure is scattered
        (:meth:`scatter_graph`, :meth:`scatter_state`): take it after that, never keep one
        from before."""
        if self._potential is None:
            raise RuntimeError("dd.mode=auto chooses the potential from the structure: read "
                               "DomainRun.potential after scatter_graph or scatter_state")
        return self._potential

    @potential.setter
    def potential(self, value) -> None:
        self._potential = value

    @property
    def model(self):
        """The model every rank evaluates (also before the potential is chosen)."""
        return self._args[0]

    def guarded(self, phase: str):
        return C.guarded(None, phase)

    def compiled_integrator(self, ensemble: str = "nve", cuda_graph: bool = False):
        """Refused: this run layer is eager (``parallelize_md(compile=True)`` gives the
        compiled decomposed one, :class:`~.domain.compiled_run.CompiledDomainRun`)."""
        raise InputError("compile=true runs in one process: launch without torchrun or set "
                         "compile: false")

    def _choose(self, graph) -> None:
        """The potential of the run's mode (``auto``: from rank 0's ``graph``, once;
        collective)."""
        if self._potential is not None:
            return
        from xnn.distributed.parallelize import parallelize

        model, manager, skin, backend, order = self._args
        self.potential = parallelize(model, manager, self.mode, graph=graph, skin=skin,
                                     order=order, backend=backend, balance=self.balance,
                                     exchange=self.exchange)

    def broadcast(self, obj):
        return C.broadcast_object(obj)

    def scatter_graph(self, graph):
        """This rank's owned atoms of rank 0's ``graph`` (one system)."""
        with C.guarded(None, "checking the structure"):
            if self.main and graph.n_systems != 1:
                raise InputError(f"a decomposed run (torchrun) simulates one system, the "
                                 f"structure selects {graph.n_systems}; pick one frame "
                                 "(index=-1) or run in one process")
        self._choose(graph if self.main else None)
        return self.potential.scatter(graph if self.main else None)

    def scatter_state(self, state: MDState | None, meta: dict | None) -> MDState:
        """Rank 0's global ``state`` (from a checkpoint) split over the ranks: atoms go to
        the ranks that owned them when it was written by as many ranks (with the ghost
        plan's reference, for a bitwise continuation), else to their box."""
        owner = graph = None
        self._choose(state.graph if self.main else None)
        dom = ((meta or {}).get("domain") or {}) if self.main else {}
        same = self.broadcast(dom.get("ranks") == self.size and dom.get("owner") is not None)
        with_ref = same and self.broadcast(dom.get("ref_positions") is not None)
        with_ref = with_ref and self.potential.layout.migrates  # graph: no rebuild reference
        if self.main:
            fields = {K.FORCES: state.forces}
            if same:
                owner = torch.as_tensor(dom["owner"], device=state.positions.device)
            if with_ref:
                fields.update({_REF: dom["ref_positions"].to(state.positions),
                               _MIGRATED: dom["migrated"].to(state.positions)})
            graph = state.graph.replace(fields)
        head = self.broadcast(None if not self.main else {
            "energy": state.energy.cpu(), "stress": state.stress.cpu(), "step": state.step,
            "vars": {k: v.cpu() for k, v in state.vars.items()},
            "rng": None if state.rng is None else state.rng.cpu(),
            "compute_stress": state.compute_stress,
            "domain": {k: v for k, v in dom.items() if k in ("grid", "counters", "ref_cell")}})
        with C.guarded(None, "checking the checkpoint"):
            if self.main and graph.n_systems != 1:
                raise InputError(f"checkpoint holds {graph.n_systems} systems; a decomposed "
                                 "run simulates one (resume it in one process)")
        owned = self.potential.scatter(graph if self.main else None, owner=owner)
        dev, moved = owned.positions.device, (K.FORCES, _REF, _MIGRATED)
        forces, ref, migrated = (owned.fields.get(k) for k in moved)
        owned = AtomicGraph({k: v for k, v in owned.fields.items() if k not in moved},
                            validate=False)
        if with_ref:
            self._restore_reference(owned, ref, migrated, head["domain"])
            c = self.potential.state.counters  # the next line counts from the checkpoint
            self._reported = dataclasses.replace(c, rebuilds=c.rebuilds - 1)
        self._reported_step = head["step"]
        return MDState(owned, forces, head["energy"].to(dev), head["stress"].to(dev),
                       head["step"], {k: v.to(dev) for k, v in head["vars"].items()},
                       head["rng"], head["compute_stress"])

    def scatter_shards(self, n_shards: int, read, meta: dict) -> MDState:
        """A sharded checkpoint (:mod:`xnn.io.sharded_checkpoint`) split over the ranks
        without assembling it on one: on as many ranks as wrote it, rank ``r`` reads shard
        ``r`` (with the ghost plan's reference: a bitwise continuation); on another count
        rank ``r`` reads shards ``r, r + P, ...`` and every atom goes to the rank of its box
        (one all-to-all; :func:`~xnn.distributed.redistribute.to_owners`). The result equals
        :meth:`scatter_state` of the assembled checkpoint. Mode ``auto``, and mode ``graph``
        on another rank count, choose from the whole structure: rank 0 assembles it.

        Args:
            n_shards: the checkpoint's shard count.
            read: ``read(shards) -> (state, per_atom, owner)``: the atoms of those shards
                (:func:`xnn.io.sharded_checkpoint.read_state`).
            meta: the checkpoint's meta (every rank).
        Collective.
        """
        dom = meta.get("domain") or {}
        same = dom.get("ranks") == self.size == n_shards
        if self.mode == "auto":
            return self._scatter_assembled(n_shards, read, meta)
        self._choose(None)
        pot = self.potential
        if not (same or pot.layout.migrates):  # graph: blocks of the whole atom order
            return self._scatter_assembled(n_shards, read, meta)
        with C.guarded(None, "reading the checkpoint's shards"):
            state, per_atom, _ = read([self.rank] if same else range(self.rank, n_shards,
                                                                       self.size))
        dev = pot.device or model_device(self.model)
        graph = state.graph.to(dev)
        forces = state.forces.to(dev)
        n_total = int(C.all_reduce_(torch.tensor([graph.n_atoms], device=dev))[0])
        if same:
            pot.adopt(graph, n_total)
            if "ref_cell" in dom and pot.layout.migrates:
                self._restore_reference(graph, per_atom["ref_positions"].to(dev),
                                        per_atom["migrated"].to(dev), dom)
                c = pot.state.counters  # the next line counts from the checkpoint
                self._reported = dataclasses.replace(c, rebuilds=c.rebuilds - 1)
        else:
            part = pot.layout.partition(graph, pot.group, self.size)
            owner = part.owner(part.fractional(graph.positions.detach())[0])
            graph, extra = to_owners(graph, {K.FORCES: forces}, owner, pot.group)
            forces = extra[K.FORCES]
            pot.adopt(graph, n_total, part.grid)
        self._reported_step = state.step
        return MDState(graph, forces, state.energy.to(dev), state.stress.to(dev), state.step,
                       {k: v.to(dev) for k, v in state.vars.items()}, state.rng,
                       state.compute_stress)

    def _scatter_assembled(self, n_shards: int, read, meta: dict) -> MDState:
        """:meth:`scatter_state` of the whole checkpoint, assembled on rank 0."""
        state = full = None
        with C.guarded(None, "reading the checkpoint's shards"):
            if self.main:
                state, per_atom, owner = read(range(n_shards))
                dom = meta.get("domain")
                full = meta if not dom else {**meta, "domain": {**dom, "owner": owner,
                                                                **per_atom}}
        return self.scatter_state(state, full)

    def gather(self, state: MDState) -> MDState | None:
        """The global state on rank 0 (atoms by id, with each atom's rank and the rebuild
        reference), ``None`` elsewhere. Collective."""
        pos = state.positions
        extra = {K.FORCES: state.forces,
                 "owner": torch.full((pos.shape[0],), self.rank, dtype=torch.int64,
                                     device=pos.device)}
        ref = self._reference(state)
        if ref is not None:
            extra.update(ref_positions=ref["ref_positions"], migrated=ref["migrated"])
        full, extra = self.potential.gather(state.graph, extra)
        if full is None:
            return None
        self._meta = {**self._domain_meta(ref), "owner": extra["owner"].cpu()}
        if ref is not None:
            self._meta.update(ref_positions=extra["ref_positions"].cpu(),
                              migrated=extra["migrated"].cpu())
        return state.replace(graph=full, forces=extra[K.FORCES])

    def checkpoint_shard(self, state: MDState) -> tuple[MDState, dict, dict]:
        """This rank's part of a sharded checkpoint (:mod:`xnn.io.sharded_checkpoint`): its
        owned ``state``, the per-atom entries of the meta (``ref_positions``, ``migrated``:
        the rebuild reference, for a bitwise continuation on as many ranks; ``{}`` when
        some rank has none) and the meta's global entries (``{"domain": {ranks, grid,
        counters, ref_cell}}``). Collective (one all-reduce); nothing is gathered."""
        ref = self._reference(state)
        per_atom = {} if ref is None else {k: ref[k] for k in ("ref_positions", "migrated")}
        return state, per_atom, {"domain": self._domain_meta(ref)}

    def _reference(self, state: MDState) -> dict | None:
        """The ghost plan's rebuild reference of this rank's atoms when every rank has one
        (else ``None`` on every rank). Collective."""
        ref = self.potential.reference(state.graph)
        flag = torch.tensor([0.0 if ref is not None else 1.0], dtype=torch.float64,
                            device=state.positions.device)
        return ref if bool(C.all_reduce_max(flag)[0] == 0) else None

    def _domain_meta(self, ref: dict | None) -> dict:
        """The checkpoint meta's global entries of the decomposition (no per-atom ones)."""
        st = self.potential.state
        out = {"ranks": self.size,
               "grid": list(self.potential.grid) if self.potential.grid else None,
               "counters": dataclasses.asdict(st.counters) if st else None}
        if ref is not None:
            out["ref_cell"] = ref["ref_cell"].cpu()
        return out

    def gather_atoms(self, graph: AtomicGraph, values: torch.Tensor):
        """``(atom_id [n_atoms], values [n_atoms, k])`` of every rank's owned atoms (of
        ``graph``) in id order on rank 0, ``None`` elsewhere: per-atom values of an
        ``owned`` hook (:class:`~xnn.dynamics.hooks.HookRunner`). Collective."""
        ids = AtomicGraph({K.POSITIONS: graph.positions, K.ATOM_ID: graph.atom_id},
                          validate=False)
        full, extra = self.potential.gather(ids, {"values": values})
        return None if full is None else (full.atom_id, extra["values"])

    def meta(self, state: MDState) -> dict:
        """Checkpoint meta of the last :meth:`gather` (rank 0): the rank count, each atom's
        rank, the grid and the ghost plan's reference positions (by id)."""
        return {"domain": self._meta}

    def _restore_reference(self, owned, ref, migrated, dom: dict) -> None:
        """Rebuild the ghost plan at the checkpoint's reference (same rank count): the
        continuation then takes the rebuilds and migrations of the uninterrupted run."""
        c = Counters(**dom["counters"]) if dom.get("counters") else Counters()
        self.potential.restore_reference(owned, ref, migrated, dom["ref_cell"], c,
                                         grid=dom.get("grid"))

    def after_step(self, state: MDState) -> MDState:
        return self.potential.maybe_migrate(state)

    def decomposition(self) -> dict | None:
        """Ranks, grid, owned/ghost/held atoms per rank (min/max), rebuilds, migrations and
        per-rank peak memory (MiB) on rank 0; ``None`` elsewhere. Collective: one
        all-gather of seven numbers per rank."""
        s = self.potential.stats()
        dev = self.potential.device or torch.device("cpu")
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        mine = torch.tensor([s.get("n_owned", 0), s.get("n_ghost", 0), s.get("n_held", 0),
                             s.get("migrations", 0), s.get("rebuilds", 0),
                             s.get("migrated_out", 0), peak], dtype=torch.float64, device=dev)
        every = C.all_gather_tensor(mine).cpu()
        if not self.main:
            return None
        cols = every.T.tolist()

        def span(values):
            return {"min": min(values), "max": max(values), "per_rank": values}

        return {"ranks": self.size, "grid": s.get("grid"), "balance": self.balance,
                "exchange": self.exchange, "n_atoms": self.potential.n_total,
                "owned": span([int(v) for v in cols[0]]),
                "ghost": span([int(v) for v in cols[1]]),
                "held": span([int(v) for v in cols[2]]),
                "migrations": int(max(cols[3])), "rebuilds": int(max(cols[4])),
                "migrated_atoms": int(sum(cols[5])),
                "peak_memory_MiB": span([round(v, 1) for v in cols[6]]),
                "memory_kind": "cuda max_memory_allocated" if dev.type == "cuda"
                else "process maxrss"}

    def report(self, step: int, command: str = "md") -> str | None:
        """At an output row: when the ghost plan was rebuilt since the last report, rank 0
        prints (and returns) one line on the decomposition (:meth:`decomposition`).

        Every rank counts the same rebuilds (they are collective), so all ranks take the
        collective together, and only at rows that follow a rebuild.

        Args:
            step: the step of the row. command: named in the line (``xnn md: ...``).
        """
        st = self.potential.state
        c = st.counters if st is not None else None
        if c is None or c.rebuilds == self._reported.rebuilds:
            return None
        d, last, since = self.decomposition(), self._reported, self._reported_step
        self._reported, self._reported_step = dataclasses.replace(c), step
        if d is None:
            return None
        grid = "x".join(str(g) for g in d["grid"] or ()) or "none (graph mode)"
        mem = d["peak_memory_MiB"]
        line = (f"xnn {command}: step {step}: {c.rebuilds - last.rebuilds} ghost-plan "
                f"rebuild(s), {c.migrations - last.migrations} with migration, "
                f"{'at start' if step == since else f'since step {since}'}; "
                f"{d['ranks']} ranks, grid {grid}; atoms per rank: owned "
                f"{d['owned']['min']}-{d['owned']['max']}, ghost "
                f"{d['ghost']['min']}-{d['ghost']['max']}; {d['migrations']} migrations "
                f"({d['migrated_atoms']} atoms moved) and {d['rebuilds']} rebuilds so far; "
                f"peak memory {mem['min']:.0f}-{mem['max']:.0f} MiB per rank")
        print(line, flush=True)
        return line
