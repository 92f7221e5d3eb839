"""Lennard-Jones and Morse against ASE and numpy references; contracts pass and can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.calculators.lj import LennardJones as AseLJ
from ase.calculators.morse import MorsePotential
from ase.neighborlist import neighbor_list as ase_neighbor_list
from ase.stress import voigt_6_to_full_3x3_stress
from conftest import make_atoms

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.errors import InputError, UnknownSpeciesError
from xnn.models import Potential, build
from xnn.models.classical import LennardJones, Morse
from xnn.testing import (
    check_batch_consistency,
    check_cross_system_gradient_zero,
    check_cutoff_smoothness,
    check_edges_beyond_cutoff_ignored,
    check_forces_finite_difference,
    check_isolated_atom_e0,
    check_rotation_equivariance,
    check_stress_finite_difference,
    check_supercell_consistency,
    run_all_contracts,
)

SIGMA, EPS, RC = 3.4, 0.0104, 8.5


def xnn_results(model, atoms, dtype=torch.float64):
    g = from_ase(atoms, dtype=dtype)
    return Potential(model)(g, stress=bool(atoms.pbc.all()))


def assert_rel(actual, expected, rel=1e-10, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(np.abs(expected).max(), 1e-300)
    err = np.abs(actual - expected).max() / scale
    assert err <= rel, f"{what}: relative error {err:.2e} > {rel:g}"


def compare_with_ase(out, atoms, ref_calc, energy_offset=None):
    """Compare xnn results with an ASE calculator; ``energy_offset`` per atom is subtracted."""
    atoms = atoms.copy()
    atoms.calc = ref_calc
    energies = atoms.get_potential_energies()
    if energy_offset is not None:
        energies = energies - energy_offset
    assert_rel(out[K.ENERGY].numpy(), [energies.sum()], what="energy")
    assert_rel(out[K.ENERGIES].numpy(), energies, what="per-atom energies")
    assert_rel(out[K.FORCES].numpy(), atoms.get_forces(), what="forces")
    if atoms.pbc.all():
        stress = voigt_6_to_full_3x3_stress(atoms.get_stress())
        assert_rel(out[K.STRESS][0].numpy(), stress, what="stress")


@pytest.mark.parametrize("fixture", ["ar_periodic", "ar_small_cell", "ar_molecule", "ar_mixed_pbc"])
def test_lj_matches_ase(fixture, request):
    atoms = request.getfixturevalue(fixture)
    out = xnn_results(LennardJones(SIGMA, EPS, RC), atoms)
    compare_with_ase(out, atoms, AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False))
    assert (out[K.FORCES].abs().max() > 1e-4) and out[K.ENERGY].abs() > 1e-4  # not trivial


def numpy_lj_mixed(atoms, sigma: dict, epsilon: dict, rc: float):
    """Independent reference: shifted LJ with Lorentz-Berthelot mixing from ASE's neighbor list."""
    i, j, d, D = ase_neighbor_list("ijdD", atoms, rc)
    sym = np.array(atoms.get_chemical_symbols())
    s = 0.5 * (np.vectorize(sigma.get)(sym[i]) + np.vectorize(sigma.get)(sym[j]))
    e = np.sqrt(np.vectorize(epsilon.get)(sym[i]) * np.vectorize(epsilon.get)(sym[j]))
    u = 4 * e * ((s / d) ** 12 - (s / d) ** 6) - 4 * e * ((s / rc) ** 12 - (s / rc) ** 6)
    du = -24 * e / d * (2 * (s / d) ** 12 - (s / d) ** 6)  # dU/dr
    energies = np.bincount(i, 0.5 * u, minlength=len(atoms))
    fpair = (du / d)[:, None] * D  # dU/dr * r_hat: force on i from j is +dU/dr r_hat_ij
    forces = np.stack([np.bincount(i, fpair[:, k], minlength=len(atoms)) for k in range(3)], 1)
    stress = 0.5 * (D.T @ fpair) / atoms.get_volume()
    return energies, forces, stress


def test_lj_mixed_species_lorentz_berthelot():
    atoms = make_atoms(species=(18, 36), n_atoms=8, seed=5)
    sigma = {"Ar": 3.4, "Kr": 3.65}
    epsilon = {"Ar": 0.0104, "Kr": 0.0141}
    model = LennardJones(sigma, {36: 0.0141, 18: 0.0104}, RC)  # symbols and numbers both work
    assert model.species == [18, 36]
    out = xnn_results(model, atoms)
    energies, forces, stress = numpy_lj_mixed(atoms, sigma, epsilon, RC)
    assert_rel(out[K.ENERGIES].numpy(), energies, what="energies")
    assert_rel(out[K.FORCES].numpy(), forces, what="forces")
    assert_rel(out[K.STRESS][0].numpy(), stress, what="stress")
    with pytest.raises(UnknownSpeciesError, match="Ne"):
        xnn_results(model, make_atoms(species=(10, 18), n_atoms=4, seed=1))
    with pytest.raises(InputError, match="no value"):
        LennardJones(sigma, epsilon, RC, species=["Ar", "Ne"])


def test_one_type_path_equals_the_tables(ar_periodic):
    """A model of one type (scalar parameters, no per-edge type gather, the shift as a
    scalar) gives what a model of two types (per-edge parameter and shift tables) gives on
    the same single-element system."""
    one = LennardJones(SIGMA, EPS, RC)
    two = LennardJones({"Ar": SIGMA, "Kr": 3.65}, {"Ar": EPS, "Kr": 0.0141}, RC)
    morse_one = Morse(D=0.35, alpha=1.4, r0=2.9, cutoff=6.5)
    morse_two = Morse(D=0.35, alpha=1.4, r0=2.9, cutoff=6.5, species=["Ar", "Kr"])
    assert (one.n_types, two.n_types, morse_one.n_types, morse_two.n_types) == (1, 2, 1, 2)
    for a, b in ((one, two), (morse_one, morse_two)):
        out_a, out_b = xnn_results(a, ar_periodic), xnn_results(b, ar_periodic)
        assert out_a[K.ENERGY].abs().max() > 1e-3
        for key in (K.ENERGIES, K.FORCES, K.STRESS):
            torch.testing.assert_close(out_a[key], out_b[key], rtol=0, atol=1e-14)


MORSE = dict(D=0.35, alpha=1.4, r0=2.9)


def morse_u(r, D, alpha, r0):
    x = np.exp(-alpha * (r - r0))
    return D * (x * x - 2 * x)


@pytest.mark.parametrize("fixture", ["ar_periodic", "ar_small_cell", "ar_molecule", "ar_mixed_pbc"])
def test_morse_matches_ase(fixture, request):
    """ASE's Morse has a smooth window [rcut1, rcut2]; a window thinner than any pair gap makes
    it the unshifted Morse, so ours = ASE - 1/2 * n_neighbors * u(r_c) per atom."""
    atoms = request.getfixturevalue(fixture)
    rc, width = 6.5, 1e-6
    i, d = ase_neighbor_list("id", atoms, rc)
    assert not ((d > rc - width) & (d < rc)).any()
    ref = MorsePotential(
        epsilon=MORSE["D"],
        r0=MORSE["r0"],
        rho0=MORSE["alpha"] * MORSE["r0"],
        rcut1=(rc - width) / MORSE["r0"],
        rcut2=rc / MORSE["r0"],
    )
    offset = 0.5 * np.bincount(i, minlength=len(atoms)) * morse_u(rc, **MORSE)
    out = xnn_results(Morse(**MORSE, cutoff=rc), atoms)
    compare_with_ase(out, atoms, ref, energy_offset=offset)


def test_contracts_lj_and_morse(ar_periodic, ar_molecule):
    periodic, molecule = from_ase(ar_periodic), from_ase(ar_molecule)
    lj = LennardJones(SIGMA, EPS, RC)
    res = run_all_contracts(lj, periodic, molecule, pair_shifted_only=True)
    # the force jump of a shifted LJ at r_c is |dU/dr(r_c)|: reported, and exactly that value
    du = 24 * EPS / RC * (2 * (SIGMA / RC) ** 12 - (SIGMA / RC) ** 6)
    assert res["cutoff_smoothness"]["force_jump"] == pytest.approx(abs(du), rel=1e-5)
    assert res["cutoff_smoothness"]["energy_jump"] < 1e-9
    morse = Morse(**MORSE, cutoff=6.5)
    run_all_contracts(morse, periodic, molecule, pair_shifted_only=True)
    check_isolated_atom_e0(lj, 18, 0.0)
    with pytest.raises(AssertionError, match="force jumps"):
        check_cutoff_smoothness(morse, (18, 18), pair_shifted_only=False)


class Unshifted(LennardJones):
    """LJ without the shift: the energy jumps at the cutoff."""

    def forward(self, graph):
        vec = graph.edge_vectors()
        r2 = (vec * vec).sum(-1)
        c6 = (self.sigma_ij[0, 0] ** 2 / r2) ** 3
        e = torch.where(r2 < self.cutoff**2, 4 * self.epsilon_ij[0, 0] * (c6 * c6 - c6), 0 * r2)
        return torch.zeros(graph.n_atoms, dtype=r2.dtype).index_add(0, graph.edge_index[1], 0.5 * e)


class NoMask(LennardJones):
    """Counts edges beyond the cutoff (as if the Verlet skin were part of the model)."""

    def forward(self, graph):
        vec = graph.edge_vectors()
        c6 = (self.sigma_ij[0, 0] ** 2 / (vec * vec).sum(-1)) ** 3
        e = 4 * self.epsilon_ij[0, 0] * (c6 * c6 - c6)
        return torch.zeros(graph.n_atoms, dtype=e.dtype).index_add(0, graph.edge_index[1], 0.5 * e)


class Broken(LennardJones):
    """LJ plus a defect selected by ``kind`` to prove each contract can fail."""

    kind = ""

    def forward(self, graph):
        e = super().forward(graph)
        pos = graph.positions
        if self.kind == "not_invariant":
            return e + 1e-3 * pos[:, 0]
        if self.kind == "detached_force":
            return e + 1e-2 * (pos.detach() - pos.detach().mean(0)).pow(2).sum(-1)
        if self.kind == "detached_cell":
            return e + 1e-3 * torch.linalg.det(graph.cell.detach())[graph.batch]
        if self.kind == "batch_leak":
            return e + 1e-3 * pos.mean()
        if self.kind == "size_dependent":
            return e / graph.n_atoms
        raise AssertionError(self.kind)


def broken(kind):
    m = Broken(SIGMA, EPS, RC)
    m.kind = kind
    return m


def test_contracts_fail_on_broken_models(ar_periodic, ar_molecule):
    g = from_ase([ar_periodic, ar_molecule])
    with pytest.raises(AssertionError, match="rotation"):
        check_rotation_equivariance(broken("not_invariant"), g)
    with pytest.raises(AssertionError, match="finite differences"):
        check_forces_finite_difference(broken("detached_force"), g)
    with pytest.raises(AssertionError, match="stress vs finite differences"):
        check_stress_finite_difference(broken("detached_cell"), from_ase(ar_periodic))
    with pytest.raises(AssertionError, match="batch vs one-by-one"):
        check_batch_consistency(broken("batch_leak"), g)
    with pytest.raises(AssertionError, match="gradient"):
        check_cross_system_gradient_zero(broken("batch_leak"), g)
    with pytest.raises(AssertionError, match="supercell"):
        check_supercell_consistency(broken("size_dependent"), from_ase(ar_periodic))
    with pytest.raises(AssertionError, match="energy jumps"):
        check_cutoff_smoothness(Unshifted(SIGMA, EPS, RC), (18, 18), pair_shifted_only=True)
    with pytest.raises(AssertionError, match="cutoff"):
        check_edges_beyond_cutoff_ignored(NoMask(SIGMA, EPS, RC), g)
    with pytest.raises(AssertionError, match="isolated atom"):
        check_isolated_atom_e0(LennardJones(SIGMA, EPS, RC), 18, 0.1)


def test_fp32_and_dtype_moves(ar_periodic):
    model = build("lj", sigma=SIGMA, epsilon=EPS, cutoff=RC)
    ref = xnn_results(model, ar_periodic)
    model32 = model.to(torch.float32)
    assert model32.sigma_ij.dtype == torch.float32
    out = xnn_results(model32, ar_periodic, dtype=torch.float32)
    assert out[K.FORCES].dtype == torch.float32
    assert_rel(out[K.ENERGY].double(), ref[K.ENERGY], rel=1e-5, what="fp32 energy")
    assert_rel(out[K.FORCES].double(), ref[K.FORCES], rel=1e-4, what="fp32 forces")
    assert_rel(out[K.STRESS].double(), ref[K.STRESS], rel=1e-4, what="fp32 stress")


def test_registry_and_parameters():
    m = build("morse", D=0.3, alpha=1.2, r0=3.0, cutoff=7.0, species=["Cu"])
    assert isinstance(m, Morse) and m.species == [29] and m.cutoff == 7.0
    with pytest.raises(InputError, match="hyperparameter"):
        build("lj", sigma=1.0, epsilon=1.0, rc=3.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="cutoff"):
            LennardJones(SIGMA, EPS, bad)
        with pytest.raises(InputError, match="cutoff"):
            Morse(**MORSE, cutoff=bad)


def test_save_load_round_trip(tmp_path):
    from xnn.models.serialization import load_model, save_model

    atoms = make_atoms(species=(18, 36), n_atoms=6, seed=9)
    for model in (
        LennardJones({"Ar": 3.4, 36: 3.65}, {"Ar": 0.0104, "Kr": 0.0141}, RC),
        Morse(**MORSE, cutoff=6.5, species=["Ar", "Kr"]),
    ):
        save_model(model, tmp_path / "m.pt")
        loaded = load_model(tmp_path / "m.pt")
        assert type(loaded) is type(model) and loaded.species == model.species
        a, b = xnn_results(model, atoms), xnn_results(loaded, atoms)
        torch.testing.assert_close(a[K.FORCES], b[K.FORCES], rtol=0, atol=0)


def test_squared_lengths_equal_the_sum_and_differentiate_twice():
    """The CPU form of |v|^2 (a matrix-vector product, torch's sum over a last dimension of 3
    being slow there) gives the sum's values to round-off (the BLAS may add the three squares
    in another order: bitwise on some CPUs, one unit in the last place on others) and its
    first and second derivatives."""
    from xnn.models.base import squared_lengths

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        v = torch.randn(5000, 3, dtype=dtype, generator=gen)
        eps = torch.finfo(dtype).eps  # two additions of positive terms: <= 2 ulp apart
        torch.testing.assert_close(squared_lengths(v), (v * v).sum(-1), rtol=2 * eps, atol=0)
    v = torch.randn(40, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: squared_lengths(t).sqrt(), (v,))
    assert torch.autograd.gradgradcheck(lambda t: squared_lengths(t).sqrt(), (v,))
