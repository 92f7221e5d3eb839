"""Execution policy carried by context (tracing, paired edges): the context managers nest and
restore the value they found, each thread sees its own, and model code follows the value."""

from __future__ import annotations

import threading

import pytest
import torch

from xnn.errors import InputError
from xnn.models import build
from xnn.models.base import (
    AtomisticModel,
    as_model,
    edges_paired,
    graph_tracing,
    pairing_edges,
    tracing_graph,
)
from xnn.neighbors import with_edges
from xnn.testing import random_periodic_system


def _sum_and_graph():
    """A sum whose short term drops the edges beyond its cutoff, unless traced."""
    lj = {"name": "lj", "sigma": 2.0, "epsilon": 0.01}
    model = build("sum", terms=[{**lj, "cutoff": 5.0}, {**lj, "cutoff": 3.0}]).double()
    g = random_periodic_system([18], 12, volume_per_atom=18.0, min_distance=2.0, seed=3)
    return model, with_edges(g.to(dtype=torch.float64), 5.0)


def test_tracing_nests_and_restores():
    """The inner block's exit leaves the outer block traced (model code keeps its traced
    branch: a sum term sees every edge), and the outer exit leaves it untraced."""
    model, g = _sum_and_graph()
    n = g.edge_index.shape[1]
    assert not graph_tracing()
    assert model.edges_within(g, 3.0).edge_index.shape[1] < n  # eager: filtered
    with tracing_graph():
        with tracing_graph():
            assert graph_tracing()
        assert graph_tracing()
        assert model.edges_within(g, 3.0) is g  # traced: no data-dependent shapes
        with tracing_graph(False):
            assert not graph_tracing()
        assert graph_tracing()
    assert not graph_tracing()
    assert model.edges_within(g, 3.0).edge_index.shape[1] < n


def test_policy_restored_after_an_error():
    with pytest.raises(RuntimeError, match="inside"):
        with tracing_graph(), pairing_edges():
            raise RuntimeError("inside")
    assert not graph_tracing() and not edges_paired()


def test_pairing_nests_and_restores():
    with pairing_edges():
        with pairing_edges(False):
            assert not edges_paired()
        assert edges_paired()
        with pairing_edges():
            assert edges_paired()
        assert edges_paired()
    assert not edges_paired()


def test_each_thread_sees_its_own_policy():
    """A thread started inside another thread's block runs untraced and unpaired (no
    process-wide flag), and its own block does not leak back."""
    seen = {}
    inside, leave = threading.Event(), threading.Event()

    def other():
        seen["start"] = (graph_tracing(), edges_paired())
        with tracing_graph(), pairing_edges():
            inside.set()
            leave.wait(30)

    with tracing_graph(), pairing_edges():
        t = threading.Thread(target=other)
        t.start()
    assert inside.wait(30)
    assert (graph_tracing(), edges_paired()) == (False, False)  # the other thread is inside
    leave.set()
    t.join(30)
    assert seen["start"] == (False, False)


def test_as_model_accepts_xnn_models_and_names_anything_else():
    model = build("lj", sigma=2.0, epsilon=0.01, cutoff=3.0)
    assert as_model(model) is model and isinstance(model, AtomisticModel)
    with pytest.raises(InputError, match=r"^sum term 1 is not an xnn model: Linear ") as err:
        as_model(torch.nn.Linear(2, 2), "sum term 1")
    assert "\n" not in str(err.value)
    with pytest.raises(InputError, match="^sum term 1 is not an xnn model: Linear"):
        build("sum", terms=[model, torch.nn.Linear(2, 2)])


def test_model_capabilities_declared_on_every_native_model():
    """What runners read as plain attributes: every built model answers them."""
    for name, kw in [("lj", {"sigma": 2.0, "epsilon": 0.01, "cutoff": 3.0}),
                     ("schnet", {"cutoff": 3.0, "species": [18]}),
                     ("painn", {"cutoff": 3.0, "species": [18]})]:
        m = build(name, **kw)
        assert m.receptive_field == pytest.approx(m.cutoff * m.num_interactions)
        assert m.receiver_field >= 0.0 and isinstance(m.pairs_edges, bool)
        assert isinstance(m.sync_points, list) and isinstance(m.traceable, bool)
        assert m.species is None or all(isinstance(z, int) for z in m.species)
