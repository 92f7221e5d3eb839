"""Context-parallel training: a global batch over a ``dp × dd`` mesh of ranks.

Each ``dd`` group (the ``dd`` consecutive ranks of one data-parallel replica, see
:class:`~xnn.distributed.mesh.ParallelDims`) takes one share of the global batch; every rank
of the group takes the same share (:class:`~xnn.training.sharding.BatchSharding`). Each
structure of the share is decomposed spatially over the group with the MD domain code
(:func:`~xnn.distributed.parallelize.parallelize`, mode ``"spatial"``: sync for models with
sync points, else halo): the group's first rank scatters it and every rank evaluates only its
owned atoms and their ghosts (:class:`DomainPredictor`). Then

* forces are per owned atom, compared with the labels the scattered atoms carry (the
  atoms travel with every per-atom field, sorted by global atom id);
* energy and stress are totals replicated on the group's ranks: their loss terms carry
  weights divided by the group size, so the sum over ranks is the loss (the adjoint of the
  all-reduce then gives each rank the true gradient);
* the loss is normalised by the global label counts; gradients, loss and metrics are summed
  over the WHOLE mesh by one :class:`~xnn.distributed.ddp.DataParallelReducer` over all
  ranks; energy and stress metrics are counted by the group's first rank only, force metrics
  by the owner of each atom: every item is counted once per group;
* each structure is backpropagated on its own (losses are additive): the activations of one
  structure's owned atoms are alive at a time;
* a structure with coincident atoms is refused when the group's ranks read it
  (:meth:`~xnn.neighbors.datasets.WithEdges.without_edges`: every rank of the group reads the
  same share and reaches the same verdict), so the whole group passes an empty share and the
  refusal to the step, whose vote in the gradients' all-reduce stops every rank of the mesh
  with the same error (:meth:`~xnn.training.trainer.Trainer.train_step`).

:func:`xnn.distributed.entries.parallelize_train` builds these from the run's manager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.training.losses import labelled, take
from xnn.training.prediction import Evaluated, stress_parity
from xnn.training.sharding import BatchSharding  # noqa: F401 - re-exported


class DomainPredictor:
    """Each structure of a share evaluated decomposed over the ranks of a ``dd`` group.

    Args:
        model: per-atom-energy model with ``cutoff`` (on ``device`` in ``dtype``).
        group: the ``dd`` process group.
        device: where the owned atoms go.
        dtype: floating dtype of the structures.
        autocast: ``torch.bfloat16`` for bf16 mixed precision, else ``None``.
        mode: ``"spatial"`` (sync where the model has sync points, else halo), ``"halo"``,
            ``"sync"`` or ``"graph"`` (graph parallelism: atoms split by index).
        backend: neighbor-list backend of the local graphs.
        balance: how the spatial modes cut the boxes (``none``, ``shift``).
        exchange: how the spatial modes send ghost rows (``direct``, ``staged``).

    Attributes:
        last_stats: :meth:`DecomposedPotential.stats` of the last evaluation plus ``n_total``.
    """

    def __init__(self, model: nn.Module, group, device, dtype: torch.dtype,
                 autocast: torch.dtype | None = None, mode: str = "spatial",
                 backend: str = "auto", balance: str = "none", exchange: str = "direct"):
        from xnn.distributed import collectives as C
        from xnn.distributed.parallelize import resolve_mode
        from xnn.distributed.potential import model_cutoff

        self.model = model
        self.group = group
        self.device = torch.device(device)
        self.dtype = dtype
        self.autocast = autocast
        cutoff, hops = model_cutoff(model)
        if mode == "auto":
            raise InputError("training decomposes with mode spatial, halo, sync or graph, not "
                             "auto (the cost model weighs one structure, not a dataset)")
        self.mode, _ = resolve_mode(model, mode)
        if self.mode == "graph":  # refuse a model graph parallelism cannot split, up front
            from xnn.distributed.graph.layout import check_graph_model

            check_graph_model(model, cutoff, hops)
        self.backend, self.balance, self.exchange = backend, balance, exchange
        self.size, self.rank = C.group_size(group), C.group_rank(group)
        self.last_stats: dict = {}

    def pieces(self, graphs: Sequence[AtomicGraph]) -> list[list[AtomicGraph]]:
        """One piece per structure (each one forward/backward)."""
        return [[g] for g in graphs]

    def local_counts(self, graphs: Sequence[AtomicGraph]) -> Tensor:
        """The share's labelled items, counted by the group's first rank only."""
        from xnn.data.datasets import collate
        from xnn.training.losses import local_counts

        if self.rank != 0 or not graphs:
            return local_counts(None, self.device)
        return local_counts(collate(graphs), self.device)

    def _context(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def __call__(self, piece: Sequence[AtomicGraph], forces: bool, stress: bool,
                 training: bool, parity: bool = False) -> Evaluated:
        """Residuals of this rank's owned atoms of the one structure in ``piece``
        (collective over the group: every rank passes the same structure)."""
        from xnn.distributed.parallelize import parallelize

        (graph,) = piece
        pot = parallelize(self.model, self.group, self.mode, backend=self.backend,
                          balance=self.balance, exchange=self.exchange)
        root = graph.without_edges().to(self.device, self.dtype) if self.rank == 0 else None
        owned = pot.scatter(root)  # each rank receives only the atoms of its box
        with self._context():
            out = pot(owned, forces, stress, training)
        out = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in out.items()}
        self.last_stats = {**pot.stats(), "n_total": pot.n_total}
        res, metric, numbers = self._residuals(out, owned, pot.n_total)
        anchor = None
        if training:
            anchor = 0.0 * sum(out[k].sum() for k in (K.ENERGY, K.FORCES, K.STRESS) if k in out)
        par = self._parity(out, owned, pot.n_total) if parity else None
        return Evaluated(res, metric, numbers, par, anchor)

    def _residuals(self, out: dict[str, Tensor], owned: AtomicGraph, n_total: int):
        """``(loss residuals, metric residuals, force numbers)`` of the owned atoms; the
        replicated energy and stress carry weights ``w / size`` and count in the metrics of
        the group's first rank only."""
        index = labelled(owned)
        w = owned.get(K.WEIGHT)
        w = torch.ones(1, dtype=self.dtype, device=owned.device) if w is None else w
        res: dict = {}
        metric: dict = {}
        numbers = None
        for name, key in (("energy", K.ENERGY), ("forces", K.FORCES), ("stress", K.STRESS)):
            if key not in out or name not in index:
                continue
            idx = index[name]
            diff = out[key] - owned[key].to(out[key].dtype)
            if name == "forces":
                res[name] = (take(diff, idx), take(w.expand(owned.n_atoms), idx))
                metric[name] = res[name]
                numbers = take(owned.numbers, idx)
                continue
            if name == "energy":
                diff = diff / n_total
            res[name] = (take(diff, idx), take(w / self.size, idx))
            if self.rank == 0:
                metric[name] = res[name]
        return res, metric, numbers

    def _parity(self, out, owned: AtomicGraph, n_total: int) -> dict[str, Tensor]:
        index = labelled(owned)
        ie, i_f = index.get("energy"), index.get("forces")
        energy = torch.stack([owned.energy / n_total, out[K.ENERGY].detach() / n_total], -1)
        energy = take(energy, ie) if self.rank == 0 else energy[:0]
        f = torch.stack([take(owned.forces, i_f), take(out[K.FORCES].detach(), i_f)], -1)
        stress = stress_parity(out, owned, index.get("stress"))  # replicated: rank 0's
        return {"energy": energy, "forces": f.reshape(-1, 2),
                "numbers": take(owned.numbers, i_f),
                "stress": stress if self.rank == 0 else stress[:0]}
