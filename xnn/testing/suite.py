"""``run_all_contracts``: every contract on small default (or given) systems, for model authors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from xnn.data.graph import AtomicGraph
from xnn.testing.batching import (
    check_batch_consistency,
    check_cross_system_gradient_zero,
    check_edges_beyond_cutoff_ignored,
)
from xnn.testing.cutoff import check_cutoff_smoothness
from xnn.testing.derivatives import check_forces_finite_difference, check_stress_finite_difference
from xnn.testing.symmetry import (
    check_permutation_equivariance,
    check_rotation_equivariance,
    check_supercell_consistency,
    check_translation_invariance,
)
from xnn.testing.systems import random_molecule, random_periodic_system

CONTRACTS = (
    "forces_fd",
    "stress_fd",
    "rotation",
    "translation",
    "permutation",
    "batch",
    "cross_system_gradient",
    "supercell",
    "skin",
    "cutoff_smoothness",
)


def default_systems(
    species: Sequence[int], min_distance: float = 2.0, volume_per_atom: float = 20.0, seed: int = 0
) -> tuple[AtomicGraph, AtomicGraph]:
    """A small triclinic periodic system (6 atoms) and a molecule (5 atoms) of ``species``."""
    periodic = random_periodic_system(species, 6, volume_per_atom, min_distance, seed=seed)
    molecule = random_molecule(species, 5, volume_per_atom, min_distance, seed=seed + 1)
    return periodic, molecule


def run_all_contracts(
    model: torch.nn.Module,
    periodic: AtomicGraph | None = None,
    molecule: AtomicGraph | None = None,
    species: Sequence[int] | None = None,
    pair_shifted_only: bool = False,
    min_distance: float = 2.0,
    skip: Sequence[str] = (),
) -> dict[str, object]:
    """Run every contract; raise one ``AssertionError`` listing all that failed.

    Args:
        model: any :class:`~xnn.models.base.AtomisticModel` (evaluated in an fp64 copy).
        periodic: a small fully periodic system (default: random triclinic, 6 atoms).
        molecule: a small non-periodic system (default: random, 5 atoms).
        species: atomic numbers for the default systems (default ``model.species`` or Ar).
        pair_shifted_only: the model's force may jump at the cutoff (see
            :func:`check_cutoff_smoothness`).
        min_distance: smallest distance (Å) in the default systems.
        skip: names from :data:`CONTRACTS` not to run.
    Returns:
        ``{contract name: its return value}`` for the contracts that passed.
    """
    unknown = sorted(set(skip) - set(CONTRACTS))
    if unknown:
        raise ValueError(f"unknown contracts {unknown}; valid: {list(CONTRACTS)}")
    species = list(species or model.species or [18])
    if periodic is None or molecule is None:
        p, m = default_systems(species, min_distance)
        periodic = p if periodic is None else periodic
        molecule = m if molecule is None else molecule
    both = AtomicGraph.concat([periodic.without_edges(), molecule.without_edges()])
    checks: dict[str, Callable[[], object]] = {
        "forces_fd": lambda: check_forces_finite_difference(model, both),
        "stress_fd": lambda: check_stress_finite_difference(model, periodic),
        "rotation": lambda: check_rotation_equivariance(model, both),
        "translation": lambda: check_translation_invariance(model, both),
        "permutation": lambda: check_permutation_equivariance(model, both),
        "batch": lambda: check_batch_consistency(model, both),
        "cross_system_gradient": lambda: check_cross_system_gradient_zero(model, both),
        "supercell": lambda: check_supercell_consistency(model, periodic),
        "skin": lambda: check_edges_beyond_cutoff_ignored(model, both),
        "cutoff_smoothness": lambda: check_cutoff_smoothness(
            model, (species[0], species[-1]), pair_shifted_only=pair_shifted_only
        ),
    }
    results: dict[str, object] = {}
    failures = []
    for name, fn in checks.items():
        if name in skip:
            continue
        try:
            results[name] = fn()
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    if failures:
        raise AssertionError(f"{len(failures)} contract(s) failed:\n  " + "\n  ".join(failures))
    return results
