"""The one entry that applies parallelism from outside to a run written for one process.

:func:`~xnn.distributed.parallelize.parallelize` is the only
constructor of a decomposition: it resolves the mode (one word of
:data:`~xnn.distributed.modes.MODES`, :func:`~xnn.distributed.parallelize.resolve_mode`) and
returns the one :class:`~xnn.distributed.potential.DecomposedPotential` with its layout.
Every decomposed entry goes through it: MD and relaxation (:func:`parallelize_md`), training
(:func:`parallelize_train`), ``xnn validate`` and the
:class:`~xnn.distributed.DistributedCalculator`.

As torchtitan's ``parallelize_*`` functions do for a model, :func:`parallelize_md` takes the
single-process objects of an MD or relaxation run (the potential) and the run's
:class:`~xnn.distributed.DistributedManager`, and returns the run layer the application
drives: :class:`~xnn.dynamics.parallel.SerialRun` in one process, or
:class:`~xnn.distributed.md_run.DomainRun` (each rank owns the atoms of its box) on several
ranks. The integrators, FIRE and the safety checks are the same functions in both cases;
they see the run layer's ``potential`` and ``reduce``.

:func:`parallelize_train` does the same for ``xnn train``: from the manager and the
``dp × dd`` degrees it returns the reducer, the sharding of global batches and the
prediction function the :class:`~xnn.training.trainer.Trainer` and
:class:`~xnn.training.loop.TrainingLoop` use; with ``dd > 1`` each structure is decomposed
over its ``dd`` group by the same domain code as MD (:mod:`xnn.distributed.cp_train`).
"""

from __future__ import annotations

from xnn.dynamics.parallel import SerialRun

__all__ = ["parallelize_md", "parallelize_train"]


def parallelize_md(model, manager=None, skin: float = 0.0,
                   backend: str = "auto", mode: str = "spatial",
                   order: str = "morton", compile: bool = False,
                   model_compile: bool = False, balance: str = "none",
                   exchange: str = "direct") -> SerialRun:
    """The run layer of an ``xnn md`` / ``xnn relax`` run.

    Args:
        model: the run's model (the same on every rank).
        manager: the :class:`~xnn.distributed.DistributedManager` of a run launched on
            several ranks; ``None``: one process (the potential is a
            :class:`~xnn.models.Potential`).
        skin: Verlet skin (Å) of the neighbor lists.
        backend: neighbor-list backend.
        mode: a key of :data:`~xnn.distributed.modes.MODES` (``auto``: chosen on the
            structure when it is scattered); ``order``: atom order of mode graph. See
            :class:`~xnn.distributed.md_run.DomainRun`.
        compile: ``md.compile``: on several ranks the run layer is a
            :class:`~xnn.distributed.domain.compiled_run.CompiledDomainRun` (mode halo,
            migration inside the compiled step); ignored in one process. The run layer
            says which through its ``compiled_integrator`` method.
        model_compile: ``model.compile``: the one-process potential compiles the model
            (:class:`~xnn.models.Potential`).
        balance: ``parallel.balance``: how the boxes are cut (``none``, ``shift``; see
            :func:`~xnn.distributed.parallelize.parallelize`); ignored in one process.
        exchange: ``parallel.exchange``: how ghost rows travel (``direct``, ``staged``;
            eager and compiled runs alike); ignored in one process.
    Returns:
        a :class:`~xnn.dynamics.parallel.SerialRun` (one process) or a
        :class:`~xnn.distributed.md_run.DomainRun` (its subclass, several ranks).
    """
    if manager is None:
        from xnn.models import Potential

        return SerialRun(Potential(model, skin=skin, backend=backend, compile=model_compile))
    from xnn.distributed.md_run import DomainRun

    if compile:
        from xnn.distributed.domain.compiled_run import CompiledDomainRun

        return CompiledDomainRun(model, manager, skin=skin, backend=backend, mode=mode,
                                 order=order, balance=balance, exchange=exchange)
    return DomainRun(model, manager, skin=skin, backend=backend, mode=mode, order=order,
                     balance=balance, exchange=exchange)


class TrainParallel:
    """What the training step and loop take from the parallelization layer.

    Attributes:
        dims: the :class:`~xnn.distributed.mesh.ParallelDims` (``None``: one process or a
            given reducer).
        reducer: gradients, loss, counts and metrics summed over the whole mesh.
        sharding: ``sharding(batch, n_atoms, max_atoms) -> indices`` of this rank's ``dd``
            group and ``sharding.load(dataset, indices) -> graphs``
            (:class:`~xnn.distributed.cp_train.BatchSharding`); its ``groups`` is the
            ``groups`` argument of ``make_batches``.
    """

    def __init__(self, reducer, sharding, dims=None, mode: str = "spatial",
                 backend: str = "auto", balance: str = "none", exchange: str = "direct"):
        self.reducer, self.sharding, self.dims = reducer, sharding, dims
        self.mode, self.backend, self.balance = mode, backend, balance
        self.exchange = exchange

    @property
    def dd(self) -> int:
        return 1 if self.dims is None else self.dims.dd

    def predictor(self, model, device, dtype, autocast=None, compile: bool | str = False,
                  forces: bool = True, stress: bool = True):
        """The training step's prediction function for ``model``: collated batches through
        ``compute_properties`` (``dd == 1``), or each structure decomposed over the ``dd``
        group (:class:`~xnn.distributed.cp_train.DomainPredictor`)."""
        if self.dd == 1:
            from xnn.training.prediction import make_local_predictor

            return make_local_predictor(model, device, dtype, autocast, compile, forces,
                                        stress)
        from xnn.distributed.cp_train import DomainPredictor

        return DomainPredictor(model, self.dims.dd_group, device, dtype, autocast, self.mode,
                               self.backend, self.balance, self.exchange)


def local_train_parallel(reducer=None) -> TrainParallel:
    """Data parallelism by a given reducer (default: one process): each rank takes its share
    by its rank among ``reducer.world_size`` (today's behaviour of a plain reducer)."""
    from xnn.distributed.cp_train import BatchSharding
    from xnn.training.reducer import LocalReducer

    reducer = reducer or LocalReducer()
    return TrainParallel(reducer, BatchSharding(reducer.rank, reducer.world_size))


def parallelize_train(manager=None, dp: int = -1, dd: int = 1, compile: bool | str = False,
                      mode: str = "spatial", backend: str = "auto",
                      balance: str = "none", exchange: str = "direct") -> TrainParallel:
    """The parallel layer of an ``xnn train`` run on a ``dp × dd`` mesh (built once, here).

    Args:
        manager: the run's :class:`~xnn.distributed.DistributedManager` (``None``: one
            process).
        dp, dd: data-parallel and domain-decomposition degrees (``-1``: inferred);
            ``dp × dd`` must equal the world size.
        compile: the run's ``compile`` setting (refused with ``dd > 1``).
        mode: decomposition mode of ``dd > 1``, a key of
            :data:`~xnn.distributed.modes.MODES` (``"spatial"``: sync where the model has
            sync points, else halo; ``"graph"``: graph parallelism, atoms split by index).
        backend: neighbor-list backend of the decomposed local graphs.
        balance: how the spatial modes cut each structure's boxes (``none``, ``shift``).
        exchange: how the spatial modes send ghost rows (``direct``, ``staged``).
    Returns:
        a :class:`TrainParallel`: the reducer (whole mesh), the sharding (by dp rank) and
        the predictor factory.
    Raises:
        InputError: ``dp × dd`` is not the world size, or ``compile`` with ``dd > 1``.
    """
    from xnn.distributed.cp_train import BatchSharding
    from xnn.errors import InputError
    from xnn.training.reducer import LocalReducer

    if manager is None or not manager.is_distributed:
        from xnn.distributed.mesh import ParallelDims

        ParallelDims(dp=dp, dd=dd, world_size=1)  # the same check and message
        return local_train_parallel(LocalReducer())
    from xnn.distributed.ddp import DataParallelReducer

    dims = manager.mesh(dp=dp, dd=dd)
    if dims.dd > 1 and compile:
        raise InputError(f"compile=true does not support parallel.dd={dims.dd} (the halo "
                         "exchange of domain-decomposed training is not compiled); set "
                         "compile=false or parallel.dd=1")
    if dims.dd == 1:
        return TrainParallel(DataParallelReducer(dims.dp_group),
                             BatchSharding(dims.dp_rank, dims.dp), dims)
    sharding = BatchSharding(dims.dp_rank, dims.dp, groups=dims.dp, without_edges=True)
    return TrainParallel(DataParallelReducer(None), sharding, dims, mode, backend, balance,
                         exchange)
