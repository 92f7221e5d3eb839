"""Predicted charges of the Coulomb terms: the charge model's reach (for the DD halo) and
the neutrality correction (through the term's ``global_sum`` under domain decomposition)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, graph_tracing

DATA_HINT = ("the model's charges='data' reads the per-atom 'charges' field (extxyz "
             "initial_charges): give every atom a finite charge (e)")


def check_finite_charges(graph: AtomicGraph, q: Tensor) -> None:
    """Refuse NaN or infinite charges ``q [n_atoms]`` read from the data of a (batched,
    single-process) graph, naming the first atoms by their index within their system (one
    host sync; skipped under a graph tracer).

    Raises:
        InputError: one line naming the system, the atoms and their values.
    """
    if graph_tracing():
        return
    finite = torch.isfinite(q.detach())
    if bool(finite.all()):
        return
    bad = torch.nonzero(~finite).flatten()
    s = int(graph.batch[bad[0]])
    bad = bad[graph.batch[bad] == s]
    _refuse(f"system {s}, atoms {(bad[:5] - graph.ptr[s]).tolist()}", q, bad)


def check_finite_by_id(q: Tensor, ids: Tensor) -> None:
    """:func:`check_finite_charges` for the charges ``q [n]`` of atoms with global ``ids
    [n]`` (a domain's owned atoms, or every rank's gathered), naming the atoms by id.

    Raises:
        InputError: one line naming the atoms by id and their values.
    """
    finite = torch.isfinite(q.detach())
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten()
        _refuse(f"atoms with ids {ids[bad[:5]].to(torch.int64).tolist()}", q, bad)


def _refuse(where: str, q: Tensor, bad: Tensor) -> None:
    values = [float(v) for v in q.detach()[bad[:5]].tolist()]
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise InputError(f"non-finite charges on {where}{more} (values {values}); {DATA_HINT}")


def check_charge_table(table: dict) -> None:
    """Refuse a charge table by element with a non-finite value.

    Raises:
        InputError: one line naming the elements.
    """
    bad = {k: v for k, v in table.items() if not math.isfinite(v)}
    if bad:
        raise InputError(f"charges table has non-finite values {bad}: give each element a "
                         "finite charge (e), e.g. {'Na': 1, 'Cl': -1}")


def charge_fields(charge_model: nn.Module | None) -> tuple[float, float]:
    """``(R_q, c_q)`` (Å): the charge model's receptive field and cutoff when it is an
    :class:`~xnn.models.base.AtomisticModel` (which declares them); ``(0, 0)`` without a
    charge model, ``(inf, 0)`` for any other module (it declares no reach)."""
    if charge_model is None:
        return 0.0, 0.0
    if not isinstance(charge_model, AtomisticModel):
        return math.inf, 0.0
    return float(charge_model.receptive_field), float(charge_model.cutoff)


def neutralised(graph: AtomicGraph, q: Tensor, global_sum: Callable[[Tensor], Tensor]) -> Tensor:
    """``q - mean(q)`` per system ``[n_atoms]`` (e); in a domain's local graph the mean over
    the owned atoms (the first ``K.N_OWNED``) of every rank, through ``global_sum``, applied
    to owned atoms and ghosts alike."""
    if K.GLOBAL_CELL in graph:
        n = int(graph[K.N_OWNED].reshape(-1)[0])
        total = global_sum(torch.stack([q[:n].sum(), q.new_tensor(float(n))]))
        return q - total[0] / total[1]
    sums = q.new_zeros(graph.n_systems).index_add(0, graph.batch, q)
    counts = torch.bincount(graph.batch, minlength=graph.n_systems).to(q.dtype)
    return q - (sums / counts.clamp_min(1.0))[graph.batch]
