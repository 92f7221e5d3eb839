"""Graph mode's owners at scale: blocks of the project's atom order without sorting the
atoms (ghost plans, :mod:`.plan`; issue 47).

:func:`~xnn.distributed.graph.order.assign_owners` sorts every atom's Morton code (ties by
id) and gives position ``k`` of that order to rank ``floor(k P / N)``, so rank ``r`` starts
at position ``k_r = ceil(r N / P)``. Those ``P - 1`` starts are order statistics of the keys
``code << 33 | id`` (codes have 30 bits, so a key orders by code, then by id), found here
without a sort, in two passes over the codes:

1. a histogram of the codes' top 20 bits (``2^20`` bins) locates the bin of every start and
   its place inside that bin;
2. the keys of the atoms in those few bins (at most ``P - 1`` bins) are collected and sorted,
   which gives every start's key exactly.

Then an atom's owner is the number of starts at or below its key (``searchsorted``), the
same integer as ``assign_owners`` gives it, atom by atom (``tests/test_cost_blocks.py``).
Memory: the codes as ``uint32`` (4 bytes an atom), the owners as ``int16`` (2 bytes), the
histogram (8 MB) and the keys of the boundary bins.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from xnn.distributed.cost.systems import System
from xnn.distributed.graph.order import _BITS, morton_codes

_ID_BITS = 33  #: a key is ``code << 33 | id``: ids below 2^33 (8.6 × 10^9 atoms)
_BIN_SHIFT = 3 * _BITS - 20  #: histogram bins: the codes' top 20 bits
_NO_ATOM = np.iinfo(np.int64).max  #: the start of a rank past the last atom (P > N)


def keys(codes: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[n]`` int64 keys ``code << 33 | id``: their order is the atom order (ties by id)."""
    return (codes.astype(np.int64) << _ID_BITS) | ids.astype(np.int64)


def rank_starts(codes: np.ndarray, n_ranks: int, block: int) -> np.ndarray:
    """``[n_ranks - 1]`` int64 keys of the first atom of ranks ``1 .. P-1`` in the order of
    ``(code, id)``; ``codes [n]`` are in id order (atom ``i`` has code ``codes[i]``). A rank
    past the last atom (more ranks than atoms) starts at the largest int64."""
    n = len(codes)
    if n >= 1 << _ID_BITS:
        raise ValueError(f"{n} atoms: ids need more than {_ID_BITS} bits")
    first = -(-np.arange(1, n_ranks, dtype=np.int64) * n // n_ranks)  # ceil(r N / P)
    starts = np.full(n_ranks - 1, _NO_ATOM, dtype=np.int64)
    real = first < n
    if not real.any():
        return starts
    hist = np.zeros(1 << (3 * _BITS - _BIN_SHIFT), dtype=np.int64)
    for lo in range(0, n, block):
        hist += np.bincount(codes[lo: lo + block] >> _BIN_SHIFT, minlength=len(hist))
    cum = np.cumsum(hist)
    bins = np.searchsorted(cum, first[real], side="right")  # the bin holding each start
    wanted = np.zeros(len(hist), dtype=bool)
    wanted[bins] = True
    found = []
    for lo in range(0, n, block):
        c = codes[lo: lo + block]
        pick = np.flatnonzero(wanted[c >> _BIN_SHIFT])
        found.append(keys(c[pick], pick + lo))
    found = np.sort(np.concatenate(found))
    # the collected keys sorted: each bin a contiguous run, starting where its codes start
    run = np.searchsorted(found, bins.astype(np.int64) << (_BIN_SHIFT + _ID_BITS))
    starts[real] = found[run + first[real] - (cum[bins] - hist[bins])]
    return starts


def owners(codes: np.ndarray, starts: np.ndarray, lo: int, dtype) -> np.ndarray:
    """``[n]`` ranks of atoms ``lo .. lo + n - 1`` (``codes [n]``): starts at or below each
    key."""
    ids = np.arange(lo, lo + len(codes), dtype=np.int64)
    return np.searchsorted(starts, keys(codes, ids), side="right").astype(dtype)


def _extremes(sys: System, block: int) -> np.ndarray | None:
    """``[6, 3]`` positions of the atoms at each axis' smallest and largest fractional
    coordinate, or ``None`` if every axis is periodic: appended to every block, they make
    each block's codes those of the whole system (``morton_codes`` scales non-periodic axes
    to the atoms' bounds)."""
    if bool(sys.pbc.all()):
        return None
    inv = np.linalg.inv(sys.cell.numpy())
    lo_hi = None
    for ids in sys.blocks(block):
        pos = sys.positions(ids)
        if lo_hi is not None:
            pos = np.concatenate([pos, lo_hi])
        frac = pos @ inv
        lo_hi = np.concatenate([pos[frac.argmin(0)], pos[frac.argmax(0)]])
    return lo_hi


def codes_of(sys: System, block: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(first id, codes [n] uint32)`` of every block of atoms, in id order: the Morton
    codes of the whole system (:func:`~xnn.distributed.graph.order.morton_codes`)."""
    lo_hi = _extremes(sys, block)
    for ids in sys.blocks(block):
        pos = sys.positions(ids)
        if lo_hi is not None:
            pos = np.concatenate([pos, lo_hi])
        c = morton_codes(torch.from_numpy(pos), sys.cell, sys.pbc)[: len(ids)]
        yield int(ids[0]), c.numpy().astype(np.uint32)


def graph_owners(sys: System, n_ranks: int, order: str, block: int) -> np.ndarray:
    """``[n_atoms]`` int16/int32 rank of each atom: blocks of the atom order (``index`` or
    ``morton``), as :func:`~xnn.distributed.graph.order.assign_owners` gives them."""
    n = sys.n_atoms
    dtype = np.int16 if n_ranks < (1 << 15) else np.int32
    if order == "index":  # ids are 0..n-1 in generation order
        return ((np.arange(n, dtype=np.int64) * n_ranks) // n).astype(dtype)
    codes = np.empty(n, dtype=np.uint32)
    for lo, c in codes_of(sys, block):
        codes[lo: lo + len(c)] = c
    starts = rank_starts(codes, n_ranks, block)
    owner = np.empty(n, dtype=dtype)
    for lo in range(0, n, block):
        owner[lo: lo + block] = owners(codes[lo: lo + block], starts, lo, dtype)
    return owner
