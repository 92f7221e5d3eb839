"""The MD/relaxation state as a checkpoint payload and back: plain dicts of CPU tensors
(graph fields, forces, thermostat or FIRE variables, RNG state) and the Verlet list's
cache. No files: :mod:`xnn.io.md_checkpoint` writes and reads these payloads."""

from __future__ import annotations

import torch

from xnn.data.graph import AtomicGraph
from xnn.dynamics.state import MDState
from xnn.models.potential import Potential

FORMAT = "xnn-md-checkpoint"


def _storable(v) -> bool:
    if v is None or isinstance(v, (torch.Tensor, int, float, str, bool)):
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in v)


def neighbor_state(potential: Potential | None) -> dict | None:
    """The Verlet list's cache (edges, reference positions/cell/ids...), so that a resumed
    run reuses exactly the list an uninterrupted run would (same edge order, same sums);
    ``None`` without a one-process potential (a decomposed run rebuilds its plan)."""
    nl = None if potential is None else potential.neighbors
    if nl is None:
        return None
    return {k: v for k, v in vars(nl).items() if _storable(v)}


#: the list's settings, which come from the run's potential, never from a checkpoint
_SETTINGS = ("cutoff", "skin", "backend")


def restore_neighbor_state(potential: Potential | None, saved: dict | None, device) -> None:
    """Reuse the checkpoint's Verlet-list cache in ``potential``'s list when it was built
    for the same cutoff and skin (else the list is built afresh at the first evaluation).
    The list's cutoff, skin and backend stay the potential's own."""
    nl = None if potential is None else potential.neighbors
    if nl is None or saved is None:
        return
    if saved.get("cutoff", nl.cutoff) != nl.cutoff or saved.get("skin", nl.skin) != nl.skin:
        return
    for k, v in saved.items():
        if k in _SETTINGS:
            continue
        if isinstance(v, torch.Tensor):
            v = v.to(device)
        elif isinstance(v, (tuple, list)):
            v = tuple(t.to(device) for t in v)
        setattr(nl, k, v)


def neighbor_payload(potential: Potential | None) -> dict | None:
    """:func:`neighbor_state` of ``potential`` on the CPU (``None``: it keeps no list)."""
    return _to_cpu(neighbor_state(potential))


def state_to_payload(state: MDState) -> dict:
    """``state`` as a dict of CPU tensors (step, graph fields, forces, energy, stress,
    integrator variables, RNG state, whether stress is computed)."""
    return {
        "step": state.step,
        "graph": {k: v.detach().cpu() for k, v in state.graph.fields.items()},
        "forces": state.forces.cpu(),
        "energy": state.energy.cpu(),
        "stress": state.stress.cpu(),
        "vars": {k: v.cpu() for k, v in state.vars.items()},
        "rng": None if state.rng is None else state.rng.cpu(),
        "compute_stress": state.compute_stress,
    }


def state_from_payload(p: dict, device=None) -> MDState:
    """The :class:`MDState` of a :func:`state_to_payload` dict, on ``device``."""
    graph = AtomicGraph({k: v.to(device) for k, v in p["graph"].items()}, validate=False)
    return MDState(
        graph=graph,
        forces=p["forces"].to(device),
        energy=p["energy"].to(device),
        stress=p["stress"].to(device),
        step=int(p["step"]),
        vars={k: v.to(device) for k, v in p["vars"].items()},
        rng=p["rng"],
        compute_stress=bool(p.get("compute_stress", True)),
    )


def checkpoint_payload(state: MDState, meta: dict, potential=None) -> dict:
    """The payload of an ``xnn md`` / ``xnn relax`` checkpoint: ``state``, ``meta``
    (ensemble, file sizes, ``meta["kind"]`` naming the run) and, with ``potential``, its
    Verlet list's cache."""
    return {
        "format": FORMAT,
        "version": 1,
        "meta": meta,
        **state_to_payload(state),
        "neighbors": neighbor_payload(potential) if potential is not None else None,
    }


def state_from_checkpoint(p: dict, device=None, potential=None) -> tuple[MDState, dict]:
    """``(state, meta)`` of a :func:`checkpoint_payload` dict; with ``potential``, its
    Verlet list takes the payload's cache (:func:`restore_neighbor_state`)."""
    state = state_from_payload(p, device)
    if potential is not None:
        restore_neighbor_state(potential, p.get("neighbors"), device)
    return state, p["meta"]


def _to_cpu(d):
    if d is None:
        return None
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            v = v.cpu()
        elif isinstance(v, (tuple, list)):
            v = tuple(t.cpu() for t in v)
        out[k] = v
    return out
