"""Small test structures shared by the distributed tests: rattled FCC Cu as fp64
``AtomicGraph``s with permuted global atom ids (so that results are compared by id)."""

from __future__ import annotations

import numpy as np
import torch

from xnn.data.graph import AtomicGraph


def fcc(reps, a=3.6, rattle=0.08, seed=0):
    """Cubic FCC Cu ``repeat(reps)`` (ASE atoms), rattled by ``rattle`` Å."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=a, cubic=True).repeat(reps)
    atoms.rattle(rattle, seed=seed)
    return atoms


def graph(atoms, seed=0):
    """``atoms`` as an fp64 graph whose atom ids are a seeded permutation."""
    ids = np.random.default_rng(seed).permutation(len(atoms))
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   atom_id=ids, dtype=torch.float64)


def triclinic(reps=(3, 3, 2), seed=1):
    """72 (8 per cubic cell) rattled Cu atoms in a sheared cell, unwrapped positions."""
    atoms = fcc(reps, seed=seed)
    cell = atoms.cell.array.copy()
    cell[1] += 0.6 * cell[0]
    cell[2] += -0.45 * cell[0] + 0.35 * cell[1]
    atoms.set_cell(cell, scale_atoms=True)
    atoms.positions += np.array([-7.0, 3.0, 12.0])  # unwrapped input positions
    return graph(atoms, seed)


def molecule(reps=(2, 2, 2)):
    """A rattled Cu cluster in vacuum (no pbc, zero cell)."""
    atoms = fcc(reps, rattle=0.15, seed=3)
    atoms.pbc = False
    atoms.cell[:] = 0.0
    return graph(atoms, 3)
