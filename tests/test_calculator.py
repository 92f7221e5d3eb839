"""The ASE calculator: agreement with ASE's LJ, one model call per change, fp32, MD, demo."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.calculator import PropertyNotImplementedError
from ase.calculators.lj import LennardJones as AseLJ
from ase.md.verlet import VelocityVerlet

import xnn
from xnn.cli.main import main
from xnn.errors import UnknownSpeciesError
from xnn.models.classical import LennardJones

SIGMA, EPS, RC = 3.4, 0.0104, 8.5


def ase_reference(atoms):
    ref = atoms.copy()
    ref.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    return ref


def test_properties_match_ase_with_one_model_call(ar_periodic):
    atoms = ar_periodic.copy()
    atoms.info["stress"] = np.zeros(5)  # a malformed label the calculator must not read
    atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu")
    ref = ase_reference(atoms)
    assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-10)
    np.testing.assert_allclose(atoms.get_forces(), ref.get_forces(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(atoms.get_stress(), ref.get_stress(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(
        atoms.get_potential_energies(), ref.get_potential_energies(), atol=1e-13
    )
    assert atoms.get_potential_energy(force_consistent=True) == atoms.get_potential_energy()
    assert atoms.calc.n_model_calls == 1
    atoms.positions[0] += 0.05
    atoms.get_forces()
    atoms.get_stress()
    atoms.get_potential_energy()
    assert atoms.calc.n_model_calls == 2
    np.testing.assert_allclose(atoms.get_forces(), ase_reference(atoms).get_forces(), atol=1e-12)


def test_stress_only_for_3d_periodic(ar_molecule, ar_mixed_pbc):
    for atoms in (ar_molecule.copy(), ar_mixed_pbc.copy()):
        atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu")
        np.testing.assert_allclose(
            atoms.get_forces(), ase_reference(atoms).get_forces(), atol=1e-12
        )
        with pytest.raises(PropertyNotImplementedError):
            atoms.get_stress()
        assert atoms.calc.n_model_calls == 1


def test_fp32_calculator(ar_periodic):
    atoms = ar_periodic.copy()
    atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu", dtype=torch.float32)
    ref = ase_reference(atoms)
    assert atoms.calc.model.sigma_ij.dtype == torch.float32
    assert atoms.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-5)
    f, fr = atoms.get_forces(), ref.get_forces()
    assert np.abs(f - fr).max() <= 1e-4 * np.abs(fr).max()


def test_unknown_species(ar_periodic):
    atoms = ar_periodic.copy()
    atoms.numbers[0] = 29
    atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC, species=["Ar"]), device="cpu")
    with pytest.raises(UnknownSpeciesError, match="Cu"):
        atoms.get_potential_energy()


def test_md_with_verlet_skin_matches_ase(ar_periodic, rng):
    """NVE with a Verlet skin: forces along the trajectory equal ASE's, energy is conserved."""
    atoms = ar_periodic.copy()
    atoms.set_velocities(rng.normal(size=(len(atoms), 3)) * 0.02)
    calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu", skin=1.0)
    atoms.calc = calc
    e0 = atoms.get_total_energy()
    dyn = VelocityVerlet(atoms, timestep=2.0 * units.fs)
    for _ in range(5):
        dyn.run(4)
        np.testing.assert_allclose(
            atoms.get_forces(), ase_reference(atoms).get_forces(), atol=1e-12
        )
    assert abs(atoms.get_total_energy() - e0) < 1e-3 * len(atoms) * 0.01
    assert calc.potential.neighbors.n_builds < calc.n_model_calls


def test_demo_relaxes_lj_argon(tmp_path, capsys):
    from ase.io import read

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--fmax", "1e-3", "--repeat", "1", "--only-lj"]) == 0
    summary = json.loads((out / "summary.json").read_text())["lj_relax"]
    assert summary["converged"] and summary["max_force_eV_per_A"] < 1e-3
    assert str(out.resolve()) in capsys.readouterr().out
    # independent check of the relaxed crystal with ASE's own LJ (same shifted cutoff)
    relaxed = read(out / "lj_relaxed.xyz")
    from xnn.app.demo import AR_CUTOFF, AR_EPSILON, AR_SIGMA

    relaxed.calc = AseLJ(sigma=AR_SIGMA, epsilon=AR_EPSILON, rc=AR_CUTOFF, smooth=False)
    assert np.abs(relaxed.get_forces()).max() < 1e-3
    assert np.abs(relaxed.get_stress()).max() * relaxed.get_volume() < 1e-3 * len(relaxed)
    assert 5.1 < summary["lattice_constant_A"] < 5.4
