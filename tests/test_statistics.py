"""Dataset statistics: E0 recovery, per-atom energy stats, force RMS, neighbour counts."""

import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from ase.neighborlist import neighbor_list as ase_neighbor_list

from xnn.data import AtomicGraph
from xnn.errors import InputError
from xnn.models.statistics import average_num_neighbors, energy_per_atom_stats, fit_e0, force_rms

E0 = {1: -13.6, 8: -432.1, 29: -1640.3}


def _structures(rng, n=40, noise=0.0):
    graphs = []
    for _ in range(n):
        k = int(rng.integers(1, 9))
        numbers = rng.choice(list(E0), size=k)
        pos = rng.uniform(0, 6, size=(k, 3))
        e = sum(E0[int(z)] for z in numbers) + noise * rng.normal()
        graphs.append(
            AtomicGraph.from_arrays(
                pos, numbers, extra={"energy": np.array([e]), "forces": rng.normal(size=(k, 3))}
            )
        )
    return graphs


def test_fit_e0_recovers_known_references():
    rng = np.random.default_rng(0)
    graphs = _structures(rng, noise=1e-3)
    fitted = fit_e0(graphs, species=[1, 8, 29, 79])
    for z, ref in E0.items():
        assert abs(fitted[z] - ref) < 5e-3
    assert fitted[79] == 0.0  # absent element: minimum-norm solution


def test_fit_e0_on_a_batched_graph_and_ase_atoms():
    rng = np.random.default_rng(1)
    graphs = _structures(rng, n=12)
    batched = AtomicGraph.concat(graphs)
    fitted = fit_e0(batched, species=list(E0))
    assert all(abs(fitted[z] - E0[z]) < 1e-8 for z in E0)
    atoms = []
    for g in graphs:
        a = Atoms(numbers=g.numbers.numpy(), positions=g.positions.numpy())
        a.calc = SinglePointCalculator(a, energy=float(g.energy[0]))
        atoms.append(a)
    fitted_ase = fit_e0(atoms, species=list(E0))
    assert all(abs(fitted_ase[z] - E0[z]) < 1e-8 for z in E0)


def test_fit_e0_rejects_unknown_species_and_missing_labels():
    rng = np.random.default_rng(2)
    with pytest.raises(InputError, match="not in the species list"):
        fit_e0(_structures(rng, n=5), species=[1, 8])
    g = AtomicGraph.from_arrays(np.zeros((1, 3)), [1])
    with pytest.raises(InputError, match="energy"):
        fit_e0([g], species=[1])


def test_energy_per_atom_stats_and_force_rms_match_numpy():
    rng = np.random.default_rng(3)
    graphs = _structures(rng, n=20, noise=0.5)
    stats = energy_per_atom_stats(graphs, e0=E0)
    per_atom = [
        (float(g.energy[0]) - sum(E0[int(z)] for z in g.numbers)) / g.n_atoms for g in graphs
    ]
    assert stats["count"] == 20
    assert stats["mean"] == pytest.approx(np.mean(per_atom), abs=1e-12)
    assert stats["std"] == pytest.approx(np.std(per_atom), abs=1e-12)
    forces = np.concatenate([g.forces.numpy() for g in graphs])
    assert force_rms(graphs) == pytest.approx(np.sqrt(np.mean(forces**2)), rel=1e-12)


def test_average_num_neighbors_matches_ase():
    cu = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    cu.rattle(0.05, seed=1)
    g = AtomicGraph.from_arrays(cu.positions, cu.numbers, cu.cell[:], cu.pbc)
    for cutoff in (3.0, 4.5):
        i, _ = ase_neighbor_list("ij", cu, cutoff)
        assert average_num_neighbors([g, g], cutoff) == pytest.approx(len(i) / len(cu))
    assert average_num_neighbors(g, 3.0) == pytest.approx(12.0)


def test_missing_labels_are_skipped():
    rng = np.random.default_rng(4)
    graphs = _structures(rng, n=15)
    labels = {"energy": np.array([np.nan]), "forces": np.full((2, 3), np.nan)}
    nan = AtomicGraph.from_arrays(np.zeros((2, 3)), [1, 8], extra=labels)
    with_nan = [nan, *graphs]
    assert fit_e0(with_nan, list(E0)) == pytest.approx(fit_e0(graphs, list(E0)))
    assert energy_per_atom_stats(with_nan, E0) == energy_per_atom_stats(graphs, E0)
    assert force_rms(with_nan) == pytest.approx(force_rms(graphs), rel=1e-14)
    with pytest.raises(InputError, match="energy label"):
        fit_e0([nan], [1, 8])
