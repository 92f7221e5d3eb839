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
"""

from __future__ import annotations

import numpy as np

from xnn.data.datasets import make_batches, shard_batches
from xnn.errors import InputError


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
        self._last: tuple[int, list] | None = None  # (epoch, its packs): planned once

    def shard(self, dataset, max_atoms: int | None):
        """``shard(batch) -> this rank's indices`` for batches made with ``max_atoms``."""
        n_atoms, sharding = dataset.n_atoms, self.sharding
        return lambda batch: sharding(batch, n_atoms, max_atoms)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """The global batches of ``epoch``."""
        return [sum(p, []) if self.cfg.balance_bins else p for p in self._epoch(epoch)]

    def shares(self, epoch: int) -> tuple[list[list[int]], list[list[int]]]:
        """``(global batches, this rank's share of each)`` of ``epoch``."""
        packs = self._epoch(epoch)
        if not self.cfg.balance_bins:
            sharding = self.sharding
            if sharding.dp > 1 and sharding.groups is None:  # greedy by atoms, vectorised
                return packs, shard_batches(packs, self.train.n_atoms, sharding.dp_rank,
                                            sharding.dp)
            shard = self.shard(self.train, self.cfg.max_atoms_per_batch)
            return packs, [shard(b) for b in packs]
        batches = [sum(p, []) for p in packs]
        if self.sharding.dp == 1:  # one process trains the union of the shares
            return batches, batches
        return batches, [p[self.sharding.dp_rank] for p in packs]

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
        return sample_epoch(self._weights, d.samples_per_epoch, d.seed, epoch)

    def _epoch(self, epoch: int) -> list:
        """The global batches of ``epoch`` (balanced: as their shares), planned once per
        epoch (the start of a run asks for epoch 0's three times)."""
        if self._last is None or self._last[0] != epoch:
            self._last = (epoch, self._plan_epoch(epoch))
        return self._last[1]

    def _plan_epoch(self, epoch: int) -> list:
        d = self.cfg
        n_atoms = np.asarray(self.train.n_atoms)
        groups = self.sharding.groups
        if d.balance_bins:
            return self._balanced(epoch, n_atoms)
        drawn = self._draws(epoch)
        if drawn is None:
            return make_batches(n_atoms, d.batch_size, d.max_atoms_per_batch,
                                shuffle=d.shuffle, seed=d.seed, epoch=epoch, groups=groups)
        # the draws are in random order already: batch them as they come
        batches = make_batches(n_atoms[drawn], d.batch_size, d.max_atoms_per_batch,
                               groups=groups)
        return [drawn[b].tolist() for b in batches]

    def _balanced(self, epoch: int, n_atoms: np.ndarray) -> list[list[list[int]]]:
        """The epoch's steps as ``balance_bins`` shares balanced by atoms."""
        from xnn.training.balance import balanced_batches

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
            make_batches(n_atoms, None, budget, groups=groups)  # refuses oversize structures
        order = self._draws(epoch)
        if order is None:
            order = (np.random.default_rng([d.seed, epoch]).permutation(len(n_atoms))
                     if d.shuffle else np.arange(len(n_atoms)))
        return balanced_batches(n_atoms, order, d.balance_bins, budget, d.balance_lookahead)
