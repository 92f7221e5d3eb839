"""NVT with the canonical-sampling velocity-rescaling thermostat (Bussi, Donadio, Parrinello 2007).

Each step is ``thermostat(dt/2)``, velocity Verlet, ``thermostat(dt/2)``. The thermostat
rescales the velocities of each system by ``α`` so that its kinetic energy ``K`` follows
the exact solution of

``dK = (K_t - K) dt/τ + 2 sqrt(K K_t / N_f) dW/sqrt(τ)``,  ``K_t = N_f k_B T / 2``:

``α² = c + (1-c)(S + R²) K_t/(N_f K) + 2 R sqrt(c (1-c) K_t/(N_f K))``, ``c = exp(-dt/τ)``,
``R`` a standard normal and ``S`` a sum of ``N_f - 1`` squared standard normals, drawn as
``2 Gamma((N_f - 1)/2)`` (:func:`xnn.dynamics.random.chi_squared`). Both are per-system
draws keyed by (seed, step, system index, half step): the same on every rank of a
decomposed run, whatever atoms it holds.

Variables: ``temperature [n_systems]`` (K), ``tau [n_systems]`` (fs), ``heat [n_systems]`` (eV).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.dynamics import nve, random
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    check_timestep,
    dof_of,
    dof_terms,
    free_mask,
    initial_state,
    kinetic_energy,
    kinetic_per_atom,
    new_rng,
    per_system,
    seed_of,
    system_words,
)
from xnn.units import KB


def init(
    state: AtomicGraph, model, temperature, tau: float = 100.0, seed: int = 0,
    reduce: Reducer = LOCAL,
) -> MDState:
    """Start CSVR dynamics.

    Args:
        state: graph with velocities (Å/fs); they must not all be zero.
        model: a :class:`~xnn.models.Potential`.
        temperature: K, scalar or ``[n_systems]``.
        tau: thermostat time constant (fs), scalar or ``[n_systems]``, > 0.
        seed: seed of the thermostat noise.
        reduce: global reductions (the default: this process holds every atom).
    """
    ref = state.positions
    n = state.n_systems
    vars_ = {
        "temperature": per_system(temperature, n, ref, "temperature"),
        "tau": per_system(tau, n, ref, "tau", positive=True),
        "heat": ref.new_zeros(n),
    }
    return initial_state(model, state, vars_, new_rng(seed), reduce)


def draws(rng: Tensor, step: int, stage: int, nf: Tensor,
          vars: Mapping[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``R`` and ``S`` ``[n_systems]`` (float64) of half step ``stage`` (0, 1) of step ``step``.

    Args:
        rng: ``MDState.rng``.
        nf: ``[n_systems]`` degrees of freedom; ``S`` sums ``N_f - 1`` squared normals.
        vars: ``MDState.vars``; per-system keys there (:func:`~xnn.dynamics.state.
            system_words`) replace the system index.
    """
    seed, stream = seed_of(rng), random.STREAMS["csvr"]
    step, system = system_words(vars or {}, step, nf.shape[0], nf.device)
    half = torch.full((), int(stage), dtype=torch.int64, device=nf.device)
    r = random.normal(seed, step, stream, *system, half, torch.zeros_like(half))
    count = (nf - 1).round().clamp(min=0)
    s = random.chi_squared(seed, step, stream, count, *system, half, torch.ones_like(half))
    return r, s


def rescale(state: MDState, dt: float, reduce: Reducer, step: int, stage: int) -> MDState:
    """Apply the stochastic velocity rescaling over a time ``dt`` (fs).

    Args:
        step: the number of the step being taken (``state.step`` at its start).
        stage: 0 for the half step before the force call, 1 for the one after.
    """
    nf, k = totals(state.graph, reduce)
    r, s = draws(state.rng, step, stage, nf, state.vars)
    return rescale_with(state, dt, reduce, r, s, nf, k)


def totals(g: AtomicGraph, reduce: Reducer) -> tuple[Tensor, Tensor]:
    """``(nf, k)``: the degrees of freedom and the kinetic energy (eV) ``[n_systems]`` of
    ``g``, in one reduction (:meth:`~xnn.dynamics.reduce.Reducer.sums_per_system`)."""
    n_free, n_fixed, k = reduce.sums_per_system(dof_terms(g) + [kinetic_per_atom(g)],
                                                g.batch, g.n_systems)
    return dof_of(n_free, n_fixed), k


def rescale_with(state: MDState, dt: float, reduce: Reducer, r: Tensor, s: Tensor,
                 nf: Tensor, k: Tensor | None = None) -> MDState:
    """:func:`rescale` with its draws given: ``r`` (normal) and ``s`` (chi-squared of
    ``nf - 1`` degrees), each ``[n_systems]``, and ``nf`` the degrees of freedom; ``k``
    the kinetic energy ``[n_systems]`` (eV) when already reduced."""
    g = state.graph
    k = kinetic_energy(g, reduce) if k is None else k
    kt = 0.5 * nf * KB * state.vars["temperature"]
    c = torch.exp(-dt / state.vars["tau"])
    r, s = r.to(g.dtype), s.to(g.dtype)
    k_safe = k.clamp(min=torch.finfo(g.dtype).tiny)
    ratio = kt / (nf * k_safe)
    alpha2 = c + (1 - c) * (s + r * r) * ratio + 2 * r * torch.sqrt(c * (1 - c) * ratio)
    sign = torch.where(r + torch.sqrt(c / ((1 - c) * ratio)) < 0, -1.0, 1.0).to(g.dtype)
    alpha = torch.where(k > 0, sign * torch.sqrt(alpha2), torch.ones_like(alpha2))
    v = g.velocities * alpha[g.batch, None]
    v = torch.where(free_mask(g)[:, None], v, torch.zeros_like(v))
    new = g.replace(velocities=v)
    dk = kinetic_energy(new, reduce) - k
    return state.replace(graph=new, vars={"heat": state.vars["heat"] - dk})


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    dt = check_timestep(dt)
    s = rescale(state, 0.5 * dt, reduce, state.step, 0)
    s = nve.verlet(s, model, dt)
    return rescale(s, 0.5 * dt, reduce, state.step, 1)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` E_pot + E_kin + heat given to the bath (eV)."""
    return state.energy + kinetic_energy(state.graph, reduce) + state.vars["heat"]
