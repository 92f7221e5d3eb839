"""``GroupReducer``: the MD engine's global reductions summed over the ranks of a group.

For dynamics where each rank integrates only its own atoms, every global quantity
(kinetic energy, degrees of freedom, pressure, FIRE power, convergence) must include the
other ranks' atoms; this subclass of :class:`xnn.dynamics.reduce.Reducer` adds the all-reduce
(:attr:`xnn.distributed.DecomposedPotential.reducer` gives one for its group).

The same reducer serves the eager decomposed step and the regions of the compiled one
(:mod:`xnn.distributed.domain.compiled_thermo`): traced inside
:func:`~xnn.distributed.collectives.traced_collectives`, its collectives become in-graph
functional ones, fused the same way (several sums of one point of a step in one all-reduce
per dtype, :meth:`GroupReducer.sums_per_system`); ``rows`` leaves the compiled step's padding
rows out of every sum and maximum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xnn.distributed import collectives as C
from xnn.dynamics.reduce import Reducer
from xnn.errors import InputError


class GroupReducer(Reducer):
    """Per-system sums, maxima and flags over the atoms of all ranks of ``group``.

    Args:
        group: the process group (None: the default group, or this process alone).
        rows: ``[n_rows]`` bool, the rows that are atoms (the compiled step's padded rows:
            False on padding); None: every row.
    """

    def __init__(self, group=None, rows: Tensor | None = None):
        self.group = group
        self.rows = rows

    def _real(self, values: Tensor, fill: float) -> Tensor:
        """``values [n_rows, ...]`` with the padding rows set to ``fill``."""
        if self.rows is None:
            return values
        mask = self.rows.reshape(-1, *([1] * (values.dim() - 1)))
        return torch.where(mask, values, torch.full_like(values, fill))

    def sum_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        local = super().sum_per_system(self._real(values, 0.0), batch, n_systems)
        return C.all_reduce_sum(local, self.group)

    def sums_per_system(self, values, batch: Tensor, n_systems: int) -> list[Tensor]:
        """This rank's sums (as :meth:`Reducer.sum_per_system`), summed over the ranks in
        one all-reduce per dtype (:func:`~xnn.distributed.collectives.all_reduce_sum_many`)."""
        local = [Reducer.sum_per_system(self, self._real(v, 0.0), batch, n_systems)
                 for v in values]
        return C.all_reduce_sum_many(local, self.group)

    def max_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        out = super().max_per_system(self._real(values, -math.inf), batch, n_systems)
        return C.all_reduce_max(out.clone(), self.group)

    def any(self, flag: Tensor) -> bool:
        if C.tracing():
            raise InputError("a compiled decomposed step cannot take host decisions inside "
                             "its regions; run this ensemble with compile: false")
        t = torch.tensor([float(bool(flag.any()))], device=flag.device)
        return bool(C.all_reduce_(t, self.group).item() > 0)

    def gather_small(self, values: Tensor) -> Tensor:
        return C.all_gather_tensor(values.contiguous(), self.group)
