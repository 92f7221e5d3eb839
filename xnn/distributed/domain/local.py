"""One rank's view of a decomposed system: owned atoms, ghost images, exchange plan, edges.

Local atoms are ordered ``[owned | images of owned atoms | ghosts from other ranks]``. Each
local atom is an image of a global atom, ``x = x_owner + shift @ cell`` with an integer
``shift`` relative to the owner's *input* (possibly unwrapped) position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.halo import HaloPlan, build_plan, halo_exchange
from xnn.distributed.domain.partition import Grid, Partition, image_shifts, make_partition
from xnn.neighbors import neighbor_list


@dataclass
class LocalDomain:
    """Owned atoms, ghosts and the exchange plan of one rank.

    Attributes:
        partition: the box grid.
        owned: ``[n_owned]`` rows of the global graph owned here (increasing).
        local_rows: ``[n_local]`` global row of every local atom.
        shifts: ``[n_local, 3]`` long image shift of every local atom.
        self_src: ``[n_self]`` owned row of each image of an owned atom.
        plan: the halo exchange for ghosts owned by other ranks.
        edge_index: ``[2, n_edges]`` local edges within ``cutoff + skin``.
        ref_positions, ref_cell: the global positions/cell the domain was built for.
    """

    partition: Partition
    owned: Tensor
    local_rows: Tensor
    shifts: Tensor
    self_src: Tensor
    plan: HaloPlan
    edge_index: Tensor
    ref_positions: Tensor
    ref_cell: Tensor
    ref_ids: Tensor

    @property
    def n_owned(self) -> int:
        return int(self.owned.numel())

    @property
    def n_local(self) -> int:
        return int(self.local_rows.numel())

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


def _rank_within_owner(owner: Tensor, n_ranks: int) -> Tensor:
    """``[n]`` index of each atom among the atoms of its owner, in global order."""
    n = owner.numel()
    order = torch.argsort(owner * max(n, 1) + torch.arange(n, device=owner.device))
    counts = torch.bincount(owner, minlength=n_ranks)
    starts = torch.cumsum(counts, 0) - counts
    out = torch.empty_like(owner)
    out[order] = torch.arange(n, device=owner.device) - starts[owner[order]]
    return out


def find_ghosts(partition: Partition, positions: Tensor, rank: int, halo_width: float):
    """Owned rows and ghost images of box ``rank``.

    Returns:
        ``(owner [n], rank_within_owner [n], wrap [n, 3], owned [n_owned], ghost_rows [g],
        ghost_shifts [g, 3])`` where the ghosts are every image of every atom inside the box
        grown by ``halo_width`` (except owned atoms themselves), shifts relative to the input
        positions.
    """
    u, wrap = partition.fractional(positions.detach())
    owner = partition.owner(u)
    within = _rank_within_owner(owner, partition.n_boxes)
    owned = torch.nonzero(owner == rank).flatten()
    low, high = partition.box_bounds(rank)
    t = partition.thickness(halo_width)
    rows, shifts = image_shifts(u, low - t, high + t, partition.pbc)
    keep = ~((owner[rows] == rank) & (shifts == 0).all(-1))
    rows, shifts = rows[keep], shifts[keep] - wrap[rows[keep]]
    return owner, within, wrap, owned, rows, shifts


def _receivers(part: Partition, rank: int, x: Tensor, n_owned: int, width: float) -> Tensor:
    """``[n_local]`` bool: owned atoms and atoms within ``width`` (Å) of box ``rank``."""
    keep = torch.arange(x.shape[0], device=x.device) < n_owned
    if width > 0:
        low, high = part.box_bounds(rank)
        t = part.thickness(width)
        frac = x @ part.inv_cell
        keep |= ((frac >= low - t) & (frac <= high + t)).all(-1)
    return keep


def build_local_domain(graph: AtomicGraph, n_ranks: int, rank: int, halo_width: float,
                       edge_cutoff: float, grid: Grid | None, group, backend: str,
                       receiver_width: float | None = None) -> LocalDomain:
    """Partition ``graph`` (one system), find this rank's ghosts, agree on the exchange plan.

    Args:
        receiver_width: if given, local edges keep only receivers that are owned or within
            this distance (Å) of the box: the others' updates never reach an owned energy
            (with ``L`` interactions, ``(L - 1) * cutoff + skin``; 0 when ghost features are
            overwritten at sync points), so their edges are wasted work.

    Collective over ``group``; rank-local failures are agreed before any other collective.
    """
    with C.guarded(group, "domain partition"):
        pos = graph.positions.detach()
        part = make_partition(pos, graph.cell[0], graph.pbc[0], n_ranks, halo_width, grid)
        owner, within, wrap, owned, rows, shifts = find_ghosts(part, pos, rank, halo_width)
        mine = owner[rows] == rank
        remote_rows, remote_shifts = rows[~mine], shifts[~mine]
        key = owner[remote_rows] * max(pos.shape[0], 1) + within[remote_rows]
        order = torch.sort(key, stable=True).indices
        remote_rows, remote_shifts = remote_rows[order], remote_shifts[order]
    plan = build_plan(owner[remote_rows], within[remote_rows], int(owned.numel()), group)
    with C.guarded(group, "local neighbor list"):
        local_rows = torch.cat([owned, rows[mine], remote_rows])
        all_shifts = torch.cat([-wrap[owned], shifts[mine], remote_shifts])
        x = pos[local_rows] + all_shifts.to(pos.dtype) @ graph.cell[0].detach()
        edge_index, _ = neighbor_list(
            x, torch.zeros(1, 3, 3, dtype=x.dtype, device=x.device),
            torch.zeros(1, 3, dtype=torch.bool, device=x.device), edge_cutoff, None, backend)
        if receiver_width is not None:
            keep = _receivers(part, rank, x, int(owned.numel()), receiver_width)
            edge_index = edge_index[:, keep[edge_index[1]]]
    return LocalDomain(part, owned, local_rows, all_shifts, within[rows[mine]], plan,
                       edge_index, pos.clone(), graph.cell.detach().clone(),
                       graph.atom_id.clone())


_NOT_COPIED = (K.POSITIONS, K.FORCES, K.ENERGIES, K.ENERGY, K.STRESS, K.VIRIAL, K.CELL, K.PBC,
               K.EDGE_INDEX, K.SHIFTS)


def local_graph(graph: AtomicGraph, dom: LocalDomain, positions: Tensor,
                owned_only: bool = False) -> AtomicGraph:
    """The non-periodic graph of the local atoms (owned + ghosts) at explicit ``positions``.

    ``owned_only``: mark the graph so that models update only the owned atoms' features
    (``K.N_UPDATE``); the ghosts' features then come from the sync points' exchanges.
    """
    fields = {}
    for name, value in graph.fields.items():
        if name in _NOT_COPIED:
            continue
        scope = K.scope_of(name)
        if scope == K.ATOM:
            fields[name] = value.index_select(0, dom.local_rows)
        elif scope == K.SYSTEM:
            fields[name] = value
    n_local = dom.n_local
    fields[K.POSITIONS] = positions
    fields[K.BATCH] = torch.zeros(n_local, dtype=torch.long, device=positions.device)
    fields[K.CELL] = torch.zeros(1, 3, 3, dtype=positions.dtype, device=positions.device)
    fields[K.PBC] = torch.zeros(1, 3, dtype=torch.bool, device=positions.device)
    if owned_only:
        fields[K.N_UPDATE] = torch.tensor([dom.n_owned], device=positions.device)
    fields[K.EDGE_INDEX] = dom.edge_index
    fields[K.SHIFTS] = torch.zeros(dom.edge_index.shape[1], 3, dtype=torch.long,
                                   device=positions.device)
    return AtomicGraph(fields, validate=False)
