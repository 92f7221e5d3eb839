"""Checkpoints of ``xnn md`` and ``xnn relax``: the full integrator state (graph, forces,
thermostat or FIRE variables, RNG state), the neighbor list, and the sizes of the output
files, written atomically. ``meta["kind"]`` (``"md"`` or ``"relax"``) names the writer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from xnn._files import atomic_write, require_file
from xnn.data.graph import AtomicGraph
from xnn.dynamics.state import MDState
from xnn.errors import DataFileError
from xnn.models.serialization import load_failure, read_as_data, refused_global

FORMAT = "xnn-md-checkpoint"


def _storable(v) -> bool:
    if v is None or isinstance(v, (torch.Tensor, int, float, str, bool)):
        return True
    return isinstance(v, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in v)


def neighbor_state(potential) -> dict | None:
    """The Verlet list's cache (edges, reference positions/cell/ids...), so that a resumed
    run reuses exactly the list an uninterrupted run would (same edge order, same sums)."""
    nl = getattr(potential, "neighbors", None)
    if nl is None:
        return None
    return {k: v for k, v in vars(nl).items() if _storable(v)}


#: the list's settings, which come from the run's potential, never from a checkpoint
_SETTINGS = ("cutoff", "skin", "backend")


def restore_neighbor_state(potential, saved: dict | None, device) -> None:
    """Reuse the checkpoint's Verlet-list cache in ``potential``'s list when it was built
    for the same cutoff and skin (else the list is built afresh at the first evaluation).
    The list's cutoff, skin and backend stay the potential's own."""
    nl = getattr(potential, "neighbors", None)
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


def save_checkpoint(path: str | os.PathLike, state: MDState, meta: dict, potential=None) -> None:
    """Write ``state`` and ``meta`` (ensemble, file sizes, ...) to ``path`` atomically
    (:func:`xnn._files.atomic_write`: the user's umask, file and folder fsynced)."""
    payload = {
        "format": FORMAT,
        "version": 1,
        "meta": meta,
        "step": state.step,
        "graph": {k: v.detach().cpu() for k, v in state.graph.fields.items()},
        "forces": state.forces.cpu(),
        "energy": state.energy.cpu(),
        "stress": state.stress.cpu(),
        "vars": {k: v.cpu() for k, v in state.vars.items()},
        "rng": None if state.rng is None else state.rng.cpu(),
        "compute_stress": state.compute_stress,
        "neighbors": _to_cpu(neighbor_state(potential)) if potential is not None else None,
    }
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


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


def load_checkpoint(
    path: str | os.PathLike, device=None, potential=None, kind: str | None = None
) -> tuple[MDState, dict]:
    """Read a checkpoint; returns the state (on ``device``) and its ``meta`` dict.

    Args:
        kind: the run that must have written it (``"md"``, ``"relax"``); ``None``: any.
    Raises:
        DataFileError: missing, unreadable, or not a checkpoint of ``kind``.
    """
    path, what = Path(path), f"xnn {kind or 'md/relax'} checkpoint"
    require_file(path, "checkpoint", suggest=("checkpoint.pt",))
    try:  # as data: no code from the file runs
        p = read_as_data(path)
    except Exception as e:
        if refused_global(e):
            raise DataFileError(f"{path} is not an {what}: {load_failure(e)} (xnn reads "
                                "checkpoints as data only)") from None
        raise DataFileError(f"{path} is not a readable {what} ({type(e).__name__})") from None
    if not isinstance(p, dict) or p.get("format") != FORMAT:
        raise DataFileError(f"{path} is not an {what}")
    got = p["meta"].get("kind")
    if kind is not None and got != kind:
        raise DataFileError(f"{path} is an xnn {got} checkpoint, not an {what}")
    graph = AtomicGraph({k: v.to(device) for k, v in p["graph"].items()}, validate=False)
    state = MDState(
        graph=graph,
        forces=p["forces"].to(device),
        energy=p["energy"].to(device),
        stress=p["stress"].to(device),
        step=int(p["step"]),
        vars={k: v.to(device) for k, v in p["vars"].items()},
        rng=p["rng"],
        compute_stress=bool(p.get("compute_stress", True)),
    )
    if potential is not None:
        restore_neighbor_state(potential, p.get("neighbors"), device)
    return state, p["meta"]
