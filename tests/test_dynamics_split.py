"""Integrators and FIRE on a system split over fake ranks equal the unsplit run, by atom id.

Each fake rank (a thread, see ``fake_ranks.py``) holds a random subset of the atoms in a
random order (one rank holds none), runs ``init``/``step`` on it with a reducer that sums
over all ranks, and gets from the potential the global energy and stress and the forces
of its own atoms: what a rank of a domain-decomposed run sees. Positions, velocities and
integrator variables must equal a single-process run to 1e-10 after 50 steps, and every
rank must hold the same thermostat/barostat state. Both runs draw their initial velocities
from ``maxwell_boltzmann`` (split and unsplit).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_ranks import SplitPotential, ThreadReducer, World, merge, split_atoms
from helpers import argon_lj, rattled_argon

from xnn.data import AtomicGraph
from xnn.dynamics import fire, maxwell_boltzmann
from xnn.dynamics.fire import FIRE_VELOCITIES
from xnn.dynamics.reduce import LOCAL
from xnn.dynamics.registry import get_integrator
from xnn.units import GPA_TO_EV_PER_A3

pytestmark = pytest.mark.usefixtures("one_thread")

N_RANKS, STEPS, DT, TEMP = 4, 50, 5.0, 40.0


lj = argon_lj


def argon(fixed=False, triclinic=False, strain=0.0):
    """32 rattled argon atoms; optionally 3 fixed atoms, a sheared or a strained cell."""
    atoms = rattled_argon(a=5.3, rep=2, amp=0.05, seed=3)
    deform = np.eye(3) * (1 + strain)
    if triclinic:
        deform = deform + np.array([[0, 0.06, 0.02], [0, 0, -0.04], [0, 0, 0]])
    atoms.set_cell(atoms.cell.array @ deform, scale_atoms=True)
    g = AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array, True)
    if fixed:
        mask = torch.zeros(g.n_atoms, dtype=torch.bool)
        mask[[0, 9, 30]] = True
        g = g.replace(fixed=mask)
    return g


def split_run(graph, advance, seed=0):
    """Run ``advance(graph, potential, reduce)`` on every fake rank; returns their results."""
    world, shared = World(N_RANKS), lj()
    parts = split_atoms(graph.n_atoms, N_RANKS, seed)

    def work(rank):
        red = ThreadReducer(world, rank)
        return advance(graph.select_atoms(parts[rank]), SplitPotential(world, rank, shared, graph),
                       red)

    return world.run(work)


def md(name, kw):
    mod = get_integrator(name)

    def advance(graph, potential, reduce):
        g = maxwell_boltzmann(graph, TEMP, seed=11, reduce=reduce)
        s = mod.init(g, potential, **kw, reduce=reduce)
        for _ in range(STEPS):
            s = mod.step(s, potential, DT, reduce)
        return s, mod.conserved(s, reduce)

    return advance


def assert_same(ranks, ref, fields, atol=1e-10):
    """Fake ranks' states equal the reference state by atom id; all ranks share their vars."""
    states = [s for s, _ in ranks]
    graphs = [s.graph for s in states]
    assert sorted(torch.cat([g.atom_id for g in graphs]).tolist()) == list(range(ref.graph.n_atoms))
    assert graphs[-1].n_atoms == 0  # the empty rank took part
    for name in fields:
        torch.testing.assert_close(merge(graphs, name), ref.graph[name], rtol=0, atol=atol,
                                   msg=name)
    for s in states:
        assert s.step == ref.step
        torch.testing.assert_close(s.graph.cell, ref.graph.cell, rtol=0, atol=atol)
        torch.testing.assert_close(s.energy, ref.energy, rtol=1e-12, atol=1e-12)
        for k, v in s.vars.items():
            assert torch.equal(v, states[0].vars[k]), k  # replicated state: same bits
            torch.testing.assert_close(v, ref.vars[k], rtol=1e-10, atol=atol, msg=k)


CASES = {
    "nve": ("nve", {}, {"fixed": True}),
    "langevin": ("langevin", {"temperature": TEMP, "friction": 0.05, "seed": 3}, {}),
    "langevin_fixed": ("langevin", {"temperature": TEMP, "friction": 0.05, "seed": 3},
                       {"fixed": True}),
    "csvr_fixed": ("csvr", {"temperature": TEMP, "tau": 20.0, "seed": 4}, {"fixed": True}),
    "nhc_fixed": ("nhc", {"temperature": TEMP, "tau": 50.0}, {"fixed": True}),
    "npt_iso": ("npt", {"temperature": TEMP, "pressure": 0.01 * GPA_TO_EV_PER_A3, "tau": 20.0,
                        "tau_p": 100.0, "compressibility": 0.3 / GPA_TO_EV_PER_A3, "seed": 5},
                {"strain": 0.02}),
    "npt_aniso": ("npt", {"temperature": TEMP, "pressure": 0.0, "tau": 20.0, "tau_p": 100.0,
                          "compressibility": 0.3 / GPA_TO_EV_PER_A3, "seed": 6,
                          "anisotropic": True}, {"triclinic": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_md_equals_one_process(case):
    name, kw, system = CASES[case]
    graph = argon(**system)
    ranks = split_run(graph, md(name, kw))
    ref, ref_conserved = md(name, kw)(graph, lj(), LOCAL)
    assert_same(ranks, ref, ("positions", "velocities"))
    for _, cons in ranks:
        torch.testing.assert_close(cons, ref_conserved, rtol=1e-12, atol=1e-12)
    if name == "npt":  # the cell moved: the test covers the barostat, not a no-op
        assert (ref.graph.cell - graph.cell).abs().max() > 1e-3


@pytest.mark.parametrize("relax_cell", [False, True])
def test_split_fire_equals_one_process(relax_cell):
    """FIRE (atoms, or atoms and cell) to fmax 1e-3 eV/Å: same steps, same structure."""
    graph = argon(triclinic=relax_cell, strain=0.02 if relax_cell else 0.0)
    fmax_target, max_steps = 1e-3, 400

    def advance(graph, potential, reduce):
        s = fire.init(graph, potential, relax_cell=relax_cell, reduce=reduce)
        while not reduce.all(fire.converged(s, fmax_target, reduce)) and s.step < max_steps:
            s = fire.step(s, potential, fmax_target, reduce)
        return s, fire.fmax(s, reduce)

    ref, ref_fmax = advance(graph, lj(), LOCAL)
    assert 20 < ref.step < max_steps and float(ref_fmax[0]) < fmax_target
    ranks = split_run(graph, advance)
    assert_same(ranks, ref, ("positions", FIRE_VELOCITIES))
    for _, fm in ranks:
        torch.testing.assert_close(fm, ref_fmax, rtol=1e-9, atol=1e-12)
