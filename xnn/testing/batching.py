"""Batching contracts: batch == one-by-one, no gradient across systems, skin edges ignored."""

from __future__ import annotations

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.neighbors import with_edges
from xnn.testing.common import as_fp64, evaluate
from xnn.testing.symmetry import _compare


def _at_least_two_systems(graph: AtomicGraph, seed: int) -> AtomicGraph:
    """The graph itself if it holds >= 2 systems, else the graph batched with a rattled copy."""
    if graph.n_systems >= 2:
        return graph
    gen = torch.Generator().manual_seed(seed)
    noise = 0.05 * torch.randn(graph.positions.shape, generator=gen, dtype=graph.dtype)
    return AtomicGraph.concat(
        [graph, graph.replace(positions=graph.positions + noise.to(graph.device))]
    )


def check_batch_consistency(
    model: torch.nn.Module,
    graph: AtomicGraph,
    atol: float = 1e-10,
    rtol: float = 1e-9,
    seed: int = 0,
) -> None:
    """Evaluating a batch gives the same results as evaluating each system alone."""
    model, graph = as_fp64(model, graph)
    graph = _at_least_two_systems(graph, seed)
    out = evaluate(model, graph)
    singles = [evaluate(model, g) for g in graph.split()]
    expected = {
        k: torch.cat([s[k] for s in singles]) for k in (K.ENERGY, K.ENERGIES, K.FORCES, K.STRESS)
    }
    _compare("batch vs one-by-one", out, expected, atol, rtol)


def check_cross_system_gradient_zero(
    model: torch.nn.Module, graph: AtomicGraph, atol: float = 0.0, seed: int = 0
) -> None:
    """The energy of one system has zero gradient w.r.t. atoms of every other system."""
    model, graph = as_fp64(model, graph)
    graph = _at_least_two_systems(graph, seed)
    g = with_edges(graph, float(model.cutoff))
    for s in range(graph.n_systems):
        pos = g.positions.detach().requires_grad_(True)
        energies = model(g.replace(positions=pos))
        e_s = energies[graph.batch == s].sum()
        if not e_s.requires_grad:
            continue
        (grad,) = torch.autograd.grad(e_s, pos, allow_unused=True)
        if grad is None:
            continue
        other = grad[graph.batch != s]
        worst = float(other.abs().max()) if other.numel() else 0.0
        if not worst <= atol:
            raise AssertionError(
                f"energy of system {s} has gradient {worst:.3e} (> {atol:g}) "
                "w.r.t. atoms of other systems"
            )


def check_edges_beyond_cutoff_ignored(
    model: torch.nn.Module,
    graph: AtomicGraph,
    skin: float = 1.0,
    atol: float = 1e-12,
    rtol: float = 1e-12,
) -> None:
    """Results with a list at ``cutoff + skin`` (a Verlet list) equal those at ``cutoff``."""
    model, graph = as_fp64(model, graph)
    _compare(
        f"edges within cutoff + {skin} Å vs cutoff",
        evaluate(model, graph, skin=skin),
        evaluate(model, graph),
        atol,
        rtol,
    )
