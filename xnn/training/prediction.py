"""Prediction functions of the training step: how a rank turns its share into residuals.

The :class:`~xnn.training.trainer.Trainer` never calls the model itself: it asks its
*predictor* to split a rank's share into pieces (evaluated and backpropagated one by one)
and to evaluate a piece into :class:`Evaluated` residuals. :class:`LocalPredictor` is the
one-process (and data-parallel) version: the share collated into one batch and evaluated by
:func:`~xnn.models.derivatives.compute_properties` (for a committee, the loss is the sum of
the members' losses and the metrics are those of its mean: :mod:`xnn.training.committee`).
The domain-decomposed version
(:class:`xnn.distributed.cp_train.DomainPredictor`) evaluates each structure spread over the
ranks of a ``dd`` group; :func:`xnn.distributed.entries.parallelize_train` picks one.

A predictor has:

* ``pieces(graphs) -> list[list[AtomicGraph]]``: the units of one forward/backward;
* ``local_counts(graphs) -> Tensor [3]``: this rank's labelled items (energies, force
  components, stress components) such that the sum over all ranks is the global count;
* ``__call__(piece, forces, stress, training, parity=False) -> Evaluated``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.datasets import collate
from xnn.data.graph import AtomicGraph
from xnn.models.derivatives import compute_properties
from xnn.training.committee import (
    UNCERTAINTY_KEYS,
    committee_size,
    member_residuals,
    uncertainty_parity,
)
from xnn.training.losses import labelled, local_counts, residuals, take


@dataclass
class Evaluated:
    """One piece's results on this rank.

    Attributes:
        res: ``{property: (diff, weight)}`` for the loss (this rank's share of it: replicated
            terms carry weights divided by the number of ranks that hold them).
        metric_res: the residuals this rank counts in the metrics (each item once over ranks).
        numbers: ``[n_f]`` atomic numbers of ``metric_res["forces"]`` rows (or ``None``).
        parity: ``{"energy": [n, 2] eV/atom, "forces": [m, 2] eV/Å, "numbers": [k],
            "stress": [9 s, 2] eV/Å³ (tensor components)}``
            (reference, prediction) rows of this rank, when asked for.
        anchor: an exact zero that depends on every collective of the evaluation (added to
            the loss so that every rank's backward joins every collective), or ``None``.
        spread: a committee evaluated (not training): ``[n_f, 2]`` (|force error|,
            ``forces_std``) per labelled atom, eV/Å (the metrics' force spread); else ``None``.
    """

    res: dict
    metric_res: dict
    numbers: Tensor | None = None
    parity: dict | None = None
    anchor: Tensor | None = None
    spread: Tensor | None = None


def stress_labelled(graphs: Sequence[AtomicGraph]) -> bool:
    """Whether some structure of ``graphs`` has a finite stress label."""
    return any(K.STRESS in g and bool(torch.isfinite(g[K.STRESS]).all()) for g in graphs)


class LocalPredictor:
    """One process: the share collated into one batch, evaluated by ``compute_properties``.

    Args:
        model: per-atom-energy model (on ``device`` in ``dtype``).
        device: where batches go.
        dtype: floating dtype of batches.
        autocast: ``torch.bfloat16`` for bf16 mixed precision, else ``None``.
        compiled: a :class:`~xnn.models.compiled_training.CompiledProperties` used in
            training steps (evaluation stays eager), or ``None``.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                 compiled=None):
        self.model = model
        self.device = torch.device(device)
        self.dtype = dtype
        self.autocast = autocast
        self.compiled = compiled

    def _context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def pieces(self, graphs: Sequence[AtomicGraph]) -> list[list[AtomicGraph]]:
        """The whole share in one piece (none when it is empty)."""
        return [list(graphs)] if graphs else []

    def local_counts(self, graphs: Sequence[AtomicGraph]) -> Tensor:
        """``[3]`` float64 labelled items of the share (on the device)."""
        if not graphs:
            return local_counts(None, self.device)
        return local_counts(collate(graphs), self.device)

    def __call__(self, graphs: Sequence[AtomicGraph], forces: bool, stress: bool,
                 training: bool, parity: bool = False) -> Evaluated:
        """Residuals of the collated ``graphs`` (labels found on the CPU, see ``labelled``)."""
        cpu_batch = collate(graphs)
        index = {k: None if v is None else v.to(self.device)
                 for k, v in labelled(cpu_batch).items()}
        batch = cpu_batch.to(self.device, self.dtype)
        pred = self._predict(batch, forces, stress, training)
        res = metric_res = residuals(pred, batch, index)
        size = committee_size(self.model)
        if size > 1:  # each member's loss; the metrics are the committee's (its mean)
            res = member_residuals(pred, batch, size, index)
        numbers = take(batch.numbers, index["forces"]) if "forces" in index else None
        par = spread = None
        if size > 1 and not training:  # the committee's spread, for metrics and parity
            rows = uncertainty_parity(pred, batch, index)
            spread = rows.get(UNCERTAINTY_KEYS["forces"])
        if parity:
            par = _parity(pred, batch, index)
            if size > 1:
                par.update(rows)
        return Evaluated(res, metric_res, numbers, par, spread=spread)


    def _predict(self, batch: AtomicGraph, forces: bool, stress: bool,
                 training: bool) -> dict[str, Tensor]:
        """The model's energy (and forces, stress) of ``batch``, in ``dtype``."""
        if training and self.compiled is not None:
            pred = self.compiled(batch)
        else:
            with self._context():
                pred = compute_properties(self.model, batch, forces=forces, stress=stress,
                                          training=training)
        return {k: v.to(self.dtype) for k, v in pred.items()}


def _parity(pred: dict[str, Tensor], batch: AtomicGraph, index) -> dict[str, Tensor]:
    n = batch.n_atoms_per_system.to(batch.dtype)
    ie, i_f = index["energy"], index["forces"]
    return {"energy": torch.stack([take(batch.energy / n, ie),
                                   take(pred[K.ENERGY].detach() / n, ie)], -1),
            "forces": torch.stack([take(batch.forces, i_f),
                                   take(pred[K.FORCES].detach(), i_f)], -1).reshape(-1, 2),
            "numbers": take(batch.numbers, i_f),
            "stress": stress_parity(pred, batch, index.get("stress"))}


def stress_parity(pred: dict[str, Tensor], batch: AtomicGraph, idx) -> Tensor:
    """``[9 n_s, 2]`` (reference, predicted) stress tensor components (eV/Å³) of the
    structures with a stress label (``idx``, all for ``None``), the components the stress
    metrics average over; empty without stress predictions."""
    if K.STRESS not in pred or K.STRESS not in batch:
        return torch.zeros(0, 2, dtype=batch.dtype, device=batch.device)
    ref = take(batch.stress, idx).reshape(-1, 9)
    got = take(pred[K.STRESS].detach(), idx).reshape(-1, 9)
    ok = torch.isfinite(ref).all(-1)
    return torch.stack([ref[ok], got[ok]], -1).reshape(-1, 2)


def make_local_predictor(model: nn.Module, device, dtype: torch.dtype,
                         autocast: torch.dtype | None = None, compile: bool | str = False,
                         forces: bool = True, stress: bool = True) -> LocalPredictor:
    """A :class:`LocalPredictor`, with compiled training kernels for ``compile`` (``True``:
    inductor, or a ``torch.compile`` backend name; not with ``autocast``)."""
    compiled = None
    if compile:
        if autocast is not None:
            raise ValueError("compiled training does not support autocast (bf16_mixed)")
        from xnn.models.compiled_training import CompiledProperties

        backend = compile if isinstance(compile, str) else "inductor"
        compiled = CompiledProperties(model, forces, stress, backend=backend)
    return LocalPredictor(model, device, dtype, autocast, compiled)
