"""Thermodynamic observables of an MD state and the columns of its thermo log (the CSV
log and its plot are written by :mod:`xnn.io.thermo`)."""

from __future__ import annotations

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState, kinetic_energy, kinetic_tensor, temperature
from xnn.units import EV_PER_A3_TO_GPA

COLUMNS = ("step", "time_fs", "system", "temperature_K", "epot_eV", "ekin_eV", "etot_eV",
           "pressure_GPa", "volume_A3", "conserved_eV")
#: the columns a committee adds (:func:`uncertainty_columns`): the largest and the mean
#: per-atom force uncertainty of each system (eV/Å), its energy uncertainty (eV)
UNCERTAINTY_COLUMNS = ("max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV")


def columns(committee: bool) -> tuple[str, ...]:
    """The thermo log's columns: :data:`COLUMNS`, and for a committee model
    :data:`UNCERTAINTY_COLUMNS`."""
    return COLUMNS + UNCERTAINTY_COLUMNS if committee else COLUMNS


def uncertainty_columns(graph: AtomicGraph, reduce: Reducer = LOCAL) -> dict[str, torch.Tensor]:
    """Per-system ``[n_systems]`` :data:`UNCERTAINTY_COLUMNS` of a committee's evaluation
    (the graph's ``forces_std`` and ``energy_std`` fields, see
    :data:`xnn.dynamics.state.UNCERTAINTY`); empty without them.

    Under domain decomposition each rank holds the spread of its owned atoms: the maximum
    and the mean are reduced over the ranks (every rank gets the system's values)."""
    if K.FORCES_STD not in graph:
        return {}
    std, b, n = graph[K.FORCES_STD], graph.batch, graph.n_systems
    count = reduce.count_per_system(b, n).to(std.dtype).clamp(min=1.0)
    return {"max_force_std_eV_A": reduce.max_per_system(std, b, n),
            "mean_force_std_eV_A": reduce.sum_per_system(std, b, n) / count,
            "energy_std_eV": graph[K.ENERGY_STD]}


def observables(state: MDState, conserved, reduce: Reducer = LOCAL) -> dict[str, torch.Tensor]:
    """Per-system ``[n_systems]`` temperature, energies, pressure (GPa), volume, conserved
    and, for a committee, :func:`uncertainty_columns`."""
    g = state.graph
    ekin = kinetic_energy(g, reduce)
    vol = g.volume()
    periodic = g.pbc.all(-1) & (vol > 0)
    vol_safe = torch.where(periodic, vol, torch.ones_like(vol))
    p_tensor = kinetic_tensor(g, reduce) / vol_safe[:, None, None] - state.stress
    p = p_tensor.diagonal(dim1=-2, dim2=-1).mean(-1) * EV_PER_A3_TO_GPA
    nan = torch.full_like(p, float("nan"))
    return {
        "temperature_K": temperature(g, reduce),
        "epot_eV": state.energy,
        "ekin_eV": ekin,
        "etot_eV": state.energy + ekin,
        "pressure_GPa": torch.where(periodic, p, nan),
        "volume_A3": torch.where(periodic, vol, nan),
        "conserved_eV": conserved(state, reduce),
        **uncertainty_columns(g, reduce),
    }
