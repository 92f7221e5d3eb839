"""``HostLayout``: a host MD engine (LAMMPS) owns the partition, the ghosts and migration.

The layout of a :class:`~xnn.distributed.potential.DecomposedPotential` inside another
program's domain decomposition. The host gives each rank its owned atoms (the graph passed
to the potential) and, before every evaluation, its ghost atoms (:class:`HostGhosts`: their
global ids and positions, images of atoms that some rank owns). From these the layout builds
the same :class:`~xnn.distributed.domain.local.LocalDomain` as the spatial layout: a ghost
is its owner's position plus an integer image shift of the cell, so forces on ghosts flow
back to their owners through the reverse halo exchange and the virial comes from the strain,
as in every other decomposed evaluation. The owners' positions are not exchanged per step:
the host's ghost positions, which its own forward communication brought, stand for them
(the exchange's values without its messages; its adjoint, the reverse exchange, stays).
Mode ``halo`` needs the host's ghosts to reach the whole receptive field (+ skin); mode
``sync`` one cutoff (+ skin), the model's sync points then exchanging ghost features per
layer.

Per-atom virials (``peratom_virial``, when the host asks for them): the local graph is given
to the model in edge form (:class:`~xnn.models.derivatives.EdgeGradients`), each local
edge's virial goes half to each of its atoms, and the ghosts' halves go home to their owners
through the same reverse exchange as their forces (:meth:`HostLayout.virials`).

Who owns a ghost: :func:`~xnn.distributed.host.owners.ghost_owners` asks only the ranks
whose owned atoms' box can hold each ghost (an ``O(n_ranks)`` all-gather of boxes, then ids
and rows point to point): per rank the lookup's traffic and memory follow its ghosts and the
owned atoms other ranks hold as ghosts, never the whole system. It runs once per rebuild of
the host's ghost list, not per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.halo import HaloPlan, reverse_halo_exchange
from xnn.distributed.domain.local import (
    LocalDomain,
    ghost_fields_of,
    local_graph,
    min_pair_distance,
)
from xnn.distributed.domain.longrange import long_range_modules
from xnn.distributed.host.owners import ghost_owners
from xnn.errors import InputError
from xnn.models.derivatives import EdgeGradients
from xnn.neighbors import neighbor_list

#: how far (Å) a host ghost may sit from its owner's position plus a whole image shift
IMAGE_TOLERANCE = 1e-6



@dataclass
class HostGhosts:
    """A rank's ghost atoms as the host holds them, before one evaluation.

    Attributes:
        ids: ``[n_ghost]`` global atom ids (the owned graph's ``atom_id`` numbering), on
            the CPU: compared at every evaluation to see whether the host rebuilt them.
        positions: ``[n_ghost, 3]`` Å (CPU), in the frame of the owned positions: each an
            image ``x_owner + n @ cell`` of its owner's current position (integer ``n``,
            zero along open axes), as the host's forward communication keeps them: read at
            every evaluation (the remote ghosts' rows, copied to the model's device), so
            positions are not exchanged again.
    """

    ids: Tensor
    positions: Tensor


class HostLayout:
    """Owned atoms and ghosts as a host engine decomposed them.

    Args:
        mode: ``"halo"`` (the host's ghosts reach the receptive field) or ``"sync"`` (one
            cutoff; the model's sync points exchange ghost features).

    Attributes:
        ghosts: the host's ghosts for the next evaluation (set by the host before it).
        peratom_virial: the next evaluations record the edges' gradients, whose per-atom
            virials :meth:`virials` returns (set by the host, the same on every rank).
        halo_width: (after :meth:`configure`) how far (Å) the host's ghosts must reach
            beyond each rank's region: the host's ghost cutoff.
    """

    migrates = False
    grid = None
    balance = "none"  #: boxes are not cut (see SpatialLayout)

    def __init__(self, mode: str = "halo"):
        if mode not in ("halo", "sync"):
            raise InputError(f"a host layout's mode is 'halo' or 'sync', got {mode!r}")
        self.mode = mode
        self.ghosts: HostGhosts | None = None
        self.peratom_virial = False
        self._edges: EdgeGradients | None = None  # the last evaluation's, with peratom_virial
        self._built_ids: Tensor | None = None
        self._remote: Tensor | None = None  # host ghost rows in the plan's receive order
        #: ids and rows this rank received when it last looked up its ghosts' owners
        self.lookup_received = 0

    @property
    def syncs(self) -> bool:
        return self.mode == "sync"

    def configure(self, model, cutoff: float, hops: int, skin: float, size: int) -> None:
        """Check ``model`` for this mode and set the ghost reach (called once)."""
        if self.mode == "sync" and hops > 1 and not model.sync_points:
            raise InputError(f"mode 'sync' needs a model with sync points; "
                             f"{type(model).__name__} has none (use mode 'halo')")
        self.long_range = long_range_modules(model)
        if self.long_range:
            raise InputError("a host engine's decomposition takes local models only; "
                             f"{type(model).__name__} has long-range terms "
                             f"({', '.join(type(m).__name__ for m in self.long_range)})")
        self.cutoff, self.skin = cutoff, skin
        #: with a skin the model sees the local edges within the cutoff only (the others it
        #: weighs zero): less edge work for the same result
        self.filters = skin > 0
        reach = cutoff if self.mode == "sync" else float(model.receptive_field)
        self.halo_width = reach + skin
        #: receivers that matter, in edge hops from an owned atom: 0 in mode sync (ghost
        #: features come from their owners), L - 1 for an L-layer message-passing model in
        #: mode halo; ``None`` (all) for a model that declares a wider receptive field or a
        #: receiver field (e.g. D3's coordination numbers)
        self.hops: int | None = 0 if self.mode == "sync" else hops - 1
        if self.mode == "halo" and (reach > cutoff * hops + 1e-9 or model.receiver_field > 0):
            self.hops = None

    def owners(self, graph, group, rank: int, size: int) -> None:
        raise InputError("a host layout never scatters: the host engine owns the atoms")

    def stale(self, state) -> bool:
        """Rank-local: the host's ghost list is not the one of the last build."""
        g = self.ghosts
        return g is None or self._built_ids is None or not torch.equal(g.ids, self._built_ids)

    # ------------------------------------------------------------------ the build
    def build(self, graph: AtomicGraph, pot, part=None) -> LocalDomain:
        """The :class:`LocalDomain` of the owned ``graph`` and the host's ghosts
        (collective)."""
        with C.guarded(pot.group, "host ghosts"):
            if self.ghosts is None:
                raise InputError("the host gave no ghost atoms before the evaluation")
            host = self.ghosts
            ids = graph.atom_id
            ghosts = HostGhosts(host.ids.to(ids.device),
                                host.positions.to(graph.positions))
            if ghosts.ids.numel() and int(ghosts.ids.min()) < 0:
                raise InputError("host ghost ids must be >= 0")
        found = ghost_owners(ids, graph.positions.detach(), graph.cell[0].detach(),
                             graph.pbc[0], ghosts.ids, ghosts.positions, pot.group,
                             IMAGE_TOLERANCE)
        pot.check_total(found.n_total)
        plan, self_src, order = found.plan, found.self_src, found.order
        self.lookup_received = found.ids_received
        fields = _ghost_fields(graph, plan, pot.group)
        with C.guarded(pot.group, "ghost images"):
            pos, cell = graph.positions.detach(), graph.cell[0].detach()
            owner_pos = torch.cat([pos.index_select(0, self_src), fields.pop("__pos")])
            shifts = _image_shifts(ghosts.positions[order] - owner_pos, cell, graph.pbc[0],
                                   ghosts.ids[order])
            shifts = torch.cat([shifts.new_zeros(graph.n_atoms, 3), shifts])
            x = torch.cat([pos, owner_pos]) + shifts.to(pos.dtype) @ cell
            edge_index, _ = neighbor_list(
                x, torch.zeros(1, 3, 3, dtype=x.dtype, device=x.device),
                torch.zeros(1, 3, dtype=torch.bool, device=x.device),
                self.cutoff + self.skin, None, pot.backend)
            if self.hops is not None:
                edge_index = _within_hops(edge_index, graph.n_atoms, x.shape[0], self.hops)
        self._built_ids = host.ids.clone()
        self._remote = order[self_src.numel():]
        return LocalDomain(None, torch.zeros(0), self_src, shifts, plan, fields, edge_index)

    def migrate(self, graph, extra, pot):  # pragma: no cover - never called (migrates False)
        raise RuntimeError("the host engine migrates atoms")

    # ------------------------------------------------------------------ evaluation
    def local_positions(self, dom, positions: Tensor, cell: Tensor) -> Tensor:
        """``[n_local, 3]`` explicit positions of owned atoms and ghosts: the remote ghosts
        at the host's positions (its own forward communication brought them: no exchange
        here), still differentiable with respect to their owners' positions (through the
        reverse exchange) and the cell."""
        cell = cell[0]
        n_remote = dom.plan.n_recv
        at = self.ghosts.positions.index_select(0, self._remote.to(
            self.ghosts.positions.device)).to(positions)
        shifts = dom.shifts.to(positions.dtype)
        owner = at - shifts[dom.n_local - n_remote:] @ cell.detach()
        remote = _Delivered.apply(positions, owner, dom.plan)
        src = torch.cat([positions, positions.index_select(0, dom.self_src), remote])
        return src + shifts @ cell

    def local_graph(self, graph: AtomicGraph, dom, x: Tensor, cell: Tensor) -> AtomicGraph:
        """The non-periodic local graph (see :func:`~.domain.local.local_graph`); in edge
        form with :attr:`peratom_virial`."""
        g = local_graph(graph, dom, x, self.mode == "sync", None,
                        self.cutoff if self.filters else None)
        self._edges = EdgeGradients() if self.peratom_virial else None
        return g if self._edges is None else self._edges.edge_form(g)

    def virials(self, dom) -> Tensor:
        """``[n_owned, 3, 3]`` (eV) per-atom virials of the owned atoms after an evaluation
        with :attr:`peratom_virial` (collective): every local edge's virial half to each of
        its atoms, the halves of ghosts summed into their owners (images of owned atoms
        here, remote ghosts through the reverse halo exchange, as their forces)."""
        if self._edges is None:
            raise InputError("per-atom virials need an evaluation with peratom_virial set")
        n, n_self = dom.n_owned, dom.self_src.numel()
        w = self._edges.virials(dom.n_local).reshape(dom.n_local, 9)
        own = w[:n].index_add(0, dom.self_src.to(w.device), w[n:n + n_self])
        own = own + reverse_halo_exchange(w[n + n_self:].contiguous(), dom.plan)
        return own.reshape(n, 3, 3)

    def min_pair_distance(self, x: Tensor, dom, ids: Tensor, cell) -> tuple[Tensor, Tensor]:
        return min_pair_distance(x, dom, dom.local_field(K.ATOM_ID, ids))

    def stats(self, st) -> dict[str, object]:
        d = st.local
        return {"grid": None, "n_held": st.n_owned + d.n_ghost, "n_recv": d.plan.n_recv,
                "n_send": d.plan.n_send, "n_peers": len(d.plan.peers), "paired": False,
                "lookup_received": self.lookup_received}


class _Delivered(torch.autograd.Function):
    """Remote ghost rows the host delivered: the values of the forward halo exchange of
    ``owned`` without its communication; the adjoint is the reverse exchange, as for
    :func:`~xnn.distributed.domain.halo.halo_exchange`."""

    @staticmethod
    def forward(ctx, owned: Tensor, rows: Tensor, plan: HaloPlan) -> Tensor:
        ctx.plan = plan
        return rows.detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return reverse_halo_exchange(grad.contiguous(), ctx.plan), None, None


def _ghost_fields(graph: AtomicGraph, plan: HaloPlan, group) -> dict[str, Tensor]:
    """The remote ghosts' per-atom fields (and owner positions as ``__pos``), received
    once per build from their owners."""
    static = ghost_fields_of(graph)
    static["__pos"] = graph.positions.detach()
    return {k: plan.forward_comm(v) for k, v in static.items()}


def _image_shifts(d: Tensor, cell: Tensor, pbc: Tensor, ids: Tensor) -> Tensor:
    """``[n, 3]`` integer image shifts ``n`` with ``d = n @ cell`` (refused otherwise)."""
    if not d.shape[0]:
        return torch.zeros(0, 3, dtype=torch.long, device=d.device)
    periodic = pbc.to(torch.bool)
    frac = torch.zeros_like(d)
    if bool(periodic.any()):
        frac = d @ torch.linalg.inv(torch.where(periodic[:, None], cell, torch.eye(
            3, dtype=cell.dtype, device=cell.device)))
    n = torch.where(periodic, torch.round(frac), torch.zeros_like(frac))
    miss = (d - n @ cell).norm(dim=-1)
    bad = miss > IMAGE_TOLERANCE
    if bool(bad.any()):
        k = int(torch.nonzero(bad)[0])
        raise InputError(f"host ghost of atom id {int(ids[k])} is {float(miss[k]):.3g} Å "
                         "from every image of its owner: not a periodic image")
    return n.to(torch.long)


def _within_hops(edge_index: Tensor, n_owned: int, n_local: int, hops: int) -> Tensor:
    """The edges whose receiver is at most ``hops`` edges from an owned atom: the others'
    updates never reach an owned energy (edges ``[2, E]``: row 0 sender, row 1 receiver)."""
    keep = torch.arange(n_local, device=edge_index.device) < n_owned
    for _ in range(hops):
        reached = keep.clone()
        reached[edge_index[0, keep[edge_index[1]]]] = True
        keep = reached
    return edge_index[:, keep[edge_index[1]]]

