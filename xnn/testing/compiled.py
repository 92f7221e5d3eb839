"""Contract: the model traces under the compiled MD step, and the compiled step follows eager.

:class:`xnn.dynamics.compiled.CompiledVerlet` traces the model's velocity-Verlet step into one
graph (``make_fx`` + ``torch.compile(fullgraph=True)``) per edge capacity. A model that calls
Python on tensor values, changes shapes with its input, or keeps state between calls fails
here. The compiled trajectory must be the eager one (:mod:`xnn.dynamics.nve`) to round-off in
float64, with no compilation after the first step.
"""

from __future__ import annotations

import unittest

import torch

from xnn.data.graph import AtomicGraph
from xnn.testing.common import as_fp64, assert_close
from xnn.testing.systems import random_periodic_system

#: default largest absolute differences, compiled vs eager, float64 (those of
#: ``tests/test_compiled_md.py``): positions Å, velocities Å/fs, forces eV/Å, energy eV,
#: stress eV/Å³
COMPILED_ATOL = {"positions": 1e-10, "velocities": 1e-12, "forces": 1e-10, "energy": 1e-10,
                 "stress": 1e-12}


def unique_graphs() -> int:
    """Graphs torch.compile (dynamo) has made in this process so far."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_stepper(potential, backend: str):
    """The compiled velocity-Verlet stepper of ``potential`` (``stepper.step(state, dt)``;
    ``n_compiles``, ``n_rebuilds``). The one call of this contract into the compiled step."""
    from xnn.dynamics.compiled import CompiledVerlet

    return CompiledVerlet(potential, backend=backend)


def check_compiled_step(model: torch.nn.Module, graph: AtomicGraph | None = None,
                        steps: int = 10, dt: float = 1.0, temperature: float = 300.0,
                        skin: float = 0.4, backend: str = "aot_eager",
                        atol: dict[str, float] | None = None, seed: int = 0) -> dict:
    """``steps`` compiled velocity-Verlet steps equal ``steps`` eager ones; no recompile.

    Args:
        model: any :class:`~xnn.models.base.AtomisticModel` (run in an fp64 copy).
        graph: one periodic system (default: 16 random atoms of ``model.species`` (Ar), 2.8 Å
            apart); velocities are drawn at ``temperature`` (K) unless it carries them.
        steps: time steps of ``dt`` fs after the first (compiling) one.
        skin: Verlet skin (Å) of both runs' neighbor lists.
        backend: ``torch.compile`` backend (``"aot_eager"``: traced, not code-generated;
            ``"inductor"`` also generates code).
        atol: largest absolute differences per quantity (default :data:`COMPILED_ATOL`).
    Returns:
        ``{quantity: largest absolute difference, "n_compiles", "n_rebuilds", "eager",
        "compiled"}`` (the last two: the final :class:`~xnn.dynamics.state.MDState` s).
    Raises:
        AssertionError: the trajectories differ beyond ``atol``, or the step compiled again
            after the first step.
        unittest.SkipTest: the model declares ``traceable = False`` (long-range terms): the
            compiled step refuses it, nothing is promised.
    """
    from xnn.dynamics import maxwell_boltzmann, nve
    from xnn.models import Potential

    if not model.traceable:
        raise unittest.SkipTest(f"{type(model).__name__} declares traceable=False: the "
                                "compiled MD step does not run it")

    unknown = sorted(set(atol or {}) - set(COMPILED_ATOL))
    if unknown:
        raise ValueError(f"atol: unknown quantities {unknown}; valid: {list(COMPILED_ATOL)}")
    atol = {**COMPILED_ATOL, **(atol or {})}
    model, _ = as_fp64(model)
    if graph is None:
        graph = random_periodic_system(list(model.species or [18]), 16, 40.0, 2.8, seed=seed)
    model, graph = as_fp64(model, graph)
    if "velocities" not in graph:
        graph = maxwell_boltzmann(graph, temperature, seed=seed)
    eager_pot, compiled_pot = Potential(model, skin=skin), Potential(model, skin=skin)
    stepper = compiled_stepper(compiled_pot, backend)
    eager = compiled = nve.init(graph, eager_pot)
    eager, compiled = nve.step(eager, eager_pot, dt), stepper.step(compiled, dt)
    compiles, graphs = stepper.n_compiles, unique_graphs()
    if compiles != 1:
        raise AssertionError(f"the first compiled step compiled {compiles} graphs, expected 1")
    for _ in range(steps):
        eager, compiled = nve.step(eager, eager_pot, dt), stepper.step(compiled, dt)
    if stepper.n_compiles != compiles or unique_graphs() != graphs:
        raise AssertionError(f"the compiled step recompiled: {stepper.n_compiles - compiles} "
                             f"graphs after the first step (capacity {stepper.capacity})")
    pairs = {"positions": (compiled.positions, eager.positions),
             "velocities": (compiled.velocities, eager.velocities),
             "forces": (compiled.forces, eager.forces), "energy": (compiled.energy, eager.energy),
             "stress": (compiled.stress, eager.stress)}
    out = {name: assert_close(f"compiled {name}", *pairs[name], atol=tol, rtol=0.0)
           for name, tol in atol.items()}
    return {**out, "n_compiles": stepper.n_compiles, "n_rebuilds": stepper.n_rebuilds,
            "eager": eager, "compiled": compiled}
