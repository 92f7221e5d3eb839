"""Neighbor lists from vesin (https://github.com/Luthaf/vesin), one system at a time.

``vesin`` (numpy, CPU) is used for CPU tensors; ``vesin.torch`` (package ``vesin-torch``) for
CUDA tensors when it is importable, otherwise the CUDA data is copied through the CPU.
vesin ≥ 0.6 supports mixed periodicity, non-periodic systems and cells thinner than the
cutoff; its ``(i, j, S)`` follow ASE (``r = pos[j] - pos[i] + S @ cell``), i.e. ``i`` is our
receiver and ``j`` our sender. A system that the installed vesin refuses (older versions
reject mixed periodicity or degenerate boxes) is computed by the torch cell list instead.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from xnn.neighbors.torch_cells import torch_neighbor_list

try:
    import vesin as _vesin
except ImportError:  # pragma: no cover - depends on the environment
    _vesin = None

try:
    import vesin.torch as _vesin_torch
except ImportError:  # pragma: no cover - depends on the environment
    _vesin_torch = None

# Errors vesin raises for inputs it cannot handle; we fall back to the torch cell list.
_VESIN_ERRORS = (ValueError, RuntimeError, TypeError)


def vesin_available() -> bool:
    """True when the numpy ``vesin`` package is importable."""
    return _vesin is not None


def vesin_torch_available() -> bool:
    """True when ``vesin.torch`` (package ``vesin-torch``) is importable."""
    return _vesin_torch is not None


def vesin_neighbor_list(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor
) -> tuple[Tensor, Tensor]:
    """Full neighbor list by vesin, looping over systems and offsetting atom indices.

    Args:
        positions: ``[n_atoms, 3]`` Å (wrapped along periodic axes by the caller).
        cell: ``[n_systems, 3, 3]`` completed (invertible) cell, rows lattice vectors.
        pbc: ``[n_systems, 3]`` bool.
        cutoff: Å, > 0.
        batch: ``[n_atoms]`` non-decreasing system index.
    Returns:
        ``edge_index [2, E]`` long (row 0 sender j, row 1 receiver i) and ``shifts [E, 3]`` long.
    """
    if _vesin is None and _vesin_torch is None:
        raise ImportError("the 'vesin' backend needs the vesin package: pip install vesin")
    device = positions.device
    n_sys = cell.shape[0]
    counts = torch.bincount(batch, minlength=n_sys).tolist()
    senders, receivers, shifts = [], [], []
    start = 0
    for s, n in enumerate(counts):
        if n > 0:
            sl = slice(start, start + n)
            j, i, sh = _one_system(positions[sl], cell[s], pbc[s], cutoff)
            senders.append(j + start)
            receivers.append(i + start)
            shifts.append(sh)
        start += n
    if not senders:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return torch.stack([z, z]), torch.zeros(0, 3, dtype=torch.long, device=device)
    edge_index = torch.stack([torch.cat(senders), torch.cat(receivers)])
    return edge_index, torch.cat(shifts)


def _one_system(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    """``(sender, receiver, shift)`` long tensors on ``pos.device`` for one system."""
    try:
        if pos.device.type != "cpu" and _vesin_torch is not None:
            return _with_vesin_torch(pos, cell, pbc, cutoff)
        if _vesin is not None:
            return _with_vesin_numpy(pos, cell, pbc, cutoff)
        return _with_vesin_torch(pos, cell, pbc, cutoff)
    except _VESIN_ERRORS:
        batch = torch.zeros(pos.shape[0], dtype=torch.long, device=pos.device)
        ei, sh = torch_neighbor_list(pos, cell.unsqueeze(0), pbc.unsqueeze(0), cutoff, batch)
        return ei[0], ei[1], sh


def _with_vesin_numpy(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    nl = _vesin.NeighborList(cutoff=cutoff, full_list=True)
    i, j, s = nl.compute(
        pos.detach().cpu().to(torch.float64).numpy(),
        cell.detach().cpu().to(torch.float64).numpy(),
        [bool(p) for p in pbc.tolist()],
        "ijS",
    )
    device = pos.device

    def as_long(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return as_long(j), as_long(i), as_long(s).reshape(-1, 3)


def _with_vesin_torch(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    nl = _vesin_torch.NeighborList(cutoff=cutoff, full_list=True)
    i, j, s = nl.compute(pos.detach(), cell.detach().to(pos.dtype), pbc.to(torch.bool), "ijS")
    return j.to(torch.long), i.to(torch.long), s.to(torch.long).reshape(-1, 3)
