"""NVE velocity Verlet against ASE, energy conservation (LJ and a random-weight MLIP),
batched == one-by-one, fixed atoms, initial velocities."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from ase import units
from helpers import argon_lj, rattled_argon

from xnn.data import AtomicGraph
from xnn.dynamics import degrees_of_freedom, maxwell_boltzmann, nhc, nve, temperature
from xnn.errors import InputError
from xnn.models import Potential, build
from xnn.models.derivatives import compute_properties

SIGMA, EPS, RC = 3.405, 0.0104, 8.0


# small MD systems: one thread avoids thread overhead on small CPU tensors
pytestmark = pytest.mark.usefixtures("one_thread")


argon = partial(rattled_argon, a=5.26, amp=0.05)


def graph_of(atoms) -> AtomicGraph:
    return AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array,
                                   atoms.pbc,
                                   masses=atoms.get_masses())


lj = partial(argon_lj, rc=RC)


def test_nve_matches_ase_velocity_verlet_1000_steps():
    """32 LJ argon atoms, 1000 steps of 5 fs: positions and velocities equal ASE's to 1e-8."""
    from ase.calculators.lj import LennardJones
    from ase.md.verlet import VelocityVerlet

    atoms = argon()
    g = maxwell_boltzmann(graph_of(atoms), 40.0, seed=1)
    atoms.set_velocities(g.velocities.numpy() / units.fs)
    atoms.calc = LennardJones(sigma=SIGMA, epsilon=EPS, rc=RC, smooth=False)
    pot = lj(skin=0.5)  # small skin: the list is rebuilt several times in the run
    s = nve.init(g, pot)
    e0 = float(nve.conserved(s)[0])
    etot = []
    for _ in range(1000):
        s = nve.step(s, pot, 5.0)
        etot.append(float(nve.conserved(s)[0]))
    VelocityVerlet(atoms, timestep=5.0 * units.fs).run(1000)
    assert pot.neighbors.n_builds > 1  # the Verlet list was rebuilt during the run
    np.testing.assert_allclose(s.positions.numpy(), atoms.positions, rtol=0, atol=1e-8)
    v_ase = atoms.get_velocities() * units.fs
    np.testing.assert_allclose(s.velocities.numpy(), v_ase, rtol=0, atol=1e-8)
    assert abs(float(s.energy[0]) - atoms.get_potential_energy()) < 1e-8
    # energy conservation: max |E_tot - E_tot(0)| below 2e-5 eV/atom (measured 2.2e-6)
    assert max(abs(e - e0) for e in etot) / 32 < 2e-5


def test_nve_energy_drift_random_schnet():
    """A random-weight SchNet (scaled so that 0.1 eV moves between E_pot and E_kin) conserves
    energy: max |ΔE_tot| < 2e-6 eV/atom over 200 steps of 2 fs (measured 2e-7), and the error
    shrinks like dt² (ratio 4–16 from 2 fs to 1 fs): an integration error, not a bug."""
    atoms = argon(rep=2, a=5.4, amp=0.02)
    g = maxwell_boltzmann(graph_of(atoms), 100.0, seed=3)
    worst = {}
    for dt in (1.0, 2.0):
        torch.manual_seed(0)
        model = build("schnet", cutoff=4.0, species=[18], num_features=32, num_filters=32,
                      num_interactions=2, num_basis=16, scale=30.0).double().eval()
        pot = Potential(model, skin=0.5)
        s = nve.init(g, pot)
        e0, w = float(nve.conserved(s)[0]), 0.0
        for _ in range(200):
            s = nve.step(s, pot, dt)
            w = max(w, abs(float(nve.conserved(s)[0]) - e0))
        worst[dt] = w / g.n_atoms
        assert pot.neighbors.n_builds > 1
    assert worst[2.0] < 2e-6, worst
    assert 3.0 < worst[2.0] / worst[1.0] < 20.0, worst


def _mixed_batch():
    a = graph_of(argon(rep=2, seed=1))
    b = graph_of(argon(rep=(2, 2, 1), a=5.4, seed=2))
    c = graph_of(argon(rep=(1, 2, 2), a=5.3, seed=3))
    temps = (20, 40, 60)
    return [maxwell_boltzmann(x, t, seed=i) for i, (x, t) in enumerate(zip((a, b, c), temps))]


@pytest.mark.parametrize("integrator", ["nve", "nhc"])
def test_batch_equals_one_by_one(integrator):
    """Three different systems advanced together equal the same systems advanced alone."""
    graphs = _mixed_batch()
    mod = {"nve": nve, "nhc": nhc}[integrator]
    kw = {} if integrator == "nve" else {"tau": 50.0}

    def run(graph, temps):
        pot = lj(rc=6.5)
        extra = {} if integrator == "nve" else {"temperature": temps}
        s = mod.init(graph, pot, **kw, **extra)
        for _ in range(60):
            s = mod.step(s, pot, 4.0)
        return s

    batched = run(AtomicGraph.concat(graphs), torch.tensor([30.0, 50.0, 70.0], dtype=torch.float64))
    ptr = batched.graph.ptr.tolist()
    for i, (g, t) in enumerate(zip(graphs, (30.0, 50.0, 70.0))):
        single = run(g, t)
        lo, hi = ptr[i], ptr[i + 1]
        torch.testing.assert_close(batched.positions[lo:hi], single.positions, rtol=0, atol=1e-11)
        torch.testing.assert_close(batched.velocities[lo:hi], single.velocities, rtol=0, atol=1e-12)
        torch.testing.assert_close(mod.conserved(batched)[i], mod.conserved(single)[0],
                                   rtol=0, atol=1e-10)


def test_maxwell_boltzmann_seeded_zero_momentum_and_fixed_atoms():
    g = AtomicGraph.concat([graph_of(argon(rep=3)), graph_of(argon(rep=3, seed=5))])
    fixed = torch.zeros(g.n_atoms, dtype=torch.bool)
    fixed[200:210] = True  # system 1 has 10 fixed atoms
    g = g.replace(fixed=fixed)
    a = maxwell_boltzmann(g, torch.tensor([100.0, 300.0], dtype=torch.float64), seed=7)
    b = maxwell_boltzmann(g, torch.tensor([100.0, 300.0], dtype=torch.float64), seed=7)
    assert torch.equal(a.velocities, b.velocities)
    assert not torch.equal(a.velocities, maxwell_boltzmann(g, 100.0, seed=8).velocities)
    p0 = (a.masses[:108, None] * a.velocities[:108]).sum(0)
    assert p0.abs().max() < 1e-12  # no fixed atoms: zero total momentum
    assert (a.velocities[200:210] == 0).all()
    dof = degrees_of_freedom(a)
    assert dof.tolist() == [3 * 108 - 3, 3 * 98]
    t = temperature(a)
    # 108-atom samples: relative spread of T is sqrt(2/dof) ~ 8%
    assert abs(float(t[0]) / 100 - 1) < 0.3 and abs(float(t[1]) / 300 - 1) < 0.3


def test_fixed_atoms_do_not_move_and_step_does_not_mutate_input():
    g = maxwell_boltzmann(graph_of(argon()), 50.0, seed=0)
    fixed = torch.zeros(g.n_atoms, dtype=torch.bool)
    fixed[:4] = True
    g = g.replace(fixed=fixed)
    pot = lj(rc=6.5)
    s0 = nve.init(g, pot)
    before = {k: v.clone() for k, v in s0.graph.fields.items()}
    forces_before = s0.forces.clone()
    s = s0
    for _ in range(20):
        s = nve.step(s, pot, 5.0)
    assert torch.equal(s.positions[:4], g.positions[:4])
    assert not torch.equal(s.positions[4:], g.positions[4:])
    for k, v in s0.graph.fields.items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(s0.forces, forces_before) and s0.step == 0 and s.step == 20


def test_potential_gives_the_model_the_edges_within_the_cutoff():
    """With a skin the model sees only the Verlet list's edges shorter than the cutoff (those
    of a list built at the cutoff itself, in the list's order), and energy, forces and stress
    are those of the whole list."""
    g = graph_of(rattled_argon(rep=2))
    model = build("lj", sigma=3.4, epsilon=0.0104, cutoff=6.0).double()
    skin, exact = Potential(model, skin=1.0), Potential(model, skin=0.0)
    listed, seen, want = skin.neighbors(g), skin.model_graph(g), exact.model_graph(g)
    assert want.n_edges == seen.n_edges < listed.n_edges

    def pairs(h):
        return sorted(zip(*h.edge_index.tolist(), *h.shifts.T.tolist()))

    assert pairs(seen) == pairs(want)
    assert bool((seen.edge_vectors().norm(dim=-1) < 6.0).all())
    everything = compute_properties(model, listed, True, True)
    for key, value in skin(g).items():
        torch.testing.assert_close(value, everything[key], rtol=0, atol=1e-13)
        torch.testing.assert_close(value, exact(g)[key], rtol=0, atol=1e-12)


def test_registered_integrator_is_found_by_name(tmp_path, monkeypatch):
    """``register_integrator`` (the extension point for integrators of library users): a
    module of the user's, registered by its import path, is what ``get_integrator`` returns
    and ``available_integrators`` lists; here a step of two half-length Verlet steps, which
    gives bitwise the trajectory of ``nve`` at half the timestep."""
    from xnn.dynamics import registry

    (tmp_path / "half_nve.py").write_text(
        "from xnn.dynamics import nve\n"
        "init, conserved = nve.init, nve.conserved\n\n"
        "def step(state, model, dt, reduce=nve.LOCAL):\n"
        "    return nve.step(nve.step(state, model, dt / 2, reduce), model, dt / 2, reduce)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_INTEGRATORS", dict(registry._INTEGRATORS))
    with pytest.raises(InputError, match="unknown ensemble/integrator 'half_nve'"):
        registry.get_integrator("half_nve")
    registry.register_integrator("half_nve", "half_nve")
    assert "half_nve" in registry.available_integrators()
    custom = registry.get_integrator("half_nve")
    g = maxwell_boltzmann(graph_of(argon()), 40.0, seed=3)
    pot_a, pot_b = lj(), lj()
    a, b = custom.init(g, pot_a), nve.init(g, pot_b)
    for _ in range(5):
        a = custom.step(a, pot_a, 4.0)
        b = nve.step(nve.step(b, pot_b, 2.0), pot_b, 2.0)
    assert a.step == b.step == 10
    assert torch.equal(a.positions, b.positions) and torch.equal(a.velocities, b.velocities)
    assert torch.equal(custom.conserved(a), nve.conserved(b))
