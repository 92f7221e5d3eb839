"""NPT: stochastic cell rescaling (Bernetti & Bussi 2020) with the CSVR thermostat.

Isotropic: the log-volume ``ε = ln V`` follows the Itô equation

``dε = (β_T/τ_p)(P - P₀) dt + sqrt(2 k_B T β_T/(V τ_p)) dW``

and positions and cell scale by ``exp(dε/3)``, velocities by ``exp(-dε/3)``. This is
Bernetti & Bussi's ``dV = (β_T V/τ_p)(P - P₀ + k_B T/V) dt + sqrt(2 k_B T β_T V/τ_p) dW``
written for ``ln V``: Itô's lemma cancels the ``k_B T/V`` term (integrating the ``ln V``
form with that term kept samples ``V^(N+1)`` instead of ``V^N``; the ideal-gas test checks
this). Its stationary distribution is ``p(V) ∝ V^(N_f/3) exp(-P₀V/k_BT)``.
Anisotropic (any triclinic cell, no rotation): a symmetric strain increment ``dε_ab`` with

``dε_aa = (β_T/3τ_p)(P_aa - P₀) dt + sqrt(2 k_B T β_T/(3 V τ_p)) dW_aa``,
``dε_ab = (β_T/3τ_p) P_ab dt + sqrt(k_B T β_T/(3 V τ_p)) dW_ab`` (a < b),

applied as ``r ← r exp(dε)``, ``cell ← cell exp(dε)``, ``v ← v exp(-dε)``. Since
``ln det exp(dε) = tr dε``, the volume follows exactly the isotropic equation; the shape
fluctuations use the same mobility without a shape Jacobian (an O(1/N) approximation).
``P_ab = (Σ m v_a v_b)/V - σ_ab`` is the instantaneous pressure tensor (σ the stress, ASE sign).

Step: thermostat(dt/2), kick(dt/2), barostat(dt), drift(dt), force call, kick(dt/2),
thermostat(dt/2). Variables: those of :mod:`xnn.dynamics.csvr` plus ``pressure`` (eV/Å³),
``compressibility`` β_T (Å³/eV), ``tau_p`` (fs), ``anisotropic`` (bool), ``work`` (eV).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics import csvr, nve
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    check_timestep,
    free_mask,
    generator,
    kinetic_energy,
    kinetic_tensor,
    per_system,
)
from xnn.errors import InputError
from xnn.units import KB


def init(
    state: AtomicGraph, model, temperature, pressure, tau: float = 100.0, tau_p: float = 1000.0,
    compressibility: float = 0.01, anisotropic: bool = False, seed: int = 0,
) -> MDState:
    """Start NPT dynamics.

    Args:
        state: graph with velocities (Å/fs) and a cell periodic along all axes.
        model: a :class:`~xnn.models.Potential`.
        temperature: K, scalar or ``[n_systems]``.
        pressure: target pressure P₀ (eV/Å³), scalar or ``[n_systems]`` (may be negative).
        tau: thermostat time constant (fs).
        tau_p: barostat relaxation time (fs).
        compressibility: β_T (Å³/eV), only sets the barostat's time scale.
        anisotropic: let all six strain components fluctuate (else isotropic).
        seed: seed of thermostat and barostat noise.
    """
    if not bool(state.pbc.all()):
        raise InputError("a pressure target needs a cell periodic along all three axes")
    if not bool(free_mask(state).all()):
        raise InputError("fixed atoms cannot be combined with a barostat (ensemble npt)")
    s = csvr.init(state, model, temperature, tau, seed)
    ref = state.positions
    n = state.n_systems
    p = torch.as_tensor(pressure, dtype=ref.dtype, device=ref.device)
    p = p.expand(n).clone() if p.ndim == 0 else p
    if p.shape != (n,) or not torch.isfinite(p).all():
        raise InputError(f"pressure must be a finite scalar or have shape [{n}]")
    return s.replace(vars={
        "pressure": p,
        "tau_p": per_system(tau_p, n, ref, "tau_p", positive=True),
        "compressibility": per_system(compressibility, n, ref, "compressibility", positive=True),
        "anisotropic": torch.full((n,), bool(anisotropic), device=ref.device),
        "work": ref.new_zeros(n),
    })


def pressure_tensor(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems, 3, 3]`` instantaneous pressure tensor (eV/Å³), kinetic part included."""
    vol = state.graph.volume()
    return kinetic_tensor(state.graph, reduce) / vol[:, None, None] - state.stress


def _strain_increment(state: MDState, dt: float, gen: torch.Generator, reduce: Reducer) -> Tensor:
    """``[n_systems, 3, 3]`` symmetric log-strain increment over ``dt``."""
    g = state.graph
    v = state.vars
    vol = g.volume()
    kt = KB * v["temperature"]
    rate = v["compressibility"] / v["tau_p"]
    p = pressure_tensor(state, reduce)
    eye = torch.eye(3, dtype=g.dtype, device=g.device)
    noise = torch.randn(g.n_systems, 3, 3, generator=gen, dtype=g.dtype, device=g.device)
    # isotropic: one scalar per system, shared by the three diagonal entries
    drift_iso = rate * (p.diagonal(dim1=-2, dim2=-1).mean(-1) - v["pressure"]) * dt
    d_iso = drift_iso + torch.sqrt(2 * kt * rate / vol * dt) * noise[:, 0, 0]
    iso = (d_iso / 3)[:, None, None] * eye
    # anisotropic: six components
    upper = torch.triu(noise, diagonal=1)
    amp = torch.sqrt(kt * rate / (3 * vol) * dt)[:, None, None]
    rnd = amp * (upper + upper.transpose(-1, -2) + math.sqrt(2.0) * noise * eye)
    target = p - v["pressure"][:, None, None] * eye
    aniso = (rate / 3 * dt)[:, None, None] * 0.5 * (target + target.transpose(-1, -2)) + rnd
    return torch.where(v["anisotropic"][:, None, None], aniso, iso)


def barostat(state: MDState, dt: float, reduce: Reducer) -> MDState:
    """Deform cell, positions and velocities by one stochastic-cell-rescaling step."""
    g = state.graph
    gen = generator(state.rng, g.device)
    deps = _strain_increment(state, dt, gen, reduce)
    mu = torch.linalg.matrix_exp(deps)
    mu_inv = torch.linalg.matrix_exp(-deps)
    new = g.replace({
        K.POSITIONS: torch.einsum("ni,nij->nj", g.positions, mu[g.batch]),
        K.CELL: g.cell @ mu,
        K.VELOCITIES: torch.einsum("ni,nij->nj", g.velocities, mu_inv[g.batch]),
    })
    vol0, vol1 = g.volume(), new.volume()
    # energy put in by the barostat, to first order in the strain (for the conserved quantity)
    de_pot = vol0 * (state.stress * deps).sum((-1, -2))
    dk = kinetic_energy(new, reduce) - kinetic_energy(g, reduce)
    work = state.vars["work"] + de_pot + dk + state.vars["pressure"] * (vol1 - vol0)
    return state.replace(graph=new, rng=gen.get_state(), vars={"work": work})


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    dt = check_timestep(dt)
    s = csvr.rescale(state, 0.5 * dt, reduce)
    s = nve.half_kick(s, dt)
    s = barostat(s, dt, reduce)
    s = nve.with_positions(s, model, nve.drift(s, dt))
    s = nve.half_kick(s, dt)
    return csvr.rescale(s, 0.5 * dt, reduce)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` E_pot + E_kin + P₀V + heat - barostat work (eV; the work is first
    order in the strain)."""
    v = state.vars
    return (
        state.energy + kinetic_energy(state.graph, reduce) + v["pressure"] * state.graph.volume()
        + v["heat"] - v["work"]
    )
