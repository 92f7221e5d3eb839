"""DFT-D3(BJ) on xnn's neighbor list against tad-dftd3 called directly (molecules, and a
periodic cell through an explicit cluster of images), published values, derivatives."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, molecule

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.errors import InputError
from xnn.models import Potential, build
from xnn.models.long_range.dispersion import D3, _units
from xnn.testing import (
    check_batch_consistency,
    check_forces_finite_difference,
    check_rotation_equivariance,
    check_stress_finite_difference,
)
from xnn.testing.symmetry import check_translation_invariance

tad_dftd3 = pytest.importorskip("tad_dftd3")
AA2AU, AU2EV = _units()


def tad_energies(numbers, positions_aa, params, cutoff_aa, cn_cutoff_aa, atm_cutoff_aa=0.1):
    """tad-dftd3's per-atom energies (eV) for a molecule, in its own units and cutoffs (the
    ATM term only where ``params`` has a nonzero ``s9``)."""
    param = {k: torch.tensor(v, dtype=torch.float64) for k, v in params.items()
             if k != "s9" or v != 0.0}
    cut = tad_dftd3.Cutoff(cn=cn_cutoff_aa * AA2AU, disp2=cutoff_aa * AA2AU,
                           disp3=atm_cutoff_aa * AA2AU, dtype=torch.float64)
    e = tad_dftd3.dftd3(torch.as_tensor(numbers), torch.as_tensor(positions_aa) * AA2AU,
                        param, cutoff=cut)
    return e * AU2EV


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name,functional,s9", [
    ("CH3CH2OH", "pbe", 0.0), ("C6H6", "b3lyp", 0.0), ("H2O", "r2scan", 0.0),
    ("CH3CH2OH", "pbe", 1.0), ("C6H6", "b3lyp", 1.0), ("CH3COOH", "r2scan", 1.0)])
def test_molecules_equal_tad_dftd3(name, functional, s9):
    """Two-body alone (s9=0) and with the ATM term (s9=1, tad-dftd3's disp3 = atm_cutoff)."""
    model = D3(functional, cutoff=12.0, cn_cutoff=9.0, s9=s9, atm_cutoff=6.0)
    atoms = molecule(name)
    out = Potential(model)(from_ase([atoms], dtype=torch.float64), stress=False)
    ref = tad_energies(atoms.numbers, atoms.positions, model.params, 12.0, 9.0, 6.0)
    assert rel_err(out[K.ENERGIES], ref) <= 1e-10
    if s9:  # the ATM term is resolved: dropping it is far outside the tolerance
        two = tad_energies(atoms.numbers, atoms.positions, dict(model.params, s9=0.0), 12, 9)
        assert rel_err(two, ref) > 1e-5
    # forces: tad-dftd3's autograd gradient
    pos = torch.tensor(atoms.positions, requires_grad=True)
    e = tad_energies(atoms.numbers, pos, model.params, 12.0, 9.0, 6.0).sum()
    (grad,) = torch.autograd.grad(e, pos)
    assert rel_err(out[K.FORCES], -grad) <= 1e-10


def test_periodic_equals_tad_dftd3_on_a_cluster_of_images():
    """Per-atom energies of a periodic cell equal tad-dftd3's for the central cell's atoms of
    a cluster of images large enough that their CN and two-body sums are complete."""
    rc, rcn = 7.0, 5.0
    atoms = bulk("Si", "diamond", a=5.43) * (1, 1, 1)
    atoms.rattle(0.05, seed=1)
    atoms.set_cell(atoms.cell.array @ np.array([[1, 0.05, 0], [0, 1, 0.02], [0, 0, 1.0]]),
                   scale_atoms=True)
    model = D3("pbe", cutoff=rc, cn_cutoff=rcn, s9=0.0)
    out = Potential(model)(from_ase([atoms], dtype=torch.float64), stress=False)
    n = len(atoms)
    reach = rc + rcn + 1.0
    m = int(np.ceil(reach / 3.0)) + 1  # cell heights > 3 Å
    shifts = np.array([(a, b, c) for a in range(-m, m + 1) for b in range(-m, m + 1)
                       for c in range(-m, m + 1)])
    pos = (atoms.positions[None] + (shifts @ atoms.cell.array)[:, None]).reshape(-1, 3)
    num = np.tile(atoms.numbers, len(shifts))
    center = atoms.positions.mean(0)
    keep = np.linalg.norm(pos - center, axis=1) < reach + np.linalg.norm(atoms.cell.array)
    central = np.zeros(len(pos), bool)
    central[int(np.flatnonzero((shifts == 0).all(1))[0]) * n + np.arange(n)] = True
    ref = tad_energies(num[keep], pos[keep], model.params, rc, rcn)[central[keep]]
    assert rel_err(out[K.ENERGIES], ref) <= 1e-10


def test_periodic_atm_equals_tad_dftd3_on_a_cluster_of_images():
    """Two-body plus ATM per-atom energies of a periodic (triclinic, rattled) NaCl cell equal
    tad-dftd3's for its central-cell atoms: CN and C6 from tad-dftd3 on a cluster of images,
    its ``dispersion_atm`` on the atoms within ``atm_cutoff`` of the central cell."""
    rc, rcn, r3 = 4.5, 3.5, 5.0
    atoms = bulk("NaCl", "rocksalt", a=5.64)
    atoms.rattle(0.1, seed=4)
    atoms.set_cell(atoms.cell.array @ np.array([[1, 0.04, 0], [0, 1, 0.03], [0, 0, 1.0]]),
                   scale_atoms=True)
    model = D3("pbe", cutoff=rc, cn_cutoff=rcn, s9=1.0, atm_cutoff=r3)
    out = Potential(model)(from_ase([atoms], dtype=torch.float64), stress=False)
    n, reach = len(atoms), max(rc, r3) + rcn + 1.0
    m = int(np.ceil(reach / 3.0)) + 1
    shifts = np.array([(a, b, c) for a in range(-m, m + 1) for b in range(-m, m + 1)
                       for c in range(-m, m + 1)])
    pos = (atoms.positions[None] + (shifts @ atoms.cell.array)[:, None]).reshape(-1, 3)
    num = np.tile(atoms.numbers, len(shifts))
    central = np.zeros(len(pos), bool)
    central[int(np.flatnonzero((shifts == 0).all(1))[0]) * n + np.arange(n)] = True
    dist = np.linalg.norm(pos[:, None] - pos[central][None], axis=-1).min(1)
    keep = dist < reach
    two = tad_energies(num[keep], pos[keep], dict(model.params, s9=0.0), rc, rcn)
    z, xyz = torch.as_tensor(num[keep]), torch.as_tensor(pos[keep]) * AA2AU
    ref = tad_dftd3.reference.Reference(dtype=torch.float64)
    from tad_mctc.data import radii
    cn = tad_dftd3.ncoord.coordination_number(
        z, xyz, counting_function=tad_dftd3.ncoord.exp_count,
        rcov=radii.COV_D3(dtype=torch.float64)[z], cutoff=torch.tensor(rcn * AA2AU))
    c6 = tad_dftd3.model.atomic_c6(z, tad_dftd3.model.weight_references(z, cn, ref), ref)
    near = torch.as_tensor(dist[keep] < r3 + 0.5)  # the triples of central atoms
    rvdw = radii.VDW_PAIRWISE(dtype=torch.float64)[z[near, None], z[None, near]]
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    atm = tad_dftd3.damping.dispersion_atm(z[near], xyz[near], c6[near][:, near], rvdw,
                                           f64(r3 * AA2AU), f64(1.0), f64(4 / 3), f64(14.0))
    total = two.clone()
    total[near] += atm * AU2EV
    expected = total[torch.as_tensor(central[keep])]
    assert rel_err(out[K.ENERGIES], expected) <= 1e-10
    atm_central = (total - two)[torch.as_tensor(central[keep])]
    assert float(atm_central.abs().min()) > 1e-5 * float(expected.abs().max())


def test_published_reference_energies():
    """tad-dftd3's documented values (its package docstring; s-dftd3 gives the same):
    S22 formamide dimer and monomer, ωB97M-D3(BJ) (s8 0.3908, a1 0.5660, a2 3.1280),
    -0.0124292 and -0.0045002 Hartree; coordinates in Bohr."""
    dimer = np.array([
        [-3.81469488143921, +0.09993441402912, 0.0], [+3.81469488143921, -0.09993441402912, 0.0],
        [-2.66030049324036, -2.15898251533508, 0.0], [+2.66030049324036, +2.15898251533508, 0.0],
        [-0.73178529739380, -2.28237795829773, 0.0], [-5.89039325714111, -0.02589114569128, 0.0],
        [-3.71254944801331, -3.73605775833130, 0.0], [+3.71254944801331, +3.73605775833130, 0.0],
        [+0.73178529739380, +2.28237795829773, 0.0], [+5.89039325714111, +0.02589114569128, 0.0],
        [-2.74426102638245, +2.16115570068359, 0.0], [+2.74426102638245, -2.16115570068359, 0.0]])
    monomer = np.array([
        [-0.55569743203406, +1.09030425468557, 0.0], [+0.51473634678469, +3.15152550263611, 0.0],
        [+0.59869690244446, -1.16861263789477, 0.0], [-0.45355203669134, -2.74568780438064, 0.0],
        [+2.52721209544999, -1.29200800956867, 0.0], [-2.63139587595376, +0.96447869452240, 0.0]])
    model = D3(None, s8=0.3908, a1=0.5660, a2=3.1280, cutoff=60 / AA2AU, cn_cutoff=40 / AA2AU,
               s9=0.0)
    frames = [Atoms("CCNNHHHHHHOO", positions=dimer / AA2AU),
              Atoms("CONHHH", positions=monomer / AA2AU)]
    out = Potential(model)(from_ase(frames, dtype=torch.float64), forces=False, stress=False)
    hartree = out[K.ENERGY].numpy() / AU2EV
    np.testing.assert_allclose(hartree, [-0.0124292, -0.0045002], atol=6e-8)


def periodic_and_molecule():
    si = bulk("Si", "diamond", a=5.43)
    si.rattle(0.05, seed=2)
    mol = molecule("CH3CH2OH")
    mol.center(vacuum=3.0)
    slab = bulk("NaCl", "rocksalt", a=5.64)
    slab.rattle(0.05, seed=3)
    slab.pbc = (True, True, False)
    return from_ase([si, mol, slab], dtype=torch.float64)


def test_derivatives_batching_and_invariance():
    """Two-body + ATM (s9=1): finite-difference forces and stress, symmetry, batching."""
    model = D3("pbe", cutoff=6.0, cn_cutoff=4.5, s9=1.0, atm_cutoff=5.0)
    graph = periodic_and_molecule()
    check_forces_finite_difference(model, graph, delta=1e-4, atol=1e-7, rtol=1e-6)
    check_stress_finite_difference(model, graph)
    check_rotation_equivariance(model, graph)
    check_translation_invariance(model, graph)
    check_batch_consistency(model, graph)


def test_parameters_and_errors():
    pbe = D3("pbe")
    assert pbe.params == pytest.approx({"s6": 1.0, "s8": 0.7875, "a1": 0.4289, "a2": 4.4407,
                                        "s9": 1.0, "alp": 14.0})  # s-dftd3's table: s9 = 1
    assert pbe.atm_cutoff == pytest.approx(min(25.0, 40 / AA2AU))
    assert pbe.receptive_field == pytest.approx(25.0 + 25 / AA2AU)
    two = D3("pbe", cutoff=6.0, cn_cutoff=4.0, s9=0.0, atm_cutoff=9.0)
    assert two.atm_cutoff == 0.0 and two.cutoff == 6.0 and two.receptive_field == 10.0
    three = D3("pbe", cutoff=6.0, cn_cutoff=4.0, atm_cutoff=9.0)
    assert three.cutoff == 9.0 and three.receptive_field == 13.0
    assert D3("pbe", a1=0.5).params["a1"] == 0.5
    assert pbe.cutoff == 25.0 and pbe.cn_cutoff == pytest.approx(25 / AA2AU)
    assert build("d3", functional="pbe", cutoff=10.0).cutoff == 10.0
    with pytest.raises(InputError, match="no D3"):
        D3("not-a-functional")
    with pytest.raises(InputError, match="s8, a1, a2"):
        D3(None)
    with pytest.raises(InputError, match="atm_cutoff"):
        D3("pbe", atm_cutoff=-1.0)
    # too many triples: one line saying what to do, not an out-of-memory
    big = bulk("Si", "diamond", a=5.43)
    with pytest.raises(InputError, match="smaller atm_cutoff"):
        Potential(D3("pbe", cutoff=6.0, max_triples=1000))(from_ase([big]), stress=False)
    assert "ref_c6" not in pbe.state_dict()  # tables are rebuilt from tad-dftd3, not saved
