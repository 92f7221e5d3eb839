"""Langevin (BAOAB), Nosé–Hoover chain and CSVR sample the canonical ensemble.

Eight independent 32-atom LJ argon crystals (four of them with 3 fixed atoms, so both DOF
rules are exercised), each with its own target temperature, are advanced together. For
each system the time average of ``K / K_t`` and ``var(K) / var_t`` are computed, with
``K_t = N_f k_B T / 2`` and ``var_t = N_f (k_B T)² / 2`` (a Gamma distribution). The systems
are independent, so the spread over systems gives the statistical error of the batch
means; both must equal 1 within 4 standard errors (plus 1 % for the mean).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.build import bulk

from xnn.data import AtomicGraph
from xnn.dynamics import csvr, degrees_of_freedom, kinetic_energy, langevin, maxwell_boltzmann, nhc
from xnn.dynamics.registry import get_integrator
from xnn.models import Potential, build
from xnn.units import KB

TEMPS = [30.0, 45.0, 60.0, 75.0, 30.0, 45.0, 60.0, 75.0]


# small MD systems: one thread avoids thread overhead on small CPU tensors
pytestmark = pytest.mark.usefixtures("one_thread")


def batch_of_crystals(n=8, seed=0):
    graphs = []
    rng = np.random.default_rng(seed)
    for i in range(n):
        atoms = bulk("Ar", "fcc", a=5.3, cubic=True).repeat(2)
        atoms.positions += rng.normal(0, 0.03, atoms.positions.shape)
        g = AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array,
                                    atoms.pbc)
        fixed = torch.zeros(len(atoms), dtype=torch.bool)
        if i >= n // 2:
            fixed[:3] = True
        graphs.append(g.replace(fixed=fixed))
    return AtomicGraph.concat(graphs)


def sample(name, n_steps, n_skip, dt=5.0, n_systems=8, **kw):
    pot = Potential(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5).double(), skin=1.0)
    temps = torch.tensor((TEMPS * (n_systems // len(TEMPS) + 1))[:n_systems],
                         dtype=torch.float64)
    g = maxwell_boltzmann(batch_of_crystals(n_systems), temps, seed=1)
    mod = get_integrator(name)
    s = mod.init(g, pot, temperature=temps, **kw)
    ks, cons = [], []
    for i in range(n_steps):
        s = mod.step(s, pot, dt)
        if i >= n_skip:
            ks.append(kinetic_energy(s.graph))
            cons.append(mod.conserved(s))
    k = torch.stack(ks).numpy()
    nf = degrees_of_freedom(s.graph).numpy()
    kt = KB * temps.numpy()
    r_mean = k.mean(0) / (0.5 * nf * kt)
    r_var = k.var(0) / (0.5 * nf * kt**2)
    return r_mean, r_var, torch.stack(cons).numpy(), s


def check_canonical(r_mean, r_var):
    se_m = r_mean.std(ddof=1) / np.sqrt(len(r_mean))
    se_v = r_var.std(ddof=1) / np.sqrt(len(r_var))
    assert abs(r_mean.mean() - 1) < 4 * se_m + 0.01, (r_mean, se_m)
    assert abs(r_var.mean() - 1) < 4 * se_v + 0.05, (r_var, se_v)


@pytest.mark.parametrize("name,kw", [
    ("langevin", {"friction": 0.02, "seed": 3}),
    ("csvr", {"tau": 50.0, "seed": 3}),
    ("nhc", {"tau": 50.0}),
])
def test_canonical_short(name, kw):
    """Short CI version: 600 steps of 10 fs (6 ps) per system after 100 steps (~7 s each).

    Measured: langevin 0.994±0.004 / 0.98±0.03, csvr 1.011±0.008 / 1.05±0.04,
    nhc 1.002±0.004 / 0.93±0.02 (mean / variance ratios)."""
    r_mean, r_var, cons, _ = sample(name, 700, 100, dt=10.0, **kw)
    check_canonical(r_mean, r_var)
    # the conserved quantity drifts little compared with the kinetic energy (~0.3 eV here)
    drift = np.abs(cons - cons[0]).max(0)
    assert (drift < 3e-3).all(), drift


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [
    ("langevin", {"friction": 0.005, "seed": 4}),
    ("csvr", {"tau": 200.0, "seed": 4}),
    ("nhc", {"tau": 200.0}),
])
def test_canonical_long(name, kw):
    """Long version: 16 systems (the 8 above twice, 8 with fixed atoms), 5,000 steps of 5 fs
    each after 500: the same 80,000 system-steps of samples as 8 systems of 10,000 steps (as
    it was until 2026-12: measured for nhc 0.997±0.002 and 0.999±0.024), so the same standard
    errors, at 1.3-1.5x the cost of a step of 8 systems instead of 2x (CPU ms per step, 8 ->
    16 systems: langevin 5.7 -> 8.5, csvr 8.3 -> 11.0, nhc 6.6 -> 9.5). The per-system
    variance of K, taken over 25 ps instead of 50 ps, is biased low by ~2 tau_K / 25 ps, under
    1 % for tau_K ~ 100 fs (friction 0.005 / fs, tau 200 fs), inside the 2 % margin; measured
    (mean / variance ratios): langevin 0.998±0.002 / 1.009±0.023, csvr 1.006±0.004 /
    1.006±0.026, nhc 1.001±0.004 / 1.025±0.022 (8 systems x 10,000 steps, langevin: 1.003±0.003
    / 1.024±0.022). Tolerance 4 standard errors + 0.5 % (mean), + 2 % (variance)."""
    r_mean, r_var, _, _ = sample(name, 5500, 500, n_systems=16, **kw)
    se_v = r_var.std(ddof=1) / np.sqrt(len(r_var))
    assert abs(r_mean.mean() - 1) < 4 * r_mean.std(ddof=1) / np.sqrt(len(r_mean)) + 0.005
    assert abs(r_var.mean() - 1) < 4 * se_v + 0.02


def test_thermostat_detects_wrong_variance():
    """The check can fail: velocity rescaling to the exact target (no noise) has var(K) ≈ 0."""
    r_mean = np.ones(8)
    r_var = np.full(8, 0.02) + np.linspace(0, 0.01, 8)
    with pytest.raises(AssertionError):
        check_canonical(r_mean, r_var)


def test_rng_state_is_part_of_the_state():
    """The noise is a function of the state: same state -> same step; ``rng`` (the seed)
    and the step number key it, so another seed or another step count draws other numbers,
    and ``rng`` itself never changes (a resumed run needs only the state)."""
    pot = Potential(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.5).double(), skin=1.0)
    g = maxwell_boltzmann(batch_of_crystals(2), 40.0, seed=1)
    for mod, kw in ((langevin, {"friction": 0.01}), (csvr, {"tau": 50.0})):
        s = mod.init(g, pot, temperature=40.0, seed=5, **kw)
        rng0 = s.rng.clone()
        a = mod.step(s, pot, 5.0)
        b = mod.step(s, pot, 5.0)
        assert torch.equal(s.rng, rng0) and torch.equal(a.rng, rng0)
        assert torch.equal(a.velocities, b.velocities)
        other_seed = mod.step(mod.init(g, pot, temperature=40.0, seed=6, **kw), pot, 5.0)
        other_step = mod.step(s.replace(step=7), pot, 5.0)
        assert not torch.allclose(a.velocities, other_seed.velocities, rtol=0, atol=1e-9)
        assert not torch.allclose(a.velocities, other_step.velocities, rtol=0, atol=1e-9)
    s = nhc.init(g, pot, temperature=40.0)
    assert s.rng is None
