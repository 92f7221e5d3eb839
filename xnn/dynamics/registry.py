"""Integrators by name: each is a module with ``init(graph, model, ..., reduce)``,
``step(state, model, dt, reduce)`` and ``conserved(state, reduce)`` (``reduce``: a
:class:`~xnn.dynamics.reduce.Reducer`; FIRE's ``step`` takes ``fmax_target`` for ``dt``)."""

from __future__ import annotations

import importlib
from types import ModuleType

from xnn.errors import InputError

_INTEGRATORS: dict[str, str] = {
    "nve": "xnn.dynamics.nve",
    "langevin": "xnn.dynamics.langevin",
    "nhc": "xnn.dynamics.nhc",
    "csvr": "xnn.dynamics.csvr",
    "npt": "xnn.dynamics.npt",
    "fire": "xnn.dynamics.fire",
}

#: ensembles of molecular dynamics (``fire`` is a relaxation)
MD_ENSEMBLES = ("nve", "langevin", "nhc", "csvr", "npt")


def available_integrators() -> list[str]:
    return list(_INTEGRATORS)


def register_integrator(name: str, module: str) -> None:
    """Register a module path providing ``init``/``step``/``conserved`` under ``name``."""
    _INTEGRATORS[name] = module


def get_integrator(name: str) -> ModuleType:
    """The integrator module for ``name``; unknown names raise with the valid choices."""
    if name not in _INTEGRATORS:
        raise InputError(f"unknown ensemble/integrator {name!r}; choose one of "
                         f"{available_integrators()}")
    return importlib.import_module(_INTEGRATORS[name])
