"""Load-balanced boxes (``parallel.balance``): per-axis cut planes at atom-count quantiles.

With ``shift`` (LAMMPS ``balance ... shift xyz``) the cut planes of each axis of a
:class:`~.partition.Partition` sit at quantiles of the atom count along it, so the grid stays
a tensor product of per-axis cuts. The cuts come from per-axis histograms
(:func:`histogram`, :data:`BINS_PER_BOX` bins per box) that a decomposition all-reduces, so
that every rank derives bitwise the same cuts (:func:`axis_cuts`; the partition's own
``axis_histograms`` and ``balanced`` apply them to its axes); no box is
made thinner than a minimum width (the halo width, or the equal width where that is
thinner), so that balancing never puts a box's ghost shell beyond its face neighbours where
equal widths did not; an axis keeps equal widths unless the fullest box gains at least
:data:`BALANCE_GAIN`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.errors import InputError

#: the words of ``parallel.balance`` / ``--balance``: how a spatial layout places its cuts
BALANCE = {
    "none": "boxes of equal width along each axis",
    "shift": "cut planes of each axis at atom-count quantiles (LAMMPS balance shift xyz), "
             "recomputed at the start and at every rebuild of the ghost plan",
}
BINS_PER_BOX = 64  #: histogram bins per box along an axis (the cuts' resolution)
#: an axis keeps equal widths unless its balanced cuts hold at least this fraction fewer
#: atoms in the fullest box (by the histogram; as LAMMPS's ``balance thresh``, no change
#: where the gain is small: in a crystal whose imbalance is that of its lattice planes,
#: moving cuts by less than a plane spacing evens nothing and changes the ghost shells)
BALANCE_GAIN = 0.02


def check_balance(balance: str) -> str:
    """``balance`` if it is a word of :data:`BALANCE`, else ``InputError``."""
    if balance not in BALANCE:
        raise InputError(f"balance must be one of {list(BALANCE)}, got {balance!r}")
    return balance




def histogram(values: Tensor, lo: float, span: float, g: int,
              weights: Tensor | None = None) -> Tensor:
    """``[BINS_PER_BOX * g]`` float64 counts of fractional coordinates ``values [n]`` in bins
    of equal width over ``[lo, lo + span]`` (values outside count in the end bins), each
    weighted by ``weights [n]`` (e.g. the atoms a crystal's factor stands for).

    Counts are integers, so a SUM all-reduce of every rank's histograms is exact and the
    same on every rank, whatever the order of the summation.
    """
    bins = BINS_PER_BOX * g
    idx = torch.floor((values.double() - lo) / span * bins)
    idx = idx.to(torch.long).clamp(0, bins - 1).cpu()
    w = None if weights is None else weights.to(torch.float64).cpu()
    return torch.bincount(idx, w, minlength=bins).to(torch.float64)


def _apart(cuts: list[float], width: float, backward_first: bool) -> list[float]:
    """``cuts`` (ends fixed) moved apart to gaps of at least ``width``: a forward and a
    backward pass, in either order (feasible when ``(len - 1) * width <= span``)."""
    c, g = list(cuts), len(cuts) - 1
    passes = ("backward", "forward") if backward_first else ("forward", "backward")
    for way in passes:
        if way == "forward":  # at least width above the previous cut
            for k in range(1, g):
                c[k] = max(c[k], c[k - 1] + width)
        else:  # and below the next (the last cut stays at the end)
            for k in range(g - 1, 0, -1):
                c[k] = min(c[k], c[k + 1] - width)
    return c


def _box_counts(hist: Tensor, lo: float, span: float, cuts: Tensor) -> Tensor:
    """``[g]`` atoms between consecutive ``cuts`` by the histogram (linear within a bin)."""
    bins = hist.shape[0]
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(hist, 0)])
    t = ((cuts - lo) / span * bins).clamp(0, bins)
    j = torch.floor(t).to(torch.long).clamp(0, bins - 1)
    at = cum[j] + (t - j) * hist[j]
    return at[1:] - at[:-1]


def _quantile_cuts(hist: Tensor, lo: float, span: float, g: int, min_width: float) -> Tensor:
    """``[g + 1]`` cuts of ``[lo, lo + span]`` at the ``k / g`` quantiles of a histogram
    (linear within a bin), moved apart to at least ``min_width`` (the mean of the
    forward-backward and backward-forward projections: symmetric, and still feasible since
    gaps are linear in the cuts); equal widths instead unless the fullest box holds at
    least :data:`BALANCE_GAIN` fewer atoms (by the histogram), so that balancing never
    makes an axis worse."""
    bins = hist.shape[0]
    total = float(hist.sum())
    edges = lo + span * torch.arange(bins + 1, dtype=torch.float64) / bins
    equal = lo + span * torch.arange(g + 1, dtype=torch.float64) / g
    if total <= 0 or g == 1:
        return equal
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(hist, 0)])
    target = total * torch.arange(1, g, dtype=torch.float64) / g
    j = (torch.searchsorted(cum, target, right=False) - 1).clamp(0, bins - 1)
    inside = (target - cum[j]) / hist[j].clamp_min(1e-300)
    cuts = [lo] + (edges[j] + inside.clamp(0, 1) * (span / bins)).tolist() + [lo + span]
    a, b = _apart(cuts, min_width, False), _apart(cuts, min_width, True)
    shift = torch.tensor([0.5 * (x + y) for x, y in zip(a, b)], dtype=torch.float64)
    shift[0], shift[-1] = lo, lo + span
    worst = float(_box_counts(hist, lo, span, shift).max())
    gain = 1 - worst / float(_box_counts(hist, lo, span, equal).max())
    return shift if gain >= BALANCE_GAIN else equal


def axis_cuts(hist: Tensor, lo: float, span: float, g: int, min_width: float) -> Tensor:
    """``[g + 1]`` float64 cut planes of ``[lo, lo + span]`` for balance ``shift``.

    Args:
        hist: ``[BINS_PER_BOX * g]`` counts of all atoms (:func:`histogram`, summed).
        lo, span: the axis's partitioned span (fractional).
        g: boxes along the axis.
        min_width: the thinnest box (fractional); where equal widths are thinner the axis
            keeps them.
    Returns:
        the cuts; every rank given the same ``hist`` gets bitwise the same cuts (float64
        arithmetic on the same numbers in the same order).
    """
    if min_width * g >= span:  # equal widths are already thinner than the minimum
        return lo + span * torch.arange(g + 1, dtype=torch.float64) / g
    return _quantile_cuts(hist.double().cpu(), lo, span, g, min_width)
