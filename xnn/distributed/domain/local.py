"""One rank's view of a decomposed system: owned atoms, ghost images, exchange plan, edges.

Local atoms are ordered ``[owned | images of owned atoms | ghosts from other ranks]``. Each
local atom is an image of an owned atom, ``x = x_owner + shift @ cell`` with an integer
``shift`` relative to the owner's (unwrapped) position; owned atoms themselves sit at their
*home* image, the one nearest to their box. Ghosts come from their owners, which push every
image of their atoms lying within the halo of a peer's region (no rank scans the system):
ids, shifts and the other per-atom fields travel once per rebuild; per evaluation only
positions (and, in mode ``"sync"``, features) travel through :func:`halo_exchange`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.halo import HaloPlan, halo_exchange
from xnn.distributed.domain.partition import Partition, sorted_images
from xnn.distributed.domain.staged import staged_routing
from xnn.distributed.domain.transport import exchange_packed, layout_of, pack, unpack
from xnn.models.base import squared_lengths
from xnn.neighbors import neighbor_list
from xnn.neighbors.pairs import pair_order

#: a paired local list keeps the reverses of the edges into far ghosts (see
#: :func:`build_local_domain`); it is used only when they add at most this fraction of the
#: edges (thin halos against the domain: large domains), else the list stays per edge
#: (the trade of extra edges against a faster step was measured with benchmarks/dd_md.py:
#: dd_md_pairs_*_halo_gloo2_s21.json at commit 1fdbda9 in benchmarks/results/).
PAIR_EXTRA_EDGES = 0.15

#: per-step or recomputed fields that do not travel with ghosts (positions travel per call)
NOT_SENT = (K.POSITIONS, K.VELOCITIES, K.FORCES, K.ENERGIES, K.BATCH)


def ghost_fields_of(graph: AtomicGraph) -> dict[str, Tensor]:
    """The per-atom fields of ``graph`` that ghosts carry (numbers, ids, masses, user
    fields...): every layout sends them once per rebuild."""
    return {k: v for k, v in graph.fields.items()
            if K.scope_of(k) == K.ATOM and k not in NOT_SENT}
_SHIFT, _POS = "__shift", "__positions"


@dataclass
class LocalDomain:
    """Ghosts, the exchange plan and the local edges of one rank (one rebuild).

    Attributes:
        partition: the box grid.
        extents: ``[n_ranks, 2, 3]`` fractional region of every rank's owned atoms (its box,
            grown to hold atoms that left it since the last migration).
        self_src: ``[n_self]`` owned row of each periodic image of an owned atom.
        shifts: ``[n_local, 3]`` long image shift of every local atom from its owner's position.
        plan: the halo exchange for ghosts owned by other ranks.
        ghost_fields: per-atom fields (numbers, ids, user fields...) of the remote ghosts,
            each ``[n_recv, ...]``, in ghost order (by peer, then image shift, then id).
        edge_index: ``[2, n_edges]`` local edges within ``cutoff + skin``.
        n_within: how many of them were shorter than ``within`` (the model's cutoff) at the
            build (0 when not counted): the compiled step's first guess of its active edges.
        paired: the edges are reverse pairs (edge ``h + k`` reverses edge ``k``,
            :func:`~xnn.neighbors.pairs.pair_order`), for a model that does its radial work
            once per pair (:func:`~xnn.models.base.edges_paired`).
    """

    partition: Partition
    extents: Tensor
    self_src: Tensor
    shifts: Tensor
    plan: HaloPlan
    ghost_fields: dict[str, Tensor] = field(default_factory=dict)
    edge_index: Tensor | None = None
    n_within: int = 0
    paired: bool = False

    @property
    def n_owned(self) -> int:
        return self.plan.n_owned

    @property
    def n_local(self) -> int:
        return int(self.shifts.shape[0])

    @property
    def n_ghost(self) -> int:
        return self.n_local - self.n_owned

    def gather_local(self, owned_values: Tensor) -> Tensor:
        """``[n_local, ...]`` rows for all local atoms from the owned rows (differentiable).

        Collective: every rank of the plan's group calls it together.
        """
        remote = halo_exchange(owned_values, self.plan)
        return torch.cat([owned_values, owned_values.index_select(0, self.self_src), remote])

    def local_positions(self, owned_positions: Tensor, cell: Tensor) -> Tensor:
        """``[n_local, 3]`` explicit positions: owner position + shift @ cell (differentiable)."""
        src = self.gather_local(owned_positions)
        return src + self.shifts.to(src.dtype) @ cell

    def local_field(self, name: str, owned: Tensor) -> Tensor:
        """``[n_local, ...]`` per-atom field ``name``: ``owned [n_owned, ...]``, then its rows
        for the owned atoms' images, then the values received with the ghosts."""
        return torch.cat([owned, owned.index_select(0, self.self_src), self.ghost_fields[name]])


def _images(part: Partition, home: Tensor, extent: Tensor, t: Tensor):
    return sorted_images(home, extent[0] - t, extent[1] + t, part.pbc)


def _push(graph: AtomicGraph, part: Partition, extents: Tensor, rank: int, halo_width: float,
          group):
    """Send each peer the images of the owned atoms within its halo; receive our ghosts.

    Returns ``(peers, send_index, self_src, self_shift, n_home, ghost fields)``.
    """
    with C.guarded(group, "ghost selection"):
        pos = graph.positions.detach()
        home, n_home = part.home(pos, rank)
        t = part.thickness(halo_width)
        rows, img = _images(part, home, extents[rank], t)
        keep = (img != 0).any(-1)  # shift 0 is the owned atom itself
        self_src, self_shift = rows[keep], img[keep] + n_home[rows[keep]]
        peers = part.peers(extents, halo_width, rank)
        static = ghost_fields_of(graph)
        layout = layout_of({**static, _SHIFT: n_home, _POS: pos})
        send_index, payloads = [], []
        for q in peers:
            r, s = _images(part, home, extents[q], t)
            send_index.append(r)
            rowfields = {k: v.index_select(0, r) for k, v in static.items()}
            rowfields.update({_SHIFT: s + n_home.index_select(0, r), _POS: pos.index_select(0, r)})
            payloads.append(pack(rowfields, layout))
    bufs = exchange_packed(peers, payloads, layout, group, "ghost exchange")
    recv = [unpack(b, layout) for b in bufs]
    empty = unpack(torch.zeros(0, layout.row_bytes, dtype=torch.uint8, device=pos.device), layout)
    ghosts = {k: torch.cat([empty[k]] + [r[k] for r in recv]) for k in layout.names}
    counts = [int(b.shape[0]) for b in bufs]
    return peers, send_index, counts, self_src, self_shift, n_home, ghosts


def _receivers(extent: Tensor, part: Partition, x: Tensor, n_owned: int, width: float) -> Tensor:
    """``[n_local]`` bool: owned atoms and atoms within ``width`` (Å) of the owned region."""
    keep = torch.arange(x.shape[0], device=x.device) < n_owned
    if width > 0:
        t = part.thickness(width)
        frac = x @ part.inv_cell
        keep |= ((frac >= extent[0] - t) & (frac <= extent[1] + t)).all(-1)
    return keep


def build_local_domain(graph: AtomicGraph, part: Partition, extents: Tensor, halo_width: float,
                       edge_cutoff: float, group, backend: str,
                       receiver_width: float | None = None,
                       within: float | None = None, paired: bool = False,
                       exchange: str = "direct") -> LocalDomain:
    """Find this rank's ghosts by owner push, agree on the exchange plan, build local edges.

    Args:
        graph: this rank's owned atoms (one system).
        part: the partition; ``extents [n_ranks, 2, 3]`` every rank's owned region.
        halo_width: Å; ghosts are all images within it of the owned region.
        edge_cutoff: Å, the local neighbor list's cutoff (``cutoff + skin``).
        receiver_width: if given, local edges keep only receivers that are owned or within
            this distance (Å) of the owned region: the others' updates never reach an owned
            energy (with ``L`` interactions, ``(L - 1) * cutoff + skin``; 0 when ghost
            features are overwritten at sync points), so their edges are wasted work.
        within: if given (Å), count the local edges shorter than it (``n_within``).
        paired: arrange the local edges as reverse pairs (``LocalDomain.paired``). The
            receiver filter then also keeps the reverse of every edge it keeps (an edge
            into a ghost beyond ``receiver_width`` from an atom within it): those ghosts'
            features never reach an owned energy (the reason they are filtered), so the
            extra edges change no result, and the radial work of each pair is done once.
            More than :data:`PAIR_EXTRA_EDGES` of them: the list stays per edge.
        exchange: ``"direct"`` (one message per peer) or ``"staged"`` (the plan carries a
            :func:`~xnn.distributed.domain.staged.staged_routing` built on the box grid).

    Collective over ``group``; rank-local failures are agreed before any other collective.
    """
    rank = C.group_rank(group)
    peers, send_index, counts, self_src, self_shift, n_home, ghosts = _push(
        graph, part, extents, rank, halo_width, group)
    plan = HaloPlan(graph.n_atoms, peers, send_index, counts, group)
    if exchange == "staged":
        plan.routing = staged_routing(plan, part.grid, part.pbc.tolist(), rank,
                                      graph.positions.device)
    with C.guarded(group, "local neighbor list"):
        pos, cell = graph.positions.detach(), part.cell.to(graph.positions.dtype)
        remote_shift, remote_pos = ghosts.pop(_SHIFT), ghosts.pop(_POS)
        shifts = torch.cat([n_home, self_shift, remote_shift])
        src = torch.cat([pos, pos.index_select(0, self_src), remote_pos])
        x = src + shifts.to(pos.dtype) @ cell
        edge_index, _ = neighbor_list(
            x, torch.zeros(1, 3, 3, dtype=x.dtype, device=x.device),
            torch.zeros(1, 3, dtype=torch.bool, device=x.device), edge_cutoff, None, backend)
        if receiver_width is not None:
            keep = _receivers(extents[rank], part, x, graph.n_atoms, receiver_width)
            kept = keep[edge_index[1]]
            if paired:  # with the reverses of the edges into far ghosts, if not too many
                both = kept | keep[edge_index[0]]
                n_kept = int(kept.sum())
                paired = int(both.sum()) - n_kept <= PAIR_EXTRA_EDGES * n_kept
                kept = both if paired else kept
            edge_index = edge_index[:, kept]
        order = None
        if paired:
            order = pair_order(edge_index, edge_index.new_zeros(edge_index.shape[1], 3))
            if order is not None:
                edge_index = edge_index[:, order]
        n_within = int(edges_within(edge_index, x, within).sum()) if within else 0
    return LocalDomain(part, extents, self_src, shifts, plan, ghosts, edge_index, n_within,
                       order is not None)


def edges_within(edge_index: Tensor, x: Tensor, cutoff: float) -> Tensor:
    """``[n_edges]`` bool: the local edges (zero shifts) shorter than ``cutoff`` at ``x``."""
    with torch.no_grad():
        d = x.detach().index_select(0, edge_index[1]) - x.detach().index_select(0, edge_index[0])
        return squared_lengths(d) < cutoff * cutoff


def min_pair_distance(x: Tensor, dom: LocalDomain, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Shortest local edge with an owned receiver: ``(distance [] Å, atom ids [2])``.

    ``x [n_local, 3]`` are local positions and ``ids [n_local]`` their global atom ids;
    ``inf`` and ids ``-1`` when there is no such edge.
    """
    ei = dom.edge_index
    ei = ei[:, ei[1] < dom.n_owned]
    if not ei.shape[1]:
        return x.new_tensor(float("inf")), ids.new_full((2,), -1)
    d = (x.index_select(0, ei[0]) - x.index_select(0, ei[1])).norm(dim=-1)
    e = int(torch.argmin(d))
    return d[e], torch.stack([ids[ei[1, e]], ids[ei[0, e]]])


def local_graph(graph: AtomicGraph, dom: LocalDomain, positions: Tensor,
                owned_only: bool = False, extra: dict[str, Tensor] | None = None,
                cutoff: float | None = None) -> AtomicGraph:
    """The non-periodic graph of the local atoms (owned + ghosts) at explicit ``positions``.

    Per-atom fields are the owned ``graph``'s (for owned atoms and their images) and those
    received with the ghosts; system fields other than cell and pbc are copied.
    ``owned_only``: mark the graph so that models update only the owned atoms' features
    (``K.N_UPDATE``); the ghosts' features then come from the sync points' exchanges.
    ``extra``: further system fields (the long-range fields of
    :func:`~xnn.distributed.domain.longrange.domain_fields`). ``cutoff``: keep only the
    edges shorter than it at ``positions`` (a Verlet list with a skin holds longer ones,
    which the model weighs zero; one host sync), as the one-process
    :meth:`~xnn.models.Potential.model_graph` does.
    """
    fields = {name: dom.local_field(name, graph[name]) for name in dom.ghost_fields}
    device = positions.device
    edge_index = dom.edge_index
    if cutoff is not None and edge_index.shape[1]:
        if dom.paired:  # a pair's two edges have the same length: one mask for both halves
            keep = edges_within(edge_index[:, : edge_index.shape[1] // 2], positions, cutoff)
            edge_index = edge_index[:, torch.cat([keep, keep])]
        else:
            edge_index = edge_index[:, edges_within(edge_index, positions, cutoff)]
    return assemble_local_graph(
        graph, fields, positions, torch.zeros(1, 3, 3, dtype=positions.dtype, device=device),
        torch.zeros(1, 3, dtype=torch.bool, device=device), edge_index,
        torch.zeros(edge_index.shape[1], 3, dtype=torch.long, device=device),
        dom.n_owned if owned_only else None, extra)


_SYSTEM_RESULTS = (K.ENERGY, K.STRESS, K.VIRIAL, K.CELL, K.PBC)


def assemble_local_graph(graph: AtomicGraph, atom_fields: dict[str, Tensor],
                         positions: Tensor, cell: Tensor, pbc: Tensor, edge_index: Tensor,
                         shifts: Tensor, n_update: int | None = None,
                         extra: dict[str, Tensor] | None = None) -> AtomicGraph:
    """The one system graph of a rank's local atoms, in every layout.

    Args:
        graph: the owned atoms (its system fields other than results, cell and pbc are
            copied).
        atom_fields: per-atom fields of the local atoms, each ``[n_local, ...]``.
        positions: ``[n_local, 3]`` (Å; may be strained, differentiable).
        cell, pbc: ``[1, 3, 3]`` and ``[1, 3]`` of the local graph (zeros for explicit
            positions).
        edge_index, shifts: ``[2, n_edges]`` local rows and ``[n_edges, 3]`` image shifts.
        n_update: mark the graph so that models update only the first ``n_update`` atoms'
            features (``K.N_UPDATE``); the others' come from the sync points' exchanges.
        extra: further system fields (long-range fields).
    """
    fields = dict(atom_fields)
    for name, value in graph.fields.items():
        if K.scope_of(name) == K.SYSTEM and name not in _SYSTEM_RESULTS:
            fields[name] = value
    device = positions.device
    fields[K.POSITIONS] = positions
    fields[K.BATCH] = torch.zeros(positions.shape[0], dtype=torch.long, device=device)
    fields[K.CELL] = cell
    fields[K.PBC] = pbc
    if n_update is not None:
        fields[K.N_UPDATE] = torch.tensor([n_update], device=device)
    fields.update(extra or {})
    fields[K.EDGE_INDEX] = edge_index
    fields[K.SHIFTS] = shifts
    return AtomicGraph(fields, validate=False)
