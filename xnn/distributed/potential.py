"""``DecomposedPotential``: one system whose atoms are owned by the ranks of a group.

The one implementation of the decomposed-potential protocol (what the MD runner, the safety
checks, relaxation, training, ``xnn validate`` and the ASE calculator call). What differs
between spatial boxes (mode ``halo`` or ``sync``) and index blocks (mode ``graph``) lives in
its layout (:class:`~xnn.distributed.domain.layout.SpatialLayout`,
:class:`~xnn.distributed.graph.layout.GraphLayout`): who owns an atom, the ghost plan, the
local graph, whether sync points exchange, the migration rule and the stats fields. Build
it with :func:`xnn.distributed.parallelize.parallelize`::

    pot = parallelize(model, manager, mode="spatial", skin=1.0)
    state = nve.init(pot.scatter(graph if manager.is_main else None), pot)
    for _ in range(steps):
        state = nve.step(state, pot, dt, reduce=pot.reducer)
        state = pot.maybe_migrate(state)        # atoms that left their box change rank
    full, extra = pot.gather(state.graph, {"forces": state.forces})   # rank 0, by id

Each rank holds only its owned atoms (an ``AtomicGraph`` sorted by atom id) and its ghosts.
``pot(owned_graph, forces=True, stress=True)`` returns the total energy and stress
(all-reduced) and the owned atoms' energies and forces, so an integrator written for one
process runs unchanged on the owned atoms. Forces and stress come from
:mod:`xnn.models.derivatives`: owned positions and a symmetric strain ``ε`` are the leaves;
local atoms are built from the strained owners and cell through the layout's differentiable
exchange; ``F_owned = -∂E_r/∂x_owned`` (the exchange's backward sums the ghosts' gradients
into their owners) and the strain gradients of the ranks' energy shares are summed.

The ghost plan is rebuilt when an atom moved more than ``skin / 2`` since the last rebuild,
counting the move of its periodic images by a changed cell (all-reduced: every rank takes
the same branch; see :meth:`DecomposedPotential._deformation`).
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
from xnn.distributed.committee import MEMBER_ROWS as COMMITTEE_MEMBER_ROWS
from xnn.distributed.committee import PER_ATOM as COMMITTEE_PER_ATOM
from xnn.distributed.committee import PER_SYSTEM as COMMITTEE_PER_SYSTEM
from xnn.distributed.committee import committee_results_decomposed, member_graphs
from xnn.distributed.domain.local import edges_within
from xnn.distributed.domain.longrange import swapped_global_sums
from xnn.distributed.domain.state import Counters, DomainState, gather, scatter
from xnn.distributed.domain.sync import swapped_sync_points
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, pairing_edges
from xnn.models.derivatives import apply_strain, derive


def model_cutoff(model) -> tuple[float, int]:
    """``(cutoff, num_interactions)`` of an xnn model with a finite positive cutoff: the
    one check of every decomposition (``InputError`` otherwise)."""
    declared = model.cutoff if isinstance(model, AtomisticModel) else None
    try:
        cutoff = float(declared)
    except (TypeError, ValueError):
        cutoff = float("nan")
    if not (cutoff > 0 and cutoff != float("inf")):
        raise InputError(f"domain decomposition needs an xnn model (AtomisticModel) with a "
                         f"finite positive `cutoff`; {type(model).__name__} declares "
                         f"cutoff={declared!r}")
    return cutoff, int(model.num_interactions)


def model_device(model) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def resolve_group(manager_or_group):
    """(group, device) from a DistributedManager, ParallelDims (its dd axis), a group or None."""
    from xnn.distributed.manager import DistributedManager
    from xnn.distributed.mesh import ParallelDims

    if isinstance(manager_or_group, DistributedManager):
        return None, manager_or_group.device
    if isinstance(manager_or_group, ParallelDims):
        return manager_or_group.dd_group, None
    return manager_or_group, None


def decomposed_results(energies: Tensor | None, tape: list[Tensor] | None, strained,
                       graph: AtomicGraph, forces: bool, stress: bool, training: bool, group,
                       error: BaseException | None = None) -> dict[str, Tensor]:
    """The results of one decomposed evaluation from the owned atoms' ``energies``.

    ``tape`` holds every exchanged tensor (the local positions first); ``strained`` is
    :func:`~xnn.models.derivatives.apply_strain`'s result (``None`` without forces/stress).
    ``error``: this rank's failure of the model evaluation (then ``energies`` and ``tape``
    are ``None``): the ranks agree on it in the energy's all-reduce
    (:func:`~xnn.distributed.collectives.agree_sum`), and every rank raises if one failed.

    Returns:
        ``energy [1]`` (eV, all-reduced), ``energies [n_owned]``, ``atom_id [n_owned]`` and,
        from :func:`~xnn.models.derivatives.derive`, forces and virial/stress as asked.
    """
    # every exchange must be part of every rank's backward, even where the model ignores
    # it (a rank with no atoms or ghosts): add exact zeros that depend on them
    e_local = None if error is not None else (
        energies.sum() + sum((0.0 * t.sum() for t in tape), tape[0].new_zeros(())))
    like = graph.positions.new_zeros(1)
    energy = C.agree_sum(group, "model evaluation", error,
                         None if e_local is None else e_local.reshape(1), like)
    out = {K.ENERGY: energy, K.ENERGIES: energies, K.ATOM_ID: graph.atom_id}
    if forces or stress:
        out.update(derive(e_local, strained, graph.volume(), graph.pbc, forces, stress,
                          training, partial(C.all_reduce_sum, group=group)))
    return out


def _same_key(a: tuple | None, b: tuple | None) -> bool:
    """Two :meth:`DecomposedPotential._key` s name the same tensors at the same versions."""
    if a is None or b is None:
        return False
    return all(x is y for x, y in zip(a[:6], b[:6])) and a[6:] == b[6:]


class DecomposedPotential:
    """Evaluate ``model`` on a system whose atoms are owned by the ranks of a group.

    Args:
        model: per-atom-energy model (:class:`~xnn.models.base.AtomisticModel`) with a
            finite ``cutoff`` (Å).
        manager_or_group: a :class:`~xnn.distributed.DistributedManager` (all ranks), a
            :class:`~xnn.distributed.ParallelDims` (its ``dd`` axis), a process group, or
            ``None`` (all ranks if ``torch.distributed`` is initialised, else one process).
        layout: a :class:`~xnn.distributed.domain.layout.SpatialLayout` (boxes, mode halo or
            sync) or a :class:`~xnn.distributed.graph.layout.GraphLayout` (index blocks).
        skin: Verlet skin (Å): ghosts and local edges are reused until an atom moved more
            than ``skin / 2``.
        backend: neighbor-list backend.

    Attributes:
        state: the :class:`~xnn.distributed.domain.state.DomainState` of the last rebuild
            (``None`` before the first).
        reason: why mode ``auto`` chose this layout (``None`` for a mode given by name).
    """

    def __init__(self, model, manager_or_group, layout, skin: float = 0.0,
                 backend: str = "auto"):
        cutoff, hops = model_cutoff(model)
        if skin < 0:
            raise InputError(f"skin must be >= 0, got {skin}")
        self.model, self.layout, self.backend = model, layout, backend
        self.skin, self.cutoff = float(skin), cutoff
        self.group, self.device = resolve_group(manager_or_group)
        self.size, self.rank = C.group_size(self.group), C.group_rank(self.group)
        layout.configure(model, cutoff, hops, self.skin, self.size)
        self.state: DomainState | None = None
        self.n_total: int | None = None
        self.reason: str | None = None
        self._last_positions: Tensor | None = None
        self._last_eval = None  # (local positions, domain, owned ids) of the last call
        self._last_cell: Tensor | None = None
        self._pending = None  # update()'s reduced migration criteria (see maybe_rebuild)
        self._root = None  # rank 0, single points: the last fresh scatter and the owners

    # ------------------------------------------------------------------ the layout's words
    @property
    def mode(self) -> str:
        """``"halo"``, ``"sync"`` or ``"graph"`` (resolved; see :data:`~.modes.MODES`)."""
        return self.layout.mode

    @property
    def grid(self):
        """The box grid ``(px, py, pz)`` (``None`` before the first partition, and in mode
        graph)."""
        return self.layout.grid

    @property
    def halo_width(self) -> float:
        """Å: the ghost shell (spatial) or the edges' reach (graph)."""
        return self.layout.halo_width

    @property
    def long_range(self) -> list:
        """The model's long-range modules whose global sums are all-reduced."""
        return self.layout.long_range

    @property
    def filters(self) -> bool:
        """With a skin the model sees the local edges within the cutoff only."""
        return self.layout.filters

    @property
    def reducer(self):
        """The MD engine's reducer over this group (global sums, maxima and flags)."""
        from xnn.distributed.reducer import GroupReducer

        return GroupReducer(self.group)

    # ------------------------------------------------------------------ start-up, output
    def scatter(self, graph: AtomicGraph | None, owner: Tensor | None = None) -> AtomicGraph:
        """This rank's owned atoms of rank 0's ``graph`` (collective; see :func:`scatter`).

        With ``owner`` (rank 0: each atom's rank) atoms go where told, and the ghost plan is
        rebuilt when first needed; otherwise the layout places them (spatial: each atom to
        its box, and the plan is built; graph: blocks of the atom order).
        """
        device = self.device or model_device(self.model)
        if owner is None:
            owner = self.layout.owners(graph, self.group, self.rank, self.size)
        owned, grid, n_total, _ = scatter(graph, self.group, self.halo_width,
                                          self.layout.grid, device, owner, self.layout.balance)
        self.n_total = n_total
        if grid is not None:  # every rank knows: atoms went to their boxes
            self.layout.grid = grid
            self._rebuild(owned, migrated=owned.positions)
        return owned

    def adopt(self, owned: AtomicGraph, n_total: int, grid=None) -> AtomicGraph:
        """Take ``owned`` as this rank's atoms, placed by the caller (a sharded checkpoint
        read by every rank): the state :meth:`scatter` leaves. With ``grid`` the atoms are
        those of this rank's box of that grid and the plan is built; without, ownership is
        as given and the plan is built when first needed. Collective with a grid."""
        self.n_total = n_total
        if grid is not None:
            self.layout.grid = tuple(grid)
            self._rebuild(owned, migrated=owned.positions)
        return owned

    def gather(self, graph: AtomicGraph, extra: Mapping[str, Tensor] | None = None,
               dst: int = 0):
        """The whole system on rank ``dst`` by atom id: see :func:`state.gather`."""
        return gather(graph, self.group, extra, dst)

    # ------------------------------------------------------------------ rebuilds
    def _rebuild(self, graph: AtomicGraph, part=None, migrated: Tensor | None = None,
                 counters: Counters | None = None) -> None:
        with C.guarded(self.group, "species check"):
            if graph.n_systems != 1:
                raise InputError(f"domain decomposition takes one system, got {graph.n_systems}")
            self.model.check_species(graph.numbers)
        local = self.layout.build(graph, self, part)
        counters = counters or (self.state.counters if self.state else Counters())
        ref = graph.without_edges().replace(positions=graph.positions.detach().clone(),
                                            cell=graph.cell.detach().clone())
        self.state = DomainState(ref, local, self.n_total, migrated,
                                 dataclasses.replace(counters, rebuilds=counters.rebuilds + 1))

    def check_total(self, n_total: int) -> None:
        """Refuse owned graphs that do not add up to the scattered atoms (all ranks agree:
        ``n_total`` is a sum over the group)."""
        if self.n_total is None:
            self.n_total = n_total
        elif n_total != self.n_total:
            raise InputError(f"the ranks hold {n_total} atoms, but {self.n_total} were "
                             "scattered; pass each rank its owned graph (from scatter or "
                             "maybe_migrate)")

    def _changed(self, graph: AtomicGraph) -> bool:
        """Rank-local: the graph is not of the atoms of the last rebuild (ids or pbc), or the
        layout says its ghosts changed (a host engine's new ghost list); a changed cell
        counts through :meth:`_deformation`."""
        st = self.state
        return (st is None or graph.n_atoms != st.n_owned
                or not torch.equal(graph.atom_id, st.graph.atom_id)
                or not torch.equal(graph.pbc, st.graph.pbc) or self.layout.stale(st))

    def _deformation(self, cell: Tensor) -> float:
        """How much a cell change since the last rebuild moved the local images (Å):
        ``max |shift @ (cell - cell_ref)|`` over this rank's image shifts.

        A pair's separation changes by the two atoms' displacements plus the change of
        their image offsets, so the plan stays complete while ``max displacement +
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
        """Rebuild ghosts and edges (not ownership) if stale; True if rebuilt. Collective:
        one all-reduce (maximum), which also carries :meth:`maybe_rebuild`'s criteria of
        these positions (see :meth:`_migration_criteria`)."""
        changed = self._changed(graph)
        disp = 0.0 if changed else (self._max_disp(graph.positions.detach(),
                                                   self.state.ref_positions)
                                    + self._deformation(graph.cell))
        criteria = self._migration_criteria(graph, changed, disp)
        flags = C.all_reduce_max(torch.tensor([float(changed), disp, *criteria],
                                              dtype=torch.float64, device=graph.device),
                                 self.group).tolist()
        rebuild = flags[0] > 0 or flags[1] > 0.5 * self.skin
        if rebuild:
            st = self.state
            same = (st is not None and st.migrated is not None and graph.n_atoms == st.n_owned
                    and torch.equal(graph.atom_id, st.graph.atom_id))
            self._rebuild(graph, migrated=st.migrated if same else None)
        if criteria:  # the criteria of the branch taken, for maybe_rebuild at these positions
            self._pending = (self._key(graph), flags[6:10] if rebuild else flags[2:6])
        return rebuild

    def _key(self, graph: AtomicGraph) -> tuple:
        """What :meth:`maybe_rebuild` may reuse :meth:`update`'s criteria for: the very
        tensors of the evaluated graph, the domain state and the last step's positions
        (identity, which every rank's code path changes alike, so every rank agrees), and the
        positions' and cell's versions (an in-place change between them counts); ``None``
        for inference tensors, which have no version."""
        pos, cell = graph.positions, graph.cell
        if pos.is_inference() or cell.is_inference():
            return None
        return (pos, cell, graph.atom_id, graph.pbc, self.state, self._last_positions,
                pos._version, cell._version)

    def _criteria(self, graph: AtomicGraph, changed: bool, st: DomainState | None,
                  ref_disp: float) -> list[float]:
        """This rank's ``[unknown, drift, since migration, last step]`` of
        :meth:`maybe_rebuild` (Å): ``changed`` means ownership unknown (then zeros)."""
        if changed or st is None or st.migrated is None:
            return [1.0, 0.0, 0.0, 0.0]
        pos, last = graph.positions.detach(), self._last_positions
        step = 0.0 if last is None or last.shape != pos.shape else self._max_disp(pos, last)
        return [0.0, ref_disp, self._max_disp(pos, st.migrated), step]

    def _migration_criteria(self, graph: AtomicGraph, changed: bool, disp: float
                            ) -> list[float]:
        """:meth:`maybe_rebuild`'s criteria at ``graph``'s positions, both as they are now
        and as they will be if :meth:`update` rebuilds (then the drift is 0 and the
        migration reference is kept for the same atoms): 8 numbers, reduced in
        :meth:`update`'s all-reduce (none when atoms never migrate)."""
        if not self.layout.migrates:
            return []
        st = self.state
        now = self._criteria(graph, changed, st, disp)
        same = (st is not None and st.migrated is not None and graph.n_atoms == st.n_owned
                and torch.equal(graph.atom_id, st.graph.atom_id))
        if same and now[0] == 0.0:  # the same displacements, without the drift
            return now + [0.0, 0.0, now[2], now[3]]
        return now + self._criteria(graph, not same, st, 0.0)

    def maybe_rebuild(self, graph: AtomicGraph, extra: Mapping[str, Tensor] | None = None):
        """Between steps: migrate atoms to their owners and rebuild, when needed. Collective.

        Nothing migrates in a layout whose ownership has no geometry (graph). Otherwise
        migrates when the displacement since the last rebuild (with the images' move by a
        changed cell, :meth:`_deformation`) plus that of the last step exceeds ``skin / 2``
        (so that the next step's evaluation rarely has to rebuild the ghosts itself), when
        atoms moved more than ``skin / 2`` since the last migration, or when ownership is
        unknown (a graph not made by :meth:`scatter` or a migration, e.g. read from a
        checkpoint shard).

        Args:
            graph: this rank's owned atoms.
            extra: per-atom tensors ``[n_owned, ...]`` that move with the atoms.
        Returns:
            ``(graph, extra)``: the same objects when nothing moved; else the new owned
            atoms sorted by atom id, with every atom-scope field and the extras.
        """
        if not self.layout.migrates:
            return graph, extra
        st, pos = self.state, graph.positions.detach()
        pending, self._pending = self._pending, None
        if pending is not None and _same_key(pending[0], self._key(graph)):
            flags = pending[1]  # reduced by update() at these very positions: no collective
        else:
            changed = self._changed(graph)
            ref_disp = 0.0 if changed or st.migrated is None else (
                self._max_disp(pos, st.ref_positions) + self._deformation(graph.cell))
            flags = C.all_reduce_max(torch.tensor(self._criteria(graph, changed, st, ref_disp),
                                                  dtype=torch.float64, device=graph.device),
                                     self.group).tolist()
        half = 0.5 * self.skin
        self._last_positions = pos
        if not (flags[0] > 0 or flags[1] + flags[3] > half or flags[2] > half):
            return graph, extra
        graph, extra, sent, received, part = self.layout.migrate(graph, extra, self)
        c = self.state.counters if self.state else Counters()
        c = dataclasses.replace(c, migrations=c.migrations + 1, sent=c.sent + sent,
                                received=c.received + received)
        self._rebuild(graph, part, migrated=graph.positions.detach().clone(), counters=c)
        self._last_positions = graph.positions.detach()
        return graph, extra

    def maybe_migrate(self, state):
        """An :class:`~xnn.dynamics.MDState` with atoms (and forces) moved to their owners
        when :meth:`maybe_rebuild` decides so; the same state otherwise. Collective."""
        graph, extra = self.maybe_rebuild(state.graph, {K.FORCES: state.forces})
        if graph is state.graph:
            return state
        return state.replace(graph=graph, forces=extra[K.FORCES])

    # ------------------------------------------------------------------ checkpoints
    def reference(self, graph: AtomicGraph) -> dict | None:
        """What a checkpoint needs to continue bitwise on as many ranks (rank-local).

        Args:
            graph: this rank's owned atoms, as last passed to :meth:`maybe_rebuild`.
        Returns:
            ``None`` unless the last rebuild is of these atoms and knows where they were at
            the last migration (never in mode graph: a resumed run rebuilds at its first
            step); else ``ref_positions [n_owned, 3]`` (Å, at the rebuild), ``migrated
            [n_owned, 3]`` (Å, at the migration), ``ref_cell [3, 3]`` (Å) and ``counters``.
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
            self.layout.grid = tuple(grid)
        cell = ref_cell.to(graph.cell).reshape(graph.cell.shape)
        self._rebuild(graph.replace(positions=ref_positions, cell=cell), migrated=migrated,
                      counters=dataclasses.replace(counters, rebuilds=counters.rebuilds - 1))
        self._last_positions = graph.positions.detach()

    # ------------------------------------------------------------------ evaluation
    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                 training: bool = False) -> dict[str, Tensor]:
        """Energy and stress of the whole system; energies and forces of the owned atoms.

        Collective: every rank calls it with its owned ``graph``. With ``training=True`` the
        results stay differentiable (double backward through the exchanges); backpropagate
        ``loss_r`` on every rank, where the total loss is ``sum_r loss_r`` (so divide
        replicated terms such as the energy loss by the group size), then sum parameter
        gradients over the group.

        Returns:
            ``energy [1]`` (eV, total), ``energies [n_owned]`` (eV), ``forces [n_owned, 3]``
            (eV/Å), ``virial [1, 3, 3]`` (eV) and ``stress [1, 3, 3]`` (eV/Å³, totals),
            ``atom_id [n_owned]``; for a committee (``model.committee_size > 1``) the
            members' means under these keys, with the members and their spreads
            (``energy_std [1]``, ``forces_std [n_owned]``, ``stress_std [1, 3, 3]``; see
            :mod:`xnn.distributed.committee`).
        """
        self.update(graph)
        dom, lay = self.state.local, self.layout
        need_grad = forces or stress
        k = int(self.model.committee_size)
        with torch.enable_grad() if (need_grad or training) else torch.no_grad():
            if k > 1:  # every member on its own leaves (xnn.distributed.committee)
                strained, gs = member_graphs(graph, k, forces, stress)
            else:
                strained = apply_strain(graph.without_edges(), with_strain=stress) \
                    if need_grad else None
                gs = [strained.graph if strained is not None else graph]
            xs = [lay.local_positions(dom, g.positions, g.cell) for g in gs]
            tape: list[Tensor] = list(xs)
            energies, error = None, None
            try:  # rank-local failures are agreed on with the energy's all-reduce
                with swapped_sync_points(self.model, dom, tape, enabled=lay.syncs), \
                        swapped_global_sums(lay.long_range, self.group, tape), \
                        pairing_edges(dom.paired and not training):
                    local = [lay.local_graph(graph, dom, x, g.cell) for x, g in zip(xs, gs)]
                    if k > 1:
                        local = local * (k // len(local))  # one graph: shared by the members
                        energies = self.model.member_energies(local)[:, : dom.n_owned]
                    else:
                        energies = self.model(local[0])[: dom.n_owned]
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                error = e
            if k > 1:
                C.agree(self.group, "model evaluation", error)
                out = committee_results_decomposed(self.model, energies, tape, strained,
                                                   graph, forces, stress, training,
                                                   self.group)
            else:
                out = decomposed_results(energies, None if error else tape, strained, graph,
                                         forces, stress, training, self.group, error)
        self.record_evaluation(xs[0], dom, graph.atom_id, gs[0].cell)
        if not training:
            out = {k: v.detach() for k, v in out.items()}
        return out

    # ------------------------------------------------------------------ single points
    def _owners(self, graph: AtomicGraph | None) -> Tensor | None:
        """Rank 0: the current rank of each atom, when ``graph`` is the last structure moved
        by less than ``skin / 2`` (then the ghosts stay valid); else ``None``."""
        r = self._root
        if self.rank != 0 or r is None or graph is None or "ids" not in r:
            return None
        pos = graph.positions.detach()
        if (pos.shape != r["positions"].shape or not torch.equal(graph.atom_id, r["atom_id"])
                or not torch.equal(graph.cell, r["cell"]) or not torch.equal(graph.pbc, r["pbc"])):
            return None
        if self.skin == 0:
            if not torch.equal(pos, r["positions"]):
                return None
        elif pos.shape[0] and float((pos - r["positions"]).norm(dim=-1).max()) > 0.5 * self.skin:
            return None
        rows = torch.searchsorted(r["ids"], graph.atom_id.to(r["ids"].device))
        return r["owner"][rows].to(graph.device)

    def single_point(self, graph: AtomicGraph | None = None, forces: bool = True,
                     stress: bool = True) -> dict[str, Tensor]:
        """Rank 0's ``graph`` scattered, evaluated (:meth:`__call__`) and its per-atom
        results gathered on every rank, sorted by atom id. Collective.

        Repeated calls on a structure whose atoms moved less than ``skin / 2`` since the
        last fresh scatter keep each atom on its rank, so the ghosts are reused.

        Args:
            graph: one system (rank 0's copy is used; other ranks may pass ``None``).
        Returns:
            ``energy [1]`` eV, ``energies [n_atoms]`` eV, ``forces [n_atoms, 3]`` eV/Å,
            ``stress [1, 3, 3]`` eV/Å³ and ``virial [1, 3, 3]`` eV, and ``atom_id
            [n_atoms]``: per-atom rows sorted by global atom id; a committee's
            ``forces_std [n_atoms]``, ``energies_members [K, n_atoms]`` and
            ``forces_members [K, n_atoms, 3]`` likewise, and its ``energy_std``,
            ``stress_std`` and members' energies, stresses and virials (totals).
        """
        owner = self._owners(graph)
        owned = self.scatter(graph, owner=owner)
        if self.rank == 0 and owner is None:
            g = graph.detach()
            self._root = {"atom_id": g.atom_id.clone(), "positions": g.positions.clone(),
                          "cell": g.cell.clone(), "pbc": g.pbc.clone()}
        local = self(owned, forces, stress, training=False)
        ids = C.gather_rows(local[K.ATOM_ID], self.group)
        counts = C.all_gather_tensor(torch.tensor([owned.n_atoms], device=ids.device),
                                     self.group)
        order = torch.argsort(ids)
        if self.rank == 0 and self._root is not None:
            owners = torch.repeat_interleave(torch.arange(self.size, device=ids.device),
                                             counts.flatten())
            self._root.update(ids=ids[order], owner=owners[order])
        out = {K.ENERGY: local[K.ENERGY], K.ATOM_ID: ids[order]}
        for name in (K.ENERGIES, K.FORCES, *COMMITTEE_PER_ATOM):
            if name in local:
                out[name] = C.gather_rows(local[name], self.group)[order]
        for name in COMMITTEE_MEMBER_ROWS:  # [K, n_owned, ...]: gathered along atoms
            if name in local:
                rows = C.gather_rows(local[name].transpose(0, 1).contiguous(), self.group)
                out[name] = rows[order].transpose(0, 1)
        for name in (K.STRESS, K.VIRIAL, *COMMITTEE_PER_SYSTEM):
            if name in local:
                out[name] = local[name]
        return out

    # ------------------------------------------------------------------ diagnostics
    def record_evaluation(self, x_local: Tensor, dom, ids: Tensor, cell: Tensor) -> None:
        """Remember an evaluation made outside :meth:`__call__` (the compiled decomposed
        step): local positions, the local domain, the owned atoms' ids and the cell, which
        :meth:`min_pair_distance` reads."""
        self._last_eval = (x_local.detach(), dom, ids)
        self._last_cell = cell.detach()

    def min_pair_distance(self, graph: AtomicGraph | None = None) -> tuple[Tensor, Tensor]:
        """Shortest pair with an owned atom at the last evaluation (rank-local).

        Returns:
            ``(distance [] Å, atom ids [2])``; ``inf`` and ``-1`` without pairs. Reduce the
            distance over the ranks (minimum) for a global safety check.
        """
        if self._last_eval is None:
            raise InputError("min_pair_distance needs an evaluation first")
        x, dom, ids = self._last_eval
        return self.layout.min_pair_distance(x, dom, ids, self._last_cell)

    def stats(self, count_within: bool = False) -> dict[str, object]:
        """This rank's decomposition: owned, ghost and exchanged atoms, peers, grid, counts;
        with ``count_within``, also ``n_edges_within``: the local edges shorter than the
        model's cutoff at the last evaluation (the work of models that drop the list's skin
        edges; the step-cost model's edge count)."""
        st = self.state
        if st is None:
            return {}
        d, c = st.local, st.counters
        within = {}
        if count_within and self._last_eval is not None and d.edge_index is not None \
                and self._last_eval[0].shape[0] == d.n_local:
            within["n_edges_within"] = int(edges_within(d.edge_index, self._last_eval[0],
                                                        self.cutoff).sum())
        return {**self.layout.stats(st), "n_owned": st.n_owned, "n_ghost": d.n_ghost,
                "n_edges": int(d.edge_index.shape[1]), **within, "halo_width": self.halo_width,
                "rebuilds": c.rebuilds, "migrations": c.migrations, "migrated_out": c.sent,
                "migrated_in": c.received}
