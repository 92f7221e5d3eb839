"""Electrostatics (``ewald``, ``pme``, ``coulomb``): Madelung constants, cluster sums, slab
capacitor, derivatives, charge sources, batching and invariances (fp64)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models import registry
from xnn.models.derivatives import compute_properties
from xnn.models.long_range import COULOMB_CONSTANT
from xnn.neighbors.api import with_edges

KE = COULOMB_CONSTANT
NACL = {"Na": 1.0, "Cl": -1.0}
NODES7 = {"ewald": {}, "pme": {"interpolation_nodes": 7}, "coulomb": {}}


def graph_of(atoms: Atoms, cutoff: float, charges=None) -> AtomicGraph:
    extra = None if charges is None else {"charges": np.asarray(charges, dtype=float)}
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell[:], atoms.pbc,
                                extra=extra)
    return with_edges(g, cutoff)


def run(model, atoms_or_graph, charges=None, stress=True):
    g = atoms_or_graph
    if isinstance(g, Atoms):
        g = graph_of(g, model.cutoff, charges)
    return compute_properties(model, g, forces=True, stress=stress)


def alternating(atoms):
    return np.where(np.arange(len(atoms)) % 2 == 0, 1.0, -1.0)


# ------------------------------------------------------------------ Madelung constants
# nearest-neighbour distance d = 1 Å: E per ion pair = -M k_e / d
CRYSTALS = {
    "NaCl": (lambda: bulk("NaCl", "rocksalt", a=2.0), 1.747564594633),
    "CsCl": (lambda: bulk("CsCl", "cesiumchloride", a=2.0 / math.sqrt(3)), 1.762674773070),
    "ZnS": (lambda: bulk("ZnS", "zincblende", a=4.0 / math.sqrt(3)), 1.638055053388),
}
ACCURATE = {"ewald": dict(cutoff=5.0, accuracy=1e-10),
            "pme": dict(cutoff=5.0, accuracy=1e-10, interpolation_nodes=7)}


@pytest.mark.parametrize("name", ["ewald", "pme"])
@pytest.mark.parametrize("crystal", sorted(CRYSTALS))
def test_madelung_constants(name, crystal):
    make, madelung = CRYSTALS[crystal]
    atoms = make()
    model = registry.build(name, charges="data", **ACCURATE[name])
    out = run(model, atoms, alternating(atoms))
    m = -float(out["energy"][0]) / (len(atoms) / 2) / KE
    assert abs(m - madelung) < 1e-8 * madelung
    # a perfect crystal: no forces, and the same constant in a 2x2x2 supercell
    assert float(out["forces"].abs().max()) < 1e-8
    sup = atoms.repeat(2)
    e2 = float(run(model, sup, alternating(sup), stress=False)["energy"][0])
    assert abs(-e2 / (len(sup) / 2) / KE - madelung) < 1e-8 * madelung


def test_matches_torchpme_called_directly():
    """xnn's composition of torch-pme's pieces equals its PMECalculator on the same input."""
    from torchpme import CoulombPotential, PMECalculator

    atoms = bulk("NaCl", "rocksalt", a=5.64).repeat(2)
    atoms.rattle(0.1, seed=3)
    model = registry.build("pme", cutoff=6.0, accuracy=1e-6, charges=NACL)
    g = graph_of(atoms, 6.0)
    e = run(model, g, stress=False)["energy"].sum()
    calc = PMECalculator(CoulombPotential(smearing=model.smearing, prefactor=KE),
                         mesh_spacing=model.mesh_spacing, full_neighbor_list=True)
    q = torch.tensor(alternating(atoms))[:, None]
    vec = g.edge_vectors()
    pairs = torch.stack([g.edge_index[1], g.edge_index[0]], 1)
    pot = calc(q, g.cell[0], g.positions, pairs, vec.norm(dim=-1))
    assert torch.allclose(e, (q * pot).sum(), rtol=1e-12, atol=0)


# ------------------------------------------------------------------ cluster
def test_ewald_pme_direct_agree_on_a_large_cluster():
    """A neutral, dipole-free 4x4x4 NaCl cube: direct sum == Ewald/PME in a vacuum box."""
    a = 5.64
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    q = np.where(grid.sum(1) % 2 == 0, 1.0, -1.0)
    pos = grid * a / 2
    direct = registry.build("coulomb", charges="data")
    mol = Atoms(numbers=np.where(q > 0, 11, 17), positions=pos)
    e_direct = float(run(direct, mol, q)["energy"][0])
    box = Atoms(numbers=mol.numbers, positions=pos + 20.0, cell=np.eye(3) * 48.0, pbc=True)
    for name, kw in [("ewald", {}), ("pme", {"interpolation_nodes": 7})]:
        model = registry.build(name, cutoff=12.0, accuracy=1e-8, charges="data", **kw)
        e = float(run(model, box, q, stress=False)["energy"][0])
        # image (quadrupole-quadrupole) interactions ~ 1/L^5 stay below 1e-6
        assert abs(e - e_direct) < 1e-6 * abs(e_direct), name
    # Madelung-like sanity: a finite cube is less bound per pair than the crystal
    assert -1.7476 * KE / (a / 2) < e_direct / 32 < 0


# ------------------------------------------------------------------ derivatives
def _rattled_nacl():
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    atoms.set_cell(atoms.cell[:] @ np.array([[1, 0.05, 0], [0, 1, -0.03], [0.02, 0, 1]]),
                   scale_atoms=True)
    atoms.rattle(0.15, seed=7)
    return atoms


def _energy(model, atoms, q):
    return float(run(model, atoms, q, stress=False)["energy"][0])


@pytest.mark.parametrize("name", ["ewald", "pme"])
def test_finite_difference_forces_and_stress(name):
    atoms = _rattled_nacl()
    q = alternating(atoms) * 0.8
    model = registry.build(name, cutoff=6.0, accuracy=1e-10, charges="data",
                           **NODES7[name])
    out = run(model, atoms, q)
    h = 1e-4
    for atom, axis in [(0, 0), (3, 2), (6, 1)]:
        e = []
        for sign in (1, -1):
            b = atoms.copy()
            b.positions[atom, axis] += sign * h
            e.append(_energy(model, b, q))
        fd = -(e[0] - e[1]) / (2 * h)
        assert abs(float(out["forces"][atom, axis]) - fd) < 1e-6 * max(1.0, abs(fd))
    vol = atoms.get_volume()
    for i, j in [(0, 0), (1, 2), (2, 2)]:
        e = []
        for sign in (1, -1):
            eps = np.eye(3)
            eps[i, j] += sign * h / 2
            eps[j, i] += sign * h / 2
            b = atoms.copy()
            b.set_cell(atoms.cell[:] @ eps, scale_atoms=True)
            e.append(_energy(model, b, q))
        fd = (e[0] - e[1]) / (2 * h) / vol
        assert abs(float(out["stress"][0, i, j]) - fd) < 1e-7


# ------------------------------------------------------------------ slab
def _capacitor(gap: float, lz: float, a: float = 3.0, n: int = 2):
    """Two square planes (n x n sites, spacing a) of charge +1 at z=5 and -1 at z=5+gap."""
    xy = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2) * a
    pos = np.concatenate([np.c_[xy, np.full(n * n, 5.0)], np.c_[xy, np.full(n * n, 5.0 + gap)]])
    q = np.r_[np.ones(n * n), -np.ones(n * n)]
    cell = np.diag([n * a, n * a, lz])
    return Atoms(numbers=[11] * (n * n) + [17] * (n * n), positions=pos, cell=cell,
                 pbc=[True, True, False]), q, (n * a) ** 2


@pytest.mark.parametrize("name", ["ewald", "pme"])
def test_slab_correction_charged_plane_capacitor(name):
    """Force on each charge 2 pi k_e q sigma_s towards the other plane; the energy grows as
    2 pi k_e sigma_s^2 A per unit gap. Without the correction the 3-D periodic sum gives
    the force of a periodic stack of capacitors, reduced by (1 - 2 gap / L_z)."""
    kw = dict(cutoff=8.0, accuracy=1e-9, charges="data",
              **NODES7[name])
    model = registry.build(name, slab_correction=True, **kw)
    gap, lz = 9.0, 90.0  # lattice-plane corrections ~ 4 exp(-2 pi gap / 3 Å) < 1e-7
    atoms, q, area = _capacitor(gap, lz)
    sigma_s = 4.0 / area
    f_ref = 2 * math.pi * KE * sigma_s  # per unit charge
    fz = run(model, atoms, q)["forces"][:, 2].numpy()
    assert np.allclose(fz[:4], f_ref, rtol=1e-6) and np.allclose(fz[4:], -f_ref, rtol=1e-6)
    e1 = _energy(model, atoms, q)
    e2 = _energy(model, _capacitor(gap + 2.0, lz)[0], q)
    assert abs((e2 - e1) / 2.0 - 2 * math.pi * KE * sigma_s**2 * area) < 1e-6 * abs(e2 - e1)
    # without it (the same cell as 3-D periodic): the periodic-capacitor force
    plain = registry.build(name, **kw)
    bulk_atoms = atoms.copy()
    bulk_atoms.pbc = True
    fz3 = run(plain, bulk_atoms, q)["forces"][:, 2].numpy()
    assert np.allclose(fz3[:4], f_ref * (1 - 2 * gap / lz), rtol=1e-6)
    assert not np.allclose(fz3[:4], f_ref, rtol=1e-2)


def test_slab_needs_the_flag():
    atoms, q, _ = _capacitor(6.0, 60.0)
    with pytest.raises(InputError, match="slab_correction"):
        run(registry.build("ewald", cutoff=8.0, charges="data"), atoms, q)


# ------------------------------------------------------------------ charges
class ScaledCharges(torch.nn.Module):
    """A trivial charge model: +s on Na, -s on Cl, with a trainable s."""

    def __init__(self, s: float):
        super().__init__()
        self.s = torch.nn.Parameter(torch.tensor(s, dtype=torch.float64))

    def forward(self, graph):
        return torch.where(graph.numbers == 11, self.s, -self.s)


@pytest.mark.parametrize("name", ["ewald", "pme", "coulomb"])
def test_charges_from_data_table_and_model(name):
    atoms = _rattled_nacl()
    if name == "coulomb":
        atoms.pbc = False
        atoms.cell = np.zeros((3, 3))
    q = np.where(atoms.numbers == 11, 1.0, -1.0)
    data = run(registry.build(name, charges="data"), atoms, q)
    table = run(registry.build(name, charges=NACL), atoms)
    for key in ("energy", "forces", "stress"):
        assert torch.allclose(data[key], table[key], rtol=1e-12, atol=1e-14)
    charge_model = ScaledCharges(0.7)
    model = registry.model_class(name)(charge_model=charge_model)
    g = graph_of(atoms, model.cutoff)
    out = compute_properties(model, g, training=True)
    assert torch.allclose(out["energy"], 0.49 * table["energy"], rtol=1e-12)
    assert torch.allclose(out["forces"], 0.49 * table["forces"], rtol=1e-10, atol=1e-12)
    (grad,) = torch.autograd.grad(out["energy"].sum(), charge_model.s)
    assert torch.allclose(grad, 2 * out["energy"][0] / 0.7, rtol=1e-10)
    with pytest.raises(InputError, match="charges"):
        run(registry.build(name, charges="data"), atoms)


# ------------------------------------------------------------------ batching, invariance
@pytest.mark.parametrize("name", ["ewald", "pme"])
def test_batch_of_bulk_slab_and_cluster_equals_each_alone(name):
    model = registry.build(name, cutoff=7.0, accuracy=1e-8, charges=NACL,
                           slab_correction=True, **NODES7[name])
    crystal = _rattled_nacl()
    slab = _capacitor(5.0, 40.0)[0]
    cluster = Atoms("NaClNaCl", positions=[[0, 0, 0], [2.8, 0, 0], [2.8, 2.8, 0.3],
                                           [0, 2.7, 0.1]])
    graphs = [graph_of(a, model.cutoff) for a in (crystal, slab, cluster)]
    alone = [run(model, g) for g in graphs]
    both = run(model, AtomicGraph.concat(graphs))
    assert torch.allclose(both["energy"], torch.cat([o["energy"] for o in alone]), rtol=1e-12)
    assert torch.allclose(both["forces"], torch.cat([o["forces"] for o in alone]),
                          rtol=1e-10, atol=1e-12)
    assert torch.allclose(both["stress"], torch.cat([o["stress"] for o in alone]),
                          rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["ewald", "pme"])
def test_translation_invariance(name):
    model = registry.build(name, cutoff=6.0, accuracy=1e-8, charges=NACL, **NODES7[name])
    atoms = _rattled_nacl()
    ref = run(model, atoms)
    moved = atoms.copy()
    moved.positions += np.array([0.37, -1.21, 2.05])
    out = run(model, moved)
    # Ewald exactly; PME up to its interpolation error (the mesh is fixed in space)
    tol = 1e-11 if name == "ewald" else 1e-7
    assert abs(float(out["energy"][0] - ref["energy"][0])) < tol * abs(float(ref["energy"][0]))
    assert torch.allclose(out["forces"], ref["forces"], atol=1e-9 if name == "ewald" else 1e-4)
    assert float(ref["forces"].sum(0).abs().max()) < (1e-9 if name == "ewald" else 1e-4)


@pytest.mark.parametrize("name", ["ewald", "pme"])
def test_net_charge_gets_a_background_and_a_warning(name):
    """One charge in a cubic box with the neutralising background: the Wigner-crystal energy
    -1.4186487397 k_e q^2 / L (simple cubic jellium Madelung constant 2.8372974794 / 2)."""
    L = 4.0
    atoms = Atoms("Na", positions=[[0.3, 0.1, 0.2]], cell=np.eye(3) * L, pbc=True)
    model = registry.build(name, cutoff=6.0, accuracy=1e-10, charges=NACL,
                           **NODES7[name])
    with pytest.warns(UserWarning, match="net charge"):
        e = _energy(model, atoms, None)
    assert abs(e - (-1.4186487397 * KE / L)) < 1e-8 * KE / L
    neutral = bulk("NaCl", "rocksalt", a=5.64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _energy(model, neutral, None)


def test_errors_and_registry():
    assert {"ewald", "pme", "coulomb"} <= set(registry.available_models())
    periodic = bulk("NaCl", "rocksalt", a=5.64)
    with pytest.raises(InputError, match="non-periodic"):
        run(registry.build("coulomb", charges=NACL), periodic)
    with pytest.raises(InputError, match="accuracy"):
        registry.build("ewald", accuracy=2.0)
    with pytest.raises(InputError, match="charges"):
        registry.build("pme", charges="mulliken")
    with pytest.raises(InputError, match="interpolation_nodes"):
        registry.build("pme", interpolation_nodes=9)


@pytest.mark.parametrize("name", ["ewald", "pme"])
@pytest.mark.parametrize("slab", [False, True])
def test_global_sum_hook_makes_kspace_exact_over_atom_subsets(name, slab):
    """Two fake 'ranks' owning halves of the atoms: each evaluates the k-space part on its
    own atoms with a ``global_sum`` that adds the other rank's partial sums (recorded); the
    potentials then equal the one-process ones. This is the contract a DD layer relies on."""
    from xnn.models.long_range.reciprocal import ewald_kspace, pme_kspace

    model = registry.build(name, cutoff=6.0, accuracy=1e-6, charges=NACL)
    atoms = _capacitor(5.0, 40.0)[0] if slab else _rattled_nacl()
    g = graph_of(atoms, 6.0)
    q = model.atom_charges(g)
    pos, cell, pbc = g.positions, g.cell[0], g.pbc[0]

    def kspace(idx, global_sum):
        if name == "ewald":
            return ewald_kspace(model.calculator.potential, model.lr_wavelength, q[idx], cell,
                                pos[idx], pbc, global_sum, slab)
        return pme_kspace(model.calculator, q[idx], cell, pos[idx], pbc, global_sum, slab)

    full = kspace(torch.arange(len(q)), lambda x: x)
    halves = [torch.arange(0, len(q), 2), torch.arange(1, len(q), 2)]
    recorded = [[], []]
    for r in (0, 1):
        kspace(halves[r], lambda x, r=r: recorded[r].append(x) or x)
    for r in (0, 1):
        other = iter(recorded[1 - r])
        phi = kspace(halves[r], lambda x, other=other: x + next(other))
        assert torch.allclose(phi, full[halves[r]], rtol=1e-12, atol=1e-12)
    # and without the hook a half alone is wrong
    assert not torch.allclose(kspace(halves[0], lambda x: x), full[halves[0]], atol=1e-3)


def test_predicted_charges_under_domain_decomposition_need_a_declared_cutoff():
    """A charge model without a cutoff cannot size the halo: refused with one line (one
    process: group of one rank); with a cutoff the halo is the real-space cutoff plus the
    charge model's receptive field (equality with one process: test_long_range_dd.py)."""
    from xnn.distributed import parallelize

    model = registry.model_class("ewald")(charge_model=ScaledCharges(0.7))
    with pytest.raises(InputError, match="predicted charges"):
        parallelize(model, None, "halo")
    parallelize(registry.model_class("ewald")(charges={"Na": 1.0, "Cl": -1.0}), None, "halo")
    q = registry.build("schnet", species=[11, 17], cutoff=3.0, num_interactions=2)
    pme = registry.build("pme", cutoff=5.0, charge_model=q)
    assert pme.receptive_field == 11.0 and pme.receiver_field == 8.0
    dd = parallelize(pme, None, "halo", skin=0.5)
    assert dd.halo_width == 11.5 and dd.layout.receiver_width == 8.5


def test_neutral_predicted_charges():
    """``neutral=True`` removes each system's mean predicted charge (batched), and a charge
    model whose cutoff exceeds the real-space one (it would miss edges) is refused."""
    atoms = _rattled_nacl()
    q = registry.build("schnet", species=[11, 17], cutoff=3.0, num_interactions=1)
    q.set_statistics(shift=0.3)  # a net charge to remove
    model = registry.build("pme", cutoff=5.0, charge_model=q, neutral=True)
    other = atoms.copy()
    other.rattle(0.1, seed=9)
    from xnn.data.ase_io import from_ase

    g = with_edges(from_ase([atoms, other[:6]], dtype=torch.float64), 5.0)
    q.double()
    charges = model.atom_charges(g).detach()
    raw = q(g).detach()
    for s in range(2):
        sel = g.batch == s
        assert abs(float(raw[sel].mean())) > 0.1
        assert abs(float(charges[sel].sum())) < 1e-12
        assert torch.allclose(charges[sel], raw[sel] - raw[sel].mean(), atol=1e-14)
    with pytest.raises(InputError, match="exceeds the real-space cutoff"):
        registry.build("pme", cutoff=2.0, charge_model=q)
    with pytest.raises(InputError, match="charge_model"):
        registry.build("pme", cutoff=5.0, neutral=True)
