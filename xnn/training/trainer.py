"""One optimizer step and one evaluation pass, written for one process.

Cross-rank operations go through a reducer (:mod:`xnn.training.reducer`) and the model is
called through a predictor (:mod:`xnn.training.prediction`), both given by the
parallelization layer (:func:`xnn.distributed.entries.parallelize_train`): the
labelled-item counts of the global batch normalise the loss, so that each rank's loss is its
share of the global loss (the loop reads them from the dataset's metadata; without them they
are all-reduced during the forward pass); gradients are summed after the double backward;
metrics are summed. Every rank therefore takes the same branch (the NaN check reads the
reduced loss).

Bad data met by one rank (a structure refused when its share is read, e.g. coincident atoms,
:class:`~xnn.errors.DataFileError`) stops every rank the same way: that rank passes an empty
share and the error, its vote rides in the step's gradient all-reduce (or the evaluation's
metric all-reduce), no parameter changes, and every rank raises the same error, whose text
one gather shares in that case only.

A step may hold several micro-batches (gradient accumulation): one forward/backward per
piece of each, then ONE gradient reduction and optimizer step; the losses are additive, so
the update is exactly that of one batch of the summed size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph
from xnn.errors import DataFileError, XnnError
from xnn.training.committee import UNCERTAINTY_KEYS, clip_groups, committee_size
from xnn.training.losses import NO_LABELS, TermSpec, has_labels, loss_terms
from xnn.training.metrics import MetricSums
from xnn.training.prediction import Evaluated, make_local_predictor, stress_labelled
from xnn.training.reducer import LocalReducer, Pending, ensure_grads


class NonFiniteLossError(XnnError, FloatingPointError):
    """The loss became NaN or infinite."""


def micro_batches(graphs) -> list[list[AtomicGraph]]:
    """``graphs`` as a list of micro-batches: a list of graphs is one micro-batch, a list of
    lists of graphs is several."""
    graphs = list(graphs)
    if graphs and isinstance(graphs[0], (list, tuple)):
        return [list(g) for g in graphs]
    return [graphs]


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
        grad_clip: max global gradient norm (``None``: no clipping); of each member's
            gradients for a committee.
        compile: predict through compiled kernels in training steps
            (:class:`~xnn.models.compiled_training.CompiledProperties`; evaluation stays
            eager); ``True`` for inductor, or the name of a ``torch.compile`` backend. Not
            with ``autocast``; only without ``predictor``.
        predictor: the prediction function (see :mod:`xnn.training.prediction`) from the
            parallelization layer; ``None``: one process
            (:class:`~xnn.training.prediction.LocalPredictor`).
        memory: a :class:`~xnn.training.memory.MemoryTools` whose ``context()`` wraps each
            step's forwards and backwards (CPU offload, allocator profile), or ``None``.
    """

    def __init__(self, model: nn.Module, specs: dict[str, TermSpec], optimizer, schedule=None,
                 ema=None, reducer=None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
                 grad_clip: float | None = None, compile: bool | str = False,
                 predictor=None, memory=None):
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
        if predictor is not None and compile:
            raise ValueError("pass compile to the predictor's factory, not with a predictor")
        if predictor is None:
            predictor = make_local_predictor(model, self.device, dtype, autocast, compile,
                                             self.need_forces, self.need_stress)
        self.predictor = predictor

    # ------------------------------------------------------------------ helpers
    def _global_counts(self, micro: list[list[AtomicGraph]],
                       counts: Sequence[float] | None) -> Pending:
        """The global batch's label counts: given (on the device), or all-reduced (started
        now, waited for when needed)."""
        if counts is not None:
            return Pending(torch.tensor(counts, dtype=torch.float64, device=self.device))
        local = sum(self.predictor.local_counts(g) for g in micro)
        return self.reducer.all_reduce_sum_async(local)

    def _loss(self, ev: Evaluated, counts: Tensor) -> Tensor:
        """This rank's share of the loss of one piece (plus the piece's exact-zero anchor)."""
        try:
            loss, _ = loss_terms(ev.res, self.specs, counts)
        except ValueError:
            if ev.anchor is None:
                raise
            return ev.anchor  # nothing labelled here: still join every collective's backward
        return loss if ev.anchor is None else loss + ev.anchor

    def _refusal(self, refused: DataFileError | None) -> DataFileError:
        """The error every rank raises when some rank met bad data: the first such rank's
        (one gather: the text crosses ranks only in this failure case)."""
        texts = self.reducer.gather_objects(None if refused is None else str(refused))
        return DataFileError(next(t for t in texts if t is not None))

    # ------------------------------------------------------------------ training
    def train_step(self, graphs, step: int, metrics: MetricSums | None = None,
                   stop_vote: bool = False, counts: Sequence[float] | None = None,
                   refused: DataFileError | None = None) -> float:
        """One optimizer step on this rank's share ``graphs`` of a global batch.

        Cross-rank cost: one collective sums the gradients, the loss, the stop votes and the
        refusals (and without ``counts``, one more sums the label counts while the forward
        pass runs); the host waits for the device once per step (to check the loss and the
        refusals before the optimizer changes anything).

        Args:
            graphs: one-system graphs with edges (may be empty on some ranks), or a list of
                such lists: micro-batches, one forward/backward each, accumulated into ONE
                gradient reduction and optimizer step.
            step: global optimizer step number (sets the learning rate).
            metrics: accumulates training errors if given.
            stop_vote: this rank's vote to stop after this step; the sum over ranks is
                :attr:`stop_votes` afterwards (summed with the loss: no extra collective).
            counts: labelled energies, force components and stress components of the whole
                step (all its global batches: the dataset's ``batch_label_counts``);
                ``None``: summed over the ranks' shares.
            refused: why this rank could not read its share (then ``graphs`` is empty): a
                vote that stops every rank (summed with the loss: no extra collective).
        Returns:
            the loss of the step's global batches (identical on every rank).
        Raises:
            DataFileError: some rank passed ``refused``: the same error on every rank, that
                of the first such rank (no parameter was changed).
            NonFiniteLossError: NaN/inf loss (idem).
            ValueError: no weighted property has labels in the global batch (idem).
        """
        self.model.train()
        micro = micro_batches(graphs)
        pending = self._global_counts(micro, counts)
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        with self.memory.context() if self.memory else contextlib.nullcontext():
            for part in micro:
                for piece in self.predictor.pieces(part):  # one backward each: losses add up
                    ev = self.predictor(piece, self.need_forces, self.need_stress,
                                        training=True)
                    loss_t = self._loss(ev, pending.wait())
                    loss_t.backward()
                    loss = loss + loss_t.detach().to(torch.float64)
                    if metrics is not None:
                        metrics.add(ev.metric_res, ev.numbers)
        counts = pending.wait()
        params = ensure_grads(p for p in self.model.parameters() if p.requires_grad)
        votes = torch.tensor([float(bool(stop_vote)), float(refused is not None)],
                             dtype=torch.float64, device=self.device)
        # loss, stop votes and refusals ride in the gradients' collective
        summed = self.reducer.all_reduce_grads(params, torch.cat([loss.reshape(1), votes]))
        # the step's one wait for the device: global loss, votes, counts and the local loss
        total, stops, refusals, *host = torch.cat([summed, counts, loss.reshape(1)]).tolist()
        self.stop_votes = int(stops)
        if refusals:
            self.optimizer.zero_grad(set_to_none=True)
            raise self._refusal(refused)
        if not math.isfinite(total) or not has_labels(self.specs, host[:3]):
            self.optimizer.zero_grad(set_to_none=True)
            if not math.isfinite(total):
                raise NonFiniteLossError(f"the loss became {total} at step {step}")
            raise ValueError(NO_LABELS)
        if self.grad_clip is not None:  # per member of a committee
            for group in clip_groups(self.model, params):
                torch.nn.utils.clip_grad_norm_(group, self.grad_clip)
        if self.schedule is not None:
            self.schedule.apply(step)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update(self.model)
        if metrics is not None:
            metrics.add_loss(host[3], 1 if self.reducer.rank == 0 else 0)
        return total

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, dataset, batches: Sequence[Sequence[int]], shard,
                 collect: bool = False, load=None) -> tuple[MetricSums, dict | None]:
        """Errors of the model (EMA weights if any) over ``batches`` of ``dataset``.

        Args:
            dataset: structures with edges.
            batches: global batches of indices (identical on every rank).
            shard: ``shard(batch) -> this rank's indices``.
            collect: also return this rank's parity data ``{"energy": (ref, pred) per atom,
                "forces": (ref, pred), "stress": (ref, pred) tensor components}`` as numpy
                arrays; for a committee also ``{energy,forces,stress}_uncertainty``:
                (|error|, predicted std) rows (:func:`~xnn.training.committee.uncertainty_parity`).
            load: ``load(dataset, indices) -> graphs`` (default: ``dataset[i]`` each).
        Returns:
            ``(metrics, parity)``: metric sums reduced over ranks; parity or ``None``.
        Raises:
            DataFileError: a rank could not read its share of a batch (e.g. coincident
                atoms): it evaluates no more, votes in the metrics' all-reduce, and every
                rank raises the first such rank's error.
        """
        self.model.eval()
        ctx = self.ema.applied(self.model) if self.ema is not None else contextlib.nullcontext()
        sums = MetricSums(self.device)
        parity: dict[str, list] = {"energy": [], "forces": [], "numbers": [], "stress": []}
        if committee_size(self.model) > 1:  # (|error|, predicted std) rows
            parity.update({key: [] for key in UNCERTAINTY_KEYS.values()})
        refused = None
        with ctx:
            for global_batch in batches:
                mine = shard(global_batch)
                try:
                    graphs = load(dataset, mine) if load else [dataset[i] for i in mine]
                except DataFileError as e:  # the vote joins the metrics' all-reduce below
                    refused = e
                    break
                if not graphs:  # the counts come from metadata: no collective to join
                    continue
                counts = self._global_counts([graphs],
                                             dataset.batch_label_counts(global_batch)).wait()
                partial = 0.0
                for piece in self.predictor.pieces(graphs):
                    ev = self.predictor(piece, True, stress_labelled(piece), training=False,
                                        parity=collect)
                    with torch.no_grad():
                        partial += float(loss_terms(ev.res, self.specs, counts)[0])
                    sums.add(ev.metric_res, ev.numbers)
                    sums.add_spread(ev.spread)
                    if collect:
                        for k in parity:
                            if k in ev.parity:
                                parity[k].append(ev.parity[k])
                sums.add_loss(partial, 1 if self.reducer.rank == 0 else 0)
        vote = torch.full((1,), float(refused is not None), dtype=sums.values.dtype,
                          device=sums.values.device)
        summed = self.reducer.all_reduce_sum(torch.cat([sums.values, vote]))
        sums.values, refusals = summed[:-1], int(summed[-1])
        self.model.train()
        if refusals:
            raise self._refusal(refused)
        if not collect:
            return sums, None
        return sums, {k: _cat(v) for k, v in parity.items()}


def _cat(parts: list[Tensor]):
    if not parts:
        return None
    return torch.cat(parts).cpu().double().numpy() if parts[0].is_floating_point() \
        else torch.cat(parts).cpu().numpy()
