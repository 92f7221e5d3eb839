"""The one derivative function: ``derive`` is the one-member case of ``derive_members``, and
its results are bitwise those of the autograd call written out by hand (forces, virial,
stress, double backward, the strain reduction of domain decomposition)."""

from __future__ import annotations

import torch
from helpers.models import native
from helpers.structures import fcc, graph

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.models.base import sum_per_system
from xnn.models.derivatives import apply_strain, derive, derive_members
from xnn.neighbors import with_edges


def cu_graph():
    """A rattled 32-atom Cu cell and a 4-atom one, the second not periodic along z."""
    big, small = fcc((2, 2, 2), rattle=0.1), fcc((1, 1, 1), rattle=0.1, seed=3)
    small.pbc = [True, True, False]
    return with_edges(AtomicGraph.concat([graph(big), graph(small)]), 3.0, backend="brute")


def by_hand(model, g, create_graph):
    """Forces, virial and stress by ``torch.autograd.grad`` written out here."""
    s = apply_strain(g)
    energy = sum_per_system(model(s.graph), g.batch, g.n_systems).sum()
    dx, de = torch.autograd.grad(energy, [s.positions, s.strain], create_graph=create_graph)
    periodic = g.pbc.all(-1)
    vol = torch.where(periodic, g.volume(), torch.ones_like(g.volume()))
    stress = torch.where(periodic[:, None, None], de / vol[:, None, None], torch.zeros_like(de))
    return {K.FORCES: -dx, K.VIRIAL: -de, K.STRESS: stress}


def test_derive_is_bitwise_the_autograd_call_and_one_member_of_derive_members():
    model, g = native("schnet"), cu_graph()
    ref = by_hand(model, g, create_graph=False)
    s = apply_strain(g)
    energy = sum_per_system(model(s.graph), g.batch, g.n_systems).sum()
    seen = []
    out = derive(energy, s, g.volume(), g.pbc, True, True, False,
                 reduce_strain=lambda x: seen.append(x.shape) or 2.0 * x)
    assert seen == [torch.Size([1, g.n_systems, 3, 3])]
    assert torch.equal(out[K.FORCES], ref[K.FORCES])
    assert torch.equal(out[K.VIRIAL], 2.0 * ref[K.VIRIAL])  # the reduction was applied
    assert torch.equal(out[K.STRESS], 2.0 * ref[K.STRESS])
    assert out[K.STRESS][1].abs().max() == 0 and out[K.STRESS][0].abs().max() > 0
    # two members: each is derive of its own leaves
    leaves = [apply_strain(g), apply_strain(g)]
    e2 = sum(sum_per_system(model(x.graph), g.batch, g.n_systems).sum() * (k + 1)
             for k, x in enumerate(leaves))
    both = derive_members(e2, leaves, g.volume(), g.pbc, True, True, False)
    assert torch.equal(both[K.FORCES][0], ref[K.FORCES])
    assert torch.equal(both[K.FORCES][1], 2.0 * ref[K.FORCES])
    assert torch.equal(both[K.STRESS][0], ref[K.STRESS])


def test_derive_double_backward_equals_the_autograd_call():
    model, g = native("schnet"), cu_graph()
    ref = by_hand(model, g, create_graph=True)
    s = apply_strain(g)
    energy = sum_per_system(model(s.graph), g.batch, g.n_systems).sum()
    out = derive(energy, s, g.volume(), g.pbc, True, True, True)
    params = list(model.parameters())
    loss = lambda o: (o[K.FORCES] ** 2).sum() + (o[K.STRESS] ** 2).sum()  # noqa: E731
    got = torch.autograd.grad(loss(out), params, allow_unused=True)
    want = torch.autograd.grad(loss(ref), params, allow_unused=True)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
    assert max(float(a.abs().max()) for a in got if a is not None) > 0


def test_derive_without_dependence_on_positions_gives_zeros():
    g = cu_graph()
    s = apply_strain(g)
    out = derive(torch.zeros((), dtype=torch.float64), s, g.volume(), g.pbc, True, True, False)
    assert out[K.FORCES].shape == (g.n_atoms, 3) and out[K.FORCES].abs().max() == 0
    assert out[K.VIRIAL].shape == (g.n_systems, 3, 3) and out[K.STRESS].abs().max() == 0
    assert derive(s.positions.sum(), s, g.volume(), g.pbc, False, False, False) == {}
