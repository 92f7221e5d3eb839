"""Migration: atoms whose box changed move to their new owner with every per-atom field.

At a rebuild each rank computes the owner of each of its atoms from the wrapped fractional
coordinate (positions themselves stay unwrapped) and sends the leavers to their new owners:
every atom-scope field of the graph (declared in :mod:`xnn.data.keys`, user fields included)
and any extra per-atom tensors of the caller (e.g. the MD state's forces). Only peers of the
halo relation exchange, both sides knowing every message size.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.partition import Partition
from xnn.distributed.domain.transport import exchange_packed, layout_of, pack, unpack
from xnn.errors import InputError

_EXTRA = "extra/"


def atom_fields(graph: AtomicGraph, extra: Mapping[str, Tensor] | None = None) -> dict:
    """Every atom-scope field of ``graph`` and the ``extra`` per-atom tensors (prefixed)."""
    fields = {k: v for k, v in graph.fields.items() if K.scope_of(k) == K.ATOM}
    for name, value in (extra or {}).items():
        if value.shape[0] != graph.n_atoms:
            raise InputError(f"extra per-atom tensor {name!r} has {value.shape[0]} rows for "
                             f"{graph.n_atoms} atoms")
        fields[_EXTRA + name] = value.detach()
    return fields


def split_fields(graph: AtomicGraph, fields: Mapping[str, Tensor]):
    """``(graph, extra)`` from merged per-atom ``fields`` sorted by atom id (inverse of
    :func:`atom_fields`); system fields are taken from ``graph``, edges dropped."""
    order = torch.argsort(fields[K.ATOM_ID])
    out = {k: v for k, v in graph.fields.items() if K.scope_of(k) == K.SYSTEM}
    extra = {}
    for name, value in fields.items():
        value = value.index_select(0, order)
        if name.startswith(_EXTRA):
            extra[name[len(_EXTRA):]] = value
        else:
            out[name] = value
    return AtomicGraph(out, validate=False), extra


def _check_owners(owner: Tensor, graph: AtomicGraph, peers: list[int], rank: int, size: int):
    allowed = torch.zeros(size, dtype=torch.bool, device=owner.device)
    allowed[peers + [rank]] = True
    bad = ~allowed[owner]
    if bool(bad.any()):
        ids = graph.atom_id[bad][:6].tolist()
        raise InputError(f"atoms (atom_id) {ids} left box {rank} for boxes "
                         f"{sorted(set(owner[bad].tolist()))} beyond the halo since the last "
                         "rebuild; migrate after every step (maybe_migrate) or use a larger skin")


def migrate(graph: AtomicGraph, extra: Mapping[str, Tensor] | None, part: Partition,
            peers: list[int], group) -> tuple[AtomicGraph, dict[str, Tensor], int, int]:
    """Send atoms that left this rank's box to their owners; receive those that arrive.

    Args:
        graph: this rank's owned atoms (one system).
        extra: per-atom tensors ``[n_owned, ...]`` that move with the atoms.
        part: the partition that decides the owners.
        peers: the ranks this one exchanges with (symmetric halo relation).
    Returns:
        ``(graph, extra, n_sent, n_received)``: the new owned atoms sorted by atom id.
    Raises:
        InputError: on every rank, when an atom's new owner is not a peer.

    Collective over ``group``.
    """
    rank, size = C.group_rank(group), C.group_size(group)
    with C.guarded(group, "migration"):
        fields = atom_fields(graph, extra)
        owner = part.owner(part.fractional(graph.positions.detach())[0])
        _check_owners(owner, graph, peers, rank, size)
        layout = layout_of(fields)
        payloads = [pack(fields, layout, torch.nonzero(owner == q).flatten()) for q in peers]
    bufs = exchange_packed(peers, payloads, layout, group, "migration")
    stay = torch.nonzero(owner == rank).flatten()
    received = [unpack(b, layout) for b in bufs]
    merged = {k: torch.cat([v.index_select(0, stay)] + [r[k] for r in received])
              for k, v in fields.items()}
    new_graph, new_extra = split_fields(graph, merged)
    n_sent = graph.n_atoms - int(stay.numel())
    return new_graph, new_extra, n_sent, sum(int(b.shape[0]) for b in bufs)
