"""The stages of ``xnn run``: start a stage for one system, advance a batch, say who is done,
and the numbers of a system's row in ``results.csv``.

A stage's state is the integrator's batched :class:`~xnn.dynamics.state.MDState` with
per-system random keys (:func:`xnn.dynamics.slots.keyed`): key ``id * 256 + stage index``,
so a system draws the same numbers in any slot of any batch, and alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.app.md_setup import pressure_to_internal
from xnn.config.workflow import StageConfig
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics import fire, random, slots
from xnn.dynamics.registry import get_integrator
from xnn.dynamics.state import (
    MDState,
    kinetic_tensor,
    maxwell_boltzmann,
    new_rng,
    temperature,
)
from xnn.dynamics.thermo import UNCERTAINTY_COLUMNS, uncertainty_columns
from xnn.units import GPA_TO_EV_PER_A3

#: fields a system carries from one stage to the next (integrator fields are dropped)
CARRIED = (K.POSITIONS, K.NUMBERS, K.CELL, K.PBC, K.BATCH, K.MASSES, K.ATOM_ID,
           K.VELOCITIES, K.FIXED)
MAX_STAGES = 256


def rng_key(system_id: int, stage_index: int) -> int:
    """The random key of a system in a stage (its draws do not depend on its slot)."""
    return int(system_id) * MAX_STAGES + int(stage_index)


def carried(graph: AtomicGraph) -> AtomicGraph:
    """``graph`` without the fields of the integrator that produced it."""
    return AtomicGraph({k: graph[k] for k in CARRIED if k in graph}, validate=False)


def integrator_name(stage: StageConfig) -> str:
    if stage.type == "nvt":
        return stage.thermostat
    return "fire" if stage.type == "relax" else stage.type


def draws_velocities(stage: StageConfig, graph: AtomicGraph) -> bool:
    """Whether an MD stage gives a system entering it Maxwell–Boltzmann velocities (always
    with ``velocities: maxwell``; with ``auto`` when the system is at rest)."""
    moving = K.VELOCITIES in graph and bool((graph.velocities != 0).any())
    return stage.velocities == "maxwell" or (stage.velocities == "auto" and not moving)


def initial_temperature(stage: StageConfig) -> float:
    """The temperature (K) of the velocities an MD stage draws."""
    if stage.initial_temperature is not None:
        return float(stage.initial_temperature)
    return float(stage.temperature) if stage.type != "nve" else 0.0


def asked_temperature(stage: StageConfig, graph: AtomicGraph) -> float:
    """The temperature (K) a stage asks of a system entering it: its thermostat's target,
    or that of the velocities it draws, whichever is higher (0 for a relaxation)."""
    if stage.type == "relax":
        return 0.0
    target = float(stage.temperature) if stage.type in ("nvt", "npt") else 0.0
    return max(target, initial_temperature(stage) if draws_velocities(stage, graph) else 0.0)


def _velocities(stage: StageConfig, graph: AtomicGraph, seed: int, key: int) -> AtomicGraph:
    if not draws_velocities(stage, graph):
        return graph if K.VELOCITIES in graph else graph.replace(
            velocities=torch.zeros_like(graph.positions))
    mixed = random.as_int64(random.mix64_int(random.mix64_int(seed) + key))
    return maxwell_boltzmann(graph, initial_temperature(stage), seed=mixed)


def start(stage: StageConfig, index: int, graph: AtomicGraph, potential, system_id: int,
          seed: int, pressure_unit: str) -> MDState:
    """The state of one system (a single-system ``graph``) at the start of ``stage``.

    Args:
        index: the stage's position in the workflow.
        potential: the stage's :class:`~xnn.models.Potential`.
        seed: the workflow's seed (velocities and thermostat noise).
    """
    graph = carried(graph)
    key = rng_key(system_id, index)
    p = pressure_to_internal(stage.pressure or 0.0, pressure_unit)
    if stage.type == "relax":
        state = fire.init(graph, potential, relax_cell=stage.relax_cell, pressure=p,
                          maxstep=stage.maxstep)
        return slots.keyed(state, key)
    graph = _velocities(stage, graph, seed, key)
    mod = get_integrator(integrator_name(stage))
    t = stage.temperature
    args: dict = {}
    if stage.type == "nvt" and stage.thermostat == "langevin":
        args = dict(temperature=t, friction=stage.friction, seed=seed)
    elif stage.type == "nvt" and stage.thermostat == "csvr":
        args = dict(temperature=t, tau=stage.tau, seed=seed)
    elif stage.type == "nvt":
        args = dict(temperature=t, tau=stage.tau, chain_length=stage.chain_length)
    elif stage.type == "npt":
        args = dict(temperature=t, pressure=p, tau=stage.tau, tau_p=stage.tau_p,
                    compressibility=stage.compressibility / GPA_TO_EV_PER_A3,
                    anisotropic=stage.anisotropic, seed=seed)
    state = mod.init(graph, potential, **args)
    if state.rng is None:  # deterministic integrators: one seed for every batch
        state = state.replace(rng=new_rng(seed))
    return slots.keyed(state, key)


def advance(stage: StageConfig, state: MDState, potential) -> MDState:
    """One step of every system of the batch ``state``."""
    if stage.type == "relax":
        return fire.step(state, potential, stage.fmax)
    return get_integrator(integrator_name(stage)).step(state, potential, stage.timestep)


def max_force(state: MDState) -> Tensor:
    """``[n_systems]`` largest atomic force norm (eV/Å)."""
    g = state.graph
    out = torch.zeros(g.n_systems, dtype=g.dtype, device=g.device)
    return out.scatter_reduce(0, g.batch, state.forces.norm(dim=-1), "amax", include_self=True)


def status(stage: StageConfig, state: MDState, limit: float) -> tuple[Tensor, Tensor, Tensor]:
    """``[n_systems]`` bools: done with the stage, converged (MD: the steps were taken),
    failed (energy or forces not finite, or a force above ``limit`` eV/Å)."""
    own = slots.own_steps(state)
    finite = torch.isfinite(state.energy) & torch.isfinite(max_force(state))
    failed = ~finite | (max_force(state) > limit)
    if stage.type == "relax":
        conv = (fire.fmax(state) < stage.fmax) & ~failed
        done = conv | (own >= stage.max_steps)
    else:
        done = own >= stage.steps
        conv = done & ~failed
    return done | failed, conv, failed


def row_values(stage: StageConfig, state: MDState) -> dict[str, list]:
    """Per-system numbers of the rows of ``results.csv``: steps, energy (eV), fmax (eV/Å),
    temperature (K), volume (Å³), pressure (GPa; NaN unless periodic) and a committee's
    uncertainty at the stage's last step (:data:`~xnn.dynamics.thermo.UNCERTAINTY_COLUMNS`:
    largest and mean per-atom force spread, eV/Å, energy spread, eV; NaN for one model)."""
    g = state.graph
    fm = fire.fmax(state) if stage.type == "relax" else max_force(state)
    periodic = g.pbc.all(-1)
    vol = torch.where(periodic, g.volume(), torch.full_like(state.energy, float("nan")))
    kin = kinetic_tensor(g).diagonal(dim1=-2, dim2=-1).sum(-1) / 3
    p = (kin / vol - state.stress.diagonal(dim1=-2, dim2=-1).mean(-1)) / GPA_TO_EV_PER_A3
    return {
        "steps": slots.own_steps(state).tolist(),
        "energy_eV": state.energy.tolist(),
        "fmax_eV_A": fm.tolist(),
        "temperature_K": temperature(g).tolist(),
        "volume_A3": vol.tolist(),
        "pressure_GPa": p.tolist(),
        **_uncertainty(g, state.energy),
    }


def _uncertainty(graph: AtomicGraph, like: Tensor) -> dict[str, list]:
    """:func:`~xnn.dynamics.thermo.uncertainty_columns` of ``graph`` (NaN without them)."""
    spread = uncertainty_columns(graph)
    nan = torch.full_like(like, float("nan"))
    return {c: spread.get(c, nan).tolist() for c in UNCERTAINTY_COLUMNS}
