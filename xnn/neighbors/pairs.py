"""Reverse-edge pairing of a full neighbor list.

A full list holds every pair twice: ``(j -> i, s)`` and its reverse ``(i -> j, -s)``, whose
vectors are exact negatives (``pos[i] - pos[j] - s @ cell = -(pos[j] - pos[i] + s @ cell)``
in floating point too: negation is exact and rounding symmetric) and whose lengths are
therefore bitwise equal. A model whose edge work depends on the length alone (a radial
network) can evaluate it once per pair. :func:`pair_order` arranges a list so that the
second half reverses the first, edge by edge.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pair_order(edge_index: Tensor, shifts: Tensor) -> Tensor | None:
    """A permutation ``order`` of the edges such that, with ``h = E // 2``, edge
    ``order[h + k]`` is the reverse of edge ``order[k]`` (receiver and sender swapped,
    shift negated) for every ``k < h``; ``None`` when the list is not full (some edge has
    no reverse, or an edge is its own reverse: ``i -> i`` without a shift).

    Args:
        edge_index: ``[2, E]`` (row 0 sender j, row 1 receiver i).
        shifts: ``[E, 3]`` integer lattice shifts.
    Returns:
        ``[E]`` int64 on the edges' device, or ``None``. The first half keeps the edges
        with ``j > i`` (and self-images with a lexicographically positive shift), sorted by
        ``(i, j, shift)``; one rebuild's work (two stable sorts), not a step's.
    """
    n = edge_index.shape[1]
    if n % 2:
        return None
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=edge_index.device)
    j, i = edge_index[0].long(), edge_index[1].long()
    s = shifts.long()
    # sign of the first non-zero shift component (0: no shift)
    nz = s != 0
    first = torch.where(nz.any(1), nz.long().argmax(1), torch.zeros_like(i))
    sign = torch.sign(s.gather(1, first[:, None]).squeeze(1))
    forward = (j > i) | ((j == i) & (sign > 0))
    if bool(((j == i) & (sign == 0)).any()):
        return None
    # the key of an edge: the (receiver, sender, shift) of the forward edge of its pair
    lo = torch.where(forward, i, j)
    hi = torch.where(forward, j, i)
    sk = torch.where(forward[:, None], s, -s)
    span = int(sk.abs().max()) if sk.numel() else 0
    base = 2 * span + 1
    n_atoms = int(torch.maximum(i.max(), j.max())) + 1
    if base ** 3 >= 2 ** 62 or n_atoms >= 2 ** 31:
        return None
    code = ((sk[:, 0] + span) * base + (sk[:, 1] + span)) * base + (sk[:, 2] + span)
    # lexicographic (lo, hi, code, reverse-last) by stable sorts, least significant first
    order = torch.argsort((~forward).long(), stable=True)
    order = order[torch.argsort(code[order], stable=True)]
    order = order[torch.argsort((lo * n_atoms + hi)[order], stable=True)]
    a, b = order[0::2], order[1::2]
    same = ((lo[a] == lo[b]) & (hi[a] == hi[b]) & (code[a] == code[b])
            & forward[a] & ~forward[b])
    if not bool(same.all()):
        return None
    return torch.cat([a, b])
