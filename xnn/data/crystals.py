"""Crystals to simulate: ``xnn data bulk --element Cu --repeat 12 --out big.xyz``.

:func:`bulk_crystal` builds the conventional cubic cell of an element's reference crystal
(ASE's ``reference_states``: fcc Cu, bcc Fe, diamond Si, ...), repeats it ``repeat`` times
along each axis and displaces every atom by Gaussian noise (seeded), so that forces are not
all zero. No labels: it is a starting structure for ``xnn md``, ``xnn relax`` and
``xnn validate``.
"""

from __future__ import annotations

import numpy as np

from xnn.errors import InputError


def bulk_crystal(element: str, repeat: int = 4, a: float | None = None, rattle: float = 0.05,
                 seed: int = 0):
    """A ``repeat``³ supercell of the conventional cubic cell of ``element``.

    Args:
        element: chemical symbol with a cubic reference crystal in ASE (fcc, bcc, diamond,
            simple cubic).
        repeat: cells along each axis.
        a: lattice constant (Å); default ASE's reference value.
        rattle: standard deviation of the random displacements (Å).
        seed: seed of the displacements.
    Returns:
        an ``ase.Atoms``, periodic.
    Raises:
        InputError: unknown element, no cubic reference crystal, or bad sizes.
    """
    from ase.build import bulk
    from ase.data import atomic_numbers, reference_states

    if element not in atomic_numbers:
        raise InputError(f"--element {element!r} is not a chemical symbol (e.g. Cu)")
    state = reference_states[atomic_numbers[element]] or {}
    if state.get("symmetry") not in ("fcc", "bcc", "diamond", "sc"):
        raise InputError(f"{element}'s reference crystal in ASE is "
                         f"{state.get('symmetry', 'unknown')}, not cubic; build the "
                         "structure with ase.build and write it with ase.io.write")
    if repeat < 1:
        raise InputError(f"--repeat must be >= 1, got {repeat}")
    if a is not None and not a > 0:
        raise InputError(f"--a must be > 0, got {a}")
    if not rattle >= 0:
        raise InputError(f"--rattle must be >= 0, got {rattle}")
    atoms = bulk(element, a=a, cubic=True).repeat(repeat)
    atoms.positions += np.random.default_rng(seed).normal(0.0, rattle, atoms.positions.shape)
    atoms.wrap()
    return atoms
