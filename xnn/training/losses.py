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


def residuals(pred: dict[str, Tensor], batch: AtomicGraph) -> dict[str, tuple[Tensor, Tensor]]:
    """``{property: (diff, weight)}`` of the labelled items of this batch.

    ``diff`` are prediction minus reference for the labelled items only: energy per atom
    ``[n_e]`` (eV/atom), force components ``[n_f, 3]`` (eV/Å), stress ``[n_s, 3, 3]``
    (eV/Å³); ``weight`` the matching per-structure weights ``[n_e]``, ``[n_f]``, ``[n_s]``.
    """
    out: dict[str, tuple[Tensor, Tensor]] = {}
    w_sys = batch.get(K.WEIGHT)
    if w_sys is None:
        w_sys = torch.ones(batch.n_systems, dtype=batch.dtype, device=batch.device)
    n = batch.n_atoms_per_system.to(batch.dtype)
    if K.ENERGY in pred and K.ENERGY in batch:
        ref = batch.energy
        ok = torch.isfinite(ref)
        diff = (pred[K.ENERGY][ok] - ref[ok].to(pred[K.ENERGY].dtype)) / n[ok]
        out["energy"] = (diff, w_sys[ok])
    if K.FORCES in pred and K.FORCES in batch:
        ref = batch.forces
        ok = torch.isfinite(ref).all(-1)
        diff = pred[K.FORCES][ok] - ref[ok].to(pred[K.FORCES].dtype)
        out["forces"] = (diff, w_sys[batch.batch][ok])
    if K.STRESS in pred and K.STRESS in batch:
        ref = batch.stress
        ok = torch.isfinite(ref).flatten(1).all(-1)
        diff = pred[K.STRESS][ok] - ref[ok].to(pred[K.STRESS].dtype)
        out["stress"] = (diff, w_sys[ok])
    return out


def local_counts(batch: AtomicGraph, device=None) -> Tensor:
    """``[3]`` float64 numbers of labelled items (energies, force components, stress
    components) of this rank's batch; all-reduce them to get the global normalisers.

    Counted where ``batch`` is (pass the CPU batch before moving it to a GPU: no device
    synchronisation) and returned on ``device`` (default: the batch's)."""
    if batch is None:
        return torch.zeros(3, dtype=torch.float64, device=device)
    zero = torch.zeros((), dtype=torch.long, device=batch.device)
    e = torch.isfinite(batch.energy).sum() if K.ENERGY in batch else zero
    f = torch.isfinite(batch.forces).all(-1).sum() * 3 if K.FORCES in batch else zero
    s = torch.isfinite(batch.stress).flatten(1).all(-1).sum() * 9 if K.STRESS in batch else zero
    out = torch.stack([e, f, s]).to(torch.float64)
    return out.to(device) if device is not None else out


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
            a tensor or a list of floats (read once: no device synchronisation per term).
    Returns:
        ``(loss, {property: term})`` with ``loss = Σ weight * term``; both are this rank's
        partial sums (add them over ranks to get the global values).
    """
    total = None
    terms: dict[str, Tensor] = {}
    if isinstance(global_counts, Tensor):
        global_counts = global_counts.tolist()
    for k, name in enumerate(PROPERTIES):
        spec = specs.get(name)
        if spec is None or spec.weight == 0.0 or name not in res:
            continue
        count = float(global_counts[k])
        if count == 0.0:
            continue
        diff, w = res[name]
        per = elementwise(spec.kind, diff, spec.delta)
        per = per.reshape(per.shape[0], -1) * w.to(per.dtype).unsqueeze(-1)
        term = per.sum() / count
        terms[name] = term
        total = spec.weight * term if total is None else total + spec.weight * term
    if total is None:
        raise ValueError("no loss term: every weighted property lacks labels in this batch")
    return total, terms
