"""``GroupReducer``: the MD engine's global reductions summed over the ranks of a group.

For dynamics where each rank integrates only its own atoms, every global quantity
(kinetic energy, degrees of freedom, pressure, FIRE power, convergence) must include the
other ranks' atoms; this subclass of :class:`xnn.dynamics.reduce.Reducer` adds the all-reduce
(:attr:`xnn.distributed.DecomposedPotential.reducer` gives one for its group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from xnn.distributed import collectives as C
from xnn.dynamics.reduce import Reducer


class GroupReducer(Reducer):
    """Per-system sums, maxima and flags over the atoms of all ranks of ``group``."""

    def __init__(self, group=None):
        self.group = group

    def sum_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        return C.all_reduce_sum(super().sum_per_system(values, batch, n_systems), self.group)

    def sums_per_system(self, values, batch: Tensor, n_systems: int) -> list[Tensor]:
        """This rank's sums (as :meth:`Reducer.sum_per_system`), summed over the ranks in
        one all-reduce per dtype (:func:`~xnn.distributed.collectives.all_reduce_sum_many`)."""
        local = [Reducer.sum_per_system(self, v, batch, n_systems) for v in values]
        return C.all_reduce_sum_many(local, self.group)

    def max_per_system(self, values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
        out = super().max_per_system(values, batch, n_systems)
        return C.all_reduce_(out.clone(), self.group, op=dist.ReduceOp.MAX)

    def any(self, flag: Tensor) -> bool:
        t = torch.tensor([float(bool(flag.any()))], device=flag.device)
        return bool(C.all_reduce_(t, self.group).item() > 0)

    def gather_small(self, values: Tensor) -> Tensor:
        return C.all_gather_tensor(values.contiguous(), self.group)
