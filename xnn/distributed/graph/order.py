"""Which rank owns which atoms in graph-parallel mode: contiguous blocks of an atom order.

Two orders: ``"index"`` (by global atom id) and ``"morton"`` (a Z-order space-filling curve
over fractional coordinates, so that each rank's atoms are spatially compact and few
neighbours of its atoms live on other ranks). Either way the ranks get blocks of
``ceil(N / P)`` or ``floor(N / P)`` atoms; results do not depend on the order (positions
are replicated), only the number of edges crossing ranks does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.errors import InputError

ORDERS = ("morton", "index")
_BITS = 10  # per axis: 2**30 cells along the curve


def _spread(v: Tensor) -> Tensor:
    """Insert two zero bits between the low ``_BITS`` (10) bits of ``v`` (long): bit ``b``
    moves to bit ``3 b``, by four shift-and-mask steps (moves of 16, 8, 4, 2 bits)."""
    v = v & 0x3FF
    v = (v | (v << 16)) & 0x30000FF
    v = (v | (v << 8)) & 0x300F00F
    v = (v | (v << 4)) & 0x30C30C3
    return (v | (v << 2)) & 0x9249249


def morton_codes(positions: Tensor, cell: Tensor, pbc: Tensor) -> Tensor:
    """``[n_atoms]`` long Z-order codes of ``positions [n_atoms, 3]`` (Å).

    Periodic axes use the wrapped fractional coordinate; other axes (and a zero cell) the
    coordinate scaled to the atoms' bounding box.
    """
    pos = positions.detach().to(torch.float64)
    cell = cell.detach().to(torch.float64).reshape(3, 3)
    pbc = pbc.reshape(3).to(pos.device)
    use_cell = bool(pbc.any()) and abs(float(torch.linalg.det(cell))) > 0
    frac = pos @ torch.linalg.inv(cell) if use_cell else pos.clone()
    lo, hi = frac.min(0).values, frac.max(0).values
    scaled = (frac - lo) / (hi - lo).clamp_min(1e-12)
    if use_cell:
        scaled = torch.where(pbc, torch.remainder(frac, 1.0), scaled)
    q = (scaled.clamp(0.0, 1.0 - 1e-12) * (1 << _BITS)).long()
    return _spread(q[:, 0]) | (_spread(q[:, 1]) << 1) | (_spread(q[:, 2]) << 2)


def assign_owners(graph, n_ranks: int, order: str = "morton") -> Tensor:
    """``[n_atoms]`` long: the rank owning each atom of ``graph`` (one system).

    Args:
        graph: the whole system (rank 0's copy).
        n_ranks: group size.
        order: ``"morton"`` or ``"index"`` (see the module docstring).
    """
    if order not in ORDERS:
        raise InputError(f"graph-parallel order must be one of {list(ORDERS)}, got {order!r}")
    n = graph.n_atoms
    ids = graph.atom_id
    if order == "index" or n == 0:
        rank_of = torch.argsort(torch.argsort(ids))
    else:
        codes = morton_codes(graph.positions, graph.cell[0], graph.pbc[0])
        # ties broken by atom id: the same order on every launch
        by_id = torch.argsort(ids)
        seq = by_id[torch.sort(codes[by_id], stable=True).indices]
        rank_of = torch.empty_like(seq)
        rank_of[seq] = torch.arange(n, device=seq.device)
    # position k of the order goes to rank floor(k * P / N): blocks of near-equal size
    return (rank_of * n_ranks) // max(n, 1)
