"""The vectorised batch plan gives the very batches of the per-structure loops it replaced.

The references below are the loops of ``make_batches``/``atom_chunks`` and of the balanced
packer as they were before vectorisation (a run resumes into the same batches): the fast
plan must equal them exactly on mixed-size streams (8 to 500 atoms, log-uniform), with
oversize structures, repeated draws, ``groups`` and every block boundary.
"""

from __future__ import annotations

import numpy as np
import pytest

from xnn.data import datasets
from xnn.data.datasets import atom_chunks, chunk_starts, make_batches, shard_batch, shard_batches
from xnn.errors import InputError
from xnn.training.balance import balanced_batches


def _ref_chunks(indices, n_atoms, max_atoms):
    batches, current, count = [], [], 0
    for i in indices:
        if current and count + int(n_atoms[i]) > max_atoms:
            batches.append(current)
            current, count = [], 0
        current.append(i)
        count += int(n_atoms[i])
    if current:
        batches.append(current)
    return batches


def _ref_pack(window, sizes, bins, budget, last):
    head = window[0]
    cap = max(budget, int(sizes[window].max()))
    rest = sorted(window[1:], key=lambda i: (-int(sizes[i]), i))
    if last and int(sizes[window].sum()) <= bins * cap:
        cap = None
    shares = [[head]] + [[] for _ in range(bins - 1)]
    load = [int(sizes[head])] + [0] * (bins - 1)
    left = []
    for i in rest:
        n = int(sizes[i])
        k = min(range(bins), key=lambda b: (load[b], b))
        if cap is not None and load[k] + n > cap:
            left.append(i)
            continue
        shares[k].append(i)
        load[k] += n
    kept = set(left)
    return [sorted(s) for s in shares], [i for i in window[1:] if i in kept]


def _ref_balanced(n_atoms, order, bins, budget, lookahead):
    sizes = np.asarray(n_atoms, dtype=np.int64)
    stream = [int(i) for i in order]
    window, steps, pos = [], [], 0
    while pos < len(stream) or window:
        take = min(lookahead - len(window), len(stream) - pos)
        window += stream[pos : pos + take]
        pos += take
        shares, window = _ref_pack(window, sizes, bins, budget, pos == len(stream))
        steps.append(shares)
    return steps


def _sizes(n, seed=0, hi=500):
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(8), np.log(hi), n)).astype(np.int32)


@pytest.mark.parametrize("max_atoms", [1, 7, 300, 1000, 5000, 10**9])
def test_atom_chunks_equal_the_loop(max_atoms):
    n_atoms = _sizes(3000, seed=max_atoms % 97)
    order = np.random.default_rng(1).permutation(len(n_atoms))
    fast = atom_chunks(order, n_atoms, max_atoms)
    assert fast == _ref_chunks(order.tolist(), n_atoms, max_atoms)
    assert all(type(i) is int for i in fast[0])
    # a concatenation of chunks cuts into the same chunks (how a dd group finds its share)
    assert atom_chunks(sum(fast[3:6], []), n_atoms, max_atoms) == fast[3:6]


def test_chunk_starts_across_blocks(monkeypatch):
    """Chunks that straddle the blocks of the vectorised search come out as in one block."""
    n_atoms = _sizes(5000, seed=3)
    ref = _ref_chunks(list(range(5000)), n_atoms, 2000)
    for block in (1, 5, 64, 333):
        monkeypatch.setattr(datasets, "CHUNK_BLOCK", block)
        assert atom_chunks(range(5000), n_atoms, 2000) == ref
    assert chunk_starts(np.zeros(0, np.int32), 10).tolist() == [0]
    assert atom_chunks([], n_atoms, 10) == []


@pytest.mark.parametrize("groups", [None, 1, 2, 3, 8])
def test_make_batches_equal_the_loop(groups):
    n_atoms = _sizes(2000, seed=5, hi=400)
    for epoch in (0, 3):
        order = np.random.default_rng([11, epoch]).permutation(len(n_atoms)).tolist()
        chunks = _ref_chunks(order, n_atoms, 450)
        ref = chunks if groups is None else [sum(chunks[k : k + groups], [])
                                             for k in range(0, len(chunks), groups)]
        got = make_batches(n_atoms, max_atoms=450, shuffle=True, seed=11, epoch=epoch,
                           groups=groups)
        assert got == ref


def test_make_batches_refuses_the_lowest_oversize_structure():
    n_atoms = np.array([5, 50, 5, 60, 5])
    with pytest.raises(InputError, match="structure 1 has 50 atoms.*2 such"):
        make_batches(n_atoms, max_atoms=40, shuffle=True, seed=2, groups=2)


@pytest.mark.parametrize("bins,budget,lookahead", [(1, 400, 16), (2, 300, None), (4, 200, 7),
                                                   (8, 600, None), (3, 50, 40)])
def test_balanced_batches_equal_the_loop(bins, budget, lookahead):
    n_atoms = _sizes(1500, seed=bins)
    rng = np.random.default_rng(bins)
    la = 64 * bins if lookahead is None else lookahead
    order = rng.permutation(len(n_atoms))
    fast = balanced_batches(n_atoms, order, bins, budget, lookahead)
    assert fast == _ref_balanced(n_atoms, order, bins, budget, la)
    assert sorted(sum(sum(fast, []), [])) == list(range(len(n_atoms)))
    # draws by weight repeat structures (samples_per_epoch): the same packs as before too
    drawn = rng.integers(0, len(n_atoms), 1200)
    assert balanced_batches(n_atoms, drawn, bins, budget, lookahead) == _ref_balanced(
        n_atoms, drawn, bins, budget, la)


@pytest.mark.parametrize("world,block", [(1, None), (2, None), (3, 500), (8, 1), (64, None)])
def test_shard_batches_equal_shard_batch(world, block, monkeypatch):
    if block:  # batches dealt a block of structures at a time
        monkeypatch.setattr(datasets, "CHUNK_BLOCK", block)
    n_atoms = _sizes(3000, seed=world)
    rng = np.random.default_rng(world)
    batches = make_batches(n_atoms, max_atoms=2000 * min(world, 8), shuffle=True, seed=4)
    batches += [[], [7], rng.integers(0, 3000, 40).tolist()]  # empty, single, repeats
    for rank in sorted({0, world // 2, world - 1}):
        assert shard_batches(batches, n_atoms, rank, world) == [
            shard_batch(b, n_atoms, rank, world) for b in batches]
    per_rank = [shard_batches(batches, n_atoms, r, world) for r in range(world)]
    union = [sorted(sum((shares[j] for shares in per_rank), [])) for j in range(len(batches))]
    assert union == [sorted(b) for b in batches]


# ------------------------------------------------------------------ the epoch planner
def _ref_shard(batch, n_atoms, rank, world):
    """The greedy share by atoms as ``shard_batch`` dealt it (largest first, to the least
    loaded rank, ties to the lowest)."""
    load, mine = [0] * world, []
    for i in sorted(batch, key=lambda i: (-int(n_atoms[i]), i)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += int(n_atoms[i])
        if r == rank:
            mine.append(i)
    return sorted(mine)


def _ref_plan(s, n_atoms, weights, rank, world, groups, epoch):
    """``(global batches, this rank's shares)`` of an epoch as the planner made them with
    Python lists before it kept compact arrays (permutation or draws, batches cut in
    order, shares greedy, by group chunk or balanced)."""
    n = len(n_atoms)
    if s.samples_per_epoch is not None:
        rng = np.random.default_rng([s.seed % 2**63, epoch])
        order = rng.choice(n, size=s.samples_per_epoch, replace=True,
                           p=weights / weights.sum()).tolist()
    elif s.shuffle:
        order = np.random.default_rng([s.seed, epoch]).permutation(n).tolist()
    else:
        order = list(range(n))
    if s.balance_bins:
        budget = s.max_atoms_per_batch // s.balance_bins
        packs = _ref_balanced(n_atoms, order, s.balance_bins, budget,
                              s.balance_lookahead or 64 * s.balance_bins)
        batches = [sum(p, []) for p in packs]
        return batches, batches if world == 1 else [p[rank] for p in packs]
    if s.batch_size is not None:
        batches = [order[i:i + s.batch_size] for i in range(0, n, s.batch_size)]
    else:
        chunks = _ref_chunks(order, n_atoms, s.max_atoms_per_batch)
        batches = chunks if groups is None else [sum(chunks[k:k + groups], [])
                                                 for k in range(0, len(chunks), groups)]
    if world == 1:
        return batches, batches
    if groups is not None and s.max_atoms_per_batch is not None:
        cut = [_ref_chunks(b, n_atoms, s.max_atoms_per_batch) for b in batches]
        return batches, [c[rank] if rank < len(c) else [] for c in cut]
    return batches, [_ref_shard(b, n_atoms, rank, world) for b in batches]


class _Weighted:
    """Structures of given sizes and dataset weights (what the planner reads of a
    training set: ``n_atoms``, and each structure's ``weight`` when drawn by weight)."""

    def __init__(self, n_atoms, weights):
        self.n_atoms, self.weights = n_atoms, weights

    def __len__(self):
        return len(self.n_atoms)

    def __getitem__(self, i):
        import torch

        from xnn.data import keys as K

        return {K.WEIGHT: torch.tensor([float(self.weights[i])])}


PLANS = {  # LoopSettings of each way of planning
    "batch_size": dict(batch_size=37, max_atoms_per_batch=None),
    "atoms": dict(batch_size=None, max_atoms_per_batch=2000),
    "in_order": dict(batch_size=None, max_atoms_per_batch=900, shuffle=False),
    "draws": dict(batch_size=None, max_atoms_per_batch=1500, samples_per_epoch=2500),
    "balanced": dict(batch_size=None, max_atoms_per_batch=3000, balance_bins=3),
    "balanced_draws": dict(batch_size=None, max_atoms_per_batch=2400, balance_bins=3,
                           samples_per_epoch=1900, balance_lookahead=50),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_the_epoch_planner_gives_the_batches_of_the_list_planner(plan, monkeypatch):
    """The compact, lazily shared plan equals the list planner's batches and shares on
    mixed sizes (8-500 atoms) for several seeds, epochs and rank counts, with blocks of a
    few hundred structures (the lazy shares cross block boundaries)."""
    from xnn.training.loop import LoopSettings
    from xnn.training.plan import BatchPlan
    from xnn.training.sharding import BatchSharding

    monkeypatch.setattr(datasets, "CHUNK_BLOCK", 300)
    n_atoms = _sizes(3000, seed=3)
    weights = np.where(np.arange(3000) % 3 == 0, 2.0, 0.5)
    data = _Weighted(n_atoms, weights)
    balanced = "balance_bins" in PLANS[plan]
    for seed in (0, 7):
        settings = LoopSettings(seed=seed, **PLANS[plan])
        for world in ((1, 3) if balanced else (1, 3, 8)):
            for rank in sorted({0, world - 1}):
                planner = BatchPlan(settings, data, BatchSharding(rank, world))
                for epoch in (0, 2):
                    batches, shares = planner.shares(epoch)
                    ref_b, ref_s = _ref_plan(settings, n_atoms, weights, rank, world, None,
                                             epoch)
                    assert list(batches) == ref_b and list(shares) == ref_s
                    assert planner.global_batches(epoch) == ref_b
                    k = len(ref_b) // 2  # a resume mid-epoch: the shares from batch k on
                    assert list(shares[k:]) == ref_s[k:] and shares[k] == ref_s[k]
                    assert batches[k:k + 2] == ref_b[k:k + 2]


def test_group_chunks_of_the_epoch_planner(monkeypatch):
    """Context-parallel training (dd groups): a group's share is its chunk of the batch."""
    from xnn.training.loop import LoopSettings
    from xnn.training.plan import BatchPlan
    from xnn.training.sharding import BatchSharding

    monkeypatch.setattr(datasets, "CHUNK_BLOCK", 500)
    n_atoms = _sizes(2000, seed=9)
    data = _Weighted(n_atoms, np.ones(2000))
    for seed, groups in ((1, 2), (4, 3)):
        settings = LoopSettings(seed=seed, batch_size=None, max_atoms_per_batch=700)
        for rank in range(groups):
            planner = BatchPlan(settings, data, BatchSharding(rank, groups, groups=groups))
            for epoch in (0, 1):
                batches, shares = planner.shares(epoch)
                ref_b, ref_s = _ref_plan(settings, n_atoms, None, rank, groups, groups, epoch)
                assert list(batches) == ref_b and list(shares) == ref_s
