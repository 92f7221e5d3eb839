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

try:
    import vesin as _vesin
except ImportError:  # pragma: no cover - depends on the environment
    _vesin = None

try:
    import vesin.torch as _vesin_torch
except (ImportError, OSError, RuntimeError):  # pragma: no cover - absent or ABI mismatch
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
        positions: ``[n_atoms, 3]`` Å; need not be wrapped (vesin's shifts account for it).
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
    if n_sys == 1:
        return _one_system(positions, cell[0], pbc[0], cutoff)
    counts = torch.bincount(batch, minlength=n_sys).tolist()
    edges, shifts = [], []
    start = 0
    for s, n in enumerate(counts):
        if n > 0:
            ei, sh = _one_system(positions[start : start + n], cell[s], pbc[s], cutoff)
            edges.append(ei + start)
            shifts.append(sh)
        start += n
    if not edges:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return torch.stack([z, z]), torch.zeros(0, 3, dtype=torch.long, device=device)
    return torch.cat(edges, dim=1), torch.cat(shifts)


def _one_system(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float) -> tuple[Tensor, Tensor]:
    """``edge_index [2, E]`` and ``shifts [E, 3]`` (long, on ``pos.device``) of one system."""
    try:
        if pos.device.type != "cpu" and _vesin_torch is not None:
            return _with_vesin_torch(pos, cell, pbc, cutoff)
        if _vesin is not None:
            return _with_vesin_numpy(pos, cell, pbc, cutoff)
        return _with_vesin_torch(pos, cell, pbc, cutoff)
    except _VESIN_ERRORS as err:
        if isinstance(err, torch.OutOfMemoryError):
            raise
        from xnn.neighbors.api import neighbor_list  # wraps positions for the torch backend

        return neighbor_list(pos, cell, pbc, cutoff, backend="torch")


def _with_vesin_numpy(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    nl = _vesin.NeighborList(cutoff=cutoff, full_list=True)
    # copy=False: views into nl's buffers, copied out once below while nl is alive
    i, j, s = nl.compute(
        pos.detach().cpu().to(torch.float64).numpy(),
        cell.detach().cpu().to(torch.float64).numpy(),
        [bool(p) for p in pbc.tolist()],
        "ijS",
        copy=False,
    )
    # vesin's indices are size_t (uint64): reinterpret, never negative below 2**63
    j = torch.from_numpy(np.asarray(j).view(np.int64))
    i = torch.from_numpy(np.asarray(i).view(np.int64))
    edge_index = torch.stack([j, i]).to(pos.device)
    shifts = torch.from_numpy(np.asarray(s)).to(device=pos.device, dtype=torch.long)
    del nl
    return edge_index, shifts.reshape(-1, 3)


def _with_vesin_torch(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    nl = _vesin_torch.NeighborList(cutoff=cutoff, full_list=True)
    i, j, s = nl.compute(pos.detach(), cell.detach().to(pos.dtype), pbc.to(torch.bool), "ijS")
    return torch.stack([j, i]).to(torch.long), s.to(torch.long).reshape(-1, 3)
