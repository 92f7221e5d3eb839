"""NVT with the canonical-sampling velocity-rescaling thermostat (Bussi, Donadio, Parrinello 2007).

Each step is ``thermostat(dt/2)``, velocity Verlet, ``thermostat(dt/2)``. The thermostat
rescales the velocities of each system by ``α`` so that its kinetic energy ``K`` follows
the exact solution of

``dK = (K_t - K) dt/τ + 2 sqrt(K K_t / N_f) dW/sqrt(τ)``,  ``K_t = N_f k_B T / 2``:

``α² = c + (1-c)(S + R²) K_t/(N_f K) + 2 R sqrt(c (1-c) K_t/(N_f K))``, ``c = exp(-dt/τ)``,
``R`` a standard normal and ``S`` a sum of ``N_f - 1`` squared standard normals.

Variables: ``temperature [n_systems]`` (K), ``tau [n_systems]`` (fs), ``heat [n_systems]`` (eV).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.dynamics import nve
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    check_timestep,
    degrees_of_freedom,
    free_mask,
    generator,
    initial_state,
    kinetic_energy,
    new_rng,
    per_system,
)
from xnn.units import KB


def init(state: AtomicGraph, model, temperature, tau: float = 100.0, seed: int = 0) -> MDState:
    """Start CSVR dynamics.

    Args:
        state: graph with velocities (Å/fs); they must not all be zero.
        model: a :class:`~xnn.models.Potential`.
        temperature: K, scalar or ``[n_systems]``.
        tau: thermostat time constant (fs), scalar or ``[n_systems]``, > 0.
        seed: seed of the thermostat noise.
    """
    ref = state.positions
    n = state.n_systems
    vars_ = {
        "temperature": per_system(temperature, n, ref, "temperature"),
        "tau": per_system(tau, n, ref, "tau", positive=True),
        "heat": ref.new_zeros(n),
    }
    return initial_state(model, state, vars_, new_rng(seed, ref.device))


def _sum_squares(
    graph: AtomicGraph, count: Tensor, gen: torch.Generator, reduce: Reducer
) -> Tensor:
    """``[n_systems]`` sum of ``count [n_systems]`` squared standard normals (``<= 3 n_atoms``)."""
    xi = torch.randn(graph.positions.shape, generator=gen, dtype=graph.dtype, device=graph.device)
    ptr = graph.ptr
    local = torch.arange(graph.n_atoms, device=graph.device) - ptr[graph.batch]
    flat = 3 * local[:, None] + torch.arange(3, device=graph.device)
    keep = flat < count[graph.batch, None]
    sq = torch.where(keep, xi * xi, torch.zeros_like(xi)).sum(-1)
    return reduce.sum_per_system(sq, graph.batch, graph.n_systems)


def rescale(state: MDState, dt: float, reduce: Reducer) -> MDState:
    """Apply the stochastic velocity rescaling over a time ``dt`` (fs)."""
    g = state.graph
    gen = generator(state.rng, g.device)
    nf = degrees_of_freedom(g, reduce)
    k = kinetic_energy(g, reduce)
    kt = 0.5 * nf * KB * state.vars["temperature"]
    c = torch.exp(-dt / state.vars["tau"])
    r = torch.randn(g.n_systems, generator=gen, dtype=g.dtype, device=g.device)
    s = _sum_squares(g, (nf - 1).round().to(torch.long), gen, reduce)
    k_safe = k.clamp(min=torch.finfo(g.dtype).tiny)
    ratio = kt / (nf * k_safe)
    alpha2 = c + (1 - c) * (s + r * r) * ratio + 2 * r * torch.sqrt(c * (1 - c) * ratio)
    sign = torch.where(r + torch.sqrt(c / ((1 - c) * ratio)) < 0, -1.0, 1.0).to(g.dtype)
    alpha = torch.where(k > 0, sign * torch.sqrt(alpha2), torch.ones_like(alpha2))
    v = g.velocities * alpha[g.batch, None]
    v = torch.where(free_mask(g)[:, None], v, torch.zeros_like(v))
    new = g.replace(velocities=v)
    dk = kinetic_energy(new, reduce) - k
    return state.replace(graph=new, rng=gen.get_state(), vars={"heat": state.vars["heat"] - dk})


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    dt = check_timestep(dt)
    s = rescale(state, 0.5 * dt, reduce)
    s = nve.verlet(s, model, dt)
    return rescale(s, 0.5 * dt, reduce)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` E_pot + E_kin + heat given to the bath (eV)."""
    return state.energy + kinetic_energy(state.graph, reduce) + state.vars["heat"]
