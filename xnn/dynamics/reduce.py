"""Global reductions of the MD engine, gathered in one object.

Every global quantity an integrator needs (kinetic energy, degrees of freedom, pressure,
FIRE power, convergence) is computed through a :class:`Reducer`. In a single process it
is a plain per-system sum; the domain-decomposition layer replaces it by a subclass whose
methods add a cross-rank all-reduce, without touching the integrators.
"""

from __future__ import annotations

from torch import Tensor


class Reducer:
    """Per-system sums over the atoms held by this process."""

    def sum_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        """``[n_systems, ...]`` sum of per-atom ``values [n_atoms, ...]`` by system index."""
        out = values.new_zeros((n_systems, *values.shape[1:]))
        return out.index_add(0, batch, values)

    def max_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        """``[n_systems]`` maximum of per-atom ``values [n_atoms]`` (``-inf`` for empty systems)."""
        out = values.new_full((n_systems,), float("-inf"))
        return out.scatter_reduce(0, batch, values, reduce="amax", include_self=True)

    def any(self, flag: Tensor) -> bool:
        """True if any element of ``flag`` is true on any process (a host decision)."""
        return bool(flag.any())


#: the default single-process reducer
LOCAL = Reducer()
