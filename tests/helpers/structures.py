"""Small test structures: rattled FCC Cu as fp64 ``AtomicGraph``s with permuted global atom
ids (so that decomposed results are compared by id), rattled argon for MD."""

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


def atoms_graph(structures, cutoff: float, dtype=torch.float64) -> AtomicGraph:
    """ASE ``structures`` as one batched graph with edges at ``cutoff`` (brute force)."""
    from xnn.neighbors import with_edges

    graphs = [AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc, dtype=dtype)
              for a in structures]
    return with_edges(AtomicGraph.concat(graphs), cutoff, backend="brute")


def cubic():
    """108 rattled Cu atoms in a cubic 10.8 Å cell."""
    return graph(fcc((3, 3, 3)))


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


def slab():
    """36 Cu atoms periodic in x, y with vacuum along z."""
    atoms = fcc((3, 3, 2), seed=2)
    atoms.cell[2] *= 3.0
    atoms.pbc = (True, True, False)
    return graph(atoms, 2)


def vacuum_slab(layers=6, vacuum=20.0, shear=False):
    """A rattled Cu slab (3 x 3 x ``layers`` cubic cells) in a cell periodic along x, y, z
    with ``vacuum`` Å of vacuum along z: equal-width boxes along z are mostly empty.
    ``shear``: the cell's c vector leans over a and b (triclinic)."""
    atoms = fcc((3, 3, layers), seed=7)
    cell = atoms.cell.array.copy()
    cell[2, 2] += vacuum
    if shear:
        cell[2, 0], cell[2, 1], cell[1, 0] = 3.0, -2.0, 1.5
    atoms.set_cell(cell, scale_atoms=False)
    atoms.positions += np.array([0.0, 0.0, vacuum / 2])
    atoms.pbc = True
    return graph(atoms, 7)


def rod(radius=9.5, cells=2):
    """A rattled Cu rod of ``radius`` Å along z (periodic, ``cells`` cubic cells long), in
    vacuum along x and y (not periodic): equal widths across it leave its rims light."""
    atoms = fcc((6, 6, cells), seed=8)
    centre = atoms.cell.array.diagonal()[:2] / 2
    keep = ((atoms.positions[:, :2] - centre) ** 2).sum(1) <= radius ** 2
    atoms = atoms[keep]
    atoms.pbc = (False, False, True)
    return graph(atoms, 8)


def corner():
    """A cluster in one corner of a large periodic cell: most boxes are empty."""
    atoms = fcc((2, 2, 2), seed=4)
    atoms.set_cell(atoms.cell.array * 3.0, scale_atoms=False)
    atoms.pbc = True
    return graph(atoms, 4)


def tiny(ids_seed=5):
    """4 atoms in a 3.6 Å cell: the halo is wider than a box, every cutoff sphere holds many
    images of every atom."""
    return graph(fcc((1, 1, 1), seed=5), ids_seed)


def cluster():
    """8 rattled Cu atoms in vacuum."""
    atoms = fcc((1, 1, 2), rattle=0.1, seed=6)
    atoms.pbc = False
    return graph(atoms, seed=6)


def primitive(reps=(4, 4, 4), seed=6):
    """Rattled FCC in its primitive (60°, triclinic) cell near the LJ minimum: 64 atoms."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.65).repeat(reps)  # lattice planes on the box faces
    atoms.rattle(0.05, seed=seed)
    return graph(atoms, seed)


def hot(graph, temperature=4000.0, seed=11):
    """Maxwell-Boltzmann velocities by atom id (independent of how atoms are split)."""
    from xnn.dynamics.state import maxwell_boltzmann

    order = torch.argsort(graph.atom_id)
    g = maxwell_boltzmann(graph.select_atoms(order), temperature, seed=seed)
    v = torch.empty_like(g.velocities)
    v[order] = g.velocities
    return graph.replace(velocities=v)


def rattled_argon(a: float = 5.3, rep=2, amp: float = 0.03, seed: int = 0):
    """FCC argon (cubic cell, lattice constant ``a`` Å) repeated ``rep`` times, every atom
    displaced by normal noise of ``amp`` Å (seeded)."""
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=a, cubic=True).repeat(rep)
    atoms.positions += np.random.default_rng(seed).normal(0, amp, atoms.positions.shape)
    return atoms
