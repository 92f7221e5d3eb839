"""Checks that stop a diverging simulation with a message naming the step and the atoms, and
a monitor that warns once when the conserved quantity drifts (a time step too large)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState, temperature
from xnn.errors import XnnError
from xnn.models.potential import PotentialInterface


class SimulationError(XnnError):
    """A simulation became unphysical (NaN, exploding forces, atoms too close, blow-up)."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def top_atoms(values: Tensor, ids: Tensor, reduce: Reducer = LOCAL,
              k: int = 6) -> tuple[list[float], list[int], list[int] | None]:
    """The ``k`` atoms of all processes with the largest ``values`` (ties: smallest id).

    Args:
        values: ``[n_atoms]`` per atom; ``-inf`` excludes an atom (``nan``: use ``inf``).
        ids: ``[n_atoms]`` their global atom ids.
        reduce: the reducer whose processes hold the atoms (one all-gather of ``[k, 2]``).
    Returns:
        ``(values, atom ids, ranks)``, best first; ``ranks`` is ``None`` in one process.
    """
    v = values.detach().to(torch.float64)
    i = ids.to(device=v.device, dtype=torch.float64)
    order = torch.argsort(i, stable=True)
    order = order[torch.argsort(-v[order], stable=True)][:k]
    mine = torch.full((k, 2), float("-inf"), dtype=torch.float64, device=v.device)
    mine[: order.numel(), 0], mine[: order.numel(), 1] = v[order], i[order]
    every = reduce.gather_small(mine).cpu()
    rows = sorted((-float(val), int(aid), r) for r, part in enumerate(every.tolist())
                  for val, aid in part if val != float("-inf"))[:k]
    ranks = [r for _, _, r in rows] if every.shape[0] > 1 else None
    return [-a for a, _, _ in rows], [b for _, b, _ in rows], ranks


def _on_ranks(ranks: list[int] | None) -> str:
    """`` (on rank(s) ...)`` naming where the atoms are under domain decomposition."""
    if not ranks:
        return ""
    return f" (owned by rank {ranks[0]})" if len(set(ranks)) == 1 else \
        f" (owned by ranks {ranks})"


def check_forces(state: MDState, max_force: float, reduce: Reducer = LOCAL) -> None:
    """Raise :class:`SimulationError` on non-finite energies/forces or a force > ``max_force``.

    The message names the global atom ids (largest forces first; under domain
    decomposition also their ranks). Collective with a cross-rank ``reduce``: one all-reduce
    of two numbers per call (every rank raises, even one without atoms)."""
    norm = state.forces.detach().norm(dim=-1)
    finite = torch.isfinite(norm)
    bad_energy = ~torch.isfinite(state.energy.detach()).all()
    largest = torch.where(finite, norm, 0.0).max() if norm.numel() else norm.new_zeros(())
    local = torch.stack([((~finite).any() | bad_energy).to(norm.dtype), largest])
    nonfinite, top = reduce.max_per_system(local, torch.arange(2, device=norm.device),
                                           2).tolist()
    if not (nonfinite > 0 or top > max_force):
        return
    if nonfinite > 0:
        what = "non-finite energy or forces"
        rank_by = torch.where(finite, float("-inf"), 1.0).to(norm.dtype)
    else:
        what = f"force above safety.max_force={max_force} eV/Å (max {top:.3g})"
        rank_by = torch.where(norm > max_force, norm, float("-inf"))
    _, ids, ranks = top_atoms(rank_by, state.graph.atom_id, reduce)
    raise SimulationError(f"step {state.step}: {what} on atoms (atom_id) {ids}"
                          f"{_on_ranks(ranks)}", state.step)


def _min_pair(state: MDState, potential: PotentialInterface) -> tuple[float, list[int]]:
    """This process's shortest pair (Å) and its atom ids (sorted)."""
    d, ids = potential.min_pair_distance(state.graph)
    return float(d), sorted(int(i) for i in ids.tolist())


def check_distances(
    state: MDState, potential: PotentialInterface, min_distance: float,
    reduce: Reducer = LOCAL,
) -> None:
    """Raise when two atoms are closer than ``min_distance`` (Å), from the Verlet list (or,
    for a decomposed potential, its last evaluation's pairs, minimum over the ranks); the
    message names the pair's global atom ids (and, decomposed, the rank that found it)."""
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
    if dmin < min_distance:  # every rank: which rank's pair, and its ids
        every = reduce.gather_small(like.new_tensor([d, *ids])).cpu().tolist()
        best, a, b, rank = min((x, int(i), int(j), r) for r, (x, i, j) in enumerate(every))
        _raise_close(state, best, [a, b], min_distance, f" (found by rank {rank})")


def _raise_close(state: MDState, d: float, ids: list[int], min_distance: float,
                 where: str = "") -> None:
    raise SimulationError(f"step {state.step}: atoms (atom_id) {ids} are {d:.3f} Å apart, "
                          f"closer than safety.min_distance={min_distance} Å{where}",
                          state.step)


def check_temperature(state: MDState, max_temperature: Tensor, reduce: Reducer = LOCAL) -> None:
    """Raise when a system's temperature exceeds ``max_temperature [n_systems]`` (K); the
    message names the fastest atoms (largest kinetic energy, global ids, over the ranks)."""
    t = temperature(state.graph, reduce)
    hot = (t > max_temperature) | ~torch.isfinite(t)
    if reduce.any(hot):
        s = int(torch.nonzero(hot).flatten()[0])
        g = state.graph
        ke = (g.masses * (g.velocities ** 2).sum(-1)).masked_fill(g.batch != s, float("-inf"))
        _, fastest, ranks = top_atoms(torch.nan_to_num(ke, nan=float("inf")), g.atom_id,
                                      reduce, k=3)
        raise SimulationError(f"step {state.step}: temperature of system {s} is "
                              f"{float(t[s]):.4g} K, above {float(max_temperature[s]):.4g} K "
                              f"(fastest atoms, atom_id: {fastest}){_on_ranks(ranks)}",
                              state.step)


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


class UncertaintyWarning(UserWarning):
    """A committee's members disagree on the forces beyond ``safety.max_force_uncertainty``:
    the simulation left the potential's training data."""


#: what :class:`UncertaintyGuard` does above its threshold (``safety.on_uncertainty``)
ON_UNCERTAINTY = ("stop", "warn")


class UncertaintyGuard:
    """Stop, or warn once per excursion, when a committee's largest per-atom force
    uncertainty (``forces_std`` of the state's graph, eV/Å) exceeds ``threshold``.

    The decision is collective under domain decomposition: one all-reduce (maximum) of one
    number per check, so every rank stops (or warns) at the same step; the message names the
    most uncertain atoms by global id (and, decomposed, their ranks).

    Args:
        threshold: eV/Å; ``None`` disables the guard.
        action: ``"stop"`` (:meth:`check` raises :class:`SimulationError`) or ``"warn"``
            (:class:`UncertaintyWarning` when the uncertainty first exceeds the threshold, and
            again only after it has fallen back below it).
    """

    def __init__(self, threshold: float | None, action: str = "stop"):
        if action not in ON_UNCERTAINTY:
            raise ValueError(f"action must be one of {list(ON_UNCERTAINTY)}, got {action!r}")
        self.threshold, self.action = threshold, action
        self.above = False  # inside an excursion (warn once per excursion)
        self.excursions = 0

    def check(self, state: MDState, reduce: Reducer = LOCAL) -> str | None:
        """Look at ``state``'s force uncertainty; returns the message of a new excursion
        (``"warn"``: the caller issues it, as :class:`UncertaintyWarning`, on one rank),
        ``None`` otherwise. Collective.

        Raises:
            SimulationError: ``"stop"`` and the uncertainty exceeds the threshold.
        """
        g = state.graph
        if self.threshold is None or K.FORCES_STD not in g:
            return None
        std = g[K.FORCES_STD].detach()
        per_system = reduce.max_per_system(std, g.batch, g.n_systems)
        s = int(torch.argmax(torch.nan_to_num(per_system, nan=float("inf"))))
        top = float(per_system[s])
        if not top > self.threshold:
            self.above = False
            return None
        if self.above and self.action == "warn":
            return None
        mine = (std > self.threshold) & (g.batch == s)
        _, ids, ranks = top_atoms(torch.where(mine, std, float("-inf")), g.atom_id, reduce,
                                  k=3)
        where = f" of system {s}" if g.n_systems > 1 else ""
        msg = (f"step {state.step}: force uncertainty (committee spread) {top:.3g} eV/Å "
               f"above safety.max_force_uncertainty={self.threshold} eV/Å on atoms "
               f"(atom_id) {ids}{where}{_on_ranks(ranks)}")
        if self.action == "stop":
            raise SimulationError(msg, state.step)
        self.above, self.excursions = True, self.excursions + 1
        return msg
