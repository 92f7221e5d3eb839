"""One rank's view in graph-parallel mode: its owned atoms, the other atoms its edges need,
and the receiver-owned edges of the whole (replicated) system.

Rows of the global order are the ranks' owned blocks in rank order. At a rebuild every rank
gathers the per-atom fields and positions of all atoms, builds the periodic neighbor list
of the whole system within ``cutoff + skin`` and keeps the edges whose receiver it owns.
Its local atoms are ``[owned | ghosts]``, the ghosts being the other atoms that send on those
edges (each once: periodic images are edge shifts, not copies). Per evaluation the owned
positions and, at every sync point, the owned features are all-gathered
(:func:`~xnn.distributed.graph.exchange.all_gather_rows`) and the ghosts' rows picked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.local import assemble_local_graph, ghost_fields_of
from xnn.distributed.graph.exchange import all_gather_rows
from xnn.neighbors import neighbor_list


@dataclass
class GraphDomain:
    """Owned block, ghosts and receiver-owned edges of one rank (one rebuild).

    Attributes:
        counts: every rank's owned atom count (rank order).
        rank: this rank. group: the process group.
        ghost_rows: ``[n_ghost]`` global rows of the ghosts (sorted).
        fields: static per-atom fields of the local atoms, each ``[n_local, ...]``.
        edge_index: ``[2, n_edges]`` local rows (row 0 sender, row 1 owned receiver).
        shifts: ``[n_edges, 3]`` long image shifts of the edges.
    """

    counts: list[int]
    rank: int
    group: object
    ghost_rows: Tensor
    fields: dict[str, Tensor]
    edge_index: Tensor
    shifts: Tensor
    paired: bool = False  # edges are never arranged as reverse pairs here

    @property
    def n_owned(self) -> int:
        return self.counts[self.rank]

    @property
    def n_ghost(self) -> int:
        return int(self.ghost_rows.shape[0])

    @property
    def n_local(self) -> int:
        return self.n_owned + self.n_ghost

    @property
    def n_total(self) -> int:
        return sum(self.counts)

    def gather_local(self, owned_values: Tensor) -> Tensor:
        """``[n_local, ...]``: the owned rows, then the ghosts' rows of every rank's owned
        rows (all-gathered; differentiable to any order). Collective."""
        every = all_gather_rows(owned_values, self.counts, self.group)
        return torch.cat([owned_values, every.index_select(0, self.ghost_rows)])


def _gather_field(t: Tensor, group) -> Tensor:
    if t.dtype == torch.bool:  # gloo reduces and gathers numbers, not bools
        return C.gather_rows(t.to(torch.uint8), group).bool()
    return C.gather_rows(t, group)


def build_graph_domain(graph: AtomicGraph, edge_cutoff: float, group,
                       backend: str = "auto") -> GraphDomain:
    """Gather the system, build its neighbor list and keep this rank's receivers' edges.

    Args:
        graph: this rank's owned atoms (one system; every rank carries the same fields).
        edge_cutoff: Å, the neighbor list's cutoff (``cutoff + skin``).
        backend: neighbor-list backend.

    Collective over ``group``: one gather of the atom counts, one per static per-atom
    field and one of the positions. Every rank builds the whole neighbor list (O(N)).
    """
    rank = C.group_rank(group)
    counts = [int(c) for c in C.all_gather_tensor(
        torch.tensor([graph.n_atoms], device=graph.device), group).flatten().tolist()]
    static = ghost_fields_of(graph)
    every = {k: _gather_field(v, group) for k, v in sorted(static.items())}
    pos = C.gather_rows(graph.positions.detach(), group)
    start = sum(counts[:rank])
    stop = start + counts[rank]
    with C.guarded(group, "graph-parallel neighbor list"):
        edge_index, shifts = neighbor_list(pos, graph.cell.detach(), graph.pbc, edge_cutoff,
                                           None, backend)
        mine = (edge_index[1] >= start) & (edge_index[1] < stop)
        edge_index, shifts = edge_index[:, mine], shifts[mine]
        senders = edge_index[0]
        ghost_rows = torch.unique(senders[(senders < start) | (senders >= stop)])
        local_rows = torch.cat([torch.arange(start, stop, device=pos.device), ghost_rows])
        lookup = torch.full((pos.shape[0],), -1, dtype=torch.long, device=pos.device)
        lookup[local_rows] = torch.arange(local_rows.shape[0], device=pos.device)
        edge_index = lookup[edge_index]
        fields = {k: v.index_select(0, local_rows) for k, v in every.items()}
    return GraphDomain(counts, rank, group, ghost_rows, fields, edge_index, shifts)


def local_graph(graph: AtomicGraph, dom: GraphDomain, positions: Tensor,
                cell: Tensor) -> AtomicGraph:
    """The periodic graph of the local atoms at ``positions [n_local, 3]`` and ``cell
    [1, 3, 3]`` (Å; both may be strained), with the receiver-owned edges.

    Marked ``K.N_UPDATE = n_owned``: models update only the owned atoms' features; the
    ghosts' come from the sync points' all-gathers.
    """
    return assemble_local_graph(graph, dom.fields, positions, cell, graph.pbc, dom.edge_index,
                                dom.shifts, dom.n_owned)
