"""Helpers shared by the external-model wrappers."""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import graph_tracing, squared_lengths


def edges_within(graph: AtomicGraph, cutoff: float,
                 zero_beyond: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Edges of ``graph`` strictly shorter than ``cutoff`` (Verlet lists carry a skin).

    Args:
        graph: a graph with ``edge_index`` and ``shifts``.
        cutoff: Å.
        zero_beyond: the wrapped model itself gives edges at or beyond ``cutoff`` exactly
            zero weight (value and gradient), as MACE's ``PolynomialCutoff`` does with its
            ``(r < r_max)`` factor. Under a graph tracer (the compiled MD step, whose edges
            are padded to a fixed capacity with inert edges beyond every cutoff) all edges
            are then kept: selecting them would make the shapes data-dependent.
    Returns:
        ``edge_index [2, E']`` (row 0 sender j, row 1 receiver i), integer ``shifts [E', 3]``
        and ``r_ij [E', 3]`` Å (``pos[j] - pos[i] + shifts @ cell[batch[i]]``,
        differentiable with respect to positions and cell).
    """
    if "edge_index" not in graph:
        raise InputError(
            "the graph has no edges: attach a neighbor list (xnn.neighbors.with_edges)"
        )
    vec = graph.edge_vectors()
    if zero_beyond and graph_tracing():
        return graph.edge_index, graph.shifts, vec
    keep = squared_lengths(vec.detach()) < float(cutoff) ** 2
    if bool(keep.all()):
        return graph.edge_index, graph.shifts, vec
    idx = torch.nonzero(keep).flatten()
    return graph.edge_index[:, idx], graph.shifts[idx], vec[idx]


def check_dtype(graph: AtomicGraph, model: torch.nn.Module) -> None:
    """Raise ``InputError`` when the graph's float dtype differs from the model's."""
    for p in model.parameters():
        if p.is_floating_point():
            if p.dtype != graph.dtype:
                raise InputError(
                    f"graph dtype {graph.dtype} differs from the model's {p.dtype}: "
                    "convert one of them (graph.to(dtype=...) or model.to(dtype))"
                )
            return


def leaf_safe(t: Tensor) -> Tensor:
    """``t`` itself if it requires grad, else an alias whose grad flag may be set freely.

    Wrapped packages call ``requires_grad_(True)`` on their inputs; this keeps that from
    changing the caller's tensors.
    """
    return t if t.requires_grad else t.detach()
