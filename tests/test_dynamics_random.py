"""Counter-based random numbers: distributions, independence, and keys by atom id.

The thermostat noise of an atom must not depend on the order of the atoms or on which
atoms a process holds (domain decomposition), and a sampler built on the hash must give
the right distributions (normal, Gamma / chi-squared for CSVR).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import rattled_argon
from scipy import stats

from xnn.data import AtomicGraph
from xnn.dynamics import langevin, maxwell_boltzmann
from xnn.dynamics import random as R
from xnn.dynamics.state import new_rng, seed_of
from xnn.errors import DataFileError
from xnn.models import Potential, build

pytestmark = pytest.mark.usefixtures("one_thread")

N = 100_000


def test_int64_hash_equals_unsigned_64_bit_arithmetic():
    """The tensor hash (int64, masked shifts) has the bits of the exact unsigned one; an
    arithmetic shift would differ on inputs with the top bit set."""
    x = [0, 1, -1, -2**63, 2**63 - 1, -123456789, 987654321987654321]
    got = R.mix64(torch.tensor(x, dtype=torch.int64)).tolist()
    assert got == [R.as_int64(R.mix64_int(v)) for v in x]


def test_normals_mean_variance_and_no_correlation():
    ids = torch.arange(N)
    z = R.normal(5, 10, 2, ids)
    assert z.dtype == torch.float64 and bool(torch.isfinite(z).all())
    assert abs(float(z.mean())) < 4 / N**0.5
    assert abs(float(z.var()) - 1) < 4 * (2 / N) ** 0.5
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    assert abs(float((z ** 4).mean()) - 3) < 4 * (96 / N) ** 0.5  # kurtosis of a normal
    others = {
        "next step": R.normal(5, 11, 2, ids),
        "next id": torch.roll(z, 1),
        "other seed": R.normal(6, 10, 2, ids),
        "other stream": R.normal(5, 10, 3, ids),
        "other word": R.normal(5, 10, 2, ids, torch.ones((), dtype=torch.int64)),
    }
    for what, y in others.items():
        r = float(np.corrcoef(z.numpy(), y.numpy())[0, 1])
        assert abs(r) < 4 / N**0.5, (what, r)
        r2 = float(np.corrcoef(z.numpy() ** 2, y.numpy() ** 2)[0, 1])
        assert abs(r2) < 4 / N**0.5, (what, r2)


def test_uniforms_cover_zero_one():
    u = R.uniform(1, 2, 3, torch.arange(N))
    assert float(u.min()) > 0 and float(u.max()) <= 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3


@pytest.mark.parametrize("shape", [0.5, 1.0, 1.5, 47.5, 5000.0])
def test_gamma_and_chi_squared_distributions(shape):
    """Marsaglia–Tsang with fixed candidates (and the shape < 1 boost) is Gamma(shape)."""
    a = torch.full((N,), shape, dtype=torch.float64)
    g = R.gamma(3, 7, 4, a, torch.arange(N))
    assert stats.kstest(g.numpy(), stats.gamma(shape).cdf).pvalue > 1e-3
    c = R.chi_squared(3, 7, 4, 2 * a, torch.arange(N))
    assert stats.kstest(c.numpy(), stats.chi2(2 * shape).cdf).pvalue > 1e-3


def test_chi_squared_of_zero_and_one_degrees_of_freedom():
    dof = torch.tensor([0.0, 1.0, 0.0, 1.0] * (N // 4), dtype=torch.float64)
    c = R.chi_squared(0, 0, 1, dof, torch.arange(N))
    assert bool((c[dof == 0] == 0).all())
    assert stats.kstest(c[dof == 1].numpy(), stats.chi2(1).cdf).pvalue > 1e-3


def argon_graph():
    atoms = rattled_argon(rep=3)  # 108 atoms
    return AtomicGraph.from_arrays(atoms.positions.copy(), atoms.numbers, atoms.cell.array, True)


def test_langevin_step_does_not_depend_on_atom_order():
    """Non-interacting atoms: a BAOAB step of the atoms in a shuffled order gives every atom
    the velocity it gets in the original order (the noise is keyed by atom id)."""
    pot = Potential(build("lj", sigma=3.4, epsilon=0.0, cutoff=3.0).double())
    g = maxwell_boltzmann(argon_graph(), 50.0, seed=2)
    perm = torch.randperm(g.n_atoms, generator=torch.Generator().manual_seed(0))
    a = langevin.init(g, pot, temperature=50.0, friction=0.1, seed=4)
    b = langevin.init(g.select_atoms(perm), pot, temperature=50.0, friction=0.1, seed=4)
    for _ in range(3):
        a, b = langevin.step(a, pot, 5.0), langevin.step(b, pot, 5.0)
    torch.testing.assert_close(b.velocities, a.velocities[perm], rtol=0, atol=1e-14)
    assert not torch.allclose(a.velocities, g.velocities)  # the thermostat acted


def test_noise_of_a_subset_equals_noise_of_the_same_ids():
    """A process holding some atoms (any order) draws their noise of the whole system."""
    g = argon_graph()
    s = langevin.init(g, Potential(build("lj", sigma=3.4, epsilon=0.0, cutoff=3.0).double()),
                      temperature=50.0, seed=9).replace(step=17)
    sub = torch.randperm(g.n_atoms, generator=torch.Generator().manual_seed(1))[:40]
    part = s.replace(graph=s.graph.select_atoms(sub))
    assert torch.equal(langevin.noise(part), langevin.noise(s)[sub])
    assert not torch.equal(langevin.noise(s), langevin.noise(s.replace(step=18)))
    mb_all = maxwell_boltzmann(g, 80.0, seed=3).velocities
    mb_perm = maxwell_boltzmann(g.select_atoms(sub.flip(0)), 80.0, seed=3)
    # the momentum removal differs (other atoms); the raw draws do not
    diff = mb_perm.velocities - mb_all[sub.flip(0)]
    assert torch.allclose(diff, diff[:1].expand_as(diff), rtol=0, atol=1e-12)


def test_seed_tensor_round_trip_and_old_generator_states():
    assert seed_of(new_rng(2**64 + 5)) == 5 and seed_of(new_rng(-3)) == -3
    old = torch.Generator().manual_seed(0).get_state()
    with pytest.raises(DataFileError, match="older xnn"):
        seed_of(old)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_equal_cpu_draws():
    ids = torch.arange(N)
    bits = R.random_bits(1, 2, 3, ids[:, None], torch.arange(3))
    assert torch.equal(R.random_bits(1, 2, 3, ids[:, None].cuda(), torch.arange(3).cuda()).cpu(),
                       bits)
    torch.testing.assert_close(R.normal(1, 2, 3, ids.cuda()).cpu(), R.normal(1, 2, 3, ids),
                               rtol=0, atol=1e-13)
    a = torch.full((1000,), 47.5, dtype=torch.float64)
    torch.testing.assert_close(R.gamma(1, 2, 3, a.cuda(), ids[:1000].cuda()).cpu(),
                               R.gamma(1, 2, 3, a, ids[:1000]), rtol=1e-12, atol=0)
