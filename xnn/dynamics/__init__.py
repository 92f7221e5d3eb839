"""Molecular dynamics and relaxation as a library: integrators as ``init``/``step`` pairs,
a registry, FIRE, safety checks, the MD state and its checkpoints. No config and no
``torch.distributed``: the runs behind ``xnn md`` / ``xnn relax`` are the application's
(:mod:`xnn.app.md`, :mod:`xnn.app.relax`), and decomposition is applied from outside
(:func:`xnn.distributed.entries.parallelize_md`).

Every integrator module (:mod:`~xnn.dynamics.nve`, :mod:`~xnn.dynamics.langevin`,
:mod:`~xnn.dynamics.nhc`, :mod:`~xnn.dynamics.csvr`, :mod:`~xnn.dynamics.npt`,
:mod:`~xnn.dynamics.fire`) provides ``init(graph, model, ..., reduce) -> MDState``,
``step(state, model, dt, reduce) -> MDState`` and ``conserved(state, reduce)``.

``reduce`` (a :class:`Reducer`, default :data:`LOCAL`) computes every quantity that
combines atoms, so the same functions run on each rank of a domain-decomposed run, where
``state.graph`` holds that rank's atoms only and the model returns the global energy and
stress and the forces of those atoms. Random numbers (:mod:`xnn.dynamics.random`) are keyed
by seed, step and global atom id, so such a run follows the single-process trajectory.
"""

from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.registry import MD_ENSEMBLES, available_integrators, get_integrator
from xnn.dynamics.state import (
    MDState,
    degrees_of_freedom,
    kinetic_energy,
    maxwell_boltzmann,
    temperature,
)

__all__ = [
    "MDState",
    "Reducer",
    "LOCAL",
    "MD_ENSEMBLES",
    "available_integrators",
    "get_integrator",
    "degrees_of_freedom",
    "kinetic_energy",
    "maxwell_boltzmann",
    "temperature",
]
