"""Atoms sent to the ranks a caller names, whichever rank holds them now: one all-to-all.

A resume from a sharded checkpoint on another number of ranks
(:meth:`~xnn.distributed.md_run.DomainRun.scatter_shards`) reads each shard on some rank and
sends every atom to the rank of its box in the new partition; no rank holds more than its
shards and its new atoms. Migration (:mod:`~xnn.distributed.domain.migrate`) moves atoms to
neighbouring boxes only; here any rank may send to any other.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.migrate import atom_fields, split_fields
from xnn.distributed.domain.transport import exchange_packed, layout_of, pack, unpack
from xnn.errors import InputError


def to_owners(graph: AtomicGraph, extra: Mapping[str, Tensor] | None, owner: Tensor,
              group=None) -> tuple[AtomicGraph, dict[str, Tensor]]:
    """Every atom of ``graph`` (and its ``extra`` rows) to rank ``owner[i]`` of ``group``.

    Args:
        graph: the atoms this rank holds (one system; any rank may hold none).
        extra: per-atom tensors ``[n_atoms, ...]`` that travel with the atoms.
        owner: ``[n_atoms]`` the group rank of each atom.
    Returns:
        ``(graph, extra)``: the atoms this rank owns, sorted by atom id, every atom-scope
        field and the extras (system fields from ``graph``).

    Collective over ``group`` (every rank exchanges with every other, empty messages
    skipped).
    """
    rank, size = C.group_rank(group), C.group_size(group)
    with C.guarded(group, "sending atoms to their ranks"):
        if owner.shape != (graph.n_atoms,) or (owner.numel() and (
                int(owner.min()) < 0 or int(owner.max()) >= size)):
            raise InputError(f"owner must give one of {size} ranks per atom")
    fields = atom_fields(graph, extra)
    layout = layout_of(fields)
    peers = [q for q in range(size) if q != rank]
    payloads = [pack(fields, layout, torch.nonzero(owner == q).flatten()) for q in peers]
    bufs = exchange_packed(peers, payloads, layout, group, "redistribution")
    stay = torch.nonzero(owner == rank).flatten()
    received = [unpack(b, layout) for b in bufs]
    merged = {k: torch.cat([v.index_select(0, stay)] + [r[k] for r in received])
              for k, v in fields.items()}
    return split_fields(graph, merged)
