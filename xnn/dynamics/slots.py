"""Slots of a batched MD state: take systems out of a batch and put others in (in-flight refill).

A batch (:class:`~xnn.dynamics.state.MDState`) advances many independent systems with one
model call per step. When one of them is done (a relaxation converged, an MD stage took its
steps) a workflow takes it out (:func:`select`) and puts the next system in its place
(:func:`concat` of the batch and that system's freshly initialised single-system state).
Every integrator variable is per system, so the systems that stay are not disturbed.

Random numbers: a batch step ``n`` keys its draws by ``(seed, n, system index)``, and the
index of a system changes when others leave. :func:`keyed` gives each system its own key
(``vars["rng_key"]``, e.g. its id in a campaign) and the batch step at which its own step
count was 0 (``vars["rng_step0"]``); the stochastic integrators then key a system's draws by
``(seed, key, own step)`` (:func:`~xnn.dynamics.state.system_words`), so a system draws the
same numbers whether it runs alone or in any slot of any batch, joined at any step.

Library code: no config, no files, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.dynamics.state import RNG_KEY, RNG_STEP0, MDState
from xnn.errors import InputError


def keyed(state: MDState, keys) -> MDState:
    """``state`` with per-system random keys; each system's own step count starts now.

    Args:
        keys: int or ``[n_systems]`` ints (e.g. the systems' ids in a campaign), >= 0.
    Returns:
        the state with ``vars["rng_key"]`` and ``vars["rng_step0"] = state.step``
        (``[n_systems]`` int64 each).
    """
    dev = state.positions.device
    k = torch.as_tensor(keys, dtype=torch.int64, device=dev).reshape(-1)
    if k.numel() == 1:
        k = k.expand(state.n_systems).clone()
    if k.shape != (state.n_systems,):
        raise InputError(f"keys must be one int or {state.n_systems} ints, got {k.numel()}")
    step0 = torch.full((state.n_systems,), state.step, dtype=torch.int64, device=dev)
    return state.replace(vars={RNG_KEY: k, RNG_STEP0: step0})


def own_steps(state: MDState) -> Tensor:
    """``[n_systems]`` int64: steps each system has taken since it was :func:`keyed`."""
    if RNG_STEP0 not in state.vars:
        raise InputError("own_steps needs a state prepared with xnn.dynamics.slots.keyed")
    return state.step - state.vars[RNG_STEP0]


def select(state: MDState, systems: Sequence[int] | Tensor) -> MDState:
    """The sub-batch of ``systems`` (indices, in that order), with their variables.

    Raises:
        InputError: no system selected (an empty batch is not a state).
    """
    idx = torch.as_tensor(systems, dtype=torch.long, device=state.positions.device).flatten()
    if idx.numel() == 0:
        raise InputError("select needs at least one system")
    graph = state.graph.select_systems(idx)
    atoms = _atom_index(state.graph, idx)
    return MDState(
        graph=graph,
        forces=state.forces.index_select(0, atoms),
        energy=state.energy.index_select(0, idx),
        stress=state.stress.index_select(0, idx),
        step=state.step,
        vars={k: v.index_select(0, idx.to(v.device)) for k, v in state.vars.items()},
        rng=state.rng,
        compute_stress=state.compute_stress,
    )


def concat(states: Sequence[MDState], step: int | None = None) -> MDState:
    """One batch of the systems of ``states`` (in order), at batch step ``step`` (default:
    that of ``states[0]``).

    The states must come from the same integrator (same variables) with the same random
    seed. A system's own step count (:func:`own_steps`) is kept: ``rng_step0`` is shifted by
    the difference of the batch steps.
    """
    if not states:
        raise InputError("concat needs at least one state")
    first = states[0]
    names = set(first.vars)
    for s in states[1:]:
        if set(s.vars) != names:
            raise InputError(f"cannot batch states of different integrators (variables "
                             f"{sorted(names)} vs {sorted(s.vars)})")
        if (first.rng is None) != (s.rng is None) or (
                first.rng is not None and not torch.equal(first.rng, s.rng)):
            raise InputError("cannot batch states with different random seeds")
    step = first.step if step is None else int(step)
    vars_ = {}
    for k in names:
        parts = [s.vars[k] for s in states]
        if k == RNG_STEP0:
            parts = [p + (step - s.step) for p, s in zip(parts, states)]
        vars_[k] = torch.cat(parts, dim=0)
    return MDState(
        graph=AtomicGraph.concat([s.graph for s in states]),
        forces=torch.cat([s.forces for s in states]),
        energy=torch.cat([s.energy for s in states]),
        stress=torch.cat([s.stress for s in states]),
        step=step,
        vars=vars_,
        rng=first.rng,
        compute_stress=any(s.compute_stress for s in states),
    )


def replace(state: MDState, k: int, new: MDState) -> MDState:
    """``state`` with system ``k`` replaced by the systems of ``new`` (at the same place)."""
    n = state.n_systems
    if not 0 <= k < n:
        raise InputError(f"system {k} is not in a batch of {n}")
    parts = []
    if k > 0:
        parts.append(select(state, range(k)))
    parts.append(new)
    if k + 1 < n:
        parts.append(select(state, range(k + 1, n)))
    return concat(parts, step=state.step)


def _atom_index(graph: AtomicGraph, systems: Tensor) -> Tensor:
    ptr = graph.ptr
    parts = [torch.arange(int(ptr[s]), int(ptr[s + 1]), device=graph.device)
             for s in systems.tolist()]
    return torch.cat(parts)
