"""Test structures shared by the MD test modules."""

from __future__ import annotations

import numpy as np
from ase.build import bulk


def rattled_argon(a: float = 5.3, rep=2, amp: float = 0.03, seed: int = 0):
    """FCC argon (cubic cell, lattice constant ``a`` Å) repeated ``rep`` times, every atom
    displaced by normal noise of ``amp`` Å (seeded)."""
    atoms = bulk("Ar", "fcc", a=a, cubic=True).repeat(rep)
    atoms.positions += np.random.default_rng(seed).normal(0, amp, atoms.positions.shape)
    return atoms
