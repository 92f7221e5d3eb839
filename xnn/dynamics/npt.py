"""NPT: stochastic cell rescaling (Bernetti & Bussi 2020) with the CSVR thermostat.

Isotropic: the log-volume ``ε = ln V`` follows the Itô equation

``dε = (β_T/τ_p)(P - P₀) dt + sqrt(2 k_B T β_T/(V τ_p)) dW``

and positions and cell scale by ``exp(dε/3)``, velocities by ``exp(-dε/3)``. This is
Bernetti & Bussi's ``dV = (β_T V/τ_p)(P - P₀ + k_B T/V) dt + sqrt(2 k_B T β_T V/τ_p) dW``
written for ``ln V``: Itô's lemma cancels the ``k_B T/V`` term (integrating the ``ln V``
form with that term kept samples ``V^(N+1)`` instead of ``V^N``; the ideal-gas test checks
this). Its stationary distribution is ``p(V) ∝ V^(N_f/3) exp(-P₀V/k_BT)``.
Anisotropic (any triclinic cell): the anisotropic SCR of Del Tatto, Raiteri, Bernetti &
Bussi (Appl. Sci. 12, 1139 (2022)). In the frame where the cell is upper triangular
(``cellᵀ = Q h``, ``a`` along x', ``b`` in the x'y' plane; ``h`` has the lattice vectors as
columns) the paper's Itô equation is ``dh = A h`` with ``A`` upper triangular,

``A_aa = (β_T/3τ_p)(P_aa - P₀ + k_B T/V) dt + sqrt(2 k_B T β_T/(3 V τ_p)) dW_aa``,
``A_ab = (β_T/3τ_p) P_ab dt + sqrt(2 k_B T β_T/(3 V τ_p)) dW_ab`` (a < b),

with ``P`` the pressure tensor in that frame. It is applied as ``h ← exp(B) h`` with
``B = A - (k_B T β_T/(3 V τ_p)) I dt``: ``E[exp(B)] = I + E[A]`` to first order in ``dt``
(the Itô term ``½ E[B²] = (k_B T β_T/(3 V τ_p)) I dt`` restores the ``k_B T/V`` of each
diagonal component, as for ``ln V`` above), and ``exp(B)`` keeps the cell triangular in
that frame, so the cell never rotates. In the lab frame ``r ← r M``, ``cell ← cell M``,
``v ← v M⁻ᵀ`` with ``M = Q exp(Bᵀ) Qᵀ``. The stationary distribution is (Fokker–Planck; the
divergence of the diffusion tensor of row ``a`` of ``h`` gives the per-component terms)

``p(h) ∝ exp(-(F(h) + P₀V)/k_BT) / (h_xx² h_yy)``  (``dh`` over the six entries of ``h``),

``F(h)`` the Helmholtz free energy of the cell ``h`` (``exp(-F/k_BT) ∝ V^(N_f/3)`` for an
ideal gas).
``ln V = Σ_a ln h_aa`` moves by ``Σ_a B_aa`` exactly: the isotropic equation with
``P = tr P/3``. Consequences checked in ``tests/test_npt_aniso.py``: ``<P_aa> = P₀`` and
``cov(V, P_aa) = -k_BT`` for each axis of the frame. (The previous symmetric-strain
variant, ``r ← r exp(ε)`` with ``ε`` symmetric and half the off-diagonal noise, let the
cell orientation diffuse and sampled
``∝ exp(-(F + P₀V)/k_BT) h_xx² h_yy / V²`` after removing rotations: a different shape
weight, ``(h_xx² h_yy / V)²``, the O(1/N) error this replaces.)
``P_ab = (Σ m v_a v_b)/V - σ_ab`` is the instantaneous pressure tensor (σ the stress, ASE sign).

Step: thermostat(dt/2), kick(dt/2), barostat(dt), drift(dt), force call, kick(dt/2),
thermostat(dt/2). Variables: those of :mod:`xnn.dynamics.csvr` plus ``pressure`` (eV/Å³),
``compressibility`` β_T (Å³/eV), ``tau_p`` (fs), ``anisotropic`` (bool), ``work`` (eV).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics import csvr, nve, random
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    MDState,
    check_timestep,
    free_mask,
    kinetic_energy,
    kinetic_per_atom,
    kinetic_tensor,
    kinetic_tensor_per_atom,
    per_system,
    seed_of,
    system_words,
)
from xnn.errors import InputError
from xnn.units import KB


def init(
    state: AtomicGraph, model, temperature, pressure, tau: float = 100.0, tau_p: float = 1000.0,
    compressibility: float = 0.01, anisotropic: bool = False, seed: int = 0,
    reduce: Reducer = LOCAL,
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
        anisotropic: let all six cell components fluctuate, orientation fixed (else
            isotropic).
        seed: seed of thermostat and barostat noise.
        reduce: global reductions (the default: this process holds every atom).
    """
    if not bool(state.pbc.all()):
        raise InputError("a pressure target needs a cell periodic along all three axes")
    if reduce.any(~free_mask(state)):
        raise InputError("fixed atoms cannot be combined with a barostat (ensemble npt)")
    s = csvr.init(state, model, temperature, tau, seed, reduce)
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


def _triangular_frame(cell: Tensor) -> Tensor:
    """``[n, 3, 3]`` orthogonal ``Q`` with ``cellᵀ = Q h``, ``h`` upper triangular, ``h_aa > 0``."""
    q, r = torch.linalg.qr(cell.transpose(-1, -2))
    sign = torch.where(r.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(cell.dtype)
    return q * sign[:, None, :]


def _aniso_generator(state: MDState, p: Tensor, xi: Tensor, dt: float) -> Tensor:
    """``[n, 3, 3]`` ``G = Q Bᵀ Qᵀ``: ``M = exp(G)`` is the lab-frame (row-vector) deformation.

    Args:
        p: ``[n, 3, 3]`` pressure tensor (eV/Å³).
        xi: ``[n, 3, 3]`` standard normals; the upper triangle is used.
        dt: fs.
    """
    v = state.vars
    vol = state.graph.volume()
    rate = (v["compressibility"] / (3 * v["tau_p"]))[:, None, None]
    q = _triangular_frame(state.graph.cell)
    p_frame = q.transpose(-1, -2) @ p @ q
    eye = torch.eye(3, dtype=p.dtype, device=p.device)
    drift = rate * dt * torch.triu(p_frame - v["pressure"][:, None, None] * eye)
    amp = torch.sqrt(2 * KB * v["temperature"][:, None, None] * rate * dt / vol[:, None, None])
    b = drift + amp * torch.triu(xi)
    return q @ b.transpose(-1, -2) @ q.transpose(-1, -2)


def noise(state: MDState, step: int) -> Tensor:
    """``[n_systems, 3, 3]`` standard normals of the barostat of step ``step``, keyed by
    (seed, step, system index, component)."""
    g = state.graph
    key_step, system = system_words(state.vars, step, g.n_systems, g.device)
    comp = torch.arange(9, device=g.device)
    words = (*(w[:, None] for w in system), comp)
    xi = random.normal(seed_of(state.rng), key_step, random.STREAMS["npt"], *words)
    return xi.reshape(g.n_systems, 3, 3).to(g.dtype)


def _strain_increment(state: MDState, dt: float, step: int, kinetic: Tensor) -> Tensor:
    """``[n_systems, 3, 3]`` log-deformation ``G`` over ``dt``: ``r ← r exp(G)``;
    ``kinetic``: the reduced :func:`~xnn.dynamics.state.kinetic_tensor` (eV)."""
    g = state.graph
    v = state.vars
    vol = g.volume()
    kt = KB * v["temperature"]
    rate = v["compressibility"] / v["tau_p"]
    p = kinetic / vol[:, None, None] - state.stress  # pressure_tensor
    eye = torch.eye(3, dtype=g.dtype, device=g.device)
    xi = noise(state, step)
    # isotropic: one scalar per system, shared by the three diagonal entries
    drift_iso = rate * (p.diagonal(dim1=-2, dim2=-1).mean(-1) - v["pressure"]) * dt
    d_iso = drift_iso + torch.sqrt(2 * kt * rate / vol * dt) * xi[:, 0, 0]
    iso = (d_iso / 3)[:, None, None] * eye
    return torch.where(v["anisotropic"][:, None, None], _aniso_generator(state, p, xi, dt), iso)


def barostat(state: MDState, dt: float, reduce: Reducer, step: int) -> tuple[MDState, Tensor]:
    """Deform cell, positions and velocities by one stochastic-cell-rescaling step
    (``step``: the number of the step being taken, which keys the noise).

    Returns the new state and the step's log-deformation ``G`` ``[n_systems, 3, 3]``. The
    state's ``work`` gains the exact kinetic-energy change and ``P₀ ΔV``; the potential-energy
    change needs the stress after the move, so :func:`step` adds it."""
    g = state.graph
    # the kinetic tensor (pressure) and the kinetic energy before the move: one reduction
    kinetic, k_old = reduce.sums_per_system(
        [kinetic_tensor_per_atom(g), kinetic_per_atom(g)], g.batch, g.n_systems)
    deps = _strain_increment(state, dt, step, kinetic)
    mu = torch.linalg.matrix_exp(deps)
    mu_inv_t = torch.linalg.matrix_exp(-deps.transpose(-1, -2))  # momenta: p ← p M⁻ᵀ
    new = g.replace({
        K.POSITIONS: torch.einsum("ni,nij->nj", g.positions, mu[g.batch]),
        K.CELL: g.cell @ mu,
        K.VELOCITIES: torch.einsum("ni,nij->nj", g.velocities, mu_inv_t[g.batch]),
    })
    dk = kinetic_energy(new, reduce) - k_old
    work = state.vars["work"] + dk + state.vars["pressure"] * (new.volume() - g.volume())
    return state.replace(graph=new, vars={"work": work}), deps


def step(state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
    """Advance by ``dt`` (fs)."""
    dt = check_timestep(dt)
    n = state.step
    s = csvr.rescale(state, 0.5 * dt, reduce, n, 0)
    s = nve.half_kick(s, dt)
    v0_sigma0 = s.graph.volume()[:, None, None] * s.stress
    s, deps = barostat(s, dt, reduce, n)
    s = nve.with_positions(s, model, nve.drift(s, dt))
    # The barostat's potential-energy input by the trapezoid rule, ½ (V₀σ₀ + V₁σ₁) : G, with
    # σ₁ from this force call (one drift later: a zero-mean O(dt^1.5) difference). The first-
    # order term V₀σ₀ : G alone misses the Itô term ½ Gᵀ(∂²E/∂G²)G, whose mean is O(dt) per
    # step (~k_BT dt/τ_p): the conserved quantity drifted by that much per unit time.
    v1_sigma1 = s.graph.volume()[:, None, None] * s.stress
    de_pot = 0.5 * ((v0_sigma0 + v1_sigma1) * deps).sum((-1, -2))
    s = s.replace(vars={"work": s.vars["work"] + de_pot})
    s = nve.half_kick(s, dt)
    return csvr.rescale(s, 0.5 * dt, reduce, n, 1)


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` E_pot + E_kin + P₀V + heat - barostat work (eV)."""
    v = state.vars
    return (
        state.energy + kinetic_energy(state.graph, reduce) + v["pressure"] * state.graph.volume()
        + v["heat"] - v["work"]
    )
