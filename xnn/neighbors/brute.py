"""Brute-force O(N²) neighbor list over periodic images: the reference backend."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from xnn.neighbors.common import image_ranges


def brute_neighbor_list(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor
) -> tuple[Tensor, Tensor]:
    """Full neighbor list by checking every pair against every needed periodic image.

    Args:
        positions: ``[n_atoms, 3]``.
        cell: ``[n_systems, 3, 3]``.
        pbc: ``[n_systems, 3]``.
        cutoff: Å.
        batch: ``[n_atoms]`` non-decreasing system index.
    Returns:
        ``edge_index [2, E]`` (row 0 sender j, row 1 receiver i) and ``shifts [E, 3]`` (long).
    """
    device = positions.device
    n_sys = cell.shape[0]
    counts = torch.bincount(batch, minlength=n_sys)
    ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).tolist()
    nmax = image_ranges(cell, pbc, cutoff)  # [n_sys, 3]
    senders, receivers, shifts = [], [], []
    for s in range(n_sys):
        lo, hi = ptr[s], ptr[s + 1]
        if hi - lo == 0:
            continue
        pos = positions[lo:hi]
        rng = [range(-int(n), int(n) + 1) for n in nmax[s].tolist()]
        idx = torch.arange(hi - lo, device=device)
        for shift in itertools.product(*rng):
            sh = torch.tensor(shift, dtype=positions.dtype, device=device)
            off = sh @ cell[s]
            # r_ij = pos[j] - pos[i] + shift @ cell
            d = pos.unsqueeze(0) - pos.unsqueeze(1) + off  # [i, j, 3]
            r2 = (d * d).sum(-1)
            mask = r2 < cutoff * cutoff
            if all(v == 0 for v in shift):
                mask &= idx.unsqueeze(0) != idx.unsqueeze(1)
            i, j = torch.nonzero(mask, as_tuple=True)
            senders.append(j + lo)
            receivers.append(i + lo)
            shifts.append(torch.tensor(shift, device=device).expand(len(i), 3))
    if not senders:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return torch.stack([z, z]), torch.zeros(0, 3, dtype=torch.long, device=device)
    edge_index = torch.stack([torch.cat(senders), torch.cat(receivers)])
    return edge_index, torch.cat(shifts).to(torch.long)
