"""Per-atom virials from the one derivative function (``compute_properties(...,
peratom_virial=True)``, :class:`xnn.models.derivatives.EdgeGradients`): each edge's
``-r ⊗ ∂E/∂r`` half to each of its atoms.

Physics checks: asking for them leaves energy, forces and virial bitwise as they were; they
sum to the strain virial; a pair potential's per-atom virial is the pair formula
``-½ Σ_j u'(r) r̂ ⊗ r`` (LAMMPS's ``compute stress/atom`` of ``lj/cut`` is checked in
test_interop_lammps.py); a periodic supercell repeats the cell's per-atom virials.
"""

from __future__ import annotations

import pytest
import torch
from helpers import native
from helpers.structures import molecule, triclinic

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.models import Potential, build
from xnn.models.derivatives import compute_properties

MODELS = {
    "lj": lambda: build("lj", sigma=2.3, epsilon=0.4, cutoff=4.0).double(),
    "schnet": lambda: native("schnet", layers=2, cutoff=3.0),
    "painn": lambda: native("painn", layers=2, cutoff=3.0),
    "equivariant": lambda: native("equivariant", layers=2, cutoff=3.0),
}


def _evaluate(model, g: AtomicGraph, **kw):
    return compute_properties(model, Potential(model).model_graph(g), **kw)


@pytest.mark.parametrize("structure", [triclinic, molecule], ids=["triclinic", "cluster"])
@pytest.mark.parametrize("name", list(MODELS))
def test_results_unchanged_and_virials_sum_to_the_virial(name, structure):
    model, g = MODELS[name](), structure()
    plain = _evaluate(model, g)
    per = _evaluate(model, g, peratom_virial=True)
    for key in (K.ENERGY, K.ENERGIES, K.FORCES, K.VIRIAL, K.STRESS):
        assert torch.equal(per[key], plain[key]), key
    w = per[K.VIRIALS]
    assert w.shape == (g.n_atoms, 3, 3)
    assert float(w.abs().max()) > 1e-3
    total = plain[K.VIRIAL][0]  # symmetric; the per-atom sum's torque is round-off
    assert float((w.sum(0) - total).abs().max()) <= 1e-12 * float(w.abs().max()) * g.n_atoms


def test_lennard_jones_pair_formula():
    """W_i = -½ Σ_j u'(r_ij) r̂_ij ⊗ r_ij over the pairs within the cutoff (all images)."""
    model, g = MODELS["lj"](), triclinic()
    per = _evaluate(model, g, peratom_virial=True)[K.VIRIALS]
    gg = Potential(model).model_graph(g)
    r = gg.edge_vectors().detach()
    d = r.norm(dim=-1)
    sigma, eps, rc = 2.3, 0.4, 4.0
    du = 4 * eps * (-12 * sigma ** 12 / d ** 13 + 6 * sigma ** 6 / d ** 7)
    du = torch.where(d < rc, du, torch.zeros_like(du))
    # a directed edge carries half the pair energy: its share of the pair's virial
    w_edge = -0.5 * (du / d)[:, None, None] * r[:, :, None] * r[:, None, :]
    ref = torch.zeros(g.n_atoms, 3, 3, dtype=torch.float64)
    ref.index_add_(0, gg.edge_index[0], 0.5 * w_edge).index_add_(0, gg.edge_index[1],
                                                                 0.5 * w_edge)
    assert float((per - ref).abs().max()) <= 1e-12 * float(ref.abs().max())


@pytest.mark.parametrize("name", ["lj", "equivariant"])
def test_a_supercell_repeats_the_per_atom_virials(name):
    model, g = MODELS[name](), triclinic()
    big = AtomicGraph.from_arrays(
        torch.cat([g.positions, g.positions + g.cell[0, 0]]), torch.cat([g.numbers] * 2),
        torch.stack([2 * g.cell[0, 0], g.cell[0, 1], g.cell[0, 2]]), g.pbc[0],
        dtype=torch.float64)
    w = _evaluate(model, g, peratom_virial=True)[K.VIRIALS]
    w2 = _evaluate(model, big, peratom_virial=True)[K.VIRIALS]
    scale = float(w.abs().max())
    assert float((w2[: g.n_atoms] - w).abs().max()) <= 1e-10 * scale
    assert float((w2[g.n_atoms:] - w).abs().max()) <= 1e-10 * scale


def test_per_atom_virials_alone():
    """Without forces or stress: energies and per-atom virials, nothing else derived."""
    model, g = MODELS["schnet"](), triclinic()
    out = _evaluate(model, g, forces=False, stress=False, peratom_virial=True)
    assert K.FORCES not in out and K.VIRIAL not in out
    ref = _evaluate(model, g, peratom_virial=True)
    assert torch.equal(out[K.VIRIALS], ref[K.VIRIALS])


def test_a_committee_is_refused_in_one_line():
    from helpers.models import SMALL

    from xnn.errors import InputError
    from xnn.models.committee import Committee

    committee = Committee({"name": "schnet", "species": [29], "cutoff": 3.0,
                           "num_interactions": 2, **SMALL["schnet"]}, size=2,
                          seeds=[0, 1]).double()
    g = triclinic()
    with pytest.raises(InputError, match="committee") as err:
        _evaluate(committee, g, peratom_virial=True)
    assert "\n" not in str(err.value)
