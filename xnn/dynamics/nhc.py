"""NVT with a Nosé–Hoover chain (Martyna, Klein, Tuckerman 1992), one chain per system.

Each step is ``chain(dt/2)``, velocity Verlet, ``chain(dt/2)``; the chain half step is the
Trotter factorisation of Tuckerman et al. (2006) with ``n_yoshida`` Suzuki–Yoshida weights.
Thermostat masses ``Q₀ = N_f k_B T τ²``, ``Q_k = k_B T τ²`` (eV fs²).

Variables (``[n_systems, M]`` for chain length ``M``): ``eta`` (positions, dimensionless),
``v_eta`` (1/fs); ``temperature``, ``tau`` ``[n_systems]``.
Conserved: ``E_pot + E_kin + Σ Q_k v_k²/2 + N_f k_B T η₀ + k_B T Σ_{k≥1} η_k``.
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
    dof_of,
    dof_terms,
    initial_state,
    kinetic_energy,
    kinetic_per_atom,
    per_system,
)
from xnn.errors import InputError
from xnn.units import KB

_YOSHIDA = {
    1: (1.0,),
    3: (1.0 / (2 - 2 ** (1 / 3)), -(2 ** (1 / 3)) / (2 - 2 ** (1 / 3)), 1.0 / (2 - 2 ** (1 / 3))),
}


def init(
    state: AtomicGraph, model, temperature, tau: float = 100.0, chain_length: int = 3,
    n_yoshida: int = 3, reduce: Reducer = LOCAL,
) -> MDState:
    """Start Nosé–Hoover-chain dynamics.

    Args:
        state: graph with velocities (Å/fs).
        model: a :class:`~xnn.models.Potential`.
        temperature: K, scalar or ``[n_systems]``, > 0.
        tau: thermostat period (fs), > 0.
        chain_length: M >= 1 thermostats per chain.
        n_yoshida: Suzuki–Yoshida order, 1 or 3.
        reduce: global reductions (the default: this process holds every atom).
    """
    if chain_length < 1:
        raise InputError(f"chain_length must be >= 1, got {chain_length}")
    if n_yoshida not in _YOSHIDA:
        raise InputError(f"n_yoshida must be one of {sorted(_YOSHIDA)}, got {n_yoshida}")
    ref = state.positions
    n = state.n_systems
    vars_ = {
        "temperature": per_system(temperature, n, ref, "temperature", positive=True),
        "tau": per_system(tau, n, ref, "tau", positive=True),
        "eta": ref.new_zeros(n, chain_length),
        "v_eta": ref.new_zeros(n, chain_length),
        "n_yoshida": torch.full((n,), n_yoshida, dtype=torch.long, device=ref.device),
    }
    return initial_state(model, state, vars_, reduce=reduce)


def _masses(state: MDState, nf: Tensor) -> Tensor:
    kt = KB * state.vars["temperature"]
    tau2 = state.vars["tau"] ** 2
    m = state.vars["eta"].shape[1]
    q = (kt * tau2)[:, None].expand(-1, m).clone()
    q[:, 0] = nf * kt * tau2
    return q


def chain_half(state: MDState, dt: float, reduce: Reducer) -> MDState:
    """Propagate the chain and scale velocities over ``dt / 2``."""
    g = state.graph
    n_free, n_fixed, ke = reduce.sums_per_system(dof_terms(g) + [kinetic_per_atom(g)],
                                                 g.batch, g.n_systems)  # one reduction
    nf = dof_of(n_free, n_fixed)
    kt = KB * state.vars["temperature"]
    q = _masses(state, nf)
    eta = state.vars["eta"].clone()
    v = state.vars["v_eta"].clone()
    m = eta.shape[1]
    ke2 = 2.0 * ke
    scale = torch.ones_like(ke2)

    def force(k: int) -> Tensor:
        if k == 0:
            return (ke2 * scale * scale - nf * kt) / q[:, 0]
        return (q[:, k - 1] * v[:, k - 1] ** 2 - kt) / q[:, k]

    def update(k: int, d: float) -> None:
        if k < m - 1:
            v[:, k] = v[:, k] * torch.exp(-0.25 * d * v[:, k + 1])
        v[:, k] = v[:, k] + 0.5 * d * force(k)
        if k < m - 1:
            v[:, k] = v[:, k] * torch.exp(-0.25 * d * v[:, k + 1])

    for w in _YOSHIDA[int(state.vars["n_yoshida"][0])]:
        d = w * 0.5 * dt
        for k in reversed(range(m)):
            update(k, d)
        scale = scale * torch.exp(-d * v[:, 0])
        eta = eta + d * v
        for k in range(m):
            update(k, d)
    new = g.replace(velocities=g.velocities * scale[g.batch, None])
    return state.replace(graph=new, vars={"eta": eta, "v_eta": v})


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    dt = check_timestep(dt)
    s = chain_half(state, dt, reduce)
    s = nve.verlet(s, model, dt)
    return chain_half(s, dt, reduce)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` the extended Hamiltonian (eV)."""
    nf = degrees_of_freedom(state.graph, reduce)
    kt = KB * state.vars["temperature"]
    q = _masses(state, nf)
    eta, v = state.vars["eta"], state.vars["v_eta"]
    chain = 0.5 * (q * v * v).sum(-1) + nf * kt * eta[:, 0] + kt * eta[:, 1:].sum(-1)
    return state.energy + kinetic_energy(state.graph, reduce) + chain
