"""The one entry that applies parallelism from outside to a run written for one process.

As torchtitan's ``parallelize_*`` functions do for a model, :func:`parallelize_md` takes the
single-process objects of an MD or relaxation run (the potential) and the run's
:class:`~xnn.distributed.DistributedManager`, and returns the run layer the application
drives: :class:`~xnn.dynamics.parallel.SerialRun` in one process, or
:class:`~xnn.distributed.md_run.DomainRun` (each rank owns the atoms of its box) on several
ranks. The integrators, FIRE and the safety checks are the same functions in both cases;
they see the run layer's ``potential`` and ``reduce``.
"""

from __future__ import annotations

from xnn.dynamics.parallel import SerialRun


def parallelize_md(potential, manager=None, skin: float = 0.0,
                   backend: str = "auto") -> SerialRun:
    """The run layer of an ``xnn md`` / ``xnn relax`` run.

    Args:
        potential: the single-process :class:`~xnn.models.Potential` (its model is reused
            by the decomposed potential).
        manager: the :class:`~xnn.distributed.DistributedManager` of a run launched on
            several ranks; ``None``: one process.
        skin: Verlet skin (Å) of the decomposed neighbor lists.
        backend: neighbor-list backend of the decomposed potential.
    Returns:
        a :class:`~xnn.dynamics.parallel.SerialRun` (one process) or a
        :class:`~xnn.distributed.md_run.DomainRun` (its subclass, several ranks).
    """
    if manager is None:
        return SerialRun(potential)
    from xnn.distributed.md_run import DomainRun

    return DomainRun(potential.model, manager, skin=skin, backend=backend)
