"""Selection for ``xnn learn``: a structure descriptor and farthest-point sampling among the
candidates whose committee uncertainty exceeds the threshold.

Descriptor (a fingerprint with no fitted parameters). For every unordered pair of elements
``(a, b)`` (``a <= b``, over the elements given), the pair distances ``r_ij < r_max`` of the
structure (periodic images included, each pair counted from both ends) are smeared with
Gaussians of width ``w = r_max / bins`` centred at ``c_k = k * r_max / (bins - 1)``:

    d[(a, b), k] = (1 / n_atoms) * sum_{i in a, j in b, r_ij < r_max} exp(-(r_ij - c_k)^2 / (2 w^2))

and the blocks are concatenated in the order of the pairs. Two structures' distance is the
Euclidean norm of the difference of their descriptors. The descriptor is invariant to
translations, rotations, permutations and the choice of cell, and per atom (a supercell has
its cell's descriptor).

Selection. Eligible: candidates with ``threshold < score <= ceiling`` (either bound ``None``:
no such bound; the ceiling is an upper trust level: a frame the committee is that unsure of
was reached by a trajectory gone outside what the committee can drive, see
docs/active-learning.md). Farthest-point sampling: each pick is
the eligible candidate farthest (in descriptor distance) from the current training set and
the structures picked before it (ties: the higher score, then the lower index), until the
budget is spent or no eligible candidate is left. Each pick records its distance.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def element_pairs(numbers: Sequence[int]) -> list[tuple[int, int]]:
    """The unordered element pairs ``(a, b)``, ``a <= b``, of the atomic numbers given."""
    zs = sorted({int(z) for z in numbers})
    return [(a, b) for i, a in enumerate(zs) for b in zs[i:]]


def descriptor(atoms, pairs: Sequence[tuple[int, int]], r_max: float, bins: int) -> np.ndarray:
    """The radial fingerprint of one structure (module docstring), ``[len(pairs) * bins]``."""
    from ase.neighborlist import neighbor_list

    i, j, d = neighbor_list("ijd", atoms, r_max)
    zi, zj = atoms.numbers[i], atoms.numbers[j]
    centres = np.linspace(0.0, r_max, bins)
    width = r_max / bins
    out = np.zeros((len(pairs), bins))
    for p, (a, b) in enumerate(pairs):
        mask = ((zi == a) & (zj == b)) | ((zi == b) & (zj == a)) if a != b else \
            (zi == a) & (zj == a)
        if mask.any():
            g = np.exp(-((d[mask, None] - centres[None, :]) ** 2) / (2.0 * width ** 2))
            out[p] = g.sum(axis=0)
    return (out / max(len(atoms), 1)).ravel()


def descriptors(frames: Sequence, pairs: Sequence[tuple[int, int]], r_max: float,
                bins: int) -> np.ndarray:
    """The descriptors of ``frames``, ``[n_frames, len(pairs) * bins]``."""
    width = len(pairs) * bins
    if not frames:
        return np.zeros((0, width))
    return np.stack([descriptor(a, pairs, r_max, bins) for a in frames])


def eligible(score: float, threshold: float | None, ceiling: float | None = None) -> bool:
    """Whether a candidate of ``score`` may be selected: ``threshold < score <= ceiling``
    (``None``: no such bound)."""
    return (threshold is None or score > threshold) and (ceiling is None or score <= ceiling)


@dataclass(frozen=True)
class Pick:
    """One selected candidate: its index, score (eV/Å) and the descriptor distance to the
    training set and the picks before it when it was chosen."""

    index: int
    score: float
    distance: float


def farthest_point_selection(cand: np.ndarray, scores: np.ndarray, reference: np.ndarray,
                             threshold: float | None, budget: int,
                             ceiling: float | None = None) -> list[Pick]:
    """Farthest-point sampling among the eligible candidates (:func:`eligible`: score above
    ``threshold`` and not above ``ceiling``).

    Args:
        cand: candidate descriptors ``[n_candidates, d]``.
        scores: their uncertainty ``[n_candidates]`` (eV/Å).
        reference: descriptors of the current training set ``[n_reference, d]``.
        threshold: eligible when ``score > threshold``; ``None``: all eligible.
        budget: at most this many picks.
        ceiling: not eligible when ``score > ceiling``; ``None``: no ceiling.
    Returns:
        the picks in the order they were chosen.
    """
    pool = np.flatnonzero([eligible(float(x), threshold, ceiling) for x in scores])
    if pool.size == 0 or budget < 1:
        return []
    if len(reference):
        nearest = np.min(np.linalg.norm(cand[pool, None, :] - reference[None, :, :],
                                        axis=-1), axis=1)
    else:
        nearest = np.full(pool.size, np.inf)
    picks: list[Pick] = []
    left = np.ones(pool.size, dtype=bool)
    while left.any() and len(picks) < budget:
        order = np.lexsort((pool, -scores[pool], -nearest))  # far, sure, first
        k = next(int(k) for k in order if left[k])
        idx = int(pool[k])
        picks.append(Pick(idx, float(scores[idx]), float(nearest[k])))
        left[k] = False
        nearest = np.minimum(nearest, np.linalg.norm(cand[pool] - cand[idx], axis=-1))
    return picks
