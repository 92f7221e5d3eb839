"""Partition one (triclinic, mixed-pbc) system into a ``px × py × pz`` grid of boxes.

Boxes are slabs in fractional coordinates ``u = frac`` of the *completed* cell (zero lattice
vectors of non-periodic axes replaced by unit vectors, as for neighbor lists). Along a
periodic axis the boxes split ``[0, 1)``; along a non-periodic axis they split the atoms'
bounding box ``[u_min, u_max]``. A Cartesian halo width ``w`` is a fractional thickness
``w / h_a`` along axis ``a``, with ``h_a = V / |b × c|`` the cell height (as LAMMPS does).
Rank ``r`` owns box ``(ix, iy, iz)`` with ``r = (ix * py + iy) * pz + iz``.

With balance ``none`` the boxes of an axis have equal widths; with ``shift`` they sit
between per-axis cut planes (``Partition.cuts``) placed by :mod:`.balance`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from xnn.data.graph import complete_cell
from xnn.distributed.domain.balance import BINS_PER_BOX, axis_cuts, check_balance, histogram
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


def check_grid(grid: Sequence[int], n_ranks: int) -> Grid:
    """``grid`` as a tuple; ``InputError`` unless it has ``n_ranks`` boxes."""
    grid = tuple(int(g) for g in grid)
    if len(grid) != 3 or min(grid) < 1 or grid[0] * grid[1] * grid[2] != n_ranks:
        raise InputError(f"grid {'x'.join(map(str, grid))} has "
                         f"{int(np.prod(grid))} boxes but there are {n_ranks} "
                         "domain ranks; give px*py*pz equal to the number of ranks")
    return grid  # type: ignore[return-value]


def box_of(rank: int, grid: Sequence[int]) -> Grid:
    """``(ix, iy, iz)`` of rank ``rank``'s box in ``grid``: ``r = (ix * py + iy) * pz + iz``."""
    _, py, pz = grid
    return rank // (py * pz), (rank // pz) % py, rank % pz


def rank_of(box: Sequence[int], grid: Sequence[int]) -> int:
    """The rank of box ``(ix, iy, iz)`` in ``grid`` (the inverse of :func:`box_of`)."""
    return (box[0] * grid[1] + box[1]) * grid[2] + box[2]


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
        cuts: ``None`` (equal widths: box ``i`` of axis ``a`` is ``lo + i * width``), or per
            axis the ``[g_a + 1]`` fractional cut planes (balance ``shift``; the first is
            ``lo``, the last ``lo + g_a * width``).
    """

    grid: Grid
    cell: Tensor
    inv_cell: Tensor
    pbc: Tensor
    lo: Tensor
    width: Tensor
    heights: Tensor
    cuts: tuple[Tensor, Tensor, Tensor] | None = None

    def box_index(self, rank: int) -> Grid:
        return box_of(rank, self.grid)

    def box_bounds(self, rank: int) -> tuple[Tensor, Tensor]:
        """Fractional ``(lower [3], upper [3])`` corners of box ``rank``."""
        if self.cuts is not None:
            ijk = self.box_index(rank)
            return (torch.stack([c[i] for c, i in zip(self.cuts, ijk)]),
                    torch.stack([c[i + 1] for c, i in zip(self.cuts, ijk)]))
        idx = torch.tensor(self.box_index(rank), dtype=self.lo.dtype, device=self.lo.device)
        low = self.lo + idx * self.width
        return low, low + self.width

    def axis_index(self, u: Tensor, a: int) -> Tensor:
        """``[n]`` box index along axis ``a`` of wrapped fractional coordinates ``u [n, 3]``."""
        if self.cuts is not None:
            inner = self.cuts[a][1:-1].to(u.device).contiguous()
            return torch.searchsorted(inner, u[:, a].contiguous(), right=True)
        idx = torch.floor((u[:, a] - self.lo[a]) / self.width[a]).to(torch.long)
        return idx.clamp(0, self.grid[a] - 1)

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
        g = self.grid
        ix, iy, iz = (self.axis_index(u, a) for a in range(3))
        return (ix * g[1] + iy) * g[2] + iz

    def home(self, positions: Tensor, rank: int) -> tuple[Tensor, Tensor]:
        """Fractional coordinates of the images of ``positions`` nearest to box ``rank``.

        Along periodic axes each atom is taken at the image whose fractional coordinate lies
        within half a cell of the box centre (its own box, once ownership is fresh).

        Args:
            positions: ``[n, 3]`` Å (unwrapped).
        Returns:
            ``g [n, 3]`` fractional coordinates and the integer ``n_home [n, 3]`` (long)
            with ``g = positions @ inv_cell + n_home``.
        """
        low, high = self.box_bounds(rank)
        frac = positions @ self.inv_cell
        centre = 0.5 * (low + high)
        n = torch.where(self.pbc, -torch.round(frac - centre), torch.zeros_like(frac))
        return frac + n, n.to(torch.long)

    def extent(self, rank: int, home: Tensor) -> Tensor:
        """``[2, 3]`` fractional ``(low, high)`` of box ``rank`` grown to hold ``home [n, 3]``."""
        low, high = self.box_bounds(rank)
        if home.shape[0]:
            low = torch.minimum(low, home.min(0).values)
            high = torch.maximum(high, home.max(0).values)
        return torch.stack([low, high])

    def peers(self, extents: Tensor, halo_width: float, rank: int) -> list[int]:
        """Ranks whose atoms lie within ``halo_width`` of rank ``rank``'s (any image).

        The relation is symmetric and computed identically on every rank (from the same
        all-gathered ``extents [n_ranks, 2, 3]``): ``q`` talks to ``r`` when some periodic
        image of extent ``r`` comes within the fractional halo thickness of extent ``q``.
        """
        t = self.thickness(halo_width) * (1 + 1e-6) + 1e-9  # wider than any pushed region
        first = (torch.arange(extents.shape[0], device=extents.device) < rank)[:, None, None]
        mine = extents[rank].expand_as(extents)
        a, b = torch.where(first, extents, mine), torch.where(first, mine, extents)
        smin = torch.ceil(b[:, 0] - t - a[:, 1])  # the same arithmetic on both sides
        smax = torch.floor(b[:, 1] + t - a[:, 0])
        ok = torch.where(self.pbc, smin <= smax, (smin <= 0) & (smax >= 0)).all(-1)
        ok[rank] = False
        return torch.nonzero(ok).flatten().tolist()


def make_partition(positions: Tensor, cell: Tensor, pbc: Tensor, n_ranks: int,
                   halo_width: float, grid: Grid | None = None,
                   balance: str = "none") -> Partition:
    """Partition one system over ``n_ranks`` boxes from all of its positions (one process).

    Args:
        positions: ``[n_atoms, 3]`` Å.
        cell: ``[3, 3]`` rows are lattice vectors (zero rows along non-periodic axes allowed).
        pbc: ``[3]`` bool.
        n_ranks: number of domain ranks.
        halo_width: Å, used to choose the grid.
        grid: ``(px, py, pz)`` or ``None`` to choose it (smallest halo volume).
        balance: a word of :data:`~.balance.BALANCE` (``shift``: cuts at the atoms' quantiles).
    Raises:
        InputError: a grid whose number of boxes is not ``n_ranks``; a singular cell.
    """
    full, inv = _completed(cell)
    frac = positions.detach() @ inv
    if frac.shape[0]:
        fmin, fmax = frac.min(0).values, frac.max(0).values
    else:
        fmin = fmax = torch.zeros(3, dtype=frac.dtype, device=frac.device)
    part = partition_from_bounds(fmin, fmax, cell, pbc, n_ranks, halo_width, grid)
    if check_balance(balance) == "none":
        return part
    hist = axis_histograms(part, part.fractional(positions.detach())[0])
    return balanced(part, hist, halo_width)


def _completed(cell: Tensor) -> tuple[Tensor, Tensor]:
    full = complete_cell(cell.detach().unsqueeze(0))[0]
    if torch.linalg.det(full).abs() < 1e-12:
        raise InputError("singular cell: cannot partition the system into domains")
    return full, torch.linalg.inv(full)


def fractional_bounds(positions: Tensor, cell: Tensor) -> Tensor:
    """``[6]`` ``(max frac, -min frac)`` of some atoms (``-inf`` when there are none).

    The form lets one MAX all-reduce give the bounding box of the atoms of all ranks.
    """
    frac = positions.detach() @ _completed(cell)[1]
    if not frac.shape[0]:
        return torch.full((6,), float("-inf"), dtype=frac.dtype, device=frac.device)
    return torch.cat([frac.max(0).values, -frac.min(0).values])


def partition_from_bounds(fmin: Tensor, fmax: Tensor, cell: Tensor, pbc: Tensor, n_ranks: int,
                          halo_width: float, grid: Grid | None = None) -> Partition:
    """The partition of a system whose atoms' fractional coordinates lie in ``[fmin, fmax]``.

    Args:
        fmin, fmax: ``[3]`` bounds of the atoms' fractional coordinates (only used along
            non-periodic axes; non-finite bounds, i.e. no atoms, count as 0).
        cell, pbc, n_ranks, halo_width, grid: see :func:`make_partition`.
    """
    full, inv = _completed(cell)
    heights = cell_heights(full.unsqueeze(0))[0]
    pbc = pbc.to(torch.bool)
    fmin = torch.where(torch.isfinite(fmin), fmin, torch.zeros_like(fmin))
    fmax = torch.where(torch.isfinite(fmax), fmax, fmin)
    lo = torch.where(pbc, torch.zeros_like(fmin), fmin)
    extent = torch.where(pbc, torch.ones_like(fmin), (fmax - fmin).clamp_min(1e-9))
    if grid is None:
        grid = choose_grid(n_ranks, (extent * heights).tolist(), pbc.tolist(), halo_width)
    else:
        grid = check_grid(grid, n_ranks)
    width = extent / torch.tensor(grid, dtype=fmin.dtype, device=fmin.device)
    return Partition(grid, full, inv, pbc, lo, width, heights)


def _span(part: Partition, a: int) -> tuple[float, float]:
    """``(lo, span)``: the fractional span ``[lo, lo + g_a * width]`` axis ``a`` splits."""
    return float(part.lo[a]), float(part.width[a] * part.grid[a])


def axis_histogram(part: Partition, values: Tensor, a: int,
                   weights: Tensor | None = None) -> Tensor:
    """``[BINS_PER_BOX * g_a]`` counts of fractional coordinates ``values [n]`` along axis
    ``a`` over its partitioned span (:func:`~.balance.histogram`)."""
    return histogram(values, *_span(part, a), part.grid[a], weights)


def axis_histograms(part: Partition, u: Tensor) -> Tensor:
    """Per-axis counts of wrapped fractional coordinates ``u [n, 3]``, concatenated:
    ``[sum_a BINS_PER_BOX * g_a]`` float64 (what a decomposition all-reduces)."""
    return torch.cat([axis_histogram(part, u[:, a], a) for a in range(3)])


def balanced(part: Partition, hist: Tensor, min_width: float) -> Partition:
    """``part`` with the cut planes of every axis at the atom-count quantiles of ``hist``
    (:func:`axis_histograms`, summed over all atoms): balance ``shift``.

    Args:
        part: the equal-width partition (its ``lo``, ``width`` and grid).
        hist: ``[sum_a BINS_PER_BOX * g_a]`` per-axis counts of all atoms.
        min_width: Å, the thinnest box (the halo width; see :func:`~.balance.axis_cuts`).
    """
    cuts, start = [], 0
    for a in range(3):
        bins = BINS_PER_BOX * part.grid[a]
        c = axis_cuts(hist[start:start + bins], *_span(part, a), part.grid[a],
                      min_width / float(part.heights[a]))
        start += bins
        cuts.append(c.to(dtype=part.lo.dtype, device=part.lo.device))
    return dataclasses.replace(part, cuts=tuple(cuts))


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



def sorted_images(u: Tensor, low: Tensor, high: Tensor, pbc: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`image_shifts` ordered by shift (lexicographic), then by point index.

    A canonical order: the same points and box give bitwise the same list.
    """
    index, shift = image_shifts(u, low, high, pbc)
    if not index.numel():
        return index, shift
    span = int(shift.abs().max()) + 1
    base = 2 * span + 1
    key = ((shift[:, 0] + span) * base + shift[:, 1] + span) * base + shift[:, 2] + span
    order = torch.argsort(key * max(u.shape[0], 1) + index)
    return index[order], shift[order]
