"""Shared fixtures: small random ASE structures (triclinic periodic, molecule, mixed pbc); the
per-test time limit of :mod:`time_limit`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms

from xnn.models.external._optional import preserved_environ
from xnn.testing.systems import random_molecule, random_periodic_system

pytest_plugins = ("pytester",)

# `import mace` sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (torch.load then unpickles anything)
# the first time it runs; tests that import mace's modules directly (or pytest.importorskip)
# left it set for every later test of the session. Import the package once here with the
# environment restored, so that no test runs with torch.load's safety turned off.
with preserved_environ():
    try:
        import mace  # noqa: F401
    except ImportError:
        pass

# a time limit for every test (300 s; slow, gpu, distributed and @pytest.mark.time_limit more)
from time_limit import (  # noqa: F401, E402 - pytest hooks, found here by name
    pytest_addoption,
    pytest_configure,
    pytest_enter_pdb,
    pytest_exception_interact,
    pytest_runtest_call,
    pytest_runtest_setup,
    pytest_runtest_teardown,
    pytest_unconfigure,
)


def graph_to_atoms(graph) -> Atoms:
    """ASE ``Atoms`` of a one-system graph (independent of ``xnn.data.ase_io``)."""
    return Atoms(
        numbers=graph.numbers.numpy(),
        positions=graph.positions.double().numpy(),
        cell=graph.cell[0].double().numpy(),
        pbc=graph.pbc[0].numpy(),
    )


def make_atoms(
    species=(18,), n_atoms=8, pbc=(True, True, True), volume_per_atom=45.0, min_distance=3.0, seed=0
) -> Atoms:
    """Random structure: periodic (possibly mixed pbc, triclinic cell) or a molecule."""
    if any(pbc):
        g = random_periodic_system(species, n_atoms, volume_per_atom, min_distance, pbc, seed=seed)
    else:
        g = random_molecule(species, n_atoms, volume_per_atom, min_distance, seed=seed)
    return graph_to_atoms(g)


@pytest.fixture
def ar_periodic() -> Atoms:
    """8 Ar atoms in a random triclinic periodic cell (~45 Å³/atom, no pair closer than 3 Å)."""
    return make_atoms(seed=1)


@pytest.fixture
def ar_small_cell() -> Atoms:
    """2 Ar atoms in a triclinic cell smaller than typical cutoffs (many periodic images)."""
    return make_atoms(n_atoms=2, volume_per_atom=40.0, seed=2)


@pytest.fixture
def ar_molecule() -> Atoms:
    """A non-periodic cluster of 6 Ar atoms (zero cell)."""
    return make_atoms(n_atoms=6, pbc=(False, False, False), volume_per_atom=30.0, seed=3)


@pytest.fixture
def ar_mixed_pbc() -> Atoms:
    """6 Ar atoms, periodic along x and z only, triclinic cell."""
    return make_atoms(n_atoms=6, pbc=(True, False, True), seed=4)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture(scope="module")
def one_thread():
    """Run a test module with one torch thread (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
