"""FIRE relaxation (Bitzek et al. 2006) of positions and, optionally, the cell.

The update is ASE's ``FIRE`` (same defaults), applied to each system of the batch on its
own: per-system time step, mixing ``a`` and step counter, and the global norms and the
power ``P = f·v`` are per-system sums through the :class:`~xnn.dynamics.reduce.Reducer`.

With ``relax_cell=True`` the degrees of freedom are ``u = r D⁻¹`` and ``c D`` (``cell = cell₀ D``,
``c`` = ``cell_factor``, default ``N_atoms`` as in ASE's ``UnitCellFilter``), with forces
``F Dᵀ`` and ``-V D⁻ᵀ (σ + P₀ I) / c``; at a minimum all forces vanish and the stress equals
``-P₀`` (pressure ``P₀``). FIRE velocities are fictitious (massless): those of the atoms are
the per-atom field ``fire_velocities`` of the graph (so they travel with their atoms between
the ranks of a decomposed run), those of the cell live in ``vars``. Every quantity that
combines atoms (atom counts, norms, power, ``fmax``) goes through the ``Reducer``, so each
rank of a decomposed relaxation takes the same steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState, evaluate_graph, free_mask, initial_state, per_system
from xnn.errors import InputError

#: per-atom field ``[n_atoms, 3]``: FIRE velocities of the atom degrees of freedom
FIRE_VELOCITIES = "fire_velocities"
K.register_field(FIRE_VELOCITIES, K.ATOM)

DEFAULTS = dict(dt=0.1, maxstep=0.2, dtmax=1.0, n_min=5, finc=1.1, fdec=0.5, astart=0.1, fa=0.99)


def init(
    state: AtomicGraph, model, relax_cell: bool = False, pressure: float = 0.0,
    cell_factor: float | None = None, dt: float = 0.1, maxstep: float = 0.2, dtmax: float = 1.0,
    reduce: Reducer = LOCAL,
) -> MDState:
    """Start a FIRE relaxation.

    Args:
        state: the graph to relax (positions Å).
        model: a :class:`~xnn.models.Potential`.
        relax_cell: also relax the cell toward ``pressure``; needs a fully periodic cell.
        pressure: target pressure P₀ (eV/Å³) for the cell relaxation.
        cell_factor: scale of the cell degrees of freedom (default: atoms per system).
        dt, maxstep, dtmax: ASE's FIRE parameters (ASE time units, Å).
        reduce: global reductions (the default: this process holds every atom).
    """
    if relax_cell and not bool(state.pbc.all()):
        raise InputError("relax_cell (a pressure target) needs a cell periodic along all "
                         "three axes")
    if maxstep <= 0 or dt <= 0 or dtmax <= 0:
        raise InputError("FIRE dt, dtmax and maxstep must be > 0")
    ref = state.positions
    n = state.n_systems
    counts = reduce.count_per_system(state.batch, n, ref.dtype)
    cf = counts if cell_factor is None else per_system(cell_factor, n, ref, "cell_factor", True)
    eye = torch.eye(3, dtype=ref.dtype, device=ref.device).expand(n, 3, 3).clone()
    vars_ = {
        "dt": ref.new_full((n,), dt),
        "a": ref.new_full((n,), DEFAULTS["astart"]),
        "n_pos": ref.new_zeros(n),
        "started": torch.zeros(n, dtype=torch.bool, device=ref.device),
        "maxstep": ref.new_full((n,), maxstep),
        "dtmax": ref.new_full((n,), dtmax),
        "relax_cell": torch.full((n,), bool(relax_cell), device=ref.device),
        "pressure": torch.as_tensor(pressure, dtype=ref.dtype, device=ref.device).expand(n).clone(),
        "cell_factor": cf,
        "cell0": state.cell.clone(),
        "deform": eye,
        "vel_cell": torch.zeros_like(eye),
    }
    graph = state.replace({K.VELOCITIES: torch.zeros_like(ref),
                           FIRE_VELOCITIES: torch.zeros_like(ref)})
    return initial_state(model, graph, vars_, reduce=reduce)


def _atom_velocities(state: MDState) -> Tensor:
    """``[n_atoms, 3]`` FIRE velocities of the atoms (``vars["vel_atoms"]`` in older states)."""
    va = state.graph.get(FIRE_VELOCITIES)
    return state.vars["vel_atoms"] if va is None else va


def generalized_forces(state: MDState) -> tuple[Tensor, Tensor]:
    """Forces on the atom DOFs ``[n_atoms, 3]`` and on the cell DOFs ``[n_systems, 3, 3]``."""
    g, v = state.graph, state.vars
    d = v["deform"]
    f = torch.where(free_mask(g)[:, None], state.forces, torch.zeros_like(state.forces))
    f = torch.einsum("nj,nij->ni", f, d[g.batch])  # F Dᵀ
    eye = torch.eye(3, dtype=g.dtype, device=g.device)
    sig = state.stress + v["pressure"][:, None, None] * eye
    fc = -g.volume()[:, None, None] * torch.linalg.solve(d.transpose(-1, -2), sig)
    fc = fc / v["cell_factor"][:, None, None]
    fc = torch.where(v["relax_cell"][:, None, None], fc, torch.zeros_like(fc))
    return f, fc


def fmax(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` largest generalized force norm (eV/Å), atoms and cell rows."""
    f, fc = generalized_forces(state)
    g = state.graph
    fa = reduce.max_per_system(f.norm(dim=-1), g.batch, g.n_systems)
    return torch.maximum(fa, fc.norm(dim=-1).amax(-1))


def _per_sys(reduce: Reducer, g: AtomicGraph, atoms: Tensor, cell: Tensor) -> Tensor:
    """Per-system sum over atom DOFs ``[n_atoms, 3]`` and cell DOFs ``[n_systems, 3, 3]``."""
    return reduce.sum_per_system(atoms.sum(-1), g.batch, g.n_systems) + cell.sum((-1, -2))


def step(state: MDState, model, fmax_target: float = 0.0, reduce: Reducer = LOCAL) -> MDState:
    """One FIRE step for every system whose ``fmax`` is above ``fmax_target`` (eV/Å)."""
    g, v = state.graph, state.vars
    b = g.batch
    f, fc = generalized_forces(state)
    active = fmax(state, reduce) >= fmax_target
    va0 = _atom_velocities(state)
    va, vc = va0, v["vel_cell"]
    vf = _per_sys(reduce, g, f * va, fc * vc)
    f2 = _per_sys(reduce, g, f * f, fc * fc)
    v2 = _per_sys(reduce, g, va * va, vc * vc)
    up = v["started"] & (vf > 0)
    down = v["started"] & ~up
    mix = torch.where(up, v["a"], torch.zeros_like(v["a"]))
    coef = mix * torch.sqrt(v2) / torch.sqrt(f2).clamp(min=torch.finfo(g.dtype).tiny)
    keep = torch.where(down, 0.0, 1.0 - mix).to(g.dtype)
    va = keep[b, None] * va + coef[b, None] * f
    vc = keep[:, None, None] * vc + coef[:, None, None] * fc
    grow = up & (v["n_pos"] > DEFAULTS["n_min"])
    dt = torch.where(grow, torch.minimum(v["dt"] * DEFAULTS["finc"], v["dtmax"]), v["dt"])
    dt = torch.where(down, dt * DEFAULTS["fdec"], dt)
    a = torch.where(grow, v["a"] * DEFAULTS["fa"], v["a"])
    a = torch.where(down, torch.full_like(a, DEFAULTS["astart"]), a)
    n_pos = torch.where(up, v["n_pos"] + 1, torch.where(down, 0.0, v["n_pos"]))
    va = va + dt[b, None] * f
    vc = vc + dt[:, None, None] * fc
    dra, drc = dt[b, None] * va, dt[:, None, None] * vc
    norm = torch.sqrt(_per_sys(reduce, g, dra * dra, drc * drc))
    shrink = torch.where(norm > v["maxstep"], v["maxstep"] / norm, torch.ones_like(norm))
    shrink = torch.where(active, shrink, torch.zeros_like(shrink))
    dra, drc = shrink[b, None] * dra, shrink[:, None, None] * drc
    d_old = v["deform"]
    u = torch.linalg.solve(d_old[b].transpose(-1, -2), g.positions.unsqueeze(-1)).squeeze(-1)
    cf = v["cell_factor"][:, None, None]
    d_new = (cf * d_old + drc) / cf
    pos = torch.einsum("ni,nij->nj", u + dra, d_new[b])
    pos = torch.where(active[b, None], pos, g.positions)
    cell = torch.where(v["relax_cell"][:, None, None] & active[:, None, None],
                       v["cell0"] @ d_new, g.cell)
    new_g = g.replace({K.POSITIONS: pos, K.CELL: cell,
                       FIRE_VELOCITIES: torch.where(active[b, None], va, va0)})
    new_g, energy, forces, stress = evaluate_graph(model, new_g, state.compute_stress)

    def sel(new, old):
        shape = (-1,) + (1,) * (new.ndim - 1)
        return torch.where(active.view(shape), new, old)

    vars_ = {
        "dt": sel(dt, v["dt"]), "a": sel(a, v["a"]), "n_pos": sel(n_pos, v["n_pos"]),
        "started": v["started"] | active, "deform": sel(d_new, d_old),
        "vel_cell": sel(vc, v["vel_cell"]),
    }
    return state.replace(graph=new_g, forces=forces, energy=energy, stress=stress,
                         step=state.step + 1, vars=vars_)


def converged(state: MDState, fmax_target: float, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` bool: every generalized force is below ``fmax_target`` (eV/Å)."""
    return fmax(state, reduce) < fmax_target


def conserved(state: MDState, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` enthalpy ``E + P₀ V`` (eV) when the cell relaxes, else energy."""
    v = state.vars
    pv = v["pressure"] * state.graph.volume()
    pv = torch.where(v["relax_cell"], pv, torch.zeros_like(pv))
    return state.energy + pv
