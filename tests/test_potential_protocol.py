"""The potential protocol (:class:`xnn.models.potential.PotentialInterface`): the
one-process ``Potential`` declares it and its members behave; the safety check of MD runs
reads the shortest pair through it; models are checked once to be xnn models."""

from __future__ import annotations

import pytest
import torch
from helpers import lj

from xnn.data import keys as K
from xnn.dynamics import nve
from xnn.dynamics.safety import SimulationError, check_distances
from xnn.errors import InputError
from xnn.models import Potential, build
from xnn.models.potential import PotentialInterface
from xnn.testing import check_potential, random_molecule, random_periodic_system, shortest_pair


def _systems():
    periodic = random_periodic_system([18], 16, volume_per_atom=20.0, min_distance=2.2,
                                      seed=5).to(dtype=torch.float64)
    molecule = random_molecule([1, 6, 8], 7, seed=2).to(dtype=torch.float64)
    return periodic.without_edges(), molecule.without_edges()


@pytest.mark.parametrize("skin", [0.0, 1.0])
def test_potential_satisfies_the_protocol(skin):
    """``Potential`` declares every member; its shortest pair is the brute-force one (skin
    or not), on a periodic system and a molecule."""
    for graph in _systems():
        model = lj(dtype=torch.float64) if graph.pbc.all() else build(
            "schnet", species=[1, 6, 8], cutoff=3.0).double()
        pot = Potential(model, skin=skin)
        assert isinstance(pot, PotentialInterface)
        out = check_potential(pot, graph)
        assert out[K.FORCES].abs().max() > 0
        d, ids = pot.min_pair_distance(graph)
        best, pair = shortest_pair(graph, model.cutoff)
        assert float(d) == pytest.approx(best, abs=1e-12)
        assert sorted(ids.tolist()) == pair


def test_the_contract_catches_an_incomplete_potential():
    """A callable without ``model`` / ``min_pair_distance`` (an integrator's bare evaluator)
    is not a potential for the runs, and a wrong shortest pair is caught."""
    graph = _systems()[0]
    pot = Potential(lj(dtype=torch.float64))

    def bare(g, forces=True, stress=True, training=False):
        return pot(g, forces, stress, training)

    assert not isinstance(bare, PotentialInterface)
    with pytest.raises(AssertionError, match="min_pair_distance"):
        check_potential(bare, graph)

    class Misreporting(Potential):
        def min_pair_distance(self, graph):
            d, ids = super().min_pair_distance(graph)
            return d + 0.1, ids

    with pytest.raises(AssertionError, match="shortest pair"):
        check_potential(Misreporting(lj(dtype=torch.float64)), graph)


def test_no_pair_within_reach():
    """Two atoms farther apart than the list's reach: ``inf`` and ids ``-1``."""
    from xnn.data.graph import AtomicGraph

    g = AtomicGraph.from_arrays(torch.tensor([[0.0, 0, 0], [0, 0, 9.0]], dtype=torch.float64),
                                torch.tensor([18, 18]), None, False)
    d, ids = Potential(lj(dtype=torch.float64), skin=0.5).min_pair_distance(g)
    assert float(d) == float("inf") and ids.tolist() == [-1, -1]


def test_safety_check_reads_the_shortest_pair_through_the_protocol():
    """``check_distances`` of an MD state names the closest atoms by global id."""
    graph = _systems()[0]
    pos = graph.positions.clone()
    pos[7] = pos[3] + torch.tensor([0.5, 0.0, 0.0], dtype=pos.dtype)
    ids = torch.arange(graph.n_atoms) + 100
    g = graph.replace({K.POSITIONS: pos, K.ATOM_ID: ids,
                       K.VELOCITIES: torch.zeros_like(pos)})
    pot = Potential(lj(dtype=torch.float64), skin=1.0)
    state = nve.init(g, pot)
    check_distances(state, pot, 0.4)  # 0.5 Å apart: allowed
    with pytest.raises(SimulationError, match=r"atoms \(atom_id\) \[103, 107\] are 0.500 Å"):
        check_distances(state, pot, 0.6)


def test_potential_refuses_what_is_not_an_xnn_model():
    class Energies(torch.nn.Module):
        cutoff = 3.0  # an attribute is not a declaration

        def forward(self, graph):
            return graph.positions.sum(-1)

    with pytest.raises(InputError, match="the Potential's model is not an xnn model: "
                                         "Energies does not subclass"):
        Potential(Energies())


@pytest.mark.parametrize("kind", ["spatial", "graph"])
def test_decomposed_potential_satisfies_the_protocol(kind):
    """The decomposed potential of ``xnn.distributed`` in both layouts (here on a group of
    one process, no process group needed) declares the protocol, its shortest pair is the
    one process's, and its results equal ``Potential``'s by atom id."""
    from xnn.distributed import parallelize

    graph = _systems()[0]
    model = lj(dtype=torch.float64)
    pot = parallelize(model, None, kind, skin=0.5)
    owned = pot.scatter(graph)
    assert isinstance(pot, PotentialInterface)
    out = check_potential(pot, owned, shortest=shortest_pair(graph, model.cutoff)[0])
    ref = Potential(model)(graph)
    order = torch.argsort(owned.atom_id)
    torch.testing.assert_close(out[K.ENERGY], ref[K.ENERGY], rtol=1e-12, atol=0)
    torch.testing.assert_close(out[K.FORCES][order], ref[K.FORCES][graph.atom_id],
                               rtol=0, atol=1e-12)
