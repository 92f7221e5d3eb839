"""NVT Langevin dynamics with the BAOAB splitting (Leimkuhler & Matthews 2013).

``B`` half kick, ``A`` half drift, ``O`` exact Ornstein–Uhlenbeck step
``v ← c₁ v + c₂ sqrt(k_B T / m) ξ`` with ``c₁ = exp(-γ dt)``, ``c₂ = sqrt(1 - c₁²)``,
``A`` half drift, force call, ``B`` half kick. For systems without fixed atoms the
noise's centre-of-mass part is removed, so total momentum stays zero (``3N - 3`` DOF).
The noise ``ξ`` of step ``n`` is keyed by (seed, ``n``, system index, global atom id,
component) (:mod:`xnn.dynamics.random`): it does not depend on the atoms' order or on
which process holds them.

Variables: ``temperature [n_systems]`` (K), ``friction [n_systems]`` (1/fs),
``heat [n_systems]`` (eV, kinetic energy removed by the thermostat, for the conserved quantity).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.dynamics import nve, random
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    check_timestep,
    com_terms,
    initial_state,
    kinetic_energy,
    kinetic_per_atom,
    new_rng,
    per_system,
    seed_of,
    system_words,
    without_com,
)
from xnn.units import KB, MVV2E


def init(
    state: AtomicGraph, model, temperature, friction: float = 0.01, seed: int = 0,
    reduce: Reducer = LOCAL,
) -> MDState:
    """Start BAOAB Langevin dynamics.

    Args:
        state: graph with velocities (Å/fs).
        model: a :class:`~xnn.models.Potential`.
        temperature: K, scalar or ``[n_systems]``.
        friction: γ (1/fs), scalar or ``[n_systems]``, > 0.
        seed: seed of the thermostat noise.
        reduce: global reductions (the default: this process holds every atom).
    """
    ref = state.positions
    n = state.n_systems
    vars_ = {
        "temperature": per_system(temperature, n, ref, "temperature"),
        "friction": per_system(friction, n, ref, "friction", positive=True),
        "heat": ref.new_zeros(n),
    }
    return initial_state(model, state, vars_, new_rng(seed), reduce)


def noise(state: MDState) -> Tensor:
    """``[n_atoms, 3]`` standard normals of the O step taken from ``state.step``."""
    g = state.graph
    key_step, sys_words = system_words(state.vars, state.step, g.n_systems, g.device)
    words = random.atom_words(g.batch, g.atom_id, 3, sys_words)
    xi = random.normal(seed_of(state.rng), key_step, random.STREAMS["langevin"], *words)
    return xi.to(g.dtype)


def ou_step(state: MDState, dt: float, reduce: Reducer, xi: Tensor | None = None) -> MDState:
    """Exact Ornstein–Uhlenbeck update of the velocities over ``dt``; ``xi`` ``[n_atoms, 3]``
    the standard normals (default: :func:`noise` of this step)."""
    g = state.graph
    xi = noise(state) if xi is None else xi
    c1 = torch.exp(-state.vars["friction"] * dt)[g.batch, None]
    c2 = torch.sqrt(1.0 - c1 * c1)
    sigma = torch.sqrt(KB * state.vars["temperature"][g.batch] / (g.masses * MVV2E))[:, None]
    v = c1 * g.velocities + c2 * sigma * xi
    # the centre-of-mass sums and the old kinetic energy in one reduction
    mom, mass, n_fixed, k_old = reduce.sums_per_system(
        com_terms(v, g) + [kinetic_per_atom(g)], g.batch, g.n_systems)
    new = g.replace(velocities=without_com(v, g, mom, mass, n_fixed))
    dk = kinetic_energy(new, reduce) - k_old
    return state.replace(graph=new, vars={"heat": state.vars["heat"] - dk})


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs): B A O A (force) B."""
    dt = check_timestep(dt)
    s = nve.half_kick(state, dt)
    s = s.replace(graph=nve.drift(s, 0.5 * dt))
    s = ou_step(s, dt, reduce)
    s = nve.with_positions(s, model, nve.drift(s, 0.5 * dt))
    return nve.half_kick(s, dt)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` E_pot + E_kin + heat given to the bath (eV); constant up to the
    integration error."""
    return state.energy + kinetic_energy(state.graph, reduce) + state.vars["heat"]
