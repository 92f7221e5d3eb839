"""Row arithmetic of concatenated per-atom arrays (HDF5, prepared shards, batches)."""

from __future__ import annotations

import numpy as np


def row_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rows ``starts[k] : starts[k] + counts[k]`` of every ``k``, one after the other
    (int64; the gather of a batch's atoms from concatenated per-atom arrays)."""
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]) if len(ends)
                                                                   else 0)


__all__ = ["row_ranges"]
