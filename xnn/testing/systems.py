"""Small random test systems: triclinic periodic, mixed-pbc, molecules; supercells; rotations."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph


def _place_atoms(
    rng: np.random.Generator,
    cell: np.ndarray,
    pbc: Sequence[bool],
    n_atoms: int,
    min_distance: float,
) -> np.ndarray:
    """Random positions inside ``cell`` with every (periodic-image) distance >= ``min_distance``.

    Random sequential insertion, restarted from scratch up to 20 times when it jams.
    """
    for _restart in range(20):
        pos = _try_place_atoms(rng, cell, pbc, n_atoms, min_distance)
        if pos is not None:
            return pos
    raise RuntimeError("could not place atoms: lower min_distance or raise volume_per_atom")


def _try_place_atoms(
    rng: np.random.Generator,
    cell: np.ndarray,
    pbc: Sequence[bool],
    n_atoms: int,
    min_distance: float,
) -> np.ndarray | None:
    images = np.array(
        [
            s
            for s in itertools.product((-1, 0, 1), repeat=3)
            if all(p or v == 0 for v, p in zip(s, pbc))
        ]
    )
    offsets = images @ cell  # [n_images, 3]
    pos: list[np.ndarray] = []
    for _ in range(n_atoms):
        for _attempt in range(2_000):
            trial = rng.random(3) @ cell
            if not pos:
                break
            d = trial[None, None, :] - np.asarray(pos)[:, None, :] - offsets[None, :, :]
            if np.sqrt((d * d).sum(-1)).min() >= min_distance:
                break
        else:
            return None
        pos.append(trial)
    return np.asarray(pos).reshape(n_atoms, 3)


def random_cell(rng: np.random.Generator, volume: float, triclinic: bool = True) -> np.ndarray:
    """``[3, 3]`` right-handed cell of the given volume (Å³), sheared when ``triclinic``."""
    cell = np.eye(3)
    if triclinic:
        cell = cell + 0.25 * rng.uniform(-1.0, 1.0, (3, 3)) * (1 - np.eye(3))
        cell = cell * rng.uniform(0.85, 1.15, (3, 1))
    cell *= (volume / abs(np.linalg.det(cell))) ** (1.0 / 3.0)
    return cell


def _species_list(rng: np.random.Generator, species: Sequence[int], n_atoms: int) -> np.ndarray:
    base = list(species) * (n_atoms // len(species) + 1)
    numbers = np.array(base[:n_atoms] if n_atoms >= len(species) else rng.choice(species, n_atoms))
    return rng.permutation(numbers)


def random_periodic_system(
    species: Sequence[int] = (18,),
    n_atoms: int = 8,
    volume_per_atom: float = 20.0,
    min_distance: float = 2.0,
    pbc: Sequence[bool] = (True, True, True),
    triclinic: bool = True,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> AtomicGraph:
    """A random (triclinic) periodic system; ``pbc`` may be mixed.

    Args:
        species: atomic numbers to draw from (each appears when ``n_atoms >= len(species)``).
        n_atoms: number of atoms.
        volume_per_atom: Å³ per atom, sets the cell size.
        min_distance: smallest allowed interatomic distance (Å), periodic images included.
        pbc: periodic axes; atoms stay inside the cell along every axis.
        triclinic: shear and stretch the cell randomly.
        seed: random seed.
    """
    rng = np.random.default_rng(seed)
    cell = random_cell(rng, n_atoms * volume_per_atom, triclinic)
    pos = _place_atoms(rng, cell, pbc, n_atoms, min_distance)
    numbers = _species_list(rng, species, n_atoms)
    return AtomicGraph.from_arrays(pos, numbers, cell, list(pbc), dtype=dtype)


def random_molecule(
    species: Sequence[int] = (18,),
    n_atoms: int = 6,
    volume_per_atom: float = 20.0,
    min_distance: float = 2.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> AtomicGraph:
    """A random non-periodic cluster (zero cell, ``pbc`` all False)."""
    rng = np.random.default_rng(seed)
    box = np.eye(3) * (n_atoms * volume_per_atom) ** (1.0 / 3.0)
    pos = _place_atoms(rng, box, (False, False, False), n_atoms, min_distance)
    numbers = _species_list(rng, species, n_atoms)
    return AtomicGraph.from_arrays(pos, numbers, None, None, dtype=dtype)


def random_orthogonal(rng: np.random.Generator, proper: bool = True) -> np.ndarray:
    """A random ``[3, 3]`` orthogonal matrix: a rotation, or a rotoreflection if not proper."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    if (np.linalg.det(q) > 0) != proper:
        q[:, 0] = -q[:, 0]
    return q


def supercell(graph: AtomicGraph, reps: Sequence[int] = (2, 2, 2)) -> AtomicGraph:
    """Repeat a one-system graph ``reps`` times along its lattice vectors (ASE ``atoms * reps``).

    Atom ids are renumbered ``0..n-1``; edges are dropped.
    """
    if graph.n_systems != 1:
        raise ValueError("supercell expects a graph with one system")
    cell = graph.cell[0]
    blocks = []
    for n in itertools.product(*(range(r) for r in reps)):
        shift = torch.tensor(n, dtype=cell.dtype, device=cell.device) @ cell
        blocks.append(graph.positions + shift)
    k = len(blocks)
    big_cell = cell * torch.tensor(reps, dtype=cell.dtype, device=cell.device)[:, None]
    n = k * graph.n_atoms
    fields = {
        K.POSITIONS: torch.cat(blocks),
        K.NUMBERS: graph.numbers.repeat(k),
        K.MASSES: graph.masses.repeat(k),
        K.CELL: big_cell.unsqueeze(0),
        K.PBC: graph.pbc.clone(),
        K.BATCH: torch.zeros(n, dtype=torch.long, device=graph.device),
        K.ATOM_ID: torch.arange(n, device=graph.device),
    }
    return AtomicGraph(fields)


def single_atom(z: int, dtype: torch.dtype = torch.float64) -> AtomicGraph:
    """One atom of element ``z`` in vacuum (zero cell, no pbc)."""
    return AtomicGraph.from_arrays(np.zeros((1, 3)), [z], None, None, dtype=dtype)


def dimer(
    z1: int, z2: int, distances: Sequence[float], dtype: torch.dtype = torch.float64
) -> AtomicGraph:
    """A batch of dimers in vacuum, one per distance, along a fixed oblique direction."""
    u = np.array([1.0, 2.0, 2.0]) / 3.0
    pos = np.concatenate([[np.zeros(3), float(r) * u] for r in distances])
    n = len(distances)
    batch = np.repeat(np.arange(n), 2)
    return AtomicGraph.from_arrays(
        pos,
        np.tile([z1, z2], n),
        np.zeros((n, 3, 3)),
        np.zeros((n, 3), bool),
        batch=batch,
        dtype=dtype,
    )
