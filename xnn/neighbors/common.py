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
    return validate_inputs(positions, cell, pbc, cutoff, batch)[:4]


def validate_inputs(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """Validate and normalise neighbor-list inputs with one host sync (two for cells with
    zero vectors); returns ``(positions, cell, pbc, batch, has_zero_vectors)``."""
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
    given_batch = batch is not None
    if batch is None:
        if cell.shape[0] != 1:
            raise InputError("batch is required when more than one cell is given")
        batch = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    if batch.shape != (positions.shape[0],):
        raise InputError(f"batch must have shape [{positions.shape[0]}], got {tuple(batch.shape)}")
    if batch.dtype.is_floating_point and batch.numel():
        raise InputError(f"batch must be non-decreasing integers in [0, {cell.shape[0]})")
    cell = cell.to(positions.dtype)
    check_batch = given_batch and batch.numel() > 0
    # every data-dependent check in one device tensor: one host sync
    zero = cell.norm(dim=-1) < 1e-12  # [n_systems, 3] vectors to complete (slabs, wires)
    checks = [torch.isfinite(positions).all(), torch.isfinite(cell).all(), zero.any(),
              ~_singular(cell, pbc, zero).any()]
    if check_batch:
        checks.append((batch.min() >= 0) & (batch.max() < cell.shape[0])
                      & ~(batch[1:] < batch[:-1]).any())
    ok = torch.stack(checks).tolist()
    if not ok[0]:
        raise InputError("non-finite positions")
    if not ok[1]:
        raise InputError("non-finite cell")
    if check_batch and not ok[4]:
        raise InputError(f"batch must be non-decreasing integers in [0, {cell.shape[0]})")
    has_zero = bool(ok[2])
    if has_zero:
        from xnn.data.graph import complete_cell

        bad = _singular(complete_cell(cell), pbc, zero)
    else:
        bad = None if ok[3] else _singular(cell, pbc, zero)
    if bad is not None and bad.any():
        s = int(torch.nonzero(bad).flatten()[0])
        raise InputError(f"system {s}: singular cell along a periodic axis")
    return positions, cell, pbc, batch, has_zero


def _singular(full: Tensor, pbc: Tensor, zero: Tensor) -> Tensor:
    """``[n_systems]`` True where a periodic axis of the completed ``full`` cell is flat."""
    h = torch.where(zero, torch.zeros_like(zero, dtype=full.dtype), cell_heights(full))
    return (pbc & (h < 1e-8)).any(-1)
