"""The first pass over a lazy source, spread over worker processes.

The pass reads every structure once (:meth:`~xnn.data.sources.frames.AtomsSource.
count_range`: its label counts and atomic numbers, refusing a broken structure) in
contiguous ranges of structures, each range an item of a
:class:`torch.utils.data.DataLoader` without automatic batching; the ranges come back in
order, so the counts are those of one pass in this process and a refusal is the first in
file order, with the same message.
"""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
from torch.utils.data import DataLoader, Dataset

from xnn.errors import DataFileError, InputError

#: structures per range of a worker (fewer where that leaves a worker without work)
RANGE = 2048
#: below this many structures the pass runs in this process (starting workers costs more)
MIN_PARALLEL = 512

#: a range's result: ``([k, 3] label counts, atomic numbers found, refusal or None)``
Counted = tuple[np.ndarray, np.ndarray, Exception | None]


def default_workers() -> int:
    """Processes of a first pass when none are given: the machine's CPUs shared by the
    ranks on it (``LOCAL_WORLD_SIZE``, set by torchrun; one where it is not set)."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, (os.cpu_count() or 1) // ranks)


class _Ranges(Dataset):
    """``ranges[k] -> count_range(bounds[k], bounds[k + 1])`` of a source."""

    def __init__(self, source, bounds: np.ndarray):
        self.source = source
        self.bounds = bounds

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, k: int) -> Counted:
        return counted(self.source, int(self.bounds[k]), int(self.bounds[k + 1]))


def counted(source, lo: int, hi: int) -> Counted:
    """``source.count_range(lo, hi)`` with a refusal returned, not raised."""
    try:
        return (*source.count_range(lo, hi), None)
    except (DataFileError, InputError) as e:
        return np.zeros((0, 3), np.int32), np.zeros(0, np.int64), e


def _identity(item: Counted) -> Counted:
    return item


def _results(source, n: int, workers: int):
    """The ranges' results in order (in this process or through ``workers`` workers)."""
    if workers <= 1 or n < MIN_PARALLEL:
        yield counted(source, 0, n)
        return
    size = max(1, min(RANGE, -(-n // (4 * workers))))
    bounds = np.append(np.arange(0, n, size), n)
    methods = multiprocessing.get_all_start_methods()
    loader = DataLoader(_Ranges(source, bounds), batch_size=None, collate_fn=_identity,
                        num_workers=min(workers, len(bounds) - 1),
                        multiprocessing_context=multiprocessing.get_context(
                            "fork" if "fork" in methods else None))
    yield from loader


def first_pass(source, workers: int | None = None) -> tuple[np.ndarray, list[int]]:
    """``([len, 3] int32 label counts, sorted species)`` of every structure of ``source``.

    Args:
        source: an :class:`~xnn.data.sources.frames.AtomsSource`.
        workers: processes reading ranges of structures (``None``: :func:`default_workers`;
            0 or 1: this process).
    Raises:
        DataFileError, InputError: the first broken structure in file order (as a pass in
            this process raises it).
    """
    n = len(source)
    workers = default_workers() if workers is None else int(workers)
    parts, found = [np.zeros((0, 3), np.int32)], set()
    for counts, numbers, refused in _results(source, n, workers):
        if refused is not None:
            raise refused
        parts.append(counts)
        found |= set(numbers.tolist())
    return np.concatenate(parts), sorted(found)
