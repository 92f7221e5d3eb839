"""Checks that stop a diverging simulation with a message naming the step and the atoms."""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState, temperature
from xnn.errors import XnnError


class SimulationError(XnnError):
    """A simulation became unphysical (NaN, exploding forces, atoms too close, blow-up)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def _ids(state: MDState, mask: Tensor, limit: int = 6) -> list[int]:
    return state.graph.atom_id[torch.nonzero(mask).flatten()[:limit]].tolist()


def check_forces(state: MDState, max_force: float, reduce: Reducer = LOCAL) -> None:
    """Raise :class:`SimulationError` on non-finite energies/forces or a force > ``max_force``."""
    f = state.forces
    norm = f.norm(dim=-1)
    bad = ~torch.isfinite(norm) | (norm > max_force)
    if reduce.any(bad) or reduce.any(~torch.isfinite(state.energy)):
        if reduce.any(~torch.isfinite(norm)) or not bool(torch.isfinite(state.energy).all()):
            what = "non-finite energy or forces"
        else:
            what = f"force above safety.max_force={max_force} eV/Å (max {float(norm.max()):.3g})"
        raise SimulationError(f"step {state.step}: {what} on atoms (atom_id) "
                              f"{_ids(state, bad)}", state.step)


def check_distances(
    state: MDState, potential, min_distance: float, reduce: Reducer = LOCAL
) -> None:
    """Raise when two atoms are closer than ``min_distance`` (Å), from the Verlet list."""
    if min_distance <= 0:
        return
    g = potential.neighbors(state.graph)
    d = g.edge_vectors().norm(dim=-1)
    close = d < min_distance
    if reduce.any(close):
        e = int(torch.argmin(d))
        j, i = g.edge_index[0, e], g.edge_index[1, e]
        ids = [int(g.atom_id[i]), int(g.atom_id[j])]
        raise SimulationError(f"step {state.step}: atoms (atom_id) {ids} are {float(d[e]):.3f} Å "
                              f"apart, closer than safety.min_distance={min_distance} Å",
                              state.step)


def check_temperature(state: MDState, max_temperature: Tensor, reduce: Reducer = LOCAL) -> None:
    """Raise when a system's temperature exceeds ``max_temperature [n_systems]`` (K)."""
    t = temperature(state.graph, reduce)
    hot = t > max_temperature
    if reduce.any(hot) or reduce.any(~torch.isfinite(t)):
        s = int(torch.nonzero(hot | ~torch.isfinite(t)).flatten()[0])
        g = state.graph
        ke = (g.masses * (g.velocities ** 2).sum(-1)).masked_fill(g.batch != s, -1.0)
        fastest = g.atom_id[torch.topk(ke, min(3, g.n_atoms)).indices].tolist()
        raise SimulationError(f"step {state.step}: temperature of system {s} is "
                              f"{float(t[s]):.4g} K, above {float(max_temperature[s]):.4g} K "
                              f"(fastest atoms, atom_id: {fastest})", state.step)
