"""Helpers shared by neighbor-list backends: input checks, cell heights, image ranges."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xnn.errors import InputError


def cell_heights(cell: Tensor) -> Tensor:
    """``[n_systems, 3]`` perpendicular heights h_a = V / |b × c| of each cell (0 if degenerate)."""
    a, b, c = cell[:, 0], cell[:, 1], cell[:, 2]
    vol = torch.linalg.det(cell).abs()
    cross = torch.stack(
        [torch.linalg.cross(b, c), torch.linalg.cross(c, a), torch.linalg.cross(a, b)], dim=1
    ).norm(dim=-1)
    return torch.where(
        cross > 0, vol.unsqueeze(-1) / cross.clamp_min(1e-300), torch.zeros_like(cross)
    )


def image_ranges(cell: Tensor, pbc: Tensor, cutoff: float) -> Tensor:
    """``[n_systems, 3]`` number of periodic images needed on each side along each axis.

    Positions are not assumed wrapped: callers wrap first (or pass wrapped positions).
    """
    h = cell_heights(cell)
    n = torch.ceil(cutoff / h.clamp_min(1e-300))
    n = torch.where(pbc, n, torch.zeros_like(n))
    return n.to(torch.long)


def check_inputs(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None):
    """Validate and normalise neighbor-list inputs; returns (positions, cell, pbc, batch)."""
    if not isinstance(cutoff, (int, float)) or not math.isfinite(cutoff) or cutoff <= 0:
        raise InputError(f"cutoff must be a positive finite number, got {cutoff!r}")
    if positions.ndim != 2 or positions.shape[-1] != 3:
        raise InputError(f"positions must have shape [n_atoms, 3], got {tuple(positions.shape)}")
    if cell.ndim == 2:
        cell = cell.unsqueeze(0)
    if cell.shape[1:] != (3, 3):
        raise InputError(f"cell must have shape [n_systems, 3, 3], got {tuple(cell.shape)}")
    pbc = torch.as_tensor(pbc, dtype=torch.bool, device=positions.device)
    if pbc.ndim > 2 or (pbc.ndim >= 1 and pbc.shape[-1] != 3):
        raise InputError(f"pbc must have shape [n_systems, 3] or [3], got {tuple(pbc.shape)}")
    if pbc.ndim == 0:
        pbc = pbc.expand(cell.shape[0], 3)
    elif pbc.ndim == 1:
        pbc = pbc.unsqueeze(0).expand(cell.shape[0], 3)
    if tuple(pbc.shape) != (cell.shape[0], 3):
        raise InputError(f"pbc must have shape [n_systems, 3], got {tuple(pbc.shape)}")
    if batch is None:
        if cell.shape[0] != 1:
            raise InputError("batch is required when more than one cell is given")
        batch = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    if batch.shape != (positions.shape[0],):
        raise InputError(f"batch must have shape [{positions.shape[0]}], got {tuple(batch.shape)}")
    if batch.numel() and (
        batch.dtype.is_floating_point
        or int(batch.min()) < 0
        or int(batch.max()) >= cell.shape[0]
        or bool((batch[1:] < batch[:-1]).any())
    ):
        raise InputError(f"batch must be non-decreasing integers in [0, {cell.shape[0]})")
    if not torch.isfinite(positions).all():
        raise InputError("non-finite positions")
    if not torch.isfinite(cell).all():
        raise InputError("non-finite cell")
    if pbc.any():
        # zero vectors along non-periodic axes (slabs, wires) are completed first: legal
        from xnn.data.graph import complete_cell

        c = cell.to(positions.dtype)
        h = cell_heights(complete_cell(c))
        h = torch.where(c.norm(dim=-1) < 1e-12, torch.zeros_like(h), h)
        bad = (pbc & (h < 1e-8)).any(-1)
        if bad.any():
            s = int(torch.nonzero(bad).flatten()[0])
            raise InputError(f"system {s}: singular cell along a periodic axis")
    return positions, cell.to(positions.dtype), pbc, batch
