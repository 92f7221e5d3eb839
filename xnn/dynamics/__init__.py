"""Molecular dynamics and relaxation: integrators as ``init``/``step`` pairs, a registry,
the runner behind ``xnn md`` / ``xnn relax``, and safety checks.

Every integrator module (:mod:`~xnn.dynamics.nve`, :mod:`~xnn.dynamics.langevin`,
:mod:`~xnn.dynamics.nhc`, :mod:`~xnn.dynamics.csvr`, :mod:`~xnn.dynamics.npt`,
:mod:`~xnn.dynamics.fire`) provides ``init(graph, model, ...) -> MDState``,
``step(state, model, dt, reduce) -> MDState`` and ``conserved(state, reduce)``.
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
