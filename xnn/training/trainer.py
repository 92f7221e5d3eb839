"""One optimizer step and one evaluation pass, written for one process.

Cross-rank operations go through a reducer (:mod:`xnn.training.reducer`): the labelled-item
counts of the global batch normalise the loss, so that each rank's loss is its share of the
global loss (the loop reads them from the dataset's metadata; without them they are
all-reduced during the forward pass); gradients are summed after the double backward;
metrics are summed. Every rank therefore takes the same branch (the NaN check reads the
reduced loss).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.datasets import collate
from xnn.data.graph import AtomicGraph
from xnn.errors import XnnError
from xnn.models.derivatives import compute_properties
from xnn.training.losses import (
    NO_LABELS,
    TermSpec,
    has_labels,
    labelled,
    local_counts,
    loss_terms,
    residuals,
    take,
)
from xnn.training.metrics import MetricSums
from xnn.training.reducer import LocalReducer, Pending, ensure_grads


class NonFiniteLossError(XnnError, FloatingPointError):
    """The loss became NaN or infinite."""


class Trainer:
    """Model, loss specification, optimizer, schedule, EMA and precision for training steps.

    Args:
        model: per-atom-energy model (already on ``device`` in its training dtype).
        specs: ``{"energy"|"forces"|"stress": TermSpec}``.
        optimizer: a torch optimizer over ``model``'s parameters.
        schedule: an :class:`~xnn.training.schedule.LRSchedule` (or ``None``).
        ema: an :class:`~xnn.training.ema.EMA` (or ``None``).
        reducer: cross-rank operations (default: single process).
        device: where batches go.
        dtype: floating dtype of batches (the model's).
        autocast: ``torch.bfloat16`` for bf16 mixed precision, else ``None``.
        grad_clip: max global gradient norm (``None``: no clipping).
        compile: predict through compiled kernels in training steps
            (:class:`~xnn.models.compiled_training.CompiledProperties`; evaluation stays
            eager); ``True`` for inductor, or the name of a ``torch.compile`` backend. Not
            with ``autocast``.
        memory: a :class:`~xnn.training.memory.MemoryTools` whose ``context()`` wraps each
            step's forward and backward (CPU offload, allocator profile), or ``None``.
    """

    def __init__(self, model: nn.Module, specs: dict[str, TermSpec], optimizer, schedule=None,
                 ema=None, reducer=None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                 grad_clip: float | None = None, compile: bool | str = False, memory=None):
        self.model = model
        self.memory = memory
        self.specs = specs
        self.optimizer = optimizer
        self.schedule = schedule
        self.ema = ema
        self.reducer = reducer if reducer is not None else LocalReducer()
        self.device = torch.device(device)
        self.dtype = dtype
        self.autocast = autocast
        self.grad_clip = grad_clip
        self.need_forces = specs.get("forces", TermSpec(0.0)).weight > 0
        self.need_stress = specs.get("stress", TermSpec(0.0)).weight > 0
        self.stop_votes = 0  # sum over ranks of train_step's stop_vote, at the last step
        self.compiled = None
        if compile:
            if autocast is not None:
                raise ValueError("compiled training does not support autocast (bf16_mixed)")
            from xnn.models.compiled_training import CompiledProperties

            backend = compile if isinstance(compile, str) else "inductor"
            self.compiled = CompiledProperties(model, self.need_forces, self.need_stress,
                                               backend=backend)

    # ------------------------------------------------------------------ helpers
    def _context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _batch(self, graphs: Sequence[AtomicGraph]):
        """``(cpu_batch, batch, index)``: collated, on the device, and its
        :func:`~xnn.training.losses.labelled` indices there (found on the CPU); Nones if
        ``graphs`` is empty."""
        if not graphs:
            return None, None, None
        cpu_batch = collate(graphs)
        index = {k: None if v is None else v.to(self.device)
                 for k, v in labelled(cpu_batch).items()}
        return cpu_batch, cpu_batch.to(self.device, self.dtype), index

    def _predict(self, batch: AtomicGraph, forces: bool, stress: bool, training: bool):
        if training and self.compiled is not None:
            pred = self.compiled(batch)
        else:
            with self._context():
                pred = compute_properties(self.model, batch, forces=forces, stress=stress,
                                          training=training)
        return {k: v.to(self.dtype) for k, v in pred.items()}

    # ------------------------------------------------------------------ training
    def _global_counts(self, cpu_batch, index, counts: Sequence[float] | None):
        """The global batch's label counts: given (on the device), or all-reduced (started
        now, waited for when needed)."""
        if counts is not None:
            return Pending(torch.tensor(counts, dtype=torch.float64, device=self.device))
        return self.reducer.all_reduce_sum_async(local_counts(cpu_batch, self.device, index))

    def train_step(self, graphs: Sequence[AtomicGraph], step: int,
                   metrics: MetricSums | None = None, stop_vote: bool = False,
                   counts: Sequence[float] | None = None) -> float:
        """One optimizer step on this rank's share ``graphs`` of a global batch.

        Cross-rank cost: one collective sums the gradients, the loss and the stop votes (and
        without ``counts``, one more sums the label counts while the forward pass runs); the
        host waits for the device once per step (to check the loss before the optimizer
        changes anything).

        Args:
            graphs: one-system graphs with edges (may be empty on some ranks).
            step: global optimizer step number (sets the learning rate).
            metrics: accumulates training errors if given.
            stop_vote: this rank's vote to stop after this step; the sum over ranks is
                :attr:`stop_votes` afterwards (summed with the loss: no extra collective).
            counts: labelled energies, force components and stress components of the whole
                global batch (the dataset's ``batch_label_counts``); ``None``: summed over
                the ranks' shares.
        Returns:
            the loss of the global batch (identical on every rank).
        Raises:
            NonFiniteLossError: NaN/inf loss (no parameter was changed).
            ValueError: no weighted property has labels in the global batch (idem).
        """
        self.model.train()
        cpu_batch, batch, index = self._batch(graphs)
        pending = self._global_counts(cpu_batch, index, counts)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        if batch is not None:
            with self.memory.context() if self.memory else contextlib.nullcontext():
                pred = self._predict(batch, self.need_forces, self.need_stress, training=True)
                res = residuals(pred, batch, index)
                loss_t, _ = loss_terms(res, self.specs, pending.wait())
                loss_t.backward()
            loss = loss_t.detach().to(torch.float64)
            if metrics is not None:
                self._add_metrics(metrics, res, batch, index)
        counts = pending.wait()
        params = ensure_grads(p for p in self.model.parameters() if p.requires_grad)
        vote = torch.full((1,), float(bool(stop_vote)), dtype=torch.float64, device=self.device)
        # loss and stop votes ride in the gradients' collective
        summed = self.reducer.all_reduce_grads(params, torch.cat([loss.reshape(1), vote]))
        # the step's one wait for the device: global loss, votes, counts and the local loss
        total, votes, *host = torch.cat([summed, counts, loss.reshape(1)]).tolist()
        self.stop_votes = int(votes)
        if not math.isfinite(total) or not has_labels(self.specs, host[:3]):
            self.optimizer.zero_grad(set_to_none=True)
            if not math.isfinite(total):
                raise NonFiniteLossError(f"the loss became {total} at step {step}")
            raise ValueError(NO_LABELS)
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        if self.schedule is not None:
            self.schedule.apply(step)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model)
        if metrics is not None:
            metrics.add_loss(host[3], 1 if self.reducer.rank == 0 else 0)
        return total

    @staticmethod
    def _add_metrics(metrics: MetricSums, res, batch: AtomicGraph, index) -> None:
        numbers = take(batch.numbers, index["forces"]) if "forces" in index else None
        metrics.add(res, numbers)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset, batches: Sequence[Sequence[int]], shard,
                 collect: bool = False) -> tuple[MetricSums, dict | None]:
        """Errors of the model (EMA weights if any) over ``batches`` of ``dataset``.

        Args:
            dataset: structures with edges.
            batches: global batches of indices (identical on every rank).
            shard: ``shard(batch) -> this rank's indices``.
            collect: also return this rank's parity data ``{"energy": (ref, pred) per atom,
                "forces": (ref, pred)}`` as numpy arrays.
        Returns:
            ``(metrics, parity)``: metric sums reduced over ranks; parity or ``None``.
        """
        self.model.eval()
        ctx = self.ema.applied(self.model) if self.ema is not None else contextlib.nullcontext()
        sums = MetricSums(self.device)
        parity: dict[str, list] = {"energy": [], "forces": [], "numbers": []}
        with ctx:
            for global_batch in batches:
                cpu_batch, batch, index = self._batch([dataset[i] for i in shard(global_batch)])
                if batch is None:  # the counts come from metadata: no collective to join
                    continue
                counts = self._global_counts(cpu_batch, index,
                                             dataset.batch_label_counts(global_batch)).wait()
                idx = index.get("stress", torch.empty(0))
                need_stress = idx is None or len(idx) > 0
                pred = self._predict(batch, True, need_stress, training=False)
                res = residuals(pred, batch, index)
                with torch.no_grad():
                    loss, _ = loss_terms(res, self.specs, counts)
                sums.add_loss(float(loss), 1 if self.reducer.rank == 0 else 0)
                self._add_metrics(sums, res, batch, index)
                if collect:
                    _collect(parity, pred, batch, index)
        sums.values = self.reducer.all_reduce_sum(sums.values)
        self.model.train()
        if not collect:
            return sums, None
        return sums, {k: _cat(v) for k, v in parity.items()}


def _collect(parity: dict, pred: dict[str, Tensor], batch: AtomicGraph, index) -> None:
    n = batch.n_atoms_per_system.to(batch.dtype)
    ie, i_f = index["energy"], index["forces"]
    parity["energy"].append(torch.stack([take(batch.energy / n, ie),
                                         take(pred[K.ENERGY].detach() / n, ie)], -1))
    parity["forces"].append(torch.stack([take(batch.forces, i_f),
                                         take(pred[K.FORCES].detach(), i_f)], -1).reshape(-1, 2))
    parity["numbers"].append(take(batch.numbers, i_f))


def _cat(parts: list[Tensor]):
    if not parts:
        return None
    return torch.cat(parts).cpu().double().numpy() if parts[0].is_floating_point() \
        else torch.cat(parts).cpu().numpy()
