"""Training a committee (:class:`~xnn.models.committee.Committee`) as K independent models in
one run.

* **Loss**: the sum of the members' losses, each the loss of a single model on the member's
  own predictions (:func:`member_residuals`, whose concatenated residuals
  :func:`~xnn.training.losses.loss_terms` sums unchanged): the gradient of member ``k``'s
  parameters is that of its own loss alone.
* **Bootstrap**: member ``k`` weighs training structure ``i`` by an integer count drawn from
  a seeded multinomial (:func:`bootstrap_weights`), carried by the structures of the training
  set (:class:`Bootstrapped`, field ``member_weight [n_systems, K]``), so every member sees
  the same batches and its own resample. The loss normalisers stay the label counts.
* **Optimizer, EMA**: Adam(W) and the moving average act element by element on each
  parameter, so one optimizer and one EMA over all members' parameters keep each member's
  state its own; gradient clipping is per member (:func:`clip_groups`).
* **Calibration** (:func:`calibration_factor`): on the validation set, the factor ``c`` with
  ``mean(err²) = mean((c·std)²)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.datasets import View
from xnn.data.graph import AtomicGraph
from xnn.models.base import AtomisticModel
from xnn.training.losses import residuals


def committee_size(model: nn.Module) -> int:
    """``model.committee_size`` of an xnn model (1 for a single model); 1 for any other
    module."""
    return model.committee_size if isinstance(model, AtomisticModel) else 1


def bootstrap_weights(n: int, size: int, seed: int) -> np.ndarray:
    """``[n, size]`` float64 integer counts: column ``k`` is a resample of ``n`` structures
    with replacement (a multinomial of ``n`` draws over ``n`` equal cells), from the numpy
    generator of ``SeedSequence([seed, k])``: the same on every rank and in a resumed run."""
    out = np.zeros((n, size))
    for k in range(size):
        rng = np.random.default_rng(np.random.SeedSequence([int(seed), k]))
        out[:, k] = rng.multinomial(n, np.full(n, 1.0 / n)) if n else 0
    return out


class Bootstrapped(View):
    """``dataset`` whose structure ``i`` carries ``member_weight = weights[i]`` (``[1, K]``);
    sizes, labels and dataset weights are those of ``dataset`` (a
    :class:`~xnn.data.datasets.View`: none of its structures is read to make it).

    Args:
        dataset: the training structures (without edges).
        weights: ``[len(dataset), K]`` per-member weights (:func:`bootstrap_weights`).
    """

    def __init__(self, dataset, weights: np.ndarray):
        super().__init__(dataset)
        if weights.shape[0] != len(dataset):
            raise ValueError(f"{weights.shape[0]} bootstrap weights for {len(dataset)} "
                             "structures")
        self.weights = torch.as_tensor(weights, dtype=torch.float64)

    def __getitem__(self, index: int) -> AtomicGraph:
        g = super().__getitem__(index)
        return g.replace({K.MEMBER_WEIGHT: self.weights[index:index + 1].to(g.dtype)})


def member_residuals(pred: dict[str, Tensor], batch: AtomicGraph, size: int,
                     index: dict[str, Tensor | None] | None = None
                     ) -> dict[str, tuple[Tensor, Tensor]]:
    """The residuals of every member, concatenated member after member: ``{property: (diff,
    weight)}`` whose :func:`~xnn.training.losses.loss_terms` is the sum over members of each
    member's loss. Member ``k`` is weighed by ``weight * member_weight[:, k]`` when the batch
    carries bootstrap weights.

    Args:
        pred: :func:`~xnn.models.derivatives.compute_properties` of a committee (with
            ``energy_members``, ``forces_members``, ``stress_members``).
        size: K.
        index: :func:`~xnn.training.losses.labelled` of ``batch``, if known.
    """
    parts: dict[str, list[tuple[Tensor, Tensor]]] = {}
    w_sys = batch.get(K.WEIGHT)
    if w_sys is None:
        w_sys = torch.ones(batch.n_systems, dtype=batch.dtype, device=batch.device)
    bootstrap = batch.get(K.MEMBER_WEIGHT)
    for k in range(size):
        own = {key: pred[members][k] for key, members in
               ((K.ENERGY, K.ENERGY_MEMBERS), (K.FORCES, K.FORCES_MEMBERS),
                (K.STRESS, K.STRESS_MEMBERS)) if members in pred}
        b = batch if bootstrap is None else \
            batch.replace({K.WEIGHT: w_sys * bootstrap[:, k].to(w_sys.dtype)})
        for name, r in residuals(own, b, index).items():
            parts.setdefault(name, []).append(r)
    return {name: (torch.cat([d for d, _ in rs]), torch.cat([w for _, w in rs]))
            for name, rs in parts.items()}


def clip_groups(model: nn.Module, params: Sequence[nn.Parameter]
                ) -> list[list[nn.Parameter]]:
    """The parameter groups whose gradient norms are clipped each on its own: one per
    member of a committee (of ``params``, in their order), else ``[params]``."""
    if committee_size(model) == 1:
        return [list(params)]
    wanted = {id(p) for p in params}
    return [[p for p in m.parameters() if id(p) in wanted] for m in model.members]


def calibration_factor(errors: np.ndarray, stds: np.ndarray) -> float | None:
    """``c = sqrt(mean(err²) / mean(std²))``: the factor that makes the mean squared
    calibrated spread ``(c·std)²`` equal the mean squared observed error (``None`` without
    data or spread).

    Args:
        errors: observed errors (``|F_pred - F_ref|`` per atom, energy per atom, stress
            components).
        stds: the predicted standard deviations of the same items, uncalibrated.
    """
    errors, stds = np.asarray(errors, np.float64), np.asarray(stds, np.float64)
    if errors.size == 0 or not np.any(stds > 0):
        return None
    return float(np.sqrt(np.mean(errors ** 2) / np.mean(stds ** 2)))


#: the parity entries of a committee: ``{property: key}`` of ``[n, 2]`` (|error|, std) rows
UNCERTAINTY_KEYS = {"energy": "energy_uncertainty", "forces": "forces_uncertainty",
                    "stress": "stress_uncertainty"}


def fit_calibration(parity: dict) -> dict[str, float]:
    """``{property: factor}`` from the (error, uncalibrated std) rows of ``parity``
    (:data:`UNCERTAINTY_KEYS`), for the properties with data."""
    out = {}
    for prop, key in UNCERTAINTY_KEYS.items():
        rows = parity.get(key)
        if rows is None or len(rows) == 0:
            continue
        c = calibration_factor(rows[:, 0], rows[:, 1])
        if c is not None and np.isfinite(c) and c > 0:
            out[prop] = c
    return out


def uncertainty_parity(pred: dict[str, Tensor], batch: AtomicGraph, index) -> dict:
    """``{energy,forces,stress}_uncertainty``: ``[n, 2]`` rows of (observed |error|,
    predicted std) of a committee's mean prediction on the labelled items: energy per atom
    (eV/atom), forces per atom (``|F̄ - F_ref|`` vs ``forces_std``, eV/Å), stress per tensor
    component (eV/Å³)."""
    from xnn.training.losses import take

    out = {}
    n = batch.n_atoms_per_system.to(batch.dtype)
    if K.ENERGY_STD in pred and "energy" in index:
        ie = index["energy"]
        err = take((pred[K.ENERGY].detach() - batch.energy).abs() / n, ie)
        out[UNCERTAINTY_KEYS["energy"]] = torch.stack([err, take(pred[K.ENERGY_STD] / n, ie)],
                                                      -1)
    if K.FORCES_STD in pred and "forces" in index:
        i_f = index["forces"]
        err = take((pred[K.FORCES].detach() - batch.forces).norm(dim=-1), i_f)
        out[UNCERTAINTY_KEYS["forces"]] = torch.stack([err, take(pred[K.FORCES_STD], i_f)],
                                                      -1)
    if K.STRESS_STD in pred and "stress" in index and K.STRESS in batch:
        i_s = index["stress"]
        ref = take(batch.stress, i_s).reshape(-1, 9)
        ok = torch.isfinite(ref).all(-1)
        got = take(pred[K.STRESS].detach(), i_s).reshape(-1, 9)[ok]
        std = take(pred[K.STRESS_STD], i_s).reshape(-1, 9)[ok]
        out[UNCERTAINTY_KEYS["stress"]] = torch.stack(
            [(got - ref[ok]).abs().reshape(-1), std.reshape(-1)], -1)
    return out


def binned_errors(errors: np.ndarray, stds: np.ndarray, bins: int = 10
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The calibration curve: items sorted by predicted std and cut into up to ``bins``
    groups of (nearly) equal counts; per group the RMS predicted std, the RMS observed error
    and the count (a calibrated committee has the two equal).

    Returns:
        ``(rms std [b], rms error [b], count [b])``.
    """
    errors, stds = np.asarray(errors, np.float64), np.asarray(stds, np.float64)
    order = np.argsort(stds, kind="stable")
    groups = [g for g in np.array_split(order, min(bins, len(order))) if len(g)]
    return (np.array([np.sqrt(np.mean(stds[g] ** 2)) for g in groups]),
            np.array([np.sqrt(np.mean(errors[g] ** 2)) for g in groups]),
            np.array([len(g) for g in groups]))


def calibrated_rows(parity: dict, calibration: dict[str, float]) -> dict[str, np.ndarray]:
    """``{property: [n, 2]}`` (|error|, std × factor) of the uncertainty rows of ``parity``
    (uncalibrated stds) with the factors ``calibration`` applied."""
    out = {}
    for prop, key in UNCERTAINTY_KEYS.items():
        rows = parity.get(key)
        if rows is not None and len(rows):
            out[prop] = np.stack([rows[:, 0], rows[:, 1] * calibration.get(prop, 1.0)], -1)
    return out
