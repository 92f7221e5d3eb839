"""Thermodynamic observables of an MD state and the columns of its thermo log (the CSV
log and its plot are written by :mod:`xnn.io.thermo`)."""

from __future__ import annotations

import torch

from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import MDState, kinetic_energy, kinetic_tensor, temperature
from xnn.units import EV_PER_A3_TO_GPA

COLUMNS = ("step", "time_fs", "system", "temperature_K", "epot_eV", "ekin_eV", "etot_eV",
           "pressure_GPa", "volume_A3", "conserved_eV")


def observables(state: MDState, conserved, reduce: Reducer = LOCAL) -> dict[str, torch.Tensor]:
    """Per-system ``[n_systems]`` temperature, energies, pressure (GPa), volume, conserved."""
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
    }
