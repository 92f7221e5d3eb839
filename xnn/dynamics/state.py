"""The MD state: an ``AtomicGraph`` plus the integrator's variables, and shared helpers.

``MDState`` is frozen: integrators return new states and never modify the caller's tensors.
Random numbers are counter-based (:mod:`xnn.dynamics.random`): a draw is a function of the
seed held in ``MDState.rng``, the step number, a stream and the system index / global atom
id it is for, so a run restarted from a checkpoint draws exactly the numbers of an
uninterrupted one, and a decomposed run the numbers of a single process.

Every function that combines atoms takes a :class:`~xnn.dynamics.reduce.Reducer`, so it
also works when a process holds only some of a system's atoms (domain decomposition).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics import random
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.errors import DataFileError, InputError
from xnn.models.potential import Evaluator
from xnn.units import KB, MVV2E


@dataclasses.dataclass(frozen=True)
class MDState:
    """State of a batch of systems under an integrator.

    Attributes:
        graph: positions (Å), velocities (Å/fs), masses (amu), cell, pbc, fixed, batch, ...
        forces: ``[n_atoms, 3]`` eV/Å at ``graph.positions``.
        energy: ``[n_systems]`` potential energy (eV).
        stress: ``[n_systems, 3, 3]`` eV/Å³ (ASE sign), zero for non-periodic systems.
        step: number of steps taken.
        vars: integrator variables by name (thermostat/barostat state, targets), each a
            tensor whose first dimension is ``n_systems``.
        rng: the seed of the integrator's random numbers, an int64 CPU tensor of shape
            ``[1]`` (:func:`new_rng`); ``None`` for deterministic integrators.
        compute_stress: evaluate the stress each step (default: when a system is periodic;
            the pressure in the thermo log needs it, NPT and cell relaxation force it).
    """

    graph: AtomicGraph
    forces: Tensor
    energy: Tensor
    stress: Tensor
    step: int = 0
    vars: Mapping[str, Tensor] = dataclasses.field(default_factory=dict)
    rng: Tensor | None = None
    compute_stress: bool = True

    @property
    def positions(self) -> Tensor:
        return self.graph.positions

    @property
    def velocities(self) -> Tensor:
        return self.graph.velocities

    @property
    def n_systems(self) -> int:
        return self.graph.n_systems

    def replace(self, **changes) -> MDState:
        """A new state with some attributes replaced (``vars`` entries merge)."""
        if "vars" in changes:
            changes["vars"] = {**self.vars, **changes["vars"]}
        return dataclasses.replace(self, **changes)


# ----------------------------------------------------------------------------- inputs
def per_system(value, n_systems: int, like: Tensor, name: str, positive: bool = False) -> Tensor:
    """Broadcast a scalar or ``[n_systems]`` value to ``[n_systems]``, checking its sign."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.ndim == 0:
        t = t.expand(n_systems).clone()
    if t.shape != (n_systems,):
        raise InputError(f"{name} must be a scalar or have shape [{n_systems}], "
                         f"got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise InputError(f"{name} must be finite, got {t.tolist()}")
    if (t < 0).any() or (positive and (t == 0).any()):
        raise InputError(f"{name} must be {'> 0' if positive else '>= 0'}, got {t.tolist()}")
    return t


def check_timestep(dt: float) -> float:
    if not dt > 0 or dt == float("inf"):
        raise InputError(f"timestep must be a positive number of fs, got {dt}")
    return float(dt)


def check_graph(graph: AtomicGraph, reduce: Reducer = LOCAL) -> AtomicGraph:
    """Validate an MD input graph: masses present and positive; add zero velocities if absent."""
    if K.MASSES not in graph or reduce.any(~(graph.masses > 0)):
        raise InputError("every atom needs a positive mass (amu) for dynamics")
    if K.VELOCITIES not in graph:
        graph = graph.replace(velocities=torch.zeros_like(graph.positions))
    return graph


# ----------------------------------------------------------------------------- kinematics
def free_mask(graph: AtomicGraph) -> Tensor:
    """``[n_atoms]`` bool, True for atoms that move."""
    fixed = graph.get(K.FIXED)
    if fixed is None:
        return torch.ones(graph.n_atoms, dtype=torch.bool, device=graph.device)
    return ~fixed.to(torch.bool)


def has_fixed(graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` bool: the system holds at least one fixed atom."""
    fixed = (~free_mask(graph)).to(graph.dtype)
    n_fixed = reduce.sum_per_system(fixed, graph.batch, graph.n_systems)
    return n_fixed > 0


def dof_terms(graph: AtomicGraph) -> list[Tensor]:
    """Per-atom ``[free, fixed]`` indicators (graph dtype) whose per-system sums give
    :func:`dof_of` (to take them in one :meth:`~Reducer.sums_per_system` with others)."""
    free = free_mask(graph)
    return [free.to(graph.dtype), (~free).to(graph.dtype)]


def dof_of(n_free: Tensor, n_fixed: Tensor) -> Tensor:
    """:func:`degrees_of_freedom` from the per-system sums of :func:`dof_terms`."""
    return torch.where(n_fixed > 0, 3 * n_free, 3 * n_free - 3).clamp(min=1.0)


def degrees_of_freedom(graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` kinetic degrees of freedom.

    ``3 N - 3`` for a system without fixed atoms (its total momentum is kept at zero),
    ``3 N_free`` otherwise; at least 1.
    """
    return dof_of(*reduce.sums_per_system(dof_terms(graph), graph.batch, graph.n_systems))


def kinetic_per_atom(graph: AtomicGraph) -> Tensor:
    """``[n_atoms]`` ``1/2 m v²`` (eV), whose per-system sum is :func:`kinetic_energy`."""
    v = graph.velocities
    return 0.5 * MVV2E * graph.masses * (v * v).sum(-1)


def kinetic_energy(graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` kinetic energy ``sum 1/2 m v²`` (eV)."""
    return reduce.sum_per_system(kinetic_per_atom(graph), graph.batch, graph.n_systems)


def kinetic_tensor_per_atom(graph: AtomicGraph) -> Tensor:
    """``[n_atoms, 3, 3]`` ``m v vᵀ`` (eV), whose per-system sum is :func:`kinetic_tensor`."""
    v = graph.velocities
    return MVV2E * graph.masses[:, None, None] * v[:, :, None] * v[:, None, :]


def kinetic_tensor(graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems, 3, 3]`` ``sum m v vᵀ`` (eV), twice the kinetic-energy tensor."""
    return reduce.sum_per_system(kinetic_tensor_per_atom(graph), graph.batch, graph.n_systems)


def temperature(graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """``[n_systems]`` instantaneous temperature ``2 K / (N_dof k_B)`` (K)."""
    return 2.0 * kinetic_energy(graph, reduce) / (degrees_of_freedom(graph, reduce) * KB)


def remove_com_velocity(v: Tensor, graph: AtomicGraph, reduce: Reducer = LOCAL) -> Tensor:
    """Subtract each system's centre-of-mass velocity (systems with fixed atoms: zero fixed atoms).

    Args:
        v: ``[n_atoms, 3]`` Å/fs.
    Returns:
        ``[n_atoms, 3]`` with zero total momentum per system without fixed atoms, and zero
        velocity on fixed atoms.
    """
    sums = reduce.sums_per_system(com_terms(v, graph), graph.batch, graph.n_systems)
    return without_com(v, graph, *sums)


def com_terms(v: Tensor, graph: AtomicGraph) -> list[Tensor]:
    """Per-atom ``[m v, m, fixed]`` whose per-system sums :func:`without_com` takes."""
    m = graph.masses
    return [m[:, None] * v, m, (~free_mask(graph)).to(graph.dtype)]


def without_com(v: Tensor, graph: AtomicGraph, mom: Tensor, mass: Tensor, n_fixed: Tensor
                ) -> Tensor:
    """:func:`remove_com_velocity` from the per-system sums of :func:`com_terms`."""
    v_com = mom / mass[:, None]
    keep = n_fixed > 0
    v = v - torch.where(keep[:, None], torch.zeros_like(v_com), v_com)[graph.batch]
    return torch.where(free_mask(graph)[:, None], v, torch.zeros_like(v))


def accelerations(forces: Tensor, graph: AtomicGraph) -> Tensor:
    """``[n_atoms, 3]`` Å/fs² from forces (eV/Å); zero on fixed atoms."""
    a = forces / (graph.masses[:, None] * MVV2E)
    return torch.where(free_mask(graph)[:, None], a, torch.zeros_like(a))


# ----------------------------------------------------------------------------- random numbers
def new_rng(seed: int) -> Tensor:
    """``MDState.rng`` for ``seed``: an int64 CPU tensor ``[1]`` (any int, taken mod 2⁶⁴)."""
    return torch.tensor([random.as_int64(int(seed))], dtype=torch.int64)


def seed_of(rng: Tensor) -> int:
    """The seed stored in ``MDState.rng`` (see :func:`new_rng`).

    Raises:
        DataFileError: ``rng`` is a torch generator state (a checkpoint of an older xnn).
    """
    if rng.dtype != torch.int64 or rng.shape != (1,):
        raise DataFileError("this MD state holds a torch generator state (a checkpoint "
                            "written by an older xnn); start the run again without resume")
    return int(rng[0])


def maxwell_boltzmann(
    graph: AtomicGraph, temperature_K, seed: int = 0, reduce: Reducer = LOCAL
) -> AtomicGraph:
    """Graph with Maxwell–Boltzmann velocities at ``temperature_K`` and zero total momentum.

    Args:
        graph: positions and masses (amu).
        temperature_K: scalar or ``[n_systems]`` (K).
        seed: the velocities are a function of the seed, the system index and the global
            atom id only (not of the atoms' order or of which process holds them).
        reduce: sums over the atoms of all processes (for the momentum).
    Returns:
        the graph with ``velocities [n_atoms, 3]`` (Å/fs); fixed atoms get zero velocity.
    """
    graph = check_graph(graph, reduce)
    t = per_system(temperature_K, graph.n_systems, graph.positions, "temperature")
    words = random.atom_words(graph.batch, graph.atom_id, 3)
    xi = random.normal(seed, 0, random.STREAMS["velocities"], *words).to(graph.positions)
    sigma = torch.sqrt(KB * t[graph.batch] / (graph.masses * MVV2E))
    v = remove_com_velocity(xi * sigma[:, None], graph, reduce)
    return graph.replace(velocities=v)


#: optional ``MDState.vars`` entries that key each system's random numbers by the system
#: itself instead of its index in the batch (:mod:`xnn.dynamics.slots`, batched workflows
#: with in-flight refill): ``rng_key [n_systems]`` int64 (e.g. a campaign's system id) and
#: ``rng_step0 [n_systems]`` int64, the batch step at which the system's own step count was 0.
RNG_KEY = "rng_key"
RNG_STEP0 = "rng_step0"


def system_words(
    vars: Mapping[str, Tensor], step: int, n_systems: int, device
) -> tuple[int, tuple[Tensor, ...]]:
    """The key step and the per-system words (each ``[n_systems]`` int64) of the draws of
    batch step ``step`` (:func:`xnn.dynamics.random.random_bits`).

    Without :data:`RNG_KEY` in ``vars``: ``(step, (system index,))``. With it:
    ``(-1, (rng_key, step - rng_step0))``: a system draws the same numbers whatever its place
    in the batch and whenever it joined it.
    """
    if RNG_KEY not in vars:
        return int(step), (torch.arange(n_systems, device=device),)
    key = vars[RNG_KEY].to(device=device, dtype=torch.int64)
    return -1, (key, int(step) - vars[RNG_STEP0].to(device=device, dtype=torch.int64))


# ----------------------------------------------------------------------------- model calls
#: a committee's uncertainties that an MD state carries as fields of its graph (per atom
#: ``forces_std [n_atoms]`` eV/Å, per system ``energy_std [n_systems]`` eV): they move with
#: the atoms, are gathered by id and reach the thermo log, the hooks and the safety checks
UNCERTAINTY = (K.FORCES_STD, K.ENERGY_STD)


def evaluate(model: Evaluator, graph: AtomicGraph, stress: bool = True
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Energy ``[n_systems]``, forces ``[n_atoms, 3]`` and stress ``[n_systems, 3, 3]``.

    Args:
        model: a potential (:class:`~xnn.models.potential.Evaluator`: a
            :class:`~xnn.models.Potential`, or any callable with its signature).
        stress: compute the stress (else it is returned as zeros).
    """
    return evaluate_graph(model, graph, stress)[1:]


def evaluate_graph(model: Evaluator, graph: AtomicGraph, stress: bool = True
                   ) -> tuple[AtomicGraph, Tensor, Tensor, Tensor]:
    """:func:`evaluate`, with ``graph`` first: for a committee with its :data:`UNCERTAINTY`
    fields set to this evaluation's (the same graph for any other model)."""
    out = model(graph.without_edges(), forces=True, stress=stress)
    stress = out.get(K.STRESS)
    if stress is None:
        stress = torch.zeros_like(graph.cell)
    spread = {k: out[k].detach() for k in UNCERTAINTY if k in out}
    if spread:
        graph = graph.replace(spread)
    return graph, out[K.ENERGY].detach(), out[K.FORCES].detach(), stress.detach()


def initial_state(
    model, graph: AtomicGraph, vars: Mapping[str, Tensor], rng: Tensor | None = None,
    reduce: Reducer = LOCAL,
) -> MDState:
    """Evaluate the model on ``graph`` and wrap it in an :class:`MDState` at step 0."""
    graph = check_graph(graph, reduce)
    graph = graph.replace(velocities=torch.where(
        free_mask(graph)[:, None], graph.velocities, torch.zeros_like(graph.velocities)
    ))
    need = bool(graph.pbc.all(-1).any())
    graph, energy, forces, stress = evaluate_graph(model, graph, need)
    return MDState(graph, forces, energy, stress, 0, dict(vars), rng, need)


def with_positions(state: MDState, model, graph: AtomicGraph) -> MDState:
    """New state at ``graph``'s positions/cell with fresh forces (and a committee's
    :data:`UNCERTAINTY`); step count +1."""
    graph, energy, forces, stress = evaluate_graph(model, graph, state.compute_stress)
    return state.replace(graph=graph, forces=forces, energy=energy, stress=stress,
                         step=state.step + 1)
