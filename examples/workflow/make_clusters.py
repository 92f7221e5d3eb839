"""Write small argon clusters (jittered fcc fragments, 5-12 atoms) for the workflow example.

    python examples/workflow/make_clusters.py clusters.xyz --n 200
"""

from __future__ import annotations

import argparse

import numpy as np


def clusters(n: int, seed: int = 0) -> list:
    """``n`` ASE ``Atoms``: argon clusters cut from an fcc lattice (a = 5.26 Å), jittered."""
    from ase import Atoms

    rng = np.random.default_rng(seed)
    base = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    grid = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)])
    sites = (grid[:, None, :] + base[None]).reshape(-1, 3) * 5.26
    sites = sites[np.argsort(np.linalg.norm(sites - sites.mean(0), axis=1), kind="stable")]
    out = []
    for _ in range(n):
        k = int(rng.integers(5, 13))
        pos = sites[:k] + rng.normal(scale=0.15, size=(k, 3))
        out.append(Atoms(f"Ar{k}", positions=pos))
    return out


def main() -> None:
    import ase.io

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    ase.io.write(a.out, clusters(a.n, a.seed), format="extxyz")


if __name__ == "__main__":
    main()
