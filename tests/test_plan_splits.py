"""Compact splits and epoch draws select the very structures of the int64 code they replaced.

The references are the expressions the code used before (``permutation(n)`` carved and
sorted; ``rng.choice(n, size, p=w / w.sum())``): same seed, same split and same draws, bit for
bit, now held as int32 in about a quarter of the memory (measured with ``tracemalloc``, which
numpy reports its arrays to).
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from xnn.data.datasets import (
    InMemoryDataset,
    Subset,
    compact_indices,
    normalize_labels,
    split_indices,
)
from xnn.errors import InputError
from xnn.training.sampling import sample_epoch


def _ref_split(n, val_fraction, test_fraction, seed):
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test = int(round(n * val_fraction)), int(round(n * test_fraction))
    val, test, train = perm[:n_val], perm[n_val:n_val + n_test], perm[n_val + n_test:]
    return np.sort(train), np.sort(val), np.sort(test)


@pytest.mark.parametrize("n", [1, 2, 9, 1000, 123_457])
@pytest.mark.parametrize("fractions", [(0.1, 0.0), (0.2, 0.1), (0.0, 0.0), (0.05, 0.3)])
def test_split_is_the_int64_split(n, fractions):
    if int(round(n * fractions[0])) + int(round(n * fractions[1])) >= n:
        pytest.skip("no training structure left")
    for seed in (0, 7, 7919 * 3 + 5):
        got = split_indices(n, *fractions, seed=seed)
        for new, ref in zip(got, _ref_split(n, *fractions, seed)):
            assert new.dtype == np.int32
            assert np.array_equal(new, ref)
        assert sum(map(len, got)) == n
        assert len(np.unique(np.concatenate(got))) == n


def test_split_peak_memory_is_about_four_bytes_a_structure():
    n = 1_000_000
    tracemalloc.start()
    try:
        train, val, test = split_indices(n, 0.05, 0.05, seed=1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5.0 * n  # the int64 permutation and its sorted copy: 16 bytes a structure
    assert train.nbytes + val.nbytes + test.nbytes == 4 * n


def test_subset_holds_int32_and_reads_the_same_structures():
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from xnn.data.ase_io import from_ase

    graphs = []
    for k in range(6):
        atoms = bulk("Cu", "fcc", a=3.6) * (1, 1, k + 1)
        atoms.calc = EMT()
        atoms.get_potential_energy()
        graphs.append(normalize_labels(from_ase([atoms]), 1.0))
    ds = InMemoryDataset(graphs)
    picks = [5, 0, 3, -1]
    for given in (picks, np.asarray(picks, np.int64), np.asarray(picks, np.int32)):
        sub = Subset(ds, given)
        assert sub.indices.dtype == np.int32 and sub.n_atoms.dtype == np.int32
        assert sub.n_atoms.tolist() == [6, 1, 4, 6]
        assert [sub[i].n_atoms for i in range(len(sub))] == [6, 1, 4, 6]
        assert np.array_equal(sub.label_counts(), ds.label_counts()[[5, 0, 3, 5]])
    held = np.asarray([1, 2], np.int32)
    assert Subset(ds, held).indices is held  # kept, not copied
    assert len(Subset(ds, [])) == 0
    with pytest.raises(IndexError):
        Subset(ds, [2**31 + 2])  # narrowing must not wrap it into range
    with pytest.raises(IndexError):
        compact_indices([-7], 6)


@pytest.mark.parametrize("n,draws", [(1, 3), (7, 100), (1000, 5000), (20_011, 70_000)])
def test_epoch_draws_are_those_of_choice(n, draws):
    w = np.random.default_rng(n).random(n) * 3
    if n > 3:
        w[::3] = 0.0
    ref = np.random.default_rng([5, 2]).choice(n, size=draws, replace=True, p=w / w.sum())
    for block in (7, 4096, 1 << 20):
        got = sample_epoch(w, draws, seed=5, epoch=2, block=block)
        assert got.dtype == np.int32
        assert np.array_equal(got, ref)


def test_epoch_draws_refuse_bad_weights():
    for w in (np.zeros(3), np.asarray([1.0, -1.0, 2.0]), np.asarray([1.0, np.inf])):
        with pytest.raises(InputError):
            sample_epoch(w, 5, 0, 0)


def test_float32_weights_draw_what_float64_drew_and_keep_the_distribution():
    """structure_weights are float32 (4 bytes a structure): dataset weights exact in float32
    draw bit for bit what their float64 array drew; others (0.1, 0.3) are rounded to float32
    first, and the draws keep each dataset's share ``n_d w_d / Σ n w`` (binomial, 5 sigma)."""
    from ase.build import bulk

    from xnn.data.ase_io import from_ase
    from xnn.data.datasets import ConcatDataset
    from xnn.training.sampling import structure_weights

    sizes = (3000, 1000, 2000)
    one = from_ase([bulk("Cu", "fcc", a=3.6)])

    def weighted(ws):
        parts = [InMemoryDataset([normalize_labels(one, w)] * n) for n, w in zip(sizes, ws)]
        return ConcatDataset(parts)

    exact = weighted((1.0, 2.0, 0.5))
    w32 = structure_weights(exact)
    assert w32.dtype == np.float32 and w32.nbytes == 4 * sum(sizes)
    w64 = np.repeat(np.asarray([1.0, 2.0, 0.5]), sizes)
    for epoch in range(3):
        assert np.array_equal(sample_epoch(w32, 10_000, 7, epoch),
                              sample_epoch(w64, 10_000, 7, epoch))
    inexact = (0.1, 0.3, 0.7)
    w32 = structure_weights(weighted(inexact))
    assert w32.dtype == np.float32 and w32[0] == np.float32(0.1)
    draws = 200_000
    got = sample_epoch(w32, draws, 3, 0)
    bounds = np.cumsum([0, *sizes])
    share = np.asarray(sizes) * np.asarray(inexact)
    share /= share.sum()
    for d in range(3):
        n_d = int(((got >= bounds[d]) & (got < bounds[d + 1])).sum())
        sigma = np.sqrt(draws * share[d] * (1 - share[d]))
        assert abs(n_d - draws * share[d]) < 5 * sigma
    # the float64 weights draw structures that differ from these in at most a few places
    same = sample_epoch(np.repeat(np.asarray(inexact), sizes), draws, 3, 0)
    assert (same != got).mean() < 1e-3


def test_structure_weights_of_a_lazy_source_read_no_structure(tmp_path, monkeypatch):
    """A lazy file's weights come from its dataset weight (was: every structure read, at
    10^8 structures a pass over the whole set before the first weighted epoch)."""
    from xnn.data.emt import write_emt
    from xnn.data.sources import read_structures
    from xnn.training.sampling import structure_weights

    write_emt(tmp_path / "a.xyz", 7, ["Cu"], seed=0)
    ds = read_structures(tmp_path / "a.xyz", 2.5, workers=0)
    expected = [float(ds[i].weight[0]) for i in range(len(ds))]
    monkeypatch.setattr(type(ds), "_atoms", lambda self, i: pytest.fail("a structure was read"))
    w = structure_weights(Subset(ds, [6, 0, 3]))
    assert w.dtype == np.float32 and w.tolist() == [2.5] * 3
    assert structure_weights(ds).tolist() == expected


def test_head_and_bootstrap_views_of_a_lazy_source_read_no_structure(tmp_path, monkeypatch):
    """``WithHead`` (multi-head) and ``Bootstrapped`` (committee) of a lazy file, through
    subsets and a concatenation, as the training set is made of them: making them and asking
    for their atom counts, label counts, dataset weights and whether they are held in
    memory reads no structure (was: ``structure_weights`` read every structure of a
    ``WithHead``); every value equals that of the same structures held in memory. A
    structure read afterwards carries its head / bootstrap weights."""
    from xnn.data.datasets import ConcatDataset
    from xnn.data.emt import write_emt
    from xnn.data.sources import read_structures
    from xnn.neighbors.datasets import in_memory
    from xnn.training.committee import Bootstrapped, bootstrap_weights
    from xnn.training.finetune import WithHead
    from xnn.training.sampling import structure_weights

    write_emt(tmp_path / "a.xyz", 7, ["Cu"], seed=0)
    ds = read_structures(tmp_path / "a.xyz", 2.5, workers=0)
    ds.label_counts()  # the source's own first pass (kept with its index on disk)
    eager = InMemoryDataset([ds[i] for i in range(len(ds))])
    reads = []
    real = type(ds)._atoms
    monkeypatch.setattr(type(ds), "_atoms", lambda self, i: reads.append(i) or real(self, i))
    boot = bootstrap_weights(3 + 7, 2, seed=4)

    def views(d):
        heads = ConcatDataset([WithHead(Subset(d, [6, 0, 3]), 1), WithHead(d, 0)])
        return [heads, Bootstrapped(heads, boot), Bootstrapped(Subset(d, [5, 2]), boot[:2])]

    lazy = views(ds)
    assert reads == []
    for a, b in zip(lazy, views(eager)):
        assert np.array_equal(a.n_atoms, b.n_atoms) and a.n_atoms.sum() > 0
        assert np.array_equal(a.label_counts(), b.label_counts())
        w = structure_weights(a)
        assert w.dtype == np.float32 and w.tolist() == structure_weights(b).tolist()
        assert w.tolist() == [2.5] * len(a)
        assert not in_memory(a) and in_memory(b)
    assert reads == []
    g = lazy[1][0]  # structure 6 of the file, head 1, the committee's first weights
    assert reads == [6] and int(g.head[0]) == 1 and g.member_weight.tolist() == [boot[0].tolist()]


def test_narrow_keeps_int64_only_where_a_value_needs_it():
    """Per-structure counts and offsets become int32 (4 bytes); the atom offsets of a
    10^8-structure set (past 2^31) stay int64, unchanged in value."""
    from xnn.data.datasets import narrow

    counts = np.full(1000, 50, np.int64)
    small = narrow(counts)
    assert small.dtype == np.int32 and small.nbytes == 4 * 1000
    assert narrow(small) is small
    offsets = narrow(np.concatenate([[0], np.cumsum(np.full(5, 2**30, np.int64))]))
    assert offsets.dtype == np.int64 and int(offsets[-1]) == 5 * 2**30
    assert narrow([]).dtype == np.int32 and narrow([-(2**31) - 1]).dtype == np.int64
