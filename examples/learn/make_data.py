"""Data of the active-learning example (EMT copper).

initial.xyz: 20 FCC bulk cells (32 atoms) near 0 K -- one phase: a strain of at most 1 % and
    displacements of 0.01-0.03 Å;
test.xyz: 60 structures of every kind `xnn data emt` makes (strained, rattled, vacancy,
    surface, MD at 300/800/1500 K), held back for the learning curve.

Run: python examples/learn/make_data.py OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def initial_structures(n: int = 20, seed: int = 0) -> list:
    """``n`` EMT-labelled FCC Cu bulk cells (2x2x2 cubic, 32 atoms) near 0 K."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
        eps = np.diag(rng.uniform(-0.01, 0.01, size=3))
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
        atoms.positions += rng.normal(0.0, rng.uniform(0.01, 0.03), size=atoms.positions.shape)
        atoms.calc = EMT()
        results = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
                   "stress": atoms.get_stress(voigt=False)}
        atoms.calc = SinglePointCalculator(atoms, **results)
        atoms.info["config_type"] = "fcc_0K"
        out.append(atoms)
    return out


def main(folder: str) -> None:
    import ase.io

    from xnn.data.emt import generate_emt

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    ase.io.write(out / "initial.xyz", initial_structures(), format="extxyz")
    ase.io.write(out / "test.xyz", generate_emt(60, ["Cu"], seed=1), format="extxyz")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
