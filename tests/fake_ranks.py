"""Domain decomposition simulated in one process: "fake ranks" as threads.

Each fake rank holds some atoms of a system (an :class:`AtomicGraph` of its own, atoms in
any order) and runs the integrator on them in lock-step with the others, as a rank of a
decomposed run would. :class:`ThreadReducer` adds the per-rank partial sums of all ranks
(in rank order, so every rank gets the same bits), and :class:`SplitPotential` returns
what a decomposed model returns: the global energy and stress, and the forces of the
rank's own atoms (rank 0 evaluates the whole system, gathered by atom id).
"""

from __future__ import annotations

import functools
import threading

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import Reducer


class World:
    """``size`` fake ranks that meet at a barrier (``timeout`` s, so a bug cannot hang)."""

    def __init__(self, size: int, timeout: float = 120.0):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size

    def all_gather(self, rank: int, value) -> list:
        """Every rank's ``value``, in rank order (a collective: all ranks must call it)."""
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before all have read it
        return out

    def run(self, fn) -> list:
        """``[fn(0), ..., fn(size - 1)]``, each in its own thread; re-raises a rank's error."""
        results, errors = [None] * self.size, [None] * self.size

        def target(rank):
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                errors[rank] = e
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [e for e in errors if e is not None]
        if errors:  # the error that broke the barrier rather than the ranks it stopped
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results


class ThreadReducer(Reducer):
    """The reductions of one fake rank: its partial results combined with the others'."""

    def __init__(self, world: World, rank: int):
        self.world, self.rank = world, rank
        self.calls = 0

    def sum_per_system(self, values, batch, n_systems):
        self.calls += 1
        parts = self.world.all_gather(self.rank, super().sum_per_system(values, batch, n_systems))
        return functools.reduce(torch.add, parts)

    def max_per_system(self, values, batch, n_systems):
        self.calls += 1
        parts = self.world.all_gather(self.rank, super().max_per_system(values, batch, n_systems))
        return torch.stack(parts).amax(0)

    def any(self, flag):
        self.calls += 1
        return any(self.world.all_gather(self.rank, bool(flag.any())))


class SplitPotential:
    """``potential`` of the whole system as seen by one fake rank.

    Args:
        template: the whole system, atom ``i`` with ``atom_id == i`` (numbers, masses, pbc).
    """

    def __init__(self, world: World, rank: int, potential, template: AtomicGraph):
        self.world, self.rank, self.potential, self.template = world, rank, potential, template

    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True):
        parts = self.world.all_gather(self.rank, (graph.atom_id, graph.positions))
        out = None
        if self.rank == 0:
            pos = torch.empty_like(self.template.positions)
            for ids, p in parts:
                pos[ids] = p
            whole = self.template.replace({K.POSITIONS: pos, K.CELL: graph.cell})
            out = self.potential(whole, forces=forces, stress=stress)
        out = self.world.all_gather(self.rank, out)[0]
        res = {K.ENERGY: out[K.ENERGY], K.FORCES: out[K.FORCES][graph.atom_id]}
        if K.STRESS in out:
            res[K.STRESS] = out[K.STRESS]
        return res


def split_atoms(n_atoms: int, n_ranks: int, seed: int, empty_rank: bool = True) -> list:
    """Random disjoint index sets, each in a random order; the last rank empty if asked."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, n_ranks - int(empty_rank), (n_atoms,), generator=g)
    perm = torch.randperm(n_atoms, generator=g)
    return [perm[owner[perm] == r] for r in range(n_ranks)]


def merge(graphs: list[AtomicGraph], name: str) -> torch.Tensor:
    """Per-atom field ``name`` of all fake ranks, ordered by atom id."""
    ids = torch.cat([g.atom_id for g in graphs])
    vals = torch.cat([g[name] for g in graphs])
    out = torch.empty_like(vals)
    out[ids] = vals
    return out
