"""The domain state of one rank: its owned atoms, the partition, the ghost plan and edges.

After start-up a rank holds only its owned atoms (an :class:`AtomicGraph` sorted by global
atom id, the canonical order that makes plans and edges bitwise reproducible) and its
ghosts; nothing per step is of the size of the whole system. :func:`scatter` distributes
rank 0's structure (O(N) on rank 0, once); :func:`gather` collects the owned atoms (and any
per-atom results) on rank 0 in global-id order, for output and checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.local import LocalDomain
from xnn.distributed.domain.migrate import atom_fields, split_fields
from xnn.distributed.domain.partition import Grid, Partition, make_partition
from xnn.distributed.domain.transport import gather_packed, layout_of, pack, unpack
from xnn.errors import InputError


@dataclass(frozen=True)
class Counters:
    """Rebuilds of the ghost plan, migrations, and atoms sent/received by migration."""

    rebuilds: int = 0
    migrations: int = 0
    sent: int = 0
    received: int = 0


@dataclass(frozen=True)
class DomainState:
    """One rank's decomposition as of the last rebuild.

    Attributes:
        graph: owned atoms at the rebuild (one system, every atom-scope field, sorted by
            atom id); its positions and cell are the references of the skin criterion.
        local: ghosts, halo plan and local edges (:class:`LocalDomain`, with the partition).
        n_total: atoms over all ranks.
        migrated: ``[n_owned, 3]`` positions (Å) at the last migration or scatter of these
            atoms (ownership then matched the boxes); ``None`` when ownership is unknown.
        counters: rebuilds and migrations so far.
    """

    graph: AtomicGraph
    local: LocalDomain
    n_total: int
    migrated: Tensor | None = None
    counters: Counters = field(default_factory=Counters)

    @property
    def partition(self) -> Partition:
        return self.local.partition

    @property
    def n_owned(self) -> int:
        return self.graph.n_atoms

    @property
    def n_ghost(self) -> int:
        return self.local.n_ghost

    @property
    def ref_positions(self) -> Tensor:
        return self.graph.positions

    @property
    def ref_cell(self) -> Tensor:
        return self.graph.cell[0]


def _check_root_graph(graph: AtomicGraph | None) -> AtomicGraph:
    if graph is None:
        raise InputError("rank 0 must pass the structure to scatter over the domain ranks")
    if graph.n_systems != 1:
        raise InputError(f"domain decomposition takes one system, got {graph.n_systems}")
    ids = torch.sort(graph.atom_id).values
    if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
        raise InputError("atom ids must be unique for domain decomposition")
    return graph.without_edges()


def _root_payloads(graph: AtomicGraph, size: int, halo_width: float, grid: Grid | None,
                   owner: Tensor | None, balance: str = "none"):
    """Rank 0: per-rank packed atoms (sorted by id within a rank), the metadata, the owners."""
    if owner is None:
        part = make_partition(graph.positions, graph.cell[0], graph.pbc[0], size, halo_width,
                              grid, balance)
        owner, grid = part.owner(part.fractional(graph.positions.detach())[0]), part.grid
    elif owner.shape != (graph.n_atoms,) or (graph.n_atoms and int(owner.max()) >= size):
        raise InputError(f"owner must give one of {size} ranks per atom")
    else:
        grid = None  # no partition made: the ranks keep theirs
    n = graph.n_atoms
    by_id = torch.argsort(graph.atom_id)
    order = by_id[torch.sort(owner[by_id], stable=True).indices]
    fields = atom_fields(graph)
    layout = layout_of(fields)
    counts = torch.bincount(owner, minlength=size).tolist()
    packed = pack(fields, layout, order)
    system = {k: v.detach().cpu() for k, v in graph.fields.items() if K.scope_of(k) == K.SYSTEM}
    meta = {"layout": layout, "system": system, "counts": counts, "grid": grid, "n_total": n}
    return list(torch.split(packed, counts)), meta, owner


def scatter(graph: AtomicGraph | None, group, halo_width: float, grid: Grid | None = None,
            device: torch.device | None = None, owner: Tensor | None = None,
            balance: str = "none"):
    """Split rank 0's structure over the ranks of ``group``: each receives its owned atoms.

    Args:
        graph: one system on group rank 0 (other ranks pass ``None``; ignored there).
        halo_width: Å, to choose the grid.
        grid: ``(px, py, pz)`` or ``None`` (smallest halo volume).
        device: where the owned atoms go (default: the graph's device on rank 0, CPU else).
        owner: ``[n_atoms]`` (rank 0) the rank of each atom instead of its box.
        balance: how the boxes are cut (:data:`~.balance.BALANCE`); the cuts of balance
            ``shift`` are those the ranks' all-reduced histograms give at the first build.
    Returns:
        ``(owned graph, grid, n_total, owner)``: the owned atoms sorted by atom id, the
        partition's grid (``None`` when ``owner`` was given), the number of atoms, and every
        atom's rank on rank 0 (``None`` elsewhere).

    Collective over ``group``; O(N) work and memory on rank 0 only.
    """
    size, rank = C.group_size(group), C.group_rank(group)
    payloads = meta = None
    with C.guarded(group, "scatter from rank 0"):
        if rank == 0:
            graph = _check_root_graph(graph)
            device = device or graph.device
            payloads, meta, owner = _root_payloads(graph, size, halo_width, grid, owner,
                                                   balance)
    meta = C.broadcast_object(meta, group)
    device = device or torch.device("cpu")
    if rank == 0:
        buf = payloads[0].to(device)
        C.exchange([(q, payloads[q].to(device)) for q in range(1, size)], [], group)
    else:
        buf = torch.empty(meta["counts"][rank], meta["layout"].row_bytes, dtype=torch.uint8,
                          device=device)
        C.exchange([], [(0, buf)], group)
        owner = None
    fields = unpack(buf, meta["layout"])
    fields.update({k: v.to(device) for k, v in meta["system"].items()})
    return AtomicGraph(fields, validate=False), meta["grid"], meta["n_total"], owner


def gather(graph: AtomicGraph, group, extra: Mapping[str, Tensor] | None = None, dst: int = 0):
    """The whole system on group rank ``dst`` in global-id order (for output, checkpoints).

    Args:
        graph: this rank's owned atoms (every rank must carry the same fields).
        extra: per-atom tensors ``[n_owned, ...]`` to gather with them (e.g. forces).
    Returns:
        ``(graph, extra)`` on ``dst`` (every atom-scope field, sorted by atom id), and
        ``(None, None)`` elsewhere.

    Collective over ``group``; the only O(N) memory is on ``dst``.
    """
    fields = atom_fields(graph.without_edges(), extra)
    layout = layout_of(fields)
    bufs = gather_packed(pack(fields, layout), layout, group, dst)
    if bufs is None:
        return None, None
    return split_fields(graph, unpack(torch.cat(bufs), layout))
