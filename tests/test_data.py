"""ASE/extxyz conversion: fields, units, labels, ids, round trips; wrapping on triclinic cells."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.calculators.singlepoint import SinglePointCalculator
from ase.geometry import wrap_positions as ase_wrap_positions
from ase.stress import full_3x3_to_voigt_6_stress
from conftest import make_atoms

from xnn.data import from_ase, read, to_ase, write
from xnn.data import keys as K
from xnn.units import MVV2E


def labelled(atoms: Atoms, rng, voigt: bool = True) -> Atoms:
    """A copy with random energy/forces/stress labels in a SinglePointCalculator."""
    atoms = atoms.copy()
    stress = rng.normal(size=(3, 3))
    stress = stress + stress.T
    atoms.calc = SinglePointCalculator(
        atoms,
        energy=float(rng.normal()),
        forces=rng.normal(size=(len(atoms), 3)),
        stress=full_3x3_to_voigt_6_stress(stress) if voigt else stress,
    )
    return atoms


def test_from_ase_fields_units_and_ids(ar_periodic, ar_molecule, rng):
    a, m = ar_periodic.copy(), ar_molecule.copy()
    a.set_masses(rng.uniform(30, 50, len(a)))
    a.set_velocities(rng.normal(size=(len(a), 3)) * 0.01)
    m.set_initial_charges(rng.normal(size=len(m)))
    m.arrays["atom_id"] = np.arange(100, 100 + len(m))
    g = from_ase([a, m])
    n = len(a) + len(m)
    assert g.n_systems == 2 and g.n_atoms == n
    np.testing.assert_array_equal(g.batch.numpy(), [0] * len(a) + [1] * len(m))
    np.testing.assert_allclose(g.positions.numpy(), np.concatenate([a.positions, m.positions]))
    np.testing.assert_allclose(g.cell.numpy(), [a.cell[:], m.cell[:]])
    np.testing.assert_array_equal(g.pbc.numpy(), [a.pbc, m.pbc])
    np.testing.assert_allclose(g.masses.numpy()[: len(a)], a.get_masses())
    np.testing.assert_array_equal(g.atom_id.numpy(), [*range(len(a)), *range(100, 100 + len(m))])
    np.testing.assert_array_equal(g.system_id.numpy(), [0, 1])
    # velocities in Å/fs: kinetic energy 1/2 m v² (amu Å²/fs² -> eV) equals ASE's
    v = g.velocities[: len(a)].numpy()
    ke = 0.5 * (g.masses[: len(a)].numpy()[:, None] * v**2).sum() * MVV2E
    assert ke == pytest.approx(a.get_kinetic_energy(), rel=1e-12)
    assert (g.velocities[len(a) :] == 0).all()
    np.testing.assert_allclose(g.charges[len(a) :].numpy(), m.get_initial_charges())
    assert K.ENERGY not in g and K.FORCES not in g  # no labels anywhere
    g32 = from_ase(a, dtype=torch.float32)
    assert g32.positions.dtype == torch.float32 and g32.numbers.dtype == torch.long


def test_labels_voigt_3x3_custom_keys_and_partial(ar_periodic, ar_mixed_pbc, rng):
    a = labelled(ar_periodic, rng, voigt=True)
    b = labelled(ar_mixed_pbc, rng, voigt=False)
    g = from_ase([a, b])
    np.testing.assert_allclose(
        g.energy.numpy(), [a.calc.results["energy"], b.calc.results["energy"]]
    )
    np.testing.assert_allclose(
        g.forces.numpy(), np.concatenate([a.calc.results["forces"], b.calc.results["forces"]])
    )
    # Voigt (xx yy zz yz xz xy) and 3x3 give the same symmetric [3, 3]
    np.testing.assert_allclose(
        full_3x3_to_voigt_6_stress(g.stress[0].numpy()), a.calc.results["stress"]
    )
    np.testing.assert_allclose(g.stress[1].numpy(), b.calc.results["stress"])
    # custom keys in info/arrays
    c = ar_periodic.copy()
    c.info["REF_energy"] = -3.5
    c.arrays["REF_forces"] = np.ones((len(c), 3))
    c.info["REF_virial"] = np.arange(9.0)
    g = from_ase(c, energy_key="REF_energy", forces_key="REF_forces", virial_key="REF_virial")
    assert float(g.energy) == -3.5 and (g.forces == 1).all()
    np.testing.assert_allclose(g.virial[0].numpy(), np.arange(9.0).reshape(3, 3))
    # a label missing in one structure is not stored at all
    g = from_ase([a, ar_periodic])
    assert K.ENERGY not in g and K.FORCES not in g and K.STRESS not in g


def test_to_ase_round_trip(ar_periodic, ar_molecule, rng):
    a = labelled(ar_periodic, rng)
    a.set_velocities(rng.normal(size=(len(a), 3)) * 0.01)
    m = labelled(ar_molecule, rng)
    g = from_ase([a, m])
    back = to_ase(g)
    assert len(back) == 2
    for orig, new in zip([a, m], back):
        np.testing.assert_allclose(new.positions, orig.positions)
        np.testing.assert_allclose(new.cell[:], orig.cell[:])
        np.testing.assert_array_equal(new.pbc, orig.pbc)
        np.testing.assert_allclose(new.get_velocities(), orig.get_velocities(), atol=1e-15)
        assert new.get_potential_energy() == pytest.approx(orig.get_potential_energy())
        np.testing.assert_allclose(new.get_forces(), orig.get_forces())
    np.testing.assert_allclose(back[0].get_stress(), a.get_stress())
    g2 = from_ase(back)
    for k in g.keys():
        assert torch.equal(g[k], g2[k]), k


def test_extxyz_write_read(tmp_path, ar_periodic, ar_mixed_pbc, rng):
    a, b = labelled(ar_periodic, rng), labelled(ar_mixed_pbc, rng)
    path = tmp_path / "data.xyz"
    g = from_ase([a, b])
    write(path, g)
    frames = read(path, require=("energy", "forces"))
    assert len(frames) == 2 and all(isinstance(f, Atoms) for f in frames)
    g2 = read(path, as_graph=True, require=("energy", "forces", "stress"))
    for k in (K.POSITIONS, K.CELL, K.ENERGY, K.FORCES, K.STRESS, K.ATOM_ID, K.NUMBERS, K.PBC):
        torch.testing.assert_close(g2[k], g[k], rtol=0, atol=1e-7)  # extxyz: 8 decimals
    last = read(path, index=-1, as_graph=True)
    assert last.n_systems == 1 and torch.equal(last.numbers, g.numbers[g.batch == 1])
    # custom key names written by hand (as DFT datasets have them)
    c = ar_periodic.copy()
    c.info["REF_energy"] = 1.25
    c.arrays["REF_forces"] = rng.normal(size=(len(c), 3))
    write(tmp_path / "ref.xyz", [c])
    g3 = read(tmp_path / "ref.xyz", energy_key="REF_energy", forces_key="REF_forces", as_graph=True)
    assert float(g3.energy) == 1.25
    np.testing.assert_allclose(g3.forces.numpy(), c.arrays["REF_forces"])


@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True), (False, True, False)])
def test_wrapped_matches_ase_on_triclinic_cells(pbc, rng):
    atoms = make_atoms(n_atoms=10, pbc=pbc, volume_per_atom=30.0, min_distance=1.0, seed=7)
    atoms.positions += rng.uniform(-25, 25, size=(len(atoms), 3))  # far outside the cell
    g = from_ase(atoms).wrapped()
    expected = ase_wrap_positions(atoms.positions, atoms.cell, pbc=atoms.pbc, eps=0.0)
    np.testing.assert_allclose(g.positions.numpy(), expected, atol=1e-10)
    frac = g.positions.numpy() @ np.linalg.inv(atoms.cell.complete()[:])
    periodic = np.asarray(pbc)
    assert (frac[:, periodic] >= 0).all() and (frac[:, periodic] < 1).all()
    # non-periodic axes are untouched
    frac0 = atoms.positions @ np.linalg.inv(atoms.cell.complete()[:])
    np.testing.assert_allclose(frac[:, ~periodic], frac0[:, ~periodic], atol=1e-10)
