"""Built-in EMT data: deterministic, labels agree with ASE's EMT, round trip through files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.calculators.emt import EMT

from xnn.data.emt import KINDS, generate_emt
from xnn.data.sources import read_structures
from xnn.errors import InputError


@pytest.fixture(scope="module")
def cu():
    return generate_emt(10, ["Cu"], seed=3)


def _same(a, b) -> bool:
    return (
        len(a) == len(b)
        and all(np.array_equal(x.numbers, y.numbers) for x, y in zip(a, b))
        and all(np.array_equal(x.positions, y.positions) for x, y in zip(a, b))
        and all(np.array_equal(x.cell[:], y.cell[:]) for x, y in zip(a, b))
        and all(x.get_potential_energy() == y.get_potential_energy() for x, y in zip(a, b))
    )


def test_deterministic_for_a_seed(cu):
    assert _same(cu, generate_emt(10, ["Cu"], seed=3))
    assert not _same(cu, generate_emt(10, ["Cu"], seed=4))


def test_kinds_and_labels_match_emt(cu):
    kinds = [a.info["config_type"] for a in cu]
    assert kinds == [KINDS[k % len(KINDS)] for k in range(10)]
    for a in cu:
        ref = a.copy()
        ref.calc = EMT()
        assert a.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(a.get_forces(), ref.get_forces(), atol=1e-10)
        np.testing.assert_allclose(a.get_stress(voigt=False), ref.get_stress(voigt=False),
                                   atol=1e-10)
        assert a.pbc.all()
    # vacancies remove atoms, surfaces have vacuum, rattled structures have forces
    sizes = {a.info["config_type"]: len(a) for a in cu}
    assert sizes["vacancy"] < sizes["strained"] and sizes["surface"] == 16
    assert np.abs(cu[1].get_forces()).max() > 0.05
    assert np.abs(cu[0].get_forces()).max() < 1e-8  # perfect (strained) lattice


def test_alloy_and_bad_element():
    atoms = generate_emt(3, ["Cu", "Au"], seed=0)
    assert set(atoms[0].get_chemical_symbols()) == {"Cu", "Au"}
    with pytest.raises(InputError, match="Fe"):
        generate_emt(2, ["Fe"])


def test_files_round_trip(tmp_path):
    xyz, h5 = tmp_path / "cu.xyz", tmp_path / "cu.h5"
    from xnn.cli.main import main

    assert main(["data", "emt", "--out", str(xyz), "--n", "6", "--seed", "1"]) == 0
    assert main(["data", "convert", str(xyz), str(h5)]) == 0
    assert main(["data", "convert", str(xyz), str(tmp_path / "x.txt")]) == 2
    ref = generate_emt(6, ["Cu"], seed=1)
    a, b = read_structures(xyz), read_structures(h5)
    assert len(a) == len(b) == 6
    offset = 0
    for i in range(6):
        ga, gb = a[i], b[i]
        np.testing.assert_allclose(ga.positions.numpy(), ref[i].positions, atol=1e-6)
        assert ga.energy.item() == pytest.approx(ref[i].get_potential_energy(), abs=1e-6)
        for k in ("positions", "forces", "stress", "energy", "cell", "numbers", "atom_id"):
            assert torch.equal(ga[k], gb[k]), k
        assert torch.equal(ga.atom_id, torch.arange(offset, offset + ga.n_atoms))
        offset += ga.n_atoms
    assert a.label_masks()["stress"].all() and b.label_masks()["forces"].all()
