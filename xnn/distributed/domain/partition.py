"""Partition one (triclinic, mixed-pbc) system into a ``px × py × pz`` grid of boxes.

Boxes are slabs in fractional coordinates ``u = frac`` of the *completed* cell (zero lattice
vectors of non-periodic axes replaced by unit vectors, as for neighbor lists). Along a
periodic axis the boxes split ``[0, 1)``; along a non-periodic axis they split the atoms'
bounding box ``[u_min, u_max]``. A Cartesian halo width ``w`` is a fractional thickness
``w / h_a`` along axis ``a``, with ``h_a = V / |b × c|`` the cell height (as LAMMPS does).
Rank ``r`` owns box ``(ix, iy, iz)`` with ``r = (ix * py + iy) * pz + iz``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data.graph import complete_cell
from xnn.errors import InputError
from xnn.neighbors.common import cell_heights

Grid = tuple[int, int, int]


def parse_grid(text: str | Sequence | None) -> Grid | None:
    """``"2,1,1"`` or ``[2, 1, 1]`` to a grid tuple (``None`` stays ``None``: automatic)."""
    if text is None:
        return None
    parts = text.replace("x", ",").split(",") if isinstance(text, str) else list(text)
    try:
        grid = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise InputError(f"grid must be three positive integers like 2,1,1; got {text!r}") from None
    if len(grid) != 3 or min(grid) < 1:
        raise InputError(f"grid must be three positive integers like 2,1,1; got {text!r}")
    return grid  # type: ignore[return-value]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_grid(n_ranks: int, lengths: Sequence[float], pbc: Sequence[bool],
                halo_width: float) -> Grid:
    """The grid of ``n_ranks`` boxes with the smallest halo volume per box.

    Args:
        n_ranks: number of boxes.
        lengths: ``[3]`` Cartesian thickness (Å) of the partitioned region along each axis
            (cell heights along periodic axes, bounding-box thickness along the others).
        pbc: ``[3]`` periodic axes (a periodic axis has a halo of images even when unsplit).
        halo_width: Å.
    """
    best, best_cost = None, None
    for px in _divisors(n_ranks):
        for py in _divisors(n_ranks // px):
            grid = (px, py, n_ranks // px // py)
            inner, outer = 1.0, 1.0
            for a in range(3):
                ell = float(lengths[a]) / grid[a]
                inner *= ell
                outer *= ell + (2 * halo_width if (grid[a] > 1 or pbc[a]) else 0.0)
            cost = outer - inner
            if best_cost is None or cost < best_cost * (1 - 1e-12):
                best, best_cost = grid, cost
    return best  # type: ignore[return-value]


@dataclass(frozen=True)
class Partition:
    """The box grid of one system.

    Attributes:
        grid: ``(px, py, pz)``.
        cell: ``[3, 3]`` completed cell (Å).
        inv_cell: ``[3, 3]`` its inverse.
        pbc: ``[3]`` bool.
        lo: ``[3]`` fractional origin of the partitioned region (0 along periodic axes).
        width: ``[3]`` fractional width of one box along each axis.
        heights: ``[3]`` cell heights h_a (Å).
    """

    grid: Grid
    cell: Tensor
    inv_cell: Tensor
    pbc: Tensor
    lo: Tensor
    width: Tensor
    heights: Tensor

    @property
    def n_boxes(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def box_index(self, rank: int) -> Grid:
        px, py, pz = self.grid
        return rank // (py * pz), (rank // pz) % py, rank % pz

    def box_bounds(self, rank: int) -> tuple[Tensor, Tensor]:
        """Fractional ``(lower [3], upper [3])`` corners of box ``rank``."""
        idx = torch.tensor(self.box_index(rank), dtype=self.lo.dtype, device=self.lo.device)
        low = self.lo + idx * self.width
        return low, low + self.width

    def thickness(self, halo_width: float) -> Tensor:
        """``[3]`` fractional halo thickness ``w / h_a`` (slightly enlarged against round-off)."""
        return halo_width / self.heights * (1 + 1e-9) + 1e-12

    def fractional(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Wrapped fractional coordinates and the integer wrap ``n`` (``u = frac - n``).

        Args:
            positions: ``[n_atoms, 3]`` Å.
        Returns:
            ``u [n_atoms, 3]`` (in ``[0, 1)`` along periodic axes) and ``n [n_atoms, 3]`` long.
        """
        frac = positions @ self.inv_cell
        n = torch.where(self.pbc, torch.floor(frac), torch.zeros_like(frac))
        return frac - n, n.to(torch.long)

    def owner(self, u: Tensor) -> Tensor:
        """``[n_atoms]`` rank owning each atom, from wrapped fractional coordinates ``u``."""
        grid = torch.tensor(self.grid, device=u.device)
        idx = torch.floor((u - self.lo) / self.width).to(torch.long)
        idx = torch.minimum(idx.clamp_min(0), grid - 1)
        return (idx[:, 0] * grid[1] + idx[:, 1]) * grid[2] + idx[:, 2]


def make_partition(positions: Tensor, cell: Tensor, pbc: Tensor, n_ranks: int,
                   halo_width: float, grid: Grid | None = None) -> Partition:
    """Partition one system over ``n_ranks`` boxes.

    Args:
        positions: ``[n_atoms, 3]`` Å.
        cell: ``[3, 3]`` rows are lattice vectors (zero rows along non-periodic axes allowed).
        pbc: ``[3]`` bool.
        n_ranks: number of domain ranks.
        halo_width: Å, used to choose the grid.
        grid: ``(px, py, pz)`` or ``None`` to choose it (smallest halo volume).
    Raises:
        InputError: a grid whose number of boxes is not ``n_ranks``; a singular cell.
    """
    pos = positions.detach()
    full = complete_cell(cell.detach().unsqueeze(0))[0]
    if torch.linalg.det(full).abs() < 1e-12:
        raise InputError("singular cell: cannot partition the system into domains")
    inv = torch.linalg.inv(full)
    heights = cell_heights(full.unsqueeze(0))[0]
    pbc = pbc.to(torch.bool)
    frac = pos @ inv
    if pos.shape[0]:
        fmin, fmax = frac.min(0).values, frac.max(0).values
    else:
        fmin = fmax = torch.zeros(3, dtype=pos.dtype, device=pos.device)
    lo = torch.where(pbc, torch.zeros_like(fmin), fmin)
    extent = torch.where(pbc, torch.ones_like(fmin), (fmax - fmin).clamp_min(1e-9))
    if grid is None:
        grid = choose_grid(n_ranks, (extent * heights).tolist(), pbc.tolist(), halo_width)
    else:
        grid = tuple(int(g) for g in grid)  # type: ignore[assignment]
        if len(grid) != 3 or min(grid) < 1 or grid[0] * grid[1] * grid[2] != n_ranks:
            raise InputError(f"grid {'x'.join(map(str, grid))} has "
                             f"{grid[0] * grid[1] * grid[2]} boxes but there are {n_ranks} "
                             "domain ranks; give px*py*pz equal to the number of ranks")
    width = extent / torch.tensor(grid, dtype=pos.dtype, device=pos.device)
    return Partition(grid, full, inv, pbc, lo, width, heights)


def image_shifts(u: Tensor, low: Tensor, high: Tensor, pbc: Tensor) -> tuple[Tensor, Tensor]:
    """All periodic images of points ``u`` inside the fractional slab box ``[low, high]``.

    Args:
        u: ``[n, 3]`` wrapped fractional coordinates.
        low, high: ``[3]`` box corners (may extend beyond ``[0, 1)``).
        pbc: ``[3]`` periodic axes (only shift 0 along the others).
    Returns:
        ``index [m]`` of the point and integer ``shift [m, 3]`` (long) of each image
        ``u[index] + shift`` inside the box (closed interval), ordered by shift then index.
    """
    smin = torch.where(pbc, torch.ceil(low - u), torch.zeros_like(u)).to(torch.long)
    smax = torch.where(pbc, torch.floor(high - u), torch.zeros_like(u)).to(torch.long)
    inside_np = ((u >= low) & (u <= high)) | pbc  # non-periodic axes: shift 0 must fit
    ok = inside_np.all(-1) & (smax >= smin).all(-1)
    span = (smax - smin).clamp_min(0)
    kmax = span.max(0).values.tolist() if u.shape[0] else [0, 0, 0]
    idx_parts, shift_parts = [], []
    for d in itertools.product(*(range(k + 1) for k in kmax)):
        dd = torch.tensor(d, device=u.device)
        m = ok & (dd <= span).all(-1)
        i = torch.nonzero(m).flatten()
        idx_parts.append(i)
        shift_parts.append(smin[i] + dd)
    if not idx_parts:
        return torch.zeros(0, dtype=torch.long, device=u.device), smin[:0]
    return torch.cat(idx_parts), torch.cat(shift_parts)

