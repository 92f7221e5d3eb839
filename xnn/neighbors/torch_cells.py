"""Cell-list neighbor list in pure PyTorch (CPU and CUDA), vectorised over atoms and systems.

Algorithm (one pass for the whole batch, no Python loop over atoms or systems):

1. Bin every atom in fractional coordinates. Along a periodic axis ``a`` the cell is cut into
   ``n_a = floor(h_a / cutoff)`` slabs (``h_a = V / |b × c|`` is the height of the cell
   perpendicular to face ``a``), so a slab is at least ``cutoff`` thick even in a triclinic
   cell. Along a non-periodic axis the atoms' bounding box (in fractional coordinates of the
   completed cell) is cut the same way. Each system gets its own block of global bin ids.
2. Sort atoms by global bin and count atoms per bin (counting-sort offsets ``bin_start``).
3. For every bin offset ``d`` in ``[-m, m]^3`` (``m = 1`` unless a cell is thinner than the
   cutoff, then ``m = ceil(cutoff / slab)`` so several periodic images are searched), the
   neighbour bin of atom ``i`` is ``e = bin_i + d`` in the unbounded (extended) grid; along a
   periodic axis its image shift is ``floor(e / n_a)`` and its bin ``e mod n_a``; along a
   non-periodic axis it must lie inside the grid. Every atom of that bin is a candidate.
   Only half of the offsets are searched: the pairs of ``-d`` are the pairs of ``d`` reversed.
4. Candidates are expanded with ``repeat_interleave`` in chunks whose size is bounded, their
   distances computed and pairs with ``|r_ij| < cutoff`` kept. Memory is O(candidates per
   chunk + edges), never O(N²).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from xnn.neighbors.common import cell_heights

# Upper bounds on the work held in memory at once (number of (atom, offset) pairs and of
# candidate (i, j) pairs), per device type. They only decide chunking, never results: large
# chunks keep a GPU busy, small ones keep a CPU's working set in cache.
_BUDGETS = {"cuda": (1 << 22, 1 << 25), "cpu": (1 << 18, 1 << 20)}


def torch_neighbor_list(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor
) -> tuple[Tensor, Tensor]:
    """Full neighbor list by a batched cell list.

    Args:
        positions: ``[n_atoms, 3]`` Å, wrapped into the cell along periodic axes.
        cell: ``[n_systems, 3, 3]`` invertible (zero rows completed), rows lattice vectors.
        pbc: ``[n_systems, 3]`` bool.
        cutoff: Å, > 0; pairs with ``|r_ij| < cutoff`` are returned.
        batch: ``[n_atoms]`` non-decreasing system index.
    Returns:
        ``edge_index [2, E]`` long (row 0 sender j, row 1 receiver i) and ``shifts [E, 3]``
        long with ``r_ij = pos[j] - pos[i] + shifts @ cell[batch[i]]``.
    """
    device = positions.device
    n_atoms = positions.shape[0]
    if n_atoms == 0:
        return _empty(device)
    grid = _bin_grid(positions, cell, pbc, cutoff, batch)
    order = torch.argsort(grid.atom_bin, stable=True)
    sorted_bins = grid.atom_bin[order]
    counts = torch.bincount(sorted_bins, minlength=grid.n_bins_total)
    bin_start = torch.cumsum(counts, 0) - counts
    pos = positions[order]
    state = _SortedState(
        pos=pos,
        pos_t=[c.contiguous() for c in pos.unbind(-1)],
        bin3=grid.bin3[order],
        sys=batch[order],
        counts=counts,
        bin_start=bin_start,
        n=grid.n,
        m=grid.m,
        sys_bin_start=grid.sys_bin_start,
        pbc=pbc,
        cell=cell,
        cutoff2=cutoff * cutoff,
    )
    senders, receivers, shifts = [], [], []
    offsets = _half_offsets(int(grid.m.max()), device)
    pair_budget = _BUDGETS.get(device.type, _BUDGETS["cuda"])[0]
    per_chunk = max(1, pair_budget // n_atoms)
    # offset 0 alone (pairs inside a bin, both directions found), then the rest (mirrored)
    chunks = [offsets[:1]] + [offsets[k : k + per_chunk] for k in range(1, len(offsets), per_chunk)]
    for chunk_id, chunk in enumerate(chunks):
        for j, i, s in _search_offsets(state, chunk, same_bin=chunk_id == 0):
            senders.append(j)
            receivers.append(i)
            shifts.append(s)
            if chunk_id > 0:
                senders.append(i)
                receivers.append(j)
                shifts.append(-s)
    if not senders:
        return _empty(device)
    edge_index = torch.stack([order[torch.cat(senders)], order[torch.cat(receivers)]])
    return edge_index, torch.cat(shifts).to(torch.long)


class _Grid:
    """Bin layout: per-system bin counts ``n`` and search ranges ``m`` ``[n_systems, 3]``,
    per-atom bin coordinates ``bin3 [n_atoms, 3]`` and global bin id ``atom_bin [n_atoms]``."""

    def __init__(self, n, m, bin3, atom_bin, sys_bin_start, n_bins_total):
        self.n, self.m, self.bin3, self.atom_bin = n, m, bin3, atom_bin
        self.sys_bin_start, self.n_bins_total = sys_bin_start, n_bins_total


class _SortedState:
    """Atoms sorted by bin and the bin tables, as used by the offset search."""

    def __init__(
        self, pos, pos_t, bin3, sys, counts, bin_start, n, m, sys_bin_start, pbc, cell, cutoff2
    ):
        self.pos, self.pos_t, self.bin3, self.sys = pos, pos_t, bin3, sys
        self.counts, self.bin_start = counts, bin_start
        self.n, self.m, self.sys_bin_start = n, m, sys_bin_start
        self.pbc, self.cell, self.cutoff2 = pbc, cell, cutoff2
        self.cand_budget = _BUDGETS.get(pos.device.type, _BUDGETS["cuda"])[1]
        self.single = cell.shape[0] == 1


def _bin_grid(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor) -> _Grid:
    """Choose bins per system (slabs >= cutoff thick, at most ~2 bins per atom) and bin atoms."""
    n_sys = cell.shape[0]
    frac = torch.einsum("ni,nij->nj", positions, torch.linalg.inv(cell)[batch])
    idx = batch.unsqueeze(-1).expand(-1, 3)
    big = torch.finfo(frac.dtype).max
    lo = torch.full((n_sys, 3), big, dtype=frac.dtype, device=frac.device)
    hi = torch.full((n_sys, 3), -big, dtype=frac.dtype, device=frac.device)
    lo = lo.scatter_reduce(0, idx, frac, "amin")
    hi = hi.scatter_reduce(0, idx, frac, "amax")
    empty = lo > hi  # systems without atoms
    lo = torch.where(pbc, torch.zeros_like(lo), torch.where(empty, torch.zeros_like(lo), lo))
    span = torch.where(pbc, torch.ones_like(hi), torch.where(empty, torch.zeros_like(hi), hi - lo))
    extent = span * cell_heights(cell)  # Å thickness of the region to bin along each axis
    n = torch.floor(extent / cutoff).clamp(min=1, max=1 << 20).to(torch.long)
    n_per_sys = torch.bincount(batch, minlength=n_sys)
    n = _cap_bins(n, 2 * n_per_sys + 8)
    slab = extent / n
    tiny = torch.finfo(frac.dtype).tiny
    m = torch.where(
        slab > 0, torch.ceil(cutoff / slab.clamp_min(tiny)), torch.ones_like(slab)
    ).to(torch.long)
    m = torch.where(pbc, m, torch.ones_like(m).clamp(max=n - 1))  # non-periodic: neighbours only
    m = torch.where(n_per_sys.unsqueeze(-1) > 0, m, torch.zeros_like(m))
    scale = torch.where(span > 0, n / span.clamp_min(tiny), torch.zeros_like(span))
    u = (frac - lo[batch]) * scale[batch]
    bin3 = torch.minimum(torch.floor(u).clamp_min(0).to(torch.long), n[batch] - 1)
    sizes = n.prod(-1)
    sys_bin_start = torch.cumsum(sizes, 0) - sizes
    atom_bin = sys_bin_start[batch] + _flat(bin3, n[batch])
    return _Grid(n, m, bin3, atom_bin, sys_bin_start, int(sizes.sum()))


def _cap_bins(n: Tensor, max_bins: Tensor) -> Tensor:
    """Coarsen bin counts ``n [n_systems, 3]`` so that ``prod(n) <= max_bins`` (about)."""
    for _ in range(4):
        total = n.prod(-1).to(torch.float64)
        over = total > max_bins
        if not bool(over.any()):
            break
        k = (n > 1).sum(-1).clamp_min(1).to(torch.float64)
        f = (total / max_bins.to(torch.float64)).clamp_min(1.0) ** (1.0 / k)
        coarse = torch.floor(n.to(torch.float64) / f.unsqueeze(-1)).clamp_min(1).to(torch.long)
        n = torch.where(over.unsqueeze(-1), coarse, n)
    return n


def _flat(bin3: Tensor, n: Tensor) -> Tensor:
    return (bin3[..., 0] * n[..., 1] + bin3[..., 1]) * n[..., 2] + bin3[..., 2]


def _half_offsets(m: int, device: torch.device) -> Tensor:
    """Offsets ``d`` in ``[-m, m]^3`` with ``d >= 0`` lexicographically (``0`` first)."""
    rng = range(-m, m + 1)
    half = [d for d in itertools.product(rng, rng, rng) if d > (0, 0, 0)]
    return torch.tensor([(0, 0, 0), *half], dtype=torch.long, device=device).reshape(-1, 3)


def _search_offsets(state: _SortedState, offsets: Tensor, same_bin: bool):
    """Yield kept ``(j, i, shift)`` (sorted-atom indices) of all atoms with ``offsets [K, 3]``.

    With ``same_bin`` (``offsets == [[0, 0, 0]]``) self-pairs are dropped. Per-system tables
    are broadcast, not gathered, when the batch holds one system.
    """
    n_atoms = state.pos.shape[0]
    d = offsets.unsqueeze(1)  # [K, 1, 3]
    n, m, periodic = (_per_atom(state, t) for t in (state.n, state.m, state.pbc))
    ext = state.bin3.unsqueeze(0) + d  # [K, N, 3] neighbour bin in the unbounded grid
    shift = torch.where(periodic, torch.div(ext, n, rounding_mode="floor"), torch.zeros_like(ext))
    target3 = ext - shift * n
    valid = ((d.abs() <= m) & (target3 >= 0) & (target3 < n)).all(-1)
    keep = torch.nonzero(valid.reshape(-1)).flatten()
    atom = torch.remainder(keep, n_atoms)
    shift = shift.reshape(-1, 3).index_select(0, keep)
    target3 = target3.reshape(-1, 3).index_select(0, keep)
    if state.single:
        target = state.sys_bin_start[0] + _flat(target3, state.n[0])
        shift_cart = shift.to(state.pos.dtype) @ state.cell[0]
    else:
        sys = state.sys.index_select(0, atom)
        target = _take(state.sys_bin_start, sys) + _flat(target3, _take(state.n, sys))
        shift_cart = torch.einsum("pk,pkl->pl", shift.to(state.pos.dtype), _take(state.cell, sys))
    count = _take(state.counts, target)
    start = _take(state.bin_start, target)
    # q = pos_i - shift @ cell, so r_ij = pos_j + shift @ cell - pos_i = pos_j - q
    q_t = [c.contiguous() for c in (_take(state.pos, atom) - shift_cart).unbind(-1)]
    csum = torch.cumsum(count, 0)
    total = int(csum[-1]) if csum.numel() else 0
    if total == 0:
        return
    bounds = _chunk_bounds(csum, total, state.cand_budget)
    for a, b in zip(bounds[:-1], bounds[1:]):
        yield _expand(state, (a, b), csum, count, start, atom, q_t, shift, same_bin)


def _per_atom(state: _SortedState, table: Tensor) -> Tensor:
    """``[n_atoms, 3]`` rows of a per-system table, or ``[1, 3]`` (broadcast) for one system."""
    return table if state.single else table.index_select(0, state.sys)


def _chunk_bounds(csum: Tensor, total: int, budget: int) -> list[int]:
    """Split (atom, offset) pairs into runs of at most about ``budget`` candidates."""
    if total <= budget:
        return [0, csum.shape[0]]
    marks = torch.arange(budget, total, budget, device=csum.device)
    cuts = torch.searchsorted(csum, marks, right=False).tolist()
    bounds = sorted({0, *[c for c in cuts if 0 < c < csum.shape[0]], csum.shape[0]})
    return bounds


def _expand(state, span, csum, count, start, atom, q_t, shift, same_bin):
    """Candidates of (atom, offset) pairs ``span = (a, b)``; return kept ``(j, i, shift)``.

    Candidate-sized index arrays are int32 (half the memory traffic) when they fit.
    """
    a, b = span
    dev = count.device
    cnt = count[a:b]
    base = csum[a - 1] if a > 0 else csum.new_zeros(())
    n_cand = int(csum[b - 1] - base)
    small = max(n_cand, state.pos.shape[0]) < 2**31 - 1
    it = torch.int32 if small else torch.long
    local = torch.repeat_interleave(
        torch.arange(b - a, device=dev, dtype=it), cnt, output_size=n_cand
    )
    # j = start of the target bin + rank of the candidate within it
    jump = (start[a:b] - (csum[a:b] - cnt - base)).to(it)
    j = jump.index_select(0, local) + torch.arange(n_cand, device=dev, dtype=it)
    r2 = None
    for x, q in zip(state.pos_t, q_t):  # x, y, z components: 1-D gathers are the fastest
        dx = x.index_select(0, j) - q[a:b].index_select(0, local)
        r2 = dx * dx if r2 is None else r2.addcmul_(dx, dx)
    ok = r2 < state.cutoff2
    atom = atom[a:b]
    if same_bin:
        ok &= j != atom.to(it).index_select(0, local)
    sel = torch.nonzero(ok).flatten()
    local = local.index_select(0, sel)
    j = j.index_select(0, sel).long()
    return j, atom.index_select(0, local), shift[a:b].index_select(0, local)


def _take(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along dim 0 (``index_select`` is several times faster on CPU)."""
    return x.index_select(0, index)


def _empty(device: torch.device) -> tuple[Tensor, Tensor]:
    z = torch.zeros(0, dtype=torch.long, device=device)
    return torch.stack([z, z]), torch.zeros(0, 3, dtype=torch.long, device=device)
