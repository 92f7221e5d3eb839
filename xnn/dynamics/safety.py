"""Checks that stop a diverging simulation with a message naming the step and the atoms, and
a monitor that warns once when the conserved quantity drifts (a time step too large)."""

from __future__ import annotations

import warnings

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
    """Raise :class:`SimulationError` on non-finite energies/forces or a force > ``max_force``.

    Collective with a cross-rank ``reduce`` (every rank raises, even one without atoms)."""
    f = state.forces
    norm = f.norm(dim=-1)
    bad = ~torch.isfinite(norm) | (norm > max_force)
    if reduce.any(bad) or reduce.any(~torch.isfinite(state.energy)):
        if reduce.any(~torch.isfinite(norm)) or not bool(torch.isfinite(state.energy).all()):
            what = "non-finite energy or forces"
        else:
            g = state.graph
            top = reduce.max_per_system(norm, g.batch, g.n_systems).max()
            what = f"force above safety.max_force={max_force} eV/Å (max {float(top):.3g})"
        raise SimulationError(f"step {state.step}: {what} on atoms (atom_id) "
                              f"{_ids(state, bad)}", state.step)


def _min_pair(state: MDState, potential) -> tuple[float, list[int]]:
    """This process's shortest pair (Å) and its atom ids, from the potential's neighbors."""
    if hasattr(potential, "min_pair_distance"):  # a decomposed potential (last evaluation)
        d, ids = potential.min_pair_distance()
        return float(d), [int(i) for i in ids.tolist()]
    g = potential.neighbors(state.graph)
    d = g.edge_vectors().norm(dim=-1)
    if not d.numel():
        return float("inf"), [-1, -1]
    e = int(torch.argmin(d))
    j, i = g.edge_index[0, e], g.edge_index[1, e]
    return float(d[e]), [int(g.atom_id[i]), int(g.atom_id[j])]


def check_distances(
    state: MDState, potential, min_distance: float, reduce: Reducer = LOCAL
) -> None:
    """Raise when two atoms are closer than ``min_distance`` (Å), from the Verlet list (or,
    for a decomposed potential, its last evaluation's pairs, minimum over the ranks)."""
    if min_distance <= 0:
        return
    d, ids = _min_pair(state, potential)
    if reduce is LOCAL:
        if d < min_distance:
            _raise_close(state, d, ids, min_distance)
        return
    like = state.positions.new_zeros(1, dtype=torch.float64)
    one = torch.zeros(1, dtype=torch.long, device=like.device)
    dmin = float(reduce.min_per_system(like + d, one, 1)[0])
    if dmin < min_distance:
        mine = torch.tensor(ids if d == dmin else [-1, -1], dtype=torch.float64,
                            device=like.device)
        pair = [int(reduce.max_per_system(mine[k:k + 1], one, 1)[0]) for k in range(2)]
        _raise_close(state, dmin, pair, min_distance)


def _raise_close(state: MDState, d: float, ids: list[int], min_distance: float) -> None:
    raise SimulationError(f"step {state.step}: atoms (atom_id) {ids} are {d:.3f} Å apart, "
                          f"closer than safety.min_distance={min_distance} Å", state.step)


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


class DriftWarning(UserWarning):
    """The conserved quantity of an MD run drifts: the time step is probably too large."""


class DriftMonitor:
    """Warn once when a system's conserved quantity drifts faster than ``max_drift``.

    The drift rate of system ``s`` at time ``t`` is ``|C_s(t) - C_s(t0)| / N_s / max(t - t0,
    1 ps)`` (eV/atom/ps), with ``C`` the integrator's conserved quantity (total energy in
    NVE; plus the heat given to the bath, or the extended Hamiltonian, with a thermostat) and
    ``t0`` the start of this run (or of its resumed part). Over the first picosecond the
    rate is thus an absolute bound on ``|ΔC| / N`` of ``max_drift × 1 ps``, so that the
    energy fluctuations of a good run do not count as a drift. For scale, LJ argon (108
    atoms, 300 K) drifts 5e-6 eV/atom/ps at dt = 5 fs, 9e-5 at 20 fs, 4e-3 at 50 fs (where it
    blew up 2.5 ps later).

    Args:
        max_drift: eV/atom/ps; ``None`` disables the check.
        n_atoms: ``[n_systems]`` atoms per system.
    """

    def __init__(self, max_drift: float | None, n_atoms: Tensor):
        self.max_drift = max_drift
        self.n_atoms = n_atoms.detach().to(torch.float64).cpu().clamp(min=1.0)
        self.start: tuple[float, Tensor] | None = None
        self.warned = False

    def update(self, time_fs: float, conserved: Tensor) -> str | None:
        """Look at the conserved quantity ``[n_systems]`` (eV) at ``time_fs``; returns (and
        warns with :class:`DriftWarning`) the message the first time the drift is too fast."""
        if self.max_drift is None or self.warned:
            return None
        c = conserved.detach().to(torch.float64).cpu()
        if self.start is None:
            self.start = (float(time_fs), c)
            return None
        t0, c0 = self.start
        elapsed_ps = (float(time_fs) - t0) * 1e-3
        per_atom = (c - c0).abs() / self.n_atoms
        rate = per_atom / max(elapsed_ps, 1.0)
        if not bool((rate > self.max_drift).any()):  # NaN: left to the other checks
            return None
        s = int(torch.argmax(torch.nan_to_num(rate, nan=-1.0)))
        self.warned = True
        msg = (f"the conserved quantity of system {s} drifted by {float(per_atom[s]):.3g} "
               f"eV/atom in {elapsed_ps:.3g} ps ({float(rate[s]):.3g} eV/atom/ps, above "
               f"safety.max_drift={self.max_drift}): the time step is probably too large "
               "for this potential; lower timestep (or set safety.max_drift=null to silence)")
        warnings.warn(msg, DriftWarning, stacklevel=2)
        return msg
