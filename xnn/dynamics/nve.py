"""NVE: velocity Verlet.

``v ← v + a dt/2;  x ← x + v dt;  F ← F(x);  v ← v + a dt/2`` with ``a = F / m``.
The conserved quantity is the total energy.
"""

from __future__ import annotations

from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    accelerations,
    check_timestep,
    initial_state,
    kinetic_energy,
    with_positions,
)


def init(state: AtomicGraph, model, reduce: Reducer = LOCAL) -> MDState:
    """Evaluate forces on ``state`` (a graph with velocities, Å/fs) and start the integrator.

    ``reduce``: global reductions (the default: this process holds every atom)."""
    return initial_state(model, state, {}, reduce=reduce)


def kick(v: Tensor, a: Tensor, dt: float) -> Tensor:
    """``v + a dt/2``: velocity Verlet's half kick of velocities ``v`` (Å/fs) by
    accelerations ``a`` (Å/fs²). The eager, compiled and compiled decomposed steps all kick
    with it."""
    return v + (0.5 * dt) * a


def drift_positions(x: Tensor, v: Tensor, dt: float) -> Tensor:
    """``x + v dt``: velocity Verlet's drift of positions ``x`` (Å) at velocities ``v``
    (Å/fs). The eager, compiled and compiled decomposed steps all drift with it."""
    return x + dt * v


def half_kick(state: MDState, dt: float) -> MDState:
    """``v ← v + a dt/2`` (fixed atoms stay at rest)."""
    g = state.graph
    return state.replace(graph=g.replace(
        velocities=kick(g.velocities, accelerations(state.forces, g), dt)))


def drift(state: MDState, dt: float) -> AtomicGraph:
    """Graph with ``x ← x + v dt`` (forces not updated)."""
    g = state.graph
    return g.replace(positions=drift_positions(g.positions, g.velocities, dt))


def verlet(state: MDState, model, dt: float) -> MDState:
    """One velocity-Verlet step (one model call)."""
    s = half_kick(state, dt)
    s = with_positions(s, model, drift(s, dt))
    return half_kick(s, dt)


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    return verlet(state, model, check_timestep(dt))


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` total energy (eV)."""
    return state.energy + kinetic_energy(state.graph, reduce)
