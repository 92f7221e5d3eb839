"""``DomainPotential``: a :class:`~xnn.models.Potential` for a system whose atoms are owned
by the ranks of a group, and the migration of an MD state between steps.

Each rank holds only the atoms of its box (an ``AtomicGraph`` sorted by atom id) and its
ghosts. The call ``pot(owned_graph, forces=True, stress=True)`` returns the total energy and
stress (all-reduced) and the owned atoms' energies and forces, so an integrator written for
one process runs unchanged on the owned atoms::

    pot = DomainPotential(model, manager, skin=1.0)
    state = nve.init(pot.scatter(graph if manager.is_main else None), pot)
    for _ in range(steps):
        state = nve.step(state, pot, dt, reduce=pot.reducer)
        state = pot.maybe_migrate(state)        # atoms that left their box change rank
    full, extra = pot.gather(state.graph, {"forces": state.forces})   # rank 0, by id

Forces and stress come from :mod:`xnn.models.derivatives`: owned positions and a symmetric
strain ``ε`` are the leaves; ghosts are built from the strained owners and strained cell
through the differentiable halo exchange, ``x_ghost = exchange(x_owner (1 + ε)) + shift @
cell (1 + ε)``; ``F_owned = -∂E_r/∂x_owned`` (the exchange's backward sums ghost gradients
into owners) and the strain gradients of the ranks' energy shares are summed.

The ghost plan is rebuilt when an atom moved more than ``skin / 2`` since the last rebuild,
counting the move of its periodic images by a changed cell (all-reduced: every rank takes the
same branch; see :meth:`DomainPotential._deformation`). Ghost regions follow the
atoms each rank actually owns, so results are exact whatever the ownership; migration (in
:meth:`DomainPotential.maybe_migrate`) keeps ownership equal to the boxes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.local import build_local_domain, local_graph, min_pair_distance
from xnn.distributed.domain.longrange import (
    domain_fields,
    long_range_modules,
    swapped_global_sums,
)
from xnn.distributed.domain.migrate import migrate
from xnn.distributed.domain.partition import (
    Partition,
    check_grid,
    fractional_bounds,
    parse_grid,
    partition_from_bounds,
)
from xnn.distributed.domain.state import Counters, DomainState, gather, scatter
from xnn.distributed.domain.sync import swapped_sync_points
from xnn.errors import InputError
from xnn.models.base import pairing_edges
from xnn.models.derivatives import apply_strain, derive

_MODES = ("auto", "halo", "sync")


def resolve_mode(model, mode: str) -> str:
    """``"halo"`` or ``"sync"``: ``"auto"`` picks ``"sync"`` for models with sync points."""
    if mode not in _MODES:
        raise InputError(f"mode must be one of {list(_MODES)}, got {mode!r}")
    if mode == "auto":
        return "sync" if getattr(model, "sync_points", None) else "halo"
    return mode


def resolve_group(manager_or_group):
    """(group, device) from a DistributedManager, ParallelDims (its dd axis), a group or None."""
    from xnn.distributed.manager import DistributedManager
    from xnn.distributed.mesh import ParallelDims

    if isinstance(manager_or_group, DistributedManager):
        return None, manager_or_group.device
    if isinstance(manager_or_group, ParallelDims):
        return manager_or_group.dd_group, None
    return manager_or_group, None


def model_cutoff(model) -> tuple[float, int]:
    """``(cutoff, num_interactions)`` of a model; ``InputError`` if it declares no cutoff."""
    cutoff = getattr(model, "cutoff", None)
    try:
        cutoff = float(cutoff)
    except (TypeError, ValueError):
        cutoff = None
    if cutoff is None or not cutoff > 0 or cutoff == float("inf"):
        declared = getattr(model, "cutoff", None)
        raise InputError(f"domain decomposition needs a model with a finite positive `cutoff`; "
                         f"{type(model).__name__} declares cutoff={declared!r}")
    return cutoff, int(getattr(model, "num_interactions", 1))


def model_device(model) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def decomposed_results(energies: Tensor, tape: list[Tensor], strained, graph: AtomicGraph,
                       forces: bool, stress: bool, training: bool, group
                       ) -> dict[str, Tensor]:
    """The results of one decomposed evaluation from the owned atoms' ``energies``.

    Shared by the spatial (:class:`DomainPotential`) and graph-parallel evaluations.
    ``tape`` holds every exchanged tensor (the local positions first); ``strained`` is
    :func:`~xnn.models.derivatives.apply_strain`'s result (``None`` without forces/stress).

    Returns:
        ``energy [1]`` (eV, all-reduced), ``energies [n_owned]``, ``atom_id [n_owned]`` and,
        from :func:`~xnn.models.derivatives.derive`, forces and virial/stress as asked.
    """
    # every exchange must be part of every rank's backward, even where the model ignores
    # it (a rank with no atoms or ghosts): add exact zeros that depend on them
    e_local = energies.sum() + sum((0.0 * t.sum() for t in tape), tape[0].new_zeros(()))
    out = {K.ENERGY: C.all_reduce_sum(e_local.reshape(1), group),
           K.ENERGIES: energies, K.ATOM_ID: graph.atom_id}
    if forces or stress:
        out.update(derive(e_local, strained, graph.volume(), graph.pbc, forces, stress,
                          training, partial(C.all_reduce_sum, group=group)))
    return out


class DomainPotential:
    """Evaluate ``model`` on a system whose atoms are owned by the ranks of a group.

    Args:
        model: per-atom-energy model with ``cutoff`` (Å) and ``num_interactions``.
        manager_or_group: a :class:`~xnn.distributed.DistributedManager` (all ranks), a
            :class:`~xnn.distributed.ParallelDims` (its ``dd`` axis), a process group, or
            ``None`` (all ranks if ``torch.distributed`` is initialised, else one process).
        grid: ``(px, py, pz)`` boxes, ``"2,1,1"``, or ``None`` (smallest halo surface).
        skin: Verlet skin (Å): ghosts and local edges are reused until an atom moved more
            than ``skin / 2``.
        mode: ``"halo"`` (any local model), ``"sync"`` (models with sync points: ghost
            features exchanged per layer, halo of one cutoff) or ``"auto"``.
        backend: neighbor-list backend for the local (non-periodic) graphs.

    Attributes:
        state: the :class:`DomainState` of the last rebuild (``None`` before the first).
    """

    def __init__(self, model, manager_or_group=None, grid=None, skin: float = 0.0,
                 mode: str = "halo", backend: str = "auto"):
        cutoff, hops = model_cutoff(model)
        mode = resolve_mode(model, mode)
        if mode == "sync" and hops > 1 and not hasattr(model, "sync_points"):
            raise InputError(f"mode 'sync' needs a model with sync points; "
                             f"{type(model).__name__} has none (use mode 'halo')")
        if skin < 0:
            raise InputError(f"skin must be >= 0, got {skin}")
        self.model = model
        self.group, self.device = resolve_group(manager_or_group)
        self.grid = parse_grid(grid)
        self.skin, self.mode, self.backend, self.cutoff = float(skin), mode, backend, cutoff
        #: with a skin the model sees the local edges within the cutoff only (the others it
        #: weighs zero): less edge work for the same result (False: the whole list)
        self.filters = self.skin > 0
        depth = 1 if mode == "sync" else hops
        reach = cutoff * depth
        if mode == "halo":  # a declared receptive field (e.g. D3's cutoff + cn_cutoff,
            # or a Coulomb term's cutoff + its charge model's receptive field)
            reach = float(getattr(model, "receptive_field", reach))
        # receivers farther than (depth - 1) hops + skin from the box never reach an owned
        # energy: their edges are dropped (all ghosts when depth is 1), unless the model
        # declares a wider ``receiver_field`` (ghosts whose predicted charges count)
        self.receiver_width = (min(cutoff * (depth - 1), reach) + self.skin if depth > 1
                               else 0.0)
        if mode == "halo" and getattr(model, "receiver_field", 0.0) > 0.0:
            self.receiver_width = max(self.receiver_width,
                                      float(model.receiver_field) + self.skin)
        self.halo_width = reach + self.skin
        # long-range terms: k-space over owned atoms, their global sums all-reduced
        self.long_range = long_range_modules(model)
        #: arrange the local edges as reverse pairs (radial work once per pair) for a model
        #: that declares ``pairs_edges``, in mode halo, without long-range terms, while the
        #: model is not training (as the one-process :class:`~xnn.models.Potential`)
        self.paired = (bool(getattr(model, "pairs_edges", False)) and mode == "halo"
                       and not self.long_range)
        if any(getattr(m, "charge_model", None) is not None for m in self.long_range) and (
                mode != "halo" or reach == float("inf")):
            raise InputError("domain decomposition of predicted charges (charge_model) needs "
                             "mode 'halo' and a charge model that declares its cutoff (and "
                             "num_interactions or receptive_field)")
        self.size, self.rank = C.group_size(self.group), C.group_rank(self.group)
        if self.grid is not None:
            self.grid = check_grid(self.grid, self.size)
        self.state: DomainState | None = None
        self.n_total: int | None = None
        self.root_owner: Tensor | None = None  # rank 0, after scatter: each atom's rank
        self._last_positions: Tensor | None = None
        self._last_eval = None

    # ------------------------------------------------------------------ start-up, output
    def scatter(self, graph: AtomicGraph | None, owner: Tensor | None = None) -> AtomicGraph:
        """This rank's owned atoms of rank 0's ``graph`` (collective; see :func:`scatter`).

        With ``owner`` (rank 0: each atom's rank) atoms go where told, and the ghost plan is
        rebuilt when first needed; otherwise each atom goes to its box and the plan is built.
        """
        device = self.device or model_device(self.model)
        owned, grid, n_total, self.root_owner = scatter(graph, self.group, self.halo_width,
                                                        self.grid, device, owner)
        self.n_total = n_total
        if grid is not None:  # every rank knows: atoms went to their boxes
            self.grid = grid
            self._rebuild(owned, migrated=owned.positions)
        return owned

    def gather(self, graph: AtomicGraph, extra: Mapping[str, Tensor] | None = None,
               dst: int = 0):
        """The whole system on rank ``dst`` by atom id: see :func:`state.gather`."""
        return gather(graph, self.group, extra, dst)

    @property
    def reducer(self):
        """The MD engine's reducer over this group (global sums, maxima and flags)."""
        from xnn.distributed.reducer import GroupReducer

        return GroupReducer(self.group)

    # ------------------------------------------------------------------ rebuilds
    def _partition(self, graph: AtomicGraph) -> Partition:
        """The partition at ``graph``'s cell; non-periodic axes split the global bounding box."""
        cell, pbc, pos = graph.cell[0].detach(), graph.pbc[0], graph.positions.detach()
        bounds = torch.zeros(6, dtype=pos.dtype, device=pos.device)
        if not bool(pbc.all()):
            bounds = C.all_reduce_max(fractional_bounds(pos, cell), self.group)
        part = partition_from_bounds(-bounds[3:], bounds[:3], cell, pbc, self.size,
                                     self.halo_width, self.grid)
        self.grid = part.grid
        return part

    def _extents(self, part: Partition, graph: AtomicGraph) -> Tensor:
        """``[n_ranks, 2, 3]`` every rank's owned region; checks the total atom count."""
        home, _ = part.home(graph.positions.detach(), self.rank)
        mine = torch.cat([part.extent(self.rank, home).flatten().double(),
                          home.new_tensor([graph.n_atoms], dtype=torch.float64)])
        every = C.all_gather_tensor(mine, self.group)
        n_total = int(every[:, 6].sum())
        if self.n_total is None:
            self.n_total = n_total
        elif n_total != self.n_total:
            raise InputError(f"the ranks hold {n_total} atoms, but {self.n_total} were "
                             "scattered; pass each rank its owned graph (from scatter or "
                             "maybe_migrate)")
        return every[:, :6].reshape(-1, 2, 3).to(home.dtype)

    def _rebuild(self, graph: AtomicGraph, part: Partition | None = None,
                 migrated: Tensor | None = None, counters: Counters | None = None) -> None:
        check = getattr(self.model, "check_species", None)
        with C.guarded(self.group, "species check"):
            if graph.n_systems != 1:
                raise InputError(f"domain decomposition takes one system, got {graph.n_systems}")
            if check is not None:
                check(graph.numbers)
        part = part or self._partition(graph)
        extents = self._extents(part, graph)
        local = build_local_domain(graph, part, extents, self.halo_width,
                                   self.cutoff + self.skin, self.group, self.backend,
                                   self.receiver_width, self.cutoff if self.filters else None,
                                   self.paired and not getattr(self.model, "training", False))
        counters = counters or (self.state.counters if self.state else Counters())
        ref = graph.without_edges().replace(positions=graph.positions.detach().clone(),
                                            cell=graph.cell.detach().clone())
        self.state = DomainState(ref, local, self.n_total, migrated,
                                 dataclasses.replace(counters, rebuilds=counters.rebuilds + 1))

    def _changed(self, graph: AtomicGraph) -> bool:
        """Rank-local: the graph is not of the atoms of the last rebuild (ids or pbc); a
        changed cell counts through :meth:`_deformation`."""
        st = self.state
        return (st is None or graph.n_atoms != st.n_owned
                or not torch.equal(graph.atom_id, st.graph.atom_id)
                or not torch.equal(graph.pbc, st.graph.pbc))

    def _deformation(self, cell: Tensor) -> float:
        """How much a cell change since the last rebuild moved the local images (Å):
        ``max |shift @ (cell - cell_ref)|`` over this rank's local atoms.

        A pair's separation changes by the two atoms' displacements plus the change of
        their image offsets, so the plan (ghosts with a halo of ``cutoff * hops + skin``,
        edges within ``cutoff + skin``) stays complete while ``max displacement +
        deformation < skin / 2`` over all ranks (a deformation budget: NPT and cell
        relaxations rebuild only when the cell has moved enough, not at every step).
        """
        d = cell.detach().reshape(3, 3) - self.state.ref_cell
        if not bool(d.any()):
            return 0.0
        shifts = self.state.local.shifts
        if self.skin == 0 or not bool(torch.isfinite(d).all()):
            return float("inf")
        if not shifts.shape[0]:
            return 0.0
        return float((shifts.to(d.dtype) @ d).norm(dim=-1).max())

    def _max_disp(self, pos: Tensor, ref: Tensor | None) -> float:
        """Largest displacement (Å) from ``ref`` (``inf`` without a matching ``ref``, and on
        any change when the skin is 0)."""
        if ref is None or ref.shape != pos.shape:
            return float("inf")
        if not pos.shape[0]:
            return 0.0
        if self.skin == 0:
            return 0.0 if torch.equal(pos, ref) else float("inf")
        return float((pos - ref).norm(dim=-1).max())

    def update(self, graph: AtomicGraph) -> bool:
        """Rebuild ghosts and edges (not ownership) if stale; True if rebuilt. Collective."""
        changed = self._changed(graph)
        disp = 0.0 if changed else (self._max_disp(graph.positions.detach(),
                                                   self.state.ref_positions)
                                    + self._deformation(graph.cell))
        flags = C.all_reduce_max(torch.tensor([float(changed), disp], dtype=torch.float64,
                                              device=graph.device), self.group)
        if not (flags[0] > 0 or flags[1] > 0.5 * self.skin):
            return False
        st = self.state
        same = (st is not None and st.migrated is not None and graph.n_atoms == st.n_owned
                and torch.equal(graph.atom_id, st.graph.atom_id))
        self._rebuild(graph, migrated=st.migrated if same else None)
        return True

    def maybe_rebuild(self, graph: AtomicGraph, extra: Mapping[str, Tensor] | None = None):
        """Between steps: migrate atoms to their boxes and rebuild, when needed. Collective.

        Migrates when the displacement since the last rebuild (with the images' move by a
        changed cell, :meth:`_deformation`) plus that of the last step exceeds ``skin / 2``
        (so that the next step's evaluation rarely has to rebuild the ghosts itself), when
        atoms moved more than ``skin / 2`` since the last migration, or when ownership is
        unknown (a graph not made by
        :meth:`scatter` or a migration, e.g. read from a checkpoint shard).

        Args:
            graph: this rank's owned atoms.
            extra: per-atom tensors ``[n_owned, ...]`` that move with the atoms.
        Returns:
            ``(graph, extra)``: the same objects when nothing moved; else the new owned
            atoms sorted by atom id, with every atom-scope field and the extras.
        """
        st, pos = self.state, graph.positions.detach()
        changed = self._changed(graph) or st.migrated is None
        last = self._last_positions
        step = 0.0 if last is None or last.shape != pos.shape else self._max_disp(pos, last)
        d = [0.0, 0.0, 0.0] if changed else [
            self._max_disp(pos, st.ref_positions) + self._deformation(graph.cell),
            self._max_disp(pos, st.migrated), step]
        flags = C.all_reduce_max(torch.tensor([float(changed), *d], dtype=torch.float64,
                                              device=graph.device), self.group).tolist()
        half = 0.5 * self.skin
        self._last_positions = pos
        if not (flags[0] > 0 or flags[1] + flags[3] > half or flags[2] > half):
            return graph, extra
        part = self._partition(graph)
        peers = part.peers(self._extents(part, graph), self.halo_width, self.rank)
        graph, extra, sent, received = migrate(graph, extra, part, peers, self.group)
        c = self.state.counters if self.state else Counters()
        c = dataclasses.replace(c, migrations=c.migrations + 1, sent=c.sent + sent,
                                received=c.received + received)
        self._rebuild(graph, part, migrated=graph.positions.detach().clone(), counters=c)
        self._last_positions = graph.positions.detach()
        return graph, extra

    # ------------------------------------------------------------------ checkpoints
    def reference(self, graph: AtomicGraph) -> dict | None:
        """What a checkpoint needs to continue bitwise on as many ranks (rank-local).

        Args:
            graph: this rank's owned atoms, as last passed to :meth:`maybe_rebuild`.
        Returns:
            ``None`` unless the last rebuild is of these atoms and knows where they were at
            the last migration; else ``ref_positions [n_owned, 3]`` (Å, at the rebuild),
            ``migrated [n_owned, 3]`` (Å, at the migration), ``ref_cell [3, 3]`` (Å) and
            ``counters`` (:class:`Counters`).
        """
        st, last = self.state, self._last_positions
        if (st is None or st.migrated is None or last is None
                or not torch.equal(st.graph.atom_id, graph.atom_id)
                or not torch.equal(last, graph.positions.detach())):
            return None
        return {"ref_positions": st.ref_positions, "migrated": st.migrated,
                "ref_cell": st.ref_cell, "counters": st.counters}

    def restore_reference(self, graph: AtomicGraph, ref_positions: Tensor, migrated: Tensor,
                          ref_cell: Tensor, counters: Counters, grid=None) -> None:
        """Rebuild the ghost plan at a checkpoint's :meth:`reference` (same rank count), so
        that the continuation takes the rebuilds and migrations of the uninterrupted run.
        Collective.

        Args:
            graph: this rank's owned atoms (as written by the checkpoint's ranks).
            ref_positions, migrated: ``[n_owned, 3]`` (Å) of :meth:`reference`, by atom.
            ref_cell: ``[3, 3]`` (Å). counters: as of the checkpoint.
            grid: the checkpoint's ``(px, py, pz)`` (``None``: keep this one's).
        """
        if grid:
            self.grid = tuple(grid)
        cell = ref_cell.to(graph.cell).reshape(graph.cell.shape)
        self._rebuild(graph.replace(positions=ref_positions, cell=cell), migrated=migrated,
                      counters=dataclasses.replace(counters, rebuilds=counters.rebuilds - 1))
        self._last_positions = graph.positions.detach()

    def maybe_migrate(self, state):
        """An :class:`~xnn.dynamics.MDState` with atoms (and forces) moved to their owners
        when :meth:`maybe_rebuild` decides so; the same state otherwise. Collective."""
        graph, extra = self.maybe_rebuild(state.graph, {K.FORCES: state.forces})
        if graph is state.graph:
            return state
        return state.replace(graph=graph, forces=extra[K.FORCES])

    # ------------------------------------------------------------------ evaluation
    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                 training: bool = False) -> dict[str, Tensor]:
        """Energy and stress of the whole system; energies and forces of the owned atoms.

        Collective: every rank calls it with its owned ``graph``. With ``training=True`` the
        results stay differentiable (double backward through the exchange); backpropagate
        ``loss_r`` on every rank, where the total loss is ``sum_r loss_r`` (so divide
        replicated terms such as the energy loss by the group size), then sum parameter
        gradients over the group.

        Returns:
            ``energy [1]`` (eV, total), ``energies [n_owned]`` (eV), ``forces [n_owned, 3]``
            (eV/Å), ``virial [1, 3, 3]`` (eV) and ``stress [1, 3, 3]`` (eV/Å³, totals),
            ``atom_id [n_owned]``.
        """
        self.update(graph)
        dom = self.state.local
        need_grad = forces or stress
        with torch.enable_grad() if (need_grad or training) else torch.no_grad():
            strained = apply_strain(graph.without_edges(), with_strain=stress) if need_grad \
                else None
            g = strained.graph if strained is not None else graph
            tape: list[Tensor] = []
            x = dom.local_positions(g.positions, g.cell[0])
            tape.append(x)
            extra = (domain_fields(g.cell[0], graph.pbc[0], dom.n_owned)
                     if self.long_range else None)
            with C.guarded(self.group, "model evaluation"), \
                    swapped_sync_points(self.model, dom, tape, enabled=self.mode == "sync"), \
                    swapped_global_sums(self.long_range, self.group, tape), \
                    pairing_edges(dom.paired and not training):
                energies = self.model(local_graph(graph, dom, x, self.mode == "sync", extra,
                                                  self.cutoff if self.filters else None))
                energies = energies[: dom.n_owned]
            out = decomposed_results(energies, tape, strained, graph, forces, stress,
                                     training, self.group)
        self._last_eval = (x.detach(), dom, graph.atom_id)
        if not training:
            out = {k: v.detach() for k, v in out.items()}
        return out

    # ------------------------------------------------------------------ diagnostics
    def min_pair_distance(self, graph: AtomicGraph | None = None) -> tuple[Tensor, Tensor]:
        """Shortest pair with an owned atom at the last evaluation (rank-local).

        Returns:
            ``(distance [] Å, atom ids [2])``; ``inf`` and ``-1`` without pairs. Reduce the
            distance over the ranks (minimum) for a global safety check.
        """
        if self._last_eval is None:
            raise InputError("min_pair_distance needs an evaluation first")
        x, dom, ids = self._last_eval
        return min_pair_distance(x, dom, dom.local_field(K.ATOM_ID, ids))

    def stats(self) -> dict[str, object]:
        """This rank's decomposition: owned, ghost and exchanged atoms, peers, grid, counts."""
        st = self.state
        if st is None:
            return {}
        d, c = st.local, st.counters
        return {"grid": list(d.partition.grid), "n_owned": st.n_owned, "n_ghost": d.n_ghost,
                "n_held": st.n_owned + d.n_ghost, "n_recv": d.plan.n_recv,
                "n_send": d.plan.n_send, "n_peers": len(d.plan.peers),
                "n_edges": int(d.edge_index.shape[1]), "paired": d.paired,
                "halo_width": self.halo_width,
                "rebuilds": c.rebuilds, "migrations": c.migrations, "migrated_out": c.sent,
                "migrated_in": c.received}
