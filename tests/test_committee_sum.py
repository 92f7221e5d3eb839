"""A committee inside a ``Sum`` (committee + a classical term): the sum is a committee whose
member ``k`` is the committee's member ``k`` plus the other term, so its spread is the
committee's (the other term adds none) and its mean the committee's mean plus the term; in
``compute_properties``, the ASE calculator and a saved model file."""

from __future__ import annotations

import pytest
import torch
from helpers.models import lj
from helpers.uncertainty import committee

from xnn.data import keys as K
from xnn.errors import InputError
from xnn.models import Sum
from xnn.models.derivatives import compute_properties
from xnn.models.serialization import load_model, save_model


def cu_graphs(cutoff: float):
    """Two rattled FCC Cu cells (32 and 4 atoms), batched, fp64, with edges."""
    from helpers.structures import fcc, graph

    from xnn.data.graph import AtomicGraph
    from xnn.neighbors import with_edges

    big, small = graph(fcc((2, 2, 2), rattle=0.1)), graph(fcc((1, 1, 1), rattle=0.1, seed=3))
    return with_edges(AtomicGraph.concat([big, small]), cutoff, backend="brute")


def test_sum_with_a_committee_passes_the_spread_through():
    c, term = committee(), lj(4.0, torch.float64)
    c.set_calibration({"forces": 1.5, "energy": 0.5})
    total = Sum([c, term])
    assert total.committee_size == 3 and total.calibration == c.calibration
    g = cu_graphs(cutoff=4.0)
    got, alone, extra = (compute_properties(m, g) for m in (total, c, term))
    scale = {key: float(alone[key].abs().max()) for key in (K.FORCES_STD, K.ENERGY_STD,
                                                              K.STRESS_STD)}
    for key in (K.FORCES_STD, K.ENERGY_STD, K.STRESS_STD):  # the committee's spread
        assert float(alone[key].abs().max()) > 0
        torch.testing.assert_close(got[key], alone[key], rtol=0, atol=1e-12 * scale[key])
    for key in (K.ENERGY, K.FORCES, K.STRESS):  # the committee's mean plus the term
        torch.testing.assert_close(got[key], alone[key] + extra[key], rtol=0, atol=1e-12)
    for k in range(3):  # each member carries the term
        torch.testing.assert_close(got[K.FORCES_MEMBERS][k],
                                   alone[K.FORCES_MEMBERS][k] + extra[K.FORCES],
                                   rtol=0, atol=1e-12)
    # forward (what MD, relaxation and decomposition call) is the mean
    torch.testing.assert_close(total(g), got[K.ENERGIES], rtol=0, atol=1e-12)


def test_calculator_and_model_file_of_a_sum_with_a_committee(tmp_path):
    from ase.build import bulk

    import xnn

    total = Sum([committee(), lj(4.0, torch.float64)])
    loaded = load_model(save_model(total, tmp_path / "sum.pt"))
    assert loaded.committee_size == 3
    atoms = bulk("Cu", "fcc", a=3.5, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.1, seed=2)
    results = []
    for model in (total, loaded, total.terms[0]):
        atoms.calc = xnn.Calculator(model)
        atoms.get_potential_energy()
        results.append(dict(atoms.calc.results))
    for key in ("energy_std", "forces_std", "stress_std"):
        assert results[0][key] == pytest.approx(results[1][key], rel=0, abs=1e-14)
        assert results[0][key] == pytest.approx(results[2][key], rel=1e-10, abs=1e-14)
    assert results[0]["forces_members"].shape == (3, len(atoms), 3)


def test_sum_of_two_committees_is_refused():
    with pytest.raises(InputError, match="at most one"):
        Sum([committee(), committee()])
