"""The run layer of ``xnn md compile=true`` on several ranks: a
:class:`~xnn.distributed.md_run.DomainRun` whose steps are compiled
(:mod:`xnn.distributed.domain.compiled`) and migrate inside the step."""

from __future__ import annotations

from xnn.distributed.md_run import DomainRun
from xnn.distributed.parallelize import parallelize
from xnn.errors import InputError


class CompiledDomainRun(DomainRun):
    """:class:`~xnn.distributed.md_run.DomainRun` in mode ``halo`` (``spatial``, ``halo``,
    ``sync`` and ``auto`` run halo here; ``graph`` is refused) for the compiled decomposed
    steps of NVE, Langevin, CSVR and NHC
    (:class:`~xnn.distributed.domain.compiled_thermo.CompiledDomainIntegrator`).

    The potential is a :class:`~xnn.distributed.DecomposedPotential` in mode ``halo`` also for
    models with sync points (their exchanges would break the compiled model region), and
    :meth:`after_step` leaves the state as it is: the compiled step migrates itself.
    ``exchange`` (``direct`` or ``staged``) is the eager decomposed run's: the compiled step
    sends its ghosts through the plan's staged routing when it has one.
    """

    def __init__(self, model, manager, skin: float, backend: str, mode: str = "halo",
                 order: str = "morton", balance: str = "none", exchange: str = "direct"):
        if mode == "graph":
            raise InputError("compile=true on several ranks runs parallel.mode halo, not graph: "
                             "set parallel.mode: spatial (or halo) or compile: false")
        super().__init__(model, manager, skin, backend, "halo", order, balance, exchange)
        self.potential = parallelize(model, manager, "halo", skin=skin, backend=backend,
                                     balance=balance, exchange=exchange)
        self.reduce = self.potential.reducer

    def after_step(self, state):
        return state

    def compiled_integrator(self, ensemble: str = "nve", cuda_graph: bool = False):
        """The compiled integrator of ``ensemble`` (``nve``, ``langevin``, ``csvr``,
        ``nhc``) for this run's potential
        (:class:`~xnn.distributed.domain.compiled_thermo.CompiledDomainIntegrator`)."""
        from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator

        if cuda_graph:
            raise InputError("md.cuda_graph runs in one process; on several ranks set "
                             "cuda_graph: false (compile: true alone compiles the step)")
        return CompiledDomainIntegrator(ensemble, self.potential)
