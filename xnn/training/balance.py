"""Global batches packed as ``bins`` equal shares of atoms (``data.balance=atoms``).

Under plain data parallelism every rank makes the same global batches and keeps a greedy
share by atoms (:func:`~xnn.data.datasets.shard_batch`); on a dataset of mixed sizes (8 to
500 atoms) a batch cut in stream order then often leaves one rank with twice the atoms of
another. Here the global batch of a step is packed as ``bins`` shares (one per data-parallel
replica) from a bounded look-ahead window of the epoch's stream of structures:

* the oldest structure of the window always goes first (no structure waits longer than
  ``lookahead`` steps);
* a structure larger than a share's budget raises the budget of the steps whose window
  holds it to its size (it trains in a share of its own, the other shares as full);
* the rest of the window, largest first, goes to the least-loaded share it fits in;
* when the stream is exhausted the last window is dealt out whole, largest first to the
  least-loaded share (the epoch's last step holds the remainder).

The packing is a pure function of ``(n_atoms, order, bins, budget, lookahead)``: every rank
computes the same packs without reading a structure, takes pack ``dp_rank``, and one process
trains their union (the same global batch). The balance is measured by :func:`imbalance`.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence

import numpy as np

from xnn.errors import InputError

#: structures of the look-ahead window per share (``data.balance_lookahead`` default)
LOOKAHEAD_PER_BIN = 64


def balanced_batches(n_atoms: np.ndarray, order: Sequence[int], bins: int, budget: int,
                     lookahead: int | None = None) -> list[list[list[int]]]:
    """The steps of one epoch as ``bins`` shares each.

    Args:
        n_atoms: ``[n_structures]`` atoms per structure.
        order: the epoch's stream of structure indices (a seeded permutation or draw).
        bins: shares per global batch (data-parallel replicas).
        budget: atoms per share (a structure of the window larger than this raises the
            step's budget to its size).
        lookahead: structures in the window (``None``: ``LOOKAHEAD_PER_BIN × bins``).
    Returns:
        ``[step][share] -> structure indices``; every index of ``order`` once, in one share
        (a structure drawn twice into one window with one copy passed over keeps both copies
        in the window, as the packer always did: the packs stay those of existing runs).
        The lists of :func:`balanced_bounds`.
    Raises:
        InputError: ``bins``, ``budget`` or ``lookahead`` below 1.
    """
    packed, starts = balanced_bounds(n_atoms, order, bins, budget, lookahead)
    bounds = starts.tolist()
    shares = [packed[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]
    return [shares[k:k + bins] for k in range(0, len(shares), bins)]


def balanced_bounds(n_atoms: np.ndarray, order: Sequence[int], bins: int, budget: int,
                    lookahead: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The packs of :func:`balanced_batches` as two arrays: share ``r`` of step ``s`` is
    ``packed[starts[s * bins + r] : starts[s * bins + r + 1]]``.

    Returns:
        ``(packed [len(order)] int32`` (int64 for an int64 ``order``), ``starts
        [n_steps * bins + 1] int64)``.
    """
    if bins < 1 or budget < 1:
        raise InputError(f"balanced batches need bins >= 1 and a budget >= 1 atom, got "
                         f"bins={bins}, budget={budget}")
    lookahead = LOOKAHEAD_PER_BIN * bins if lookahead is None else int(lookahead)
    if lookahead < 1:
        raise InputError(f"data.balance_lookahead must be >= 1, got {lookahead}")
    sizes = np.asarray(n_atoms)  # no int64 copy of the whole array: a window at a time
    stream = np.asarray(order)
    if not np.issubdtype(stream.dtype, np.integer):
        stream = stream.astype(np.int64)
    seen = np.zeros(len(sizes), dtype=bool)
    seen[stream] = True
    repeats = int(seen.sum()) < len(stream)  # draws by weight repeat structures
    del seen
    wide = stream.dtype.itemsize > 4 or len(sizes) >= 2**31
    packed = array("q" if wide else "i")  # 4 bytes a structure
    lengths = array("q")  # share sizes: 8 bytes a share
    window = stream[:0]
    pos = 0
    while pos < len(stream) or len(window):
        take = min(lookahead - len(window), len(stream) - pos)
        window = np.concatenate((window, stream[pos : pos + take]))
        pos += take
        last = pos == len(stream)
        shares, window = _pack(window, sizes, bins, budget, last, repeats)
        for share in shares:
            packed.extend(share)
            lengths.append(len(share))
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=starts[1:])
    return np.frombuffer(packed, dtype=np.int64 if wide else np.int32), starts


def _pack(window: np.ndarray, sizes: np.ndarray, bins: int, budget: int, last: bool,
          repeats: bool = False) -> tuple[list[list[int]], np.ndarray]:
    """One step's shares from ``window`` (its oldest structure first, then largest first to
    the least-loaded share it fits); ``last``: the stream is done, deal out the whole window
    if it fits in one step's total. Returns the shares and what stays in the window.

    The least-loaded share (ties to the lowest) is the top of a heap of ``(load, share)``;
    the structures too large for its room are passed over in one ``searchsorted`` on the
    sizes (largest first), so the Python steps are the structures placed, not the window."""
    head = int(window[0])
    n_w = sizes[window].astype(np.int64)
    cap = max(budget, int(n_w.max()))
    w1, n1 = window[1:], n_w[1:]
    by_size = np.lexsort((w1, -n1))  # largest first, ties by index
    rest, rest_n = w1[by_size], n1[by_size]
    if last and int(n_w.sum()) <= bins * cap:
        # the end of the epoch: everything left, as evenly as it goes (no share's room
        # is ever short of the whole window)
        cap = int(n_w.sum())
    shares: list[list[int]] = [[head]] + [[] for _ in range(bins - 1)]
    heap = [(int(n_w[0]), 0)] + [(0, b) for b in range(1, bins)]
    heapq.heapify(heap)
    placed: list[int] = []
    ids, ns, neg = rest.tolist(), rest_n.tolist(), -rest_n
    j = 0
    while j < len(ns):
        load, k = heap[0]
        if ns[j] > cap - load:  # the least-loaded share's room: skip what is larger
            j = max(j, int(np.searchsorted(neg, load - cap, side="left")))
            if j == len(ns):
                break
        shares[k].append(ids[j])
        heapq.heapreplace(heap, (load + ns[j], k))
        placed.append(j)
        j += 1
    taken = np.zeros(len(rest), dtype=bool)
    taken[placed] = True
    if repeats:  # what stays, in stream order: every copy of a structure passed over
        return [sorted(s) for s in shares], w1[np.isin(w1, rest[~taken])]
    return [sorted(s) for s in shares], w1[np.sort(by_size[~taken])]


def imbalance(steps: Sequence[Sequence[Sequence[int]]], n_atoms: np.ndarray) -> np.ndarray:
    """``[n_steps]`` max over shares / mean over shares of the atoms of each step."""
    sizes = np.asarray(n_atoms, dtype=np.int64)
    loads = np.asarray([[int(sizes[list(s)].sum()) if len(s) else 0 for s in step]
                        for step in steps], dtype=np.float64)
    return loads.max(1) / loads.mean(1)


def greedy_steps(batches: Sequence[Sequence[int]], n_atoms: np.ndarray,
                 bins: int) -> list[list[list[int]]]:
    """The shares today's sharding gives each of ``bins`` ranks of ``batches``
    (:func:`~xnn.data.datasets.shard_batch`), as :func:`imbalance` takes them."""
    from xnn.data.datasets import shard_batch

    return [[shard_batch(b, n_atoms, r, bins) for r in range(bins)] for b in batches]
