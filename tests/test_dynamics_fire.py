"""FIRE: reaches fmax, equals ASE's FIRE step by step and at the minimum, cell relaxation
toward a target pressure, batched relaxations equal single ones."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from helpers import argon_lj, rattled_argon

from xnn.data import AtomicGraph
from xnn.dynamics import fire
from xnn.units import EV_PER_A3_TO_GPA, GPA_TO_EV_PER_A3

SIGMA, EPS, RC = 3.405, 0.0104, 7.0


# small MD systems: one thread avoids thread overhead on small CPU tensors
pytestmark = pytest.mark.usefixtures("one_thread")


rattled = partial(rattled_argon, amp=0.15)


def graph_of(atoms):
    return AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array,
                                   atoms.pbc)


lj = partial(argon_lj, rc=RC, skin=0.5)


def relax(g, pot, fmax, steps=2000, **kw):
    s = fire.init(g, pot, **kw)
    while not bool(fire.converged(s, fmax).all()) and s.step < steps:
        s = fire.step(s, pot, fmax)
    return s


def test_fire_matches_ase_fire():
    from ase.calculators.lj import LennardJones
    from ase.optimize import FIRE

    atoms = rattled()
    g = graph_of(atoms)
    atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    opt = FIRE(atoms, logfile=None)
    pot = lj()
    s = fire.init(g, pot)
    # step by step for 30 steps: identical up to round-off
    for _ in range(30):
        opt.step()
        s = fire.step(s, pot)
    np.testing.assert_allclose(s.positions.numpy(), atoms.positions, rtol=0, atol=1e-9)
    opt.run(fmax=1e-4, steps=3000)
    while not bool(fire.converged(s, 1e-4).all()):
        s = fire.step(s, pot, 1e-4)
    assert s.step == 30 + opt.nsteps  # the same number of steps
    assert float(fire.fmax(s)[0]) < 1e-4
    assert abs(float(s.energy[0]) - atoms.get_potential_energy()) < 1e-10
    np.testing.assert_allclose(s.positions.numpy(), atoms.positions, rtol=0, atol=1e-6)


def test_fire_cell_relaxation_reaches_target_pressure():
    """Positions + cell toward P₀ = 0.2 GPa: stress = -P₀ I and forces < fmax; ASE's
    FrechetCellFilter (with ASE's LJ) finds no force at the result, and ASE's FIRE reaches
    the same volume."""
    from ase.calculators.lj import LennardJones
    from ase.filters import FrechetCellFilter
    from ase.optimize import FIRE

    p0 = 0.2
    atoms = rattled(a=5.5, amp=0.05, seed=1)
    atoms.set_cell(atoms.cell.array @ np.array([[1, 0.03, 0], [0, 1, 0], [0, 0, 0.98]]),
                   scale_atoms=True)
    g = graph_of(atoms)
    pot = lj()
    s = relax(g, pot, 1e-4, relax_cell=True, pressure=p0 * GPA_TO_EV_PER_A3)
    assert bool(fire.converged(s, 1e-4).all())
    stress = s.stress[0] * EV_PER_A3_TO_GPA
    np.testing.assert_allclose(stress.numpy(), -p0 * np.eye(3), atol=1e-3)
    # ASE's own LJ and FrechetCellFilter see a minimum there: its FIRE would stop at once
    relaxed = atoms.copy()
    relaxed.set_cell(s.graph.cell[0].numpy(), scale_atoms=False)
    relaxed.positions = s.positions.numpy()
    relaxed.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    filt = FrechetCellFilter(relaxed, scalar_pressure=p0 * GPA_TO_EV_PER_A3)
    assert np.linalg.norm(filt.get_forces(), axis=1).max() < 1e-3
    assert abs(relaxed.get_potential_energy() - float(s.energy[0])) < 1e-10
    # and ASE's FIRE from the same start reaches the same volume (a few steps, to fmax 2e-3)
    atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    opt = FIRE(FrechetCellFilter(atoms, scalar_pressure=p0 * GPA_TO_EV_PER_A3), logfile=None)
    opt.run(fmax=2e-3, steps=200)
    assert abs(float(s.graph.volume()[0]) / atoms.get_volume() - 1) < 2e-3


def test_fire_batch_equals_single_and_stops_converged_systems():
    graphs = [graph_of(rattled(seed=i, amp=0.05 + 0.03 * i)) for i in range(3)]
    pot = lj()
    batched = relax(AtomicGraph.concat(graphs), pot, 1e-3)
    ptr = batched.graph.ptr.tolist()
    for i, g in enumerate(graphs):
        single = relax(g, lj(), 1e-3)
        lo, hi = ptr[i], ptr[i + 1]
        torch.testing.assert_close(batched.positions[lo:hi], single.positions, rtol=0, atol=1e-9)
    assert bool(fire.converged(batched, 1e-3).all())


def test_fire_fixed_atoms_stay():
    g = graph_of(rattled())
    fixed = torch.zeros(g.n_atoms, dtype=torch.bool)
    fixed[[0, 5]] = True
    g = g.replace(fixed=fixed)
    s = relax(g, lj(), 1e-2, steps=300)
    assert torch.equal(s.positions[[0, 5]], g.positions[[0, 5]])
    assert float(fire.fmax(s)[0]) < 1e-2
