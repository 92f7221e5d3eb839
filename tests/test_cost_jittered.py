"""The liquid's spatial ghost plans by bands (:mod:`xnn.distributed.cost.jittered`: crystal
sites summed factor by factor, only the atoms within the jitter of a box or region face
streamed) equal the plans that stream every atom (:func:`plan_counts` with ``stream=True``),
which ``tests/test_cost_plan.py`` checks against real decomposed runs."""

from __future__ import annotations

import numpy as np
import pytest

from xnn.distributed.cost.jittered import band_ids, check_banded
from xnn.distributed.cost.plan import plan_counts
from xnn.distributed.cost.separable import NotSeparable
from xnn.distributed.cost.systems import make_system
from xnn.distributed.domain.partition import partition_from_bounds

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = ("owned", "ghost", "send_rows", "recv_rows", "peers")
WIDTH = {"halo": 11.0, "sync": 6.0}


def _pair(n_atoms, n_ranks, mode, seed, **kw):
    args = dict(mode=mode, cutoff=5.0, halo_width=WIDTH[mode], seed=seed, **kw)
    return (plan_counts("liquid", n_atoms, n_ranks, **args),
            plan_counts("liquid", n_atoms, n_ranks, stream=True, **args))


@pytest.mark.parametrize("mode", ["halo", "sync"])
def test_banded_liquid_equals_the_streamed_plan_edges_included(mode):
    """Small liquids, exact edges: every count of every rank, boxes thicker and thinner than
    the halo (2 to 512 ranks: ghost shells wider than a box, several images), two seeds."""
    for seed in (0, 7):
        for p in (2, 3, 8, 27, 64, 512):
            band, streamed = _pair(3000, p, mode, seed)
            assert "within the jitter" in band.method and "streamed)" in streamed.method
            assert band.grid == streamed.grid
            for name in ROWS + ("edges",):
                assert (getattr(band, name) == getattr(streamed, name)).all(), (seed, p, name)


@pytest.mark.parametrize("mode", ["halo", "sync"])
def test_banded_liquid_equals_the_streamed_plan_at_1e5_atoms(mode):
    """97,556 atoms on 8, 64 and 1,024 ranks: owned, ghost, sent and received rows and
    peers of every rank equal (edges sampled: not compared here)."""
    for seed, p in ((1, 8), (2, 64), (3, 1024)):
        band, streamed = _pair(100_000, p, mode, seed, exact_edges=1000, sample=0.001)
        assert band.n_atoms == 97_556
        for name in ROWS:
            assert (getattr(band, name) == getattr(streamed, name)).all(), (seed, p, name)
        assert band.ghost.sum() > 0 and band.send_rows.sum() == band.recv_rows.sum()


def test_banded_sampled_edges_are_close_to_the_exact_ones_and_say_so():
    """The difference estimator of the edges: within 4 stated standard errors of the exact
    counts, and far tighter than the plain scaled sample of the same atoms."""
    for mode in ("halo", "sync"):
        exact = plan_counts("liquid", 20000, 8, mode=mode, cutoff=5.0, halo_width=WIDTH[mode])
        est = plan_counts("liquid", 20000, 8, mode=mode, cutoff=5.0, halo_width=WIDTH[mode],
                          exact_edges=1000, sample=0.05)
        plain = plan_counts("liquid", 20000, 8, mode=mode, cutoff=5.0,
                            halo_width=WIDTH[mode], exact_edges=1000, sample=0.05,
                            stream=True)
        assert "difference estimator" in est.method and "sampled: edges" in est.method
        rel = float(est.method.split("standard error of a rank's edges ")[1].split(";")[0])
        err = np.abs(est.edges / exact.edges - 1).max()
        assert 0 < rel < 0.01 and err < 4 * rel, (mode, rel, err)
        assert err < 0.5 * np.abs(plain.edges / exact.edges - 1).max(), mode
        assert (est.ghost == exact.ghost).all() and (est.owned == exact.owned).all()


def test_band_holds_every_atom_near_a_face_once():
    """The band's atoms are distinct, and they are exactly the atoms whose site lies within
    the jitter of a face along some axis (brute force over all sites)."""
    sys = make_system("liquid", 4000, seed=3)
    x = np.arange(2 * sys.cells[0])
    near = (x % 5 == 0)  # any marked set of planes along each axis
    ids = np.concatenate(list(band_ids(sys, [near, ~near, near], 500)))
    assert len(np.unique(ids)) == len(ids)
    sites = sys.sites(np.arange(sys.n_atoms))
    want = np.flatnonzero(near[sites[:, 0]] | ~near[sites[:, 1]] | near[sites[:, 2]])
    assert np.array_equal(np.sort(ids), want)


def test_the_band_method_refuses_what_it_cannot_count():
    """Crystals (no jitter), open boundaries and cut (balanced) boxes go to the other paths."""
    import torch

    fcc = make_system("fcc", 2000)
    part = partition_from_bounds(torch.zeros(3), torch.zeros(3), fcc.cell, fcc.pbc, 8, 6.0)
    with pytest.raises(NotSeparable):
        check_banded(fcc, part)
    liquid = make_system("liquid", 2000)
    check_banded(liquid, part)
    shifted = plan_counts("liquid", 3000, 8, mode="sync", cutoff=5.0, halo_width=6.0,
                          balance="shift")
    assert "every atom streamed" in shifted.method
