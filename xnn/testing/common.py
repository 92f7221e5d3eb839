"""Helpers shared by the contracts: fp64 copies, one evaluation path, closeness assertions."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.models.derivatives import compute_properties
from xnn.neighbors import with_edges


def as_fp64(model: torch.nn.Module, graph: AtomicGraph | None = None):
    """``(model, graph)`` in float64 on the model's device (the model is deep-copied only when
    it is not fp64 already)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if any(t.is_floating_point() and t.dtype != torch.float64 for t in tensors):
        model = copy.deepcopy(model).to(torch.float64)
    if graph is not None:
        graph = graph.without_edges().to(device=model_device(model), dtype=torch.float64)
    return model, graph


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter or buffer (CPU for a model without tensors)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def evaluate(
    model: torch.nn.Module,
    graph: AtomicGraph,
    forces: bool = True,
    stress: bool = True,
    skin: float = 0.0,
) -> dict[str, Tensor]:
    """Energy, per-atom energies, forces, stress of ``graph`` (edges rebuilt at cutoff + skin)."""
    g = with_edges(graph.without_edges().to(device=model_device(model)), float(model.cutoff) + skin)
    return compute_properties(model, g, forces=forces, stress=stress)


def with_skin_edges(model: torch.nn.Module, graph: AtomicGraph, skin: float) -> AtomicGraph:
    """``graph`` on the model's device with edges for ``cutoff + skin`` (a Verlet list)."""
    g = graph.without_edges().to(device=model_device(model))
    return with_edges(g, float(model.cutoff) + skin)


def total_energies(model: torch.nn.Module, graphs: list[AtomicGraph]) -> Tensor:
    """``[n_graphs, n_systems]`` energies of same-shaped graphs that carry edges, in one call.

    Finite-difference copies reuse the reference graph's Verlet list (cutoff + skin, with the
    skin much larger than the displacements), exactly as MD does between rebuilds.
    """
    big = AtomicGraph.concat(graphs)
    e = compute_properties(model, big, forces=False, stress=False)[K.ENERGY]
    return e.reshape(len(graphs), -1)


def assert_close(name: str, actual: Tensor, expected: Tensor, atol: float, rtol: float) -> float:
    """Raise ``AssertionError`` unless ``|actual - expected| <= atol + rtol * max|expected|``.

    Returns the largest absolute error.
    """
    actual = torch.as_tensor(actual).detach().to("cpu", torch.float64)
    expected = torch.as_tensor(expected).detach().to("cpu", torch.float64)
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    if actual.numel() == 0:
        return 0.0
    err = (actual - expected).abs()
    worst = float(err.max())
    scale = float(expected.abs().max())
    tol = atol + rtol * scale
    if not worst <= tol:  # also catches NaN
        idx = tuple(int(v) for v in torch.nonzero(err == err.max())[0]) if err.numel() else ()
        raise AssertionError(
            f"{name}: max abs error {worst:.3e} at index {idx} exceeds tolerance {tol:.3e} "
            f"(atol={atol:g}, rtol={rtol:g}, scale={scale:.3e}); "
            f"got {float(actual[idx]):.10g}, expected {float(expected[idx]):.10g}"
        )
    return worst
