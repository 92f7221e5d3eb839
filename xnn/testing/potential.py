"""The potential-protocol contract: a potential (one process's :class:`xnn.models.Potential`,
or the decomposed potential of :mod:`xnn.distributed` on each rank) declares
:class:`~xnn.models.potential.PotentialInterface` and its members behave."""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.models.base import AtomisticModel
from xnn.models.potential import PotentialInterface
from xnn.neighbors import with_edges


def shortest_pair(graph: AtomicGraph, cutoff: float) -> tuple[float, list[int]]:
    """The shortest distance (Å) between two atoms of ``graph`` within ``cutoff`` (periodic
    images included), by brute force, and the two atoms' global ids (sorted); ``inf`` and
    ``[-1, -1]`` without such a pair."""
    g = with_edges(graph.without_edges(), cutoff, backend="brute")
    d = g.edge_vectors().norm(dim=-1)
    if not d.numel():
        return float("inf"), [-1, -1]
    e = int(torch.argmin(d))
    return float(d[e]), sorted(int(g.atom_id[i]) for i in g.edge_index[:, e])


def check_potential(potential, graph: AtomicGraph, reduce: Reducer = LOCAL,
                    shortest: float | None = None, atol: float = 1e-10) -> dict[str, Tensor]:
    """Check that ``potential`` implements the potential protocol on ``graph``.

    Checks: ``isinstance(potential, PotentialInterface)`` (every member declared), its
    ``model`` is an :class:`~xnn.models.base.AtomisticModel`; ``potential(graph)`` returns
    ``energy [n_systems]``, ``forces [n_atoms, 3]`` and ``stress [n_systems, 3, 3]``, all
    finite; without forces and stress the energy is the same; ``min_pair_distance(graph)``
    returns a distance ``[]`` and two ids ``[2]`` whose minimum over the processes of
    ``reduce`` is ``shortest`` (default: the brute-force shortest pair of ``graph`` within
    the model's cutoff, :func:`shortest_pair`; pass it for a decomposed potential, whose
    ``graph`` holds one rank's atoms).

    Collective when ``reduce`` spans processes: call it on every rank, with this rank's
    owned ``graph`` (after the potential's ``scatter``).

    Returns:
        The results of ``potential(graph)``.
    Raises:
        AssertionError: naming the member that fails.
    """
    assert isinstance(potential, PotentialInterface), (
        f"{type(potential).__name__} does not declare the potential protocol: it lacks "
        f"{sorted({'model', '__call__', 'min_pair_distance'} - set(dir(potential)))}")
    assert isinstance(potential.model, AtomisticModel), (
        f"{type(potential).__name__}.model is a {type(potential.model).__name__}, not an "
        "AtomisticModel")
    out = potential(graph, forces=True, stress=True)
    n, s = graph.n_atoms, graph.n_systems
    for key, shape in ((K.ENERGY, (s,)), (K.FORCES, (n, 3)), (K.STRESS, (s, 3, 3))):
        assert key in out, f"{type(potential).__name__}(graph) returned no {key!r}"
        assert tuple(out[key].shape) == shape, (
            f"{key} has shape {tuple(out[key].shape)}, expected {shape}")
        assert bool(torch.isfinite(out[key]).all()), f"{key} is not finite"
    energy = potential(graph, forces=False, stress=False)[K.ENERGY]
    torch.testing.assert_close(energy, out[K.ENERGY], rtol=0, atol=atol,
                               msg=lambda m: f"energy without forces/stress differs: {m}")
    d, ids = potential.min_pair_distance(graph)
    assert isinstance(d, Tensor) and d.dim() == 0, "min_pair_distance: distance is not []"
    assert isinstance(ids, Tensor) and tuple(ids.shape) == (2,), \
        "min_pair_distance: ids are not [2]"
    if shortest is None:
        shortest = shortest_pair(graph, float(potential.model.cutoff))[0]
    one = torch.zeros(1, dtype=torch.long, device=graph.positions.device)
    found = float(reduce.min_per_system(d.detach().to(torch.float64).reshape(1), one, 1)[0])
    assert found == shortest or abs(found - shortest) <= atol, (
        f"min_pair_distance gives {found} Å, the shortest pair is {shortest} Å")
    return out
