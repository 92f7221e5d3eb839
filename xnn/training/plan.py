"""The batches of a run: the global batches of every epoch and this rank's share of each.

Pure index arithmetic on the structures' atom counts (no structure is read, no collective):
the global batches of an epoch are a function of ``(seed, epoch)`` only, the same on every
rank and after a resume; each rank then takes its share of every global batch. Three ways:

* by default, batches cut in the order of a seeded permutation (or of the epoch's draws by
  dataset weight, ``samples_per_epoch``), ``batch_size`` structures or up to
  ``max_atoms_per_batch`` atoms (:func:`~xnn.data.datasets.make_batches`), and shared by
  the sharding (greedily by atoms, :func:`~xnn.data.datasets.shard_batch`);
* with ``balance_bins``, each global batch packed as that many shares balanced by atoms
  (:mod:`xnn.training.balance`): rank ``dp_rank`` takes share ``dp_rank``, one process their
  union.

An epoch is planned as two arrays (:class:`EpochPlan`: the structures in batch order, int32
below 2**31 structures, and where each batch or piece starts), about 4 bytes a structure;
the global batches and this rank's shares are sequences of index lists made from it on
demand (:class:`Batches`, :class:`Shares`), a block of about
:data:`~xnn.data.datasets.CHUNK_BLOCK` structures at a time as the training loop reads
them. At 10^8 structures a rank's plan takes about 0.5 GiB besides the atom counts, where
the lists of every batch and share took 4-6 GiB; the batches are the same.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from xnn.data import datasets
from xnn.data.datasets import (
    batch_bounds,
    chunk_starts,
    index_dtype,
    make_batches,
    shard_stream,
)
from xnn.errors import InputError


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """The global batches of one epoch as two arrays (about 4 bytes a structure).

    Structures ``stream[starts[k]:starts[k + 1]]`` are piece ``k``; global batch ``b`` is
    pieces ``b * pieces`` to ``(b + 1) * pieces`` (fewer at the end) one after the other. A
    piece is a whole batch (``pieces = 1``), a balanced share (``balance_bins``) or a
    domain-decomposition group's chunk (``groups``).
    """

    stream: np.ndarray
    starts: np.ndarray
    pieces: int = 1

    def __len__(self) -> int:
        return -(-(len(self.starts) - 1) // self.pieces)

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Stream positions of batches ``lo..hi``."""
        last = len(self.starts) - 1
        return int(self.starts[min(lo * self.pieces, last)]), int(
            self.starts[min(hi * self.pieces, last)])

    def batch(self, b: int) -> np.ndarray:
        a, z = self.span(b, b + 1)
        return self.stream[a:z]

    def piece(self, k: int) -> list[int]:
        """Piece ``k`` (empty past the last)."""
        if k >= len(self.starts) - 1:
            return []
        return self.stream[self.starts[k]:self.starts[k + 1]].tolist()

    def blocks(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """Batches ``lo..hi`` cut into runs of about :data:`CHUNK_BLOCK` structures."""
        while lo < hi:
            a = self.span(lo, lo)[0]
            k = int(np.searchsorted(self.starts, a + datasets.CHUNK_BLOCK, side="right")) - 1
            step = max(1, k // self.pieces - lo)
            yield lo, min(hi, lo + step)
            lo += step


@dataclass(frozen=True, eq=False)
class ShareRule:
    """Which part of each global batch this rank takes.

    Attributes:
        kind: ``"all"`` (one replica: the whole batch), ``"piece"`` (piece ``rank`` of the
            batch: a balanced share or a group's chunk) or ``"greedy"``
            (:func:`~xnn.data.datasets.shard_batch` by atoms).
        rank, world: this replica and the number of replicas.
        n_atoms: atoms per structure (``"greedy"``).
    """

    kind: str = "all"
    rank: int = 0
    world: int = 1
    n_atoms: np.ndarray | None = None


class _Lazy(Sequence):
    """A sequence of index lists made on demand from an :class:`EpochPlan` (equal to a
    list of the same lists)."""

    def __init__(self, plan: EpochPlan, lo: int = 0, hi: int | None = None):
        self.plan = plan
        self.lo = lo
        self.hi = len(plan) if hi is None else hi

    def __len__(self) -> int:
        return max(self.hi - self.lo, 0)

    def _block(self, lo: int, hi: int) -> list[list[int]]:
        raise NotImplementedError

    def __getitem__(self, k):
        if isinstance(k, slice):
            start, stop, step = k.indices(len(self))
            if step != 1:
                return list(self)[k]
            return type(self)(*self._args(), self.lo + start, self.lo + max(stop, start))
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} out of range [0, {len(self)})")
        return self._block(self.lo + k, self.lo + k + 1)[0]

    def _args(self) -> tuple:
        return (self.plan,)

    def __iter__(self) -> Iterator[list[int]]:
        for lo, hi in self.plan.blocks(self.lo, self.hi):
            yield from self._block(lo, hi)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(list(a) == list(b) for a, b in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {len(self)} batches>"


class Batches(_Lazy):
    """The global batches of an epoch (``batches[b]``: a list of structure indices)."""

    def _block(self, lo: int, hi: int) -> list[list[int]]:
        return [self.plan.batch(b).tolist() for b in range(lo, hi)]


class Shares(_Lazy):
    """This rank's share of each global batch of an epoch, made a block at a time."""

    def __init__(self, plan: EpochPlan, rule: ShareRule, lo: int = 0, hi: int | None = None):
        super().__init__(plan, lo, hi)
        self.rule = rule

    def _args(self) -> tuple:
        return (self.plan, self.rule)

    def _block(self, lo: int, hi: int) -> list[list[int]]:
        plan, rule = self.plan, self.rule
        if rule.kind == "piece":
            return [plan.piece(b * plan.pieces + rule.rank) for b in range(lo, hi)]
        if rule.kind == "greedy":
            a, z = plan.span(lo, hi)
            bounds = plan.starts[lo:hi + 1] - a
            return [share for block in shard_stream(plan.stream[a:z], bounds, rule.n_atoms,
                                                    rule.rank, rule.world)
                    for share in block]
        return [plan.batch(b).tolist() for b in range(lo, hi)]


class BatchPlan:
    """The batches of a run's training and evaluation sets.

    Args:
        cfg: the loop's :class:`~xnn.training.loop.LoopSettings`.
        train: the training set (its ``n_atoms``; read once for the sampling weights when
            ``samples_per_epoch`` is set, :func:`~xnn.training.sampling.structure_weights`).
        sharding: ``sharding(batch, n_atoms, max_atoms) -> this rank's indices`` with
            ``dp``, ``dp_rank`` and ``groups`` (:class:`~xnn.training.sharding.BatchSharding`).
    """

    def __init__(self, cfg, train, sharding):
        self.cfg = cfg
        self.train = train
        self.sharding = sharding
        self._weights = None  # per-structure sampling weights (samples_per_epoch)
        self._last: tuple[int, EpochPlan] | None = None  # planned once an epoch

    def shard(self, dataset, max_atoms: int | None):
        """``shard(batch) -> this rank's indices`` for batches made with ``max_atoms``."""
        n_atoms, sharding = dataset.n_atoms, self.sharding
        return lambda batch: sharding(batch, n_atoms, max_atoms)

    def global_batches(self, epoch: int) -> Batches:
        """The global batches of ``epoch`` (a sequence of index lists, made on demand)."""
        return Batches(self._epoch(epoch))

    def shares(self, epoch: int) -> tuple[Batches, Shares]:
        """``(global batches, this rank's share of each)`` of ``epoch``: sequences of index
        lists made on demand from the epoch's :class:`EpochPlan` (iterating them makes a
        block of about :data:`~xnn.data.datasets.CHUNK_BLOCK` structures at a time)."""
        plan = self._epoch(epoch)
        return Batches(plan), Shares(plan, self._rule())

    def _rule(self) -> ShareRule:
        sharding, d = self.sharding, self.cfg
        if sharding.dp == 1:
            return ShareRule()
        if d.balance_bins or (sharding.groups is not None and d.max_atoms_per_batch):
            return ShareRule("piece", sharding.dp_rank, sharding.dp)
        return ShareRule("greedy", sharding.dp_rank, sharding.dp,
                         np.asarray(self.train.n_atoms))

    def eval_max_atoms(self) -> int | None:
        d = self.cfg
        return None if d.val_batch_size else d.max_atoms_per_batch

    def eval_batches(self, dataset) -> list[list[int]]:
        """The batches of an evaluation set (in order)."""
        d = self.cfg
        max_atoms = self.eval_max_atoms()
        size = None if max_atoms is not None else d.val_batch_size or d.batch_size
        return make_batches(dataset.n_atoms, size, max_atoms, groups=self.sharding.groups)

    def _draws(self, epoch: int) -> np.ndarray | None:
        """The epoch's stream of structures when drawn by weight (``samples_per_epoch``)."""
        d = self.cfg
        if d.samples_per_epoch is None:
            return None
        from xnn.training.sampling import sample_epoch, structure_weights

        if self._weights is None:
            self._weights = structure_weights(self.train)
        return sample_epoch(self._weights, d.samples_per_epoch, d.seed, epoch)  # int32

    def _epoch(self, epoch: int) -> EpochPlan:
        """The :class:`EpochPlan` of ``epoch``, planned once per epoch (the start of a run
        asks for epoch 0's three times)."""
        if self._last is None or self._last[0] != epoch:
            self._last = None  # the old plan's memory goes before the new one's is taken
            self._last = (epoch, self._plan_epoch(epoch))
        return self._last[1]

    def _plan_epoch(self, epoch: int) -> EpochPlan:
        d = self.cfg
        n_atoms = np.asarray(self.train.n_atoms)
        groups = self.sharding.groups
        if d.balance_bins:
            return self._balanced(epoch, n_atoms)
        stream, starts = batch_bounds(n_atoms, d.batch_size, d.max_atoms_per_batch,
                                      shuffle=d.shuffle, seed=d.seed, epoch=epoch,
                                      groups=groups, stream=self._draws(epoch))
        if groups is None or d.max_atoms_per_batch is None:
            return EpochPlan(stream, starts)
        # a batch of ``groups`` chunks: the chunks are the pieces (a group's share)
        return EpochPlan(stream, chunk_starts(n_atoms, d.max_atoms_per_batch, stream), groups)

    def _balanced(self, epoch: int, n_atoms: np.ndarray) -> EpochPlan:
        """The epoch's steps as ``balance_bins`` shares balanced by atoms."""
        from xnn.training.balance import balanced_bounds

        d, dp = self.cfg, self.sharding.dp
        if d.max_atoms_per_batch is None:
            raise InputError("data.balance=atoms packs shares of data.max_atoms_per_batch "
                             "atoms; set data.max_atoms_per_batch")
        if dp > 1 and d.balance_bins != dp:
            raise InputError(f"data.balance_bins={d.balance_bins} shares per global batch, "
                             f"but {dp} data-parallel replicas train them; set "
                             f"data.balance_bins={dp} or null")
        groups = self.sharding.groups  # dd > 1: the budget is one group's
        budget = d.max_atoms_per_batch if groups else max(d.max_atoms_per_batch
                                                           // d.balance_bins, 1)
        if groups:
            batch_bounds(n_atoms, None, budget, groups=groups)  # refuses oversize structures
        order = self._draws(epoch)
        if order is None:
            order = np.arange(len(n_atoms), dtype=index_dtype(len(n_atoms)))
            if d.shuffle:  # in place: the same permutation as ``permutation(n)``
                np.random.default_rng([d.seed, epoch]).shuffle(order)
        packed, starts = balanced_bounds(n_atoms, order, d.balance_bins, budget,
                                         d.balance_lookahead)
        return EpochPlan(packed, starts, d.balance_bins)
