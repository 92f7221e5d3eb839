"""``DomainDecomposed``: evaluate a model on one system split over the ranks of a group.

Each rank owns the atoms of one box and holds ghosts within ``halo_width`` of it. Owned
positions are autograd leaves; a symmetric strain ``ε`` deforms them and the cell, and ghosts
are built *from the strained owners and strained cell* through the halo exchange,
``x_ghost = exchange(x_owner (1 + ε)) + shift @ cell (1 + ε)``. Then

* ``E = all_reduce(sum of owned energies)``,
* ``F_owned = -∂E/∂x_owned`` (the exchange's backward sums ghost gradients into owners),
* ``W = -all_reduce(∂E_r/∂ε_r)``, ``σ = -W / V``.

Each rank differentiates its own share ``E_r`` of the energy; the exchange's adjoint makes
the per-rank gradient the gradient of the total. No force is communicated by hand.

Modes: ``"halo"`` (v1) uses ``halo_width = receptive_field + skin`` and runs the model
unchanged, exact for any local model. ``"sync"`` (v2) swaps the model's sync points (see
:class:`xnn.models.base.SyncPoint`) for halo feature exchanges, so ``halo_width = cutoff +
skin`` whatever the depth.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.local import LocalDomain, build_local_domain, local_graph
from xnn.distributed.domain.partition import parse_grid
from xnn.distributed.domain.sync import swapped_sync_points
from xnn.errors import InputError

_MODES = ("auto", "halo", "sync")


def resolve_mode(model, mode: str) -> str:
    """``"halo"`` or ``"sync"``: ``"auto"`` picks ``"sync"`` for models with sync points."""
    if mode not in _MODES:
        raise InputError(f"mode must be one of {list(_MODES)}, got {mode!r}")
    if mode == "auto":
        return "sync" if getattr(model, "sync_points", None) else "halo"
    return mode


def _resolve_group(manager_or_group):
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


class DomainDecomposed:
    """Evaluate ``model`` on a system spread over the ranks of a group (every rank calls it).

    Args:
        model: per-atom-energy model with ``cutoff`` (Å) and ``num_interactions``.
        manager_or_group: a :class:`~xnn.distributed.DistributedManager` (all ranks), a
            :class:`~xnn.distributed.ParallelDims` (its ``dd`` axis), a process group, or
            ``None`` (all ranks if ``torch.distributed`` is initialised, else one process).
        grid: ``(px, py, pz)`` boxes, ``"2,1,1"``, or ``None`` (smallest halo surface).
        skin: Verlet skin (Å); the partition and local edges are reused until an atom moved
            more than ``skin / 2`` (ownership is then refreshed).
        mode: ``"halo"`` (v1, any local model), ``"sync"`` (v2, models with sync points) or
            ``"auto"`` (sync for models with sync points, else halo).
        backend: neighbor-list backend for the local (non-periodic) graphs.
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
        self.group, self.device = _resolve_group(manager_or_group)
        self.grid = parse_grid(grid)
        self.skin = float(skin)
        self.mode = mode
        self.backend = backend
        self.cutoff = cutoff
        depth = 1 if mode == "sync" else hops
        # receivers farther than (depth - 1) hops + skin from the box never reach an owned
        # energy: their edges are dropped (all ghosts when depth is 1)
        self.receiver_width = cutoff * (depth - 1) + self.skin if depth > 1 else 0.0
        self.halo_width = cutoff * depth + self.skin
        self.size, self.rank = C.group_size(self.group), C.group_rank(self.group)
        self.domain: LocalDomain | None = None
        self.n_builds = 0

    # ------------------------------------------------------------------ set-up
    def broadcast(self, graph: AtomicGraph | None) -> AtomicGraph:
        """Rank 0's graph on every rank (other ranks may pass ``None``)."""
        with C.guarded(self.group, "input check"):
            if self.rank == 0:
                if graph is None:
                    raise InputError("rank 0 must pass the graph to DomainDecomposed")
                if graph.n_systems != 1:
                    raise InputError("domain decomposition takes one system, "
                                     f"got {graph.n_systems}")
        if self.size > 1:
            fields = None if self.rank != 0 else {
                k: v.detach().cpu() for k, v in graph.fields.items() if K.scope_of(k) != K.EDGE}
            fields = C.broadcast_object(fields, self.group)
            graph = AtomicGraph(fields, validate=False)
        device = self.device or _model_device(self.model) or graph.device
        return graph.without_edges().to(device)

    def _needs_rebuild(self, graph: AtomicGraph) -> bool:
        d = self.domain
        stale = (d is None or d.ref_positions.shape != graph.positions.shape
                 or not torch.equal(d.ref_ids, graph.atom_id)
                 or not torch.equal(d.ref_cell, graph.cell.detach()))
        if not stale and self.skin == 0:
            stale = not torch.equal(graph.positions.detach(), d.ref_positions)
        elif not stale and graph.n_atoms:
            disp = (graph.positions.detach() - d.ref_positions).norm(dim=-1)
            stale = bool(disp.max() > 0.5 * self.skin)
        flag = torch.tensor([float(stale)], device=graph.device)
        return bool(C.all_reduce_(flag, self.group).item() > 0)  # every rank takes one branch

    def local_domain(self, graph: AtomicGraph) -> LocalDomain:
        """This rank's domain for ``graph`` (rebuilt when atoms moved more than skin / 2)."""
        if self._needs_rebuild(graph):
            self.domain = build_local_domain(graph, self.size, self.rank, self.halo_width,
                                             self.cutoff + self.skin, self.grid, self.group,
                                             self.backend, self.receiver_width)
            self.n_builds += 1
        return self.domain

    # ------------------------------------------------------------------ evaluation
    def evaluate_local(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                       training: bool = False) -> dict[str, Tensor]:
        """Energy (all ranks), and this rank's owned per-atom energies and forces.

        ``graph`` must be the same on every rank (see :meth:`broadcast`). With
        ``training=True`` the results stay differentiable (double backward through the
        exchange); backpropagate ``loss_r`` on every rank, where the total loss is
        ``sum_r loss_r`` (so divide replicated terms such as the energy loss by the group
        size), then sum parameter gradients over the group.

        Returns:
            ``energy [1]`` (eV, total), ``energies [n_owned]``, ``forces [n_owned, 3]``,
            ``virial [1, 3, 3]`` and ``stress [1, 3, 3]`` (totals), ``atom_id [n_owned]``.
        """
        model = self.model
        check = getattr(model, "check_species", None)
        if check is not None:
            with C.guarded(self.group, "species check"):
                check(graph.numbers)
        dom = self.local_domain(graph)
        need_grad = forces or stress
        with torch.enable_grad() if need_grad else torch.no_grad():
            pos = graph.positions[dom.owned].detach().requires_grad_(forces)
            strain = torch.zeros_like(graph.cell[0]).requires_grad_(stress)
            sym = 0.5 * (strain + strain.T)
            pos_s, cell_s = pos + pos @ sym, graph.cell[0] + graph.cell[0] @ sym
            tape: list[Tensor] = []
            x = dom.local_positions(pos_s, cell_s)
            tape.append(x)
            with C.guarded(self.group, "model evaluation"), \
                    swapped_sync_points(model, dom, tape, enabled=self.mode == "sync"):
                lg = local_graph(graph, dom, x, owned_only=self.mode == "sync")
                energies = model(lg)[: dom.n_owned]
            e_local = energies.sum()
            # every exchange must be part of every rank's backward, even where the model
            # ignores it (a rank with no atoms): add exact zeros that depend on them
            e_local = e_local + sum((0.0 * t.sum() for t in tape), e_local.new_zeros(()))
            energy = C.all_reduce_sum(e_local.reshape(1), self.group)
            out = {K.ENERGY: energy, K.ENERGIES: energies, K.ATOM_ID: graph.atom_id[dom.owned]}
            if need_grad:
                out.update(self._derive(e_local, pos, strain, graph, forces, stress, training))
        if not training:
            out = {k: v.detach() for k, v in out.items()}
        return out

    def _derive(self, e_local, pos, strain, graph, forces, stress, training):
        inputs = ([pos] if forces else []) + ([strain] if stress else [])
        grads = torch.autograd.grad(e_local, inputs, create_graph=training, allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
        out = {}
        if forces:
            out[K.FORCES] = -grads[0]
        if stress:
            g = C.all_reduce_sum(grads[-1].unsqueeze(0), self.group)  # dE/dε [1, 3, 3]
            out[K.VIRIAL] = -g
            vol = graph.volume()
            periodic = bool(graph.pbc[0].all())
            out[K.STRESS] = g / vol[:, None, None] if periodic else torch.zeros_like(g)
        return out

    def __call__(self, graph: AtomicGraph | None = None, forces: bool = True,
                 stress: bool = True, replicated: bool = False) -> dict[str, Tensor]:
        """Energy, per-atom energies, forces and stress of rank 0's ``graph``, on every rank.

        Args:
            graph: one system (rank 0's copy is used; other ranks may pass ``None``).
            replicated: the caller guarantees that every rank passes the same graph (e.g. a
                dynamics loop run identically on every rank from these gathered forces);
                skips the broadcast from rank 0.
        Returns:
            ``energy [1]`` eV, ``energies [n_atoms]`` eV, ``forces [n_atoms, 3]`` eV/Å,
            ``stress [1, 3, 3]`` eV/Å³ and ``virial [1, 3, 3]`` eV, and ``atom_id
            [n_atoms]``: per-atom rows sorted by global atom id.
        """
        if replicated:
            device = self.device or _model_device(self.model) or graph.device
            graph = graph.without_edges().to(device)
        else:
            graph = self.broadcast(graph)
        local = self.evaluate_local(graph, forces, stress, training=False)
        ids = C.gather_rows(local[K.ATOM_ID], self.group)
        order = torch.argsort(ids)
        out = {K.ENERGY: local[K.ENERGY], K.ATOM_ID: ids[order]}
        for name in (K.ENERGIES, K.FORCES):
            if name in local:
                out[name] = C.gather_rows(local[name], self.group)[order]
        for name in (K.STRESS, K.VIRIAL):
            if name in local:
                out[name] = local[name]
        return out

    def stats(self) -> dict[str, object]:
        """Sizes of this rank's domain: owned, ghost and exchanged atoms, peers, grid."""
        d = self.domain
        if d is None:
            return {}
        return {"grid": list(d.partition.grid), "n_owned": d.n_owned, "n_ghost": d.n_ghost,
                "n_recv": d.plan.n_recv, "n_send": d.plan.n_send, "n_peers": len(d.plan.peers),
                "n_edges": int(d.edge_index.shape[1]), "halo_width": self.halo_width}


def _model_device(model) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None
