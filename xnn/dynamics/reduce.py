"""Global reductions of the MD engine, gathered in one object.

Every global quantity an integrator needs (kinetic energy, degrees of freedom, atom counts,
centre-of-mass motion, pressure, FIRE power and norms, convergence, input checks) is
computed through a :class:`Reducer`, so that every rank of a decomposed run gets the same
value and takes the same branch. In a single process it is a plain per-system sum; the
domain-decomposition layer replaces it by a subclass whose primitive methods
(:meth:`~Reducer.sum_per_system`, :meth:`~Reducer.max_per_system`, :meth:`~Reducer.any`,
:meth:`~Reducer.gather_small`) add a cross-rank collective, without touching the
integrators. The other methods are
written with the primitives, so a subclass inherits them correct;
:meth:`~Reducer.sums_per_system` (several sums known at the same point of a step) is one
of them, which a communicating subclass may override to reduce them in one collective.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class Reducer:
    """Per-system sums, maxima and flags over the atoms held by this process."""

    # ------------------------------------------------------------------ primitives
    def sum_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        """``[n_systems, ...]`` sum of per-atom ``values [n_atoms, ...]`` by system index.

        One system: a plain sum (deterministic on CUDA, where ``index_add`` accumulates
        with atomics; and inductor's CPU code generation fails on a scatter of constant
        values into one row, which the degrees of freedom of a compiled thermostat were)."""
        if n_systems == 1:
            return values.sum(0, keepdim=True, dtype=values.dtype)
        out = values.new_zeros((n_systems, *values.shape[1:]))
        return out.index_add(0, batch, values)

    def max_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        """``[n_systems]`` maximum of per-atom ``values [n_atoms]`` (``-inf`` for empty systems)."""
        out = values.new_full((n_systems,), float("-inf"))
        return out.scatter_reduce(0, batch, values, reduce="amax", include_self=True)

    def any(self, flag: Tensor) -> bool:
        """True if any element of ``flag`` is true on any process (a host decision)."""
        return bool(flag.any())

    def gather_small(self, values: Tensor) -> Tensor:
        """``[n_processes, ...]``: every process's ``values`` (a small tensor of the same
        shape everywhere), stacked in rank order; here ``values[None]``."""
        return values[None]

    # ------------------------------------------------------------------ derived
    def sums_per_system(self, values: Sequence[Tensor], batch: Tensor, n_systems: int
                        ) -> list[Tensor]:
        """``[sum_per_system(v) for v in values]``: several sums of per-atom values
        ``[n_atoms, ...]`` needed at the same point of a step. A subclass that communicates
        may take them in one collective; each result equals its own
        :meth:`sum_per_system`."""
        return [self.sum_per_system(v, batch, n_systems) for v in values]

    def all(self, flag: Tensor) -> bool:
        """True if every element of ``flag`` is true on every process (a host decision)."""
        return not self.any(~flag.to(torch.bool))

    def min_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        """``[n_systems]`` minimum of per-atom ``values [n_atoms]`` (``+inf`` for empty systems)."""
        return -self.max_per_system(-values, batch, n_systems)

    def count_per_system(
        self, batch: Tensor, n_systems: int, dtype: torch.dtype = torch.float64
    ) -> Tensor:
        """``[n_systems]`` number of atoms of each system (as ``dtype``)."""
        ones = torch.ones(batch.shape[0], dtype=dtype, device=batch.device)
        return self.sum_per_system(ones, batch, n_systems)


#: the default single-process reducer
LOCAL = Reducer()
