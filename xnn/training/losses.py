"""Loss terms on energy per atom, forces and stress, normalised by GLOBAL counts.

For one global batch split over ranks, each rank computes

    L_rank = Σ_p w_p * (Σ_{local items of p} ω_item * ℓ_p(pred - ref)) / N_p

where ``N_p`` is the number of labelled items of property ``p`` in the whole global batch
(structures for energy, force components ``3 × atoms`` for forces, ``9 ×`` structures for
stress), ``ω`` the per-structure weight and ``ℓ_p`` MSE, MAE or Huber. Then
``Σ_rank L_rank`` is the loss of the global batch whatever the split, and summing the ranks'
gradients (an all-reduce SUM) gives exactly its gradient.

Energy is compared per atom: ``(E_pred - E_ref) / n_atoms`` (eV/atom).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph

PROPERTIES = ("energy", "forces", "stress")


@dataclass(frozen=True)
class TermSpec:
    """One loss term: weight, kind (``mse``/``mae``/``huber``) and Huber delta."""

    weight: float = 1.0
    kind: str = "mse"
    delta: float = 0.01


def elementwise(kind: str, diff: Tensor, delta: float) -> Tensor:
    """``ℓ(diff)`` element by element: ``diff²``, ``|diff|`` or Huber with ``delta``."""
    if kind == "mse":
        return diff * diff
    if kind == "mae":
        return diff.abs()
    if kind == "huber":
        a = diff.abs()
        return torch.where(a <= delta, 0.5 * diff * diff, delta * (a - 0.5 * delta))
    raise ValueError(f"unknown loss type {kind!r}; choose one of ['mse', 'mae', 'huber']")


_LABELS = (("energy", K.ENERGY), ("forces", K.FORCES), ("stress", K.STRESS))


def labelled(batch: AtomicGraph) -> dict[str, Tensor | None]:
    """``{property: indices}`` of the labelled items (finite references: structures for energy
    and stress, atoms for forces) of the properties ``batch`` carries; ``None`` when all are.

    Computed where ``batch`` is: on the CPU batch before it moves to a GPU, the residuals then
    need no boolean indexing (one device synchronisation each) on the device."""
    out: dict[str, Tensor | None] = {}
    for name, key in _LABELS:
        if key in batch:
            ok = torch.isfinite(batch[key]).flatten(1).all(-1) if name != "energy" \
                else torch.isfinite(batch[key])
            out[name] = None if bool(ok.all()) else torch.nonzero(ok).flatten()
    return out


def take(x: Tensor, idx: Tensor | None) -> Tensor:
    """The rows ``idx`` of ``x`` (all of them for ``None``, as :func:`labelled` gives)."""
    return x if idx is None else x.index_select(0, idx)


def residuals(pred: dict[str, Tensor], batch: AtomicGraph,
              index: dict[str, Tensor | None] | None = None) -> dict[str, tuple[Tensor, Tensor]]:
    """``{property: (diff, weight)}`` of the labelled items of this batch.

    ``diff`` are prediction minus reference for the labelled items only: energy per atom
    ``[n_e]`` (eV/atom), force components ``[n_f, 3]`` (eV/Å), stress ``[n_s, 3, 3]``
    (eV/Å³); ``weight`` the matching per-structure weights ``[n_e]``, ``[n_f]``, ``[n_s]``.
    ``index``: :func:`labelled` of ``batch`` (on ``batch``'s device), if already known.
    """
    if index is None:
        index = labelled(batch)
    out: dict[str, tuple[Tensor, Tensor]] = {}
    w_sys = batch.get(K.WEIGHT)
    if w_sys is None:
        w_sys = torch.ones(batch.n_systems, dtype=batch.dtype, device=batch.device)
    scale = {"energy": batch.n_atoms_per_system.to(batch.dtype), "forces": None, "stress": None}
    for name, key in _LABELS:
        if key not in pred or name not in index:
            continue
        idx = index[name]
        p, ref = pred[key], batch[key].to(pred[key].dtype)
        w = w_sys[batch.batch] if name == "forces" else w_sys
        diff = p - ref
        if scale[name] is not None:
            diff = diff / scale[name]
        out[name] = (take(diff, idx), take(w, idx))
    return out


def local_counts(batch: AtomicGraph, device=None,
                 index: dict[str, Tensor | None] | None = None) -> Tensor:
    """``[3]`` float64 numbers of labelled items (energies, force components, stress
    components) of this rank's batch; all-reduce them to get the global normalisers.

    Returned on ``device`` (default: the batch's); ``index``: :func:`labelled` of ``batch``
    if already known (its sizes are read, wherever it is: no device synchronisation)."""
    if batch is None:
        return torch.zeros(3, dtype=torch.float64, device=device)
    if index is None:
        index = labelled(batch)
    items = {"energy": (batch.n_systems, 1), "forces": (batch.n_atoms, 3),
             "stress": (batch.n_systems, 9)}
    counts = [0.0] * len(PROPERTIES)
    for k, name in enumerate(PROPERTIES):
        if name in index:
            n, per = items[name]
            counts[k] = float(per * (n if index[name] is None else len(index[name])))
    return torch.tensor(counts, dtype=torch.float64,
                        device=batch.device if device is None else device)


def has_labels(specs: dict[str, TermSpec], global_counts) -> bool:
    """Whether some weighted property has labelled items among ``global_counts``."""
    return any(global_counts[k] > 0 for k, name in enumerate(PROPERTIES)
               if specs.get(name) is not None and specs[name].weight != 0.0)


NO_LABELS = "no loss term: every weighted property lacks labels in this batch"


def loss_terms(
    res: dict[str, tuple[Tensor, Tensor]],
    specs: dict[str, TermSpec],
    global_counts: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This rank's share of the global loss and of each (unweighted) term.

    Args:
        res: from :func:`residuals`.
        specs: ``{property: TermSpec}``; terms with weight 0 are skipped.
        global_counts: ``[3]`` labelled items of the global batch (see :func:`local_counts`),
            used where they are (no device synchronisation): a property without labels adds
            a zero term; the caller checks :func:`has_labels` once the counts are on the host.
    Returns:
        ``(loss, {property: term})`` with ``loss = Σ weight * term``; both are this rank's
        partial sums (add them over ranks to get the global values).
    """
    total = None
    terms: dict[str, Tensor] = {}
    for k, name in enumerate(PROPERTIES):
        spec = specs.get(name)
        if spec is None or spec.weight == 0.0 or name not in res:
            continue
        diff, w = res[name]
        # a zero count has zero local items too: clamped, the term is 0 (no host read)
        count = global_counts[k].to(diff.dtype).clamp_min(1.0)
        per = elementwise(spec.kind, diff, spec.delta)
        per = per * w.to(per.dtype).reshape(-1, *[1] * (per.dim() - 1))  # [n] or [n, ...]
        term = per.sum() / count
        terms[name] = term
        total = spec.weight * term if total is None else total + spec.weight * term
    if total is None:
        raise ValueError(NO_LABELS)
    return total, terms
