"""Models, systems and assertions of the kernel-backend tests (cuEquivariance, Triton, edge
pairs): the same model through two backends gives the same numbers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from xnn.data import keys as K
from xnn.models import build, compute_properties
from xnn.neighbors import with_edges
from xnn.neighbors.pairs import pair_order
from xnn.testing import random_periodic_system

requires_cue = pytest.mark.skipif(importlib.util.find_spec("cuequivariance_torch") is None,
                                  reason="needs cuEquivariance (pip install cuequivariance-torch)")

#: elements of the kernel tests' models (H, O)
SPECIES = [1, 8]


def small_model(backend: str = "reference", **hp) -> torch.nn.Module:
    """A small fp64 equivariant model (l <= 2, correlation 3) on kernel ``backend``."""
    torch.manual_seed(hp.pop("seed", 0))
    base = dict(species=SPECIES, cutoff=3.0, channels=4, l_max=2, hidden_l_max=1,
                correlation=3, num_bessel=4, radial_mlp=[8], avg_num_neighbors=4.0,
                backend=backend)
    base.update(hp)
    return build("equivariant", **base).double()


def kernel_system(dtype=torch.float64, device="cpu"):
    """8 random H/O atoms in a dense triclinic cell, with edges at 3 Å."""
    g = random_periodic_system(SPECIES, 8, volume_per_atom=11.0, min_distance=1.0, seed=3)
    return with_edges(g, 3.0).to(dtype=dtype, device=device)


def props(model, graph, training=False):
    return compute_properties(model, graph, forces=True, stress=True, training=training)


def assert_same_properties(model, ref, g, atol=1e-10):
    """Energy, forces and stress of ``model`` equal those of ``ref`` on ``g`` (none zero)."""
    o_ref, o = props(ref, g), props(model, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        assert o_ref[key].abs().max() > 1e-6  # not trivially zero
        torch.testing.assert_close(o[key], o_ref[key], atol=atol, rtol=0)


def assert_same_force_loss_grads(models, g, backends=(None, None)):
    """The gradients of a force loss with respect to the parameters (double backward) are
    the same for both ``models`` (each first switched to its entry of ``backends``)."""
    grads = []
    for model, backend in zip(models, backends):
        if backend is not None:
            model.set_backend(backend)
        model.zero_grad()
        props(model, g, training=True)[K.FORCES].square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0)


def tiny_mace():
    """A random-weight ScaleShiftMACE for H/O (l <= 2, correlation 3), fp64, evaluation
    mode; the test is skipped without mace-torch."""
    from xnn.models.external._optional import MissingExtraError, import_extra

    try:
        (modules,) = import_extra("mace", "mace.modules")
    except MissingExtraError as err:
        pytest.skip(str(err))
    import numpy as np
    from e3nn import o3

    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = modules.ScaleShiftMACE(
        r_max=3.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=2, interaction_cls=block,
        interaction_cls_first=block, num_interactions=2, num_elements=2,
        hidden_irreps=o3.Irreps("4x0e + 4x1o"), MLP_irreps=o3.Irreps("4x0e"),
        gate=torch.nn.functional.silu, atomic_energies=np.array([-1.5, -3.25]),
        avg_num_neighbors=6.0, atomic_numbers=SPECIES, correlation=3,
        atomic_inter_scale=1.3, atomic_inter_shift=0.2)
    return model.double().eval()


def paired(graph):
    """``graph`` with its edges arranged as reverse pairs (edge ``h + k`` reverses ``k``)."""
    order = pair_order(graph.edge_index, graph.shifts)
    assert order is not None
    return graph.replace(edge_index=graph.edge_index[:, order], shifts=graph.shifts[order])


def pair_equivariant(backend: str = "reference"):
    """A small fp64 equivariant model for H/O (cutoff 3.5 Å) whose radial work is done once
    per reverse pair on a paired list."""
    torch.manual_seed(0)
    return build("equivariant", species=SPECIES, cutoff=3.5, channels=4, l_max=2,
                 hidden_l_max=1, correlation=2, num_bessel=4, radial_mlp=[8, 8],
                 avg_num_neighbors=8.0, backend=backend).double()
