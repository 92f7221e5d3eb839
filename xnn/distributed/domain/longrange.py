"""Long-range models under domain decomposition: their global sums become all-reduces.

A long-range model (``ewald``, ``pme``, ``coulomb``: :mod:`xnn.models.long_range.coulomb`)
marks every sum over all atoms of the system with its swappable attributes ``global_sum``
(structure factors, the PME charge mesh, total charge and slab moments, in one call per
evaluation) and ``global_gather`` (the positions and charges of a non-periodic system, for
its all-pairs direct sum); both are identities in one process. During a decomposed
evaluation :func:`swapped_global_sums` replaces them, in every module of the model that has
them (terms of a :class:`~xnn.models.Sum` included), by differentiable collectives over the
domain group, and :func:`domain_fields` gives the local graph the true (strained) cell, pbc
and owned count; the model then runs its k-space part over the owned atoms only, without
importing ``torch.distributed``.

Cost per rank and evaluation (PME with a mesh of ``n_mesh`` points; Ewald with ``n_k``
k-vectors): one all-reduce of ``n_mesh`` (``2 n_k``) values plus a few moments forward and
one of the same size backward; the mesh and its FFT are replicated on every rank (memory
``O(n_mesh)``, work ``O(n_mesh log n_mesh)`` besides the ``O(n_owned)`` spreading and
interpolation). Direct sums of non-periodic systems gather all ``N`` positions and charges
on every rank (``O(N)`` memory, ``O(n_owned N)`` work).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.distributed import collectives as C

_HOOKS = ("global_sum", "global_gather")


def long_range_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` (itself included) that declare a ``global_sum``."""
    return [m for m in model.modules() if callable(getattr(m, "global_sum", None))]


class GroupSum:
    """``global_sum``: a differentiable all-reduce (sum) over ``group``; every output is
    recorded on ``tape`` so that each rank's backward runs its adjoint all-reduce."""

    def __init__(self, group, tape: list[Tensor]):
        self.group, self.tape = group, tape

    def __call__(self, x: Tensor) -> Tensor:
        out = C.all_reduce_sum(x, self.group)
        self.tape.append(out)
        return out


class GroupGather(GroupSum):
    """``global_gather``: ``[n_total, ...]`` every rank's rows in rank order (differentiable:
    each rank's rows are placed at its offset in zeros and the blocks all-reduced)."""

    def __call__(self, rows: Tensor) -> Tensor:
        count = torch.tensor([rows.shape[0]], dtype=torch.float64, device=rows.device)
        counts = [int(c) for c in C.all_gather_tensor(count, self.group).flatten().tolist()]
        rank = C.group_rank(self.group)
        before, after = sum(counts[:rank]), sum(counts[rank + 1:])
        padded = torch.cat([rows.new_zeros((before, *rows.shape[1:])), rows,
                            rows.new_zeros((after, *rows.shape[1:]))])
        return super().__call__(padded)


@contextmanager
def swapped_global_sums(modules: list[nn.Module], group, tape: list[Tensor]) -> Iterator[None]:
    """Within the block, the ``global_sum`` / ``global_gather`` of ``modules`` are
    collectives over ``group`` (restored afterwards, also on error)."""
    originals = [(m, name, getattr(m, name)) for m in modules for name in _HOOKS
                 if hasattr(m, name)]
    hooks = {"global_sum": GroupSum(group, tape), "global_gather": GroupGather(group, tape)}
    try:
        for m, name, _ in originals:
            setattr(m, name, hooks[name])
        yield
    finally:
        for m, name, fn in originals:
            setattr(m, name, fn)


def domain_fields(cell: Tensor, pbc: Tensor, n_owned: int) -> dict[str, Tensor]:
    """The system fields a long-range model reads in a local graph: ``K.GLOBAL_CELL [1, 3,
    3]`` (the strained cell: stress flows through it), ``K.GLOBAL_PBC [1, 3]`` and
    ``K.N_OWNED [1]``."""
    return {K.GLOBAL_CELL: cell.reshape(1, 3, 3), K.GLOBAL_PBC: pbc.reshape(1, 3),
            K.N_OWNED: torch.tensor([n_owned], device=cell.device)}
