"""Contract: a model decomposed over ranks gives the numbers of one process.

The spatial modes (``halo``; ``sync`` where the model has sync points) and graph parallelism
(``graph``, where the model can be split by atom index) must reproduce energy, per-atom
energies, forces (matched by global atom id) and stress (virial for a non-periodic system)
of :class:`xnn.models.Potential` in one process, to round-off in float64.

:func:`check_decomposition` spawns gloo ranks on this machine itself; a test that already
runs its own ranks calls :func:`decomposition_errors` inside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.testing.ranks import spawn
from xnn.testing.systems import random_molecule, random_periodic_system

#: the quantities compared (``stress`` for a fully periodic system, ``virial`` otherwise)
QUANTITIES = ("energy", "energies", "forces", "stress", "virial")


class DecompositionCase(NamedTuple):
    """One comparison: ``model`` on ``graph`` decomposed in ``mode`` (a name for reports)."""

    name: str
    model: torch.nn.Module
    graph: AtomicGraph
    mode: str = "halo"
    grid: tuple[int, int, int] | None = None
    skin: float = 0.0


def decomposed(model, manager_or_group, mode: str, graph: AtomicGraph | None, grid=None,
               skin: float = 0.0, balance: str = "none"):
    """The decomposed potential of ``mode`` (collective for ``auto``).

    The one call of the contracts into :mod:`xnn.distributed` (its one constructor,
    :func:`~xnn.distributed.parallelize`): ``.single_point(graph)`` returns energy,
    ``energies``/``forces`` sorted by atom id, ``stress``, ``virial`` and ``atom_id`` on
    every rank.
    """
    from xnn.distributed import parallelize

    return parallelize(model, manager_or_group, mode, graph=graph, grid=grid, skin=skin,
                       balance=balance)


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """``max|actual - expected| / max|expected|`` (in float64)."""
    a, b = actual.detach().double().cpu(), expected.detach().double().cpu()
    if b.numel() == 0:
        return 0.0
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def compare_by_id(out: dict[str, Tensor], ref: dict[str, Tensor],
                  graph: AtomicGraph) -> dict[str, float | bool]:
    """Relative errors of a decomposed result ``out`` (rows sorted by atom id) against the
    one-process result ``ref`` of ``graph`` (rows in graph order).

    Returns:
        ``{"energy", "energies", "forces", "stress" | "virial": relative error,
        "ids": whether out's atom ids are exactly the graph's, sorted}``.
    """
    order = torch.argsort(graph.atom_id.cpu())
    errors: dict[str, float | bool] = {
        "energy": relative_error(out[K.ENERGY], ref[K.ENERGY]),
        "energies": relative_error(out[K.ENERGIES], ref[K.ENERGIES].cpu()[order]),
        "forces": relative_error(out[K.FORCES], ref[K.FORCES].cpu()[order]),
        "ids": bool(torch.equal(out[K.ATOM_ID].cpu(), graph.atom_id.cpu()[order])),
    }
    key = K.STRESS if bool(graph.pbc.all()) else K.VIRIAL
    errors[key] = relative_error(out[key], ref[key])
    return errors


def decomposition_errors(model, graph: AtomicGraph | None, manager_or_group, mode: str = "halo",
                         grid=None, skin: float = 0.0, balance: str = "none") -> dict | None:
    """``model`` on rank 0's ``graph``, decomposed in ``mode`` over the group, against one
    process (collective; call it on every rank of the group). ``balance``: how the boxes
    are cut (``none``, ``shift``; see :func:`~xnn.distributed.parallelize.parallelize`).

    Returns:
        on group rank 0, :func:`compare_by_id` of the decomposed and the one-process result,
        plus ``"mode"`` (the mode run: ``auto`` resolved); ``None`` on the other ranks.
    """
    from xnn.models import Potential

    evaluator = decomposed(model, manager_or_group, mode, graph, grid=grid, skin=skin,
                           balance=balance)
    out = evaluator.single_point(graph)
    if evaluator.rank != 0:
        return None
    errors = compare_by_id(out, Potential(model)(graph), graph)
    errors["mode"] = evaluator.mode
    return errors


def decomposition_modes(model) -> tuple[str, ...]:
    """The modes the contract checks for ``model``: ``halo``; ``sync`` where the model has
    sync points; ``graph`` where graph parallelism can split it exactly."""
    from xnn.distributed.graph.layout import check_graph_model
    from xnn.distributed.potential import model_cutoff

    modes = ["halo"]
    if model.sync_points:
        modes.append("sync")
    try:
        check_graph_model(model, *model_cutoff(model))
        modes.append("graph")
    except InputError:
        pass
    return tuple(modes)


def default_decomposition_systems(species: Sequence[int], seed: int = 0,
                                  min_distance: float = 2.0) -> dict[str, AtomicGraph]:
    """A triclinic periodic system (24 atoms) and a molecule (12 atoms) of ``species``, with
    atom ids a random permutation (so that results must be matched by id)."""
    periodic = random_periodic_system(species, 24, 14.0, min_distance, seed=seed)
    molecule = random_molecule(species, 12, 14.0, min_distance, seed=seed + 1)
    systems = {}
    for i, (name, g) in enumerate((("periodic", periodic), ("molecule", molecule))):
        ids = torch.randperm(g.n_atoms, generator=torch.Generator().manual_seed(seed + i))
        systems[name] = g.replace(atom_id=ids)
    return systems


def _run_cases(rank: int, world_size: int, cases: Sequence[tuple]) -> dict:
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    results = {}
    for name, model, fields, mode, grid, skin in cases:
        graph = AtomicGraph(fields) if rank == 0 else None
        results[name] = decomposition_errors(model, graph, manager, mode, grid, skin)
    return results


def run_decomposition_cases(cases: Sequence[DecompositionCase], world_size: int = 2,
                            timeout_s: float = 300.0) -> dict[str, dict]:
    """Every case in ONE set of ``world_size`` spawned gloo ranks (a spawn costs seconds).

    Models and graphs are pickled to the ranks: a model's class must be importable.
    Returns:
        ``{case name: errors}`` (see :func:`decomposition_errors`), from rank 0.
    """
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique, got {names}")
    # graphs travel as their fields (an AtomicGraph does not pickle)
    sent = [(c.name, c.model, c.graph.without_edges().fields, c.mode, c.grid, c.skin)
            for c in cases]
    return spawn(_run_cases, world_size, (sent,), timeout_s=timeout_s)[0]


def assert_decomposition_errors(errors: dict[str, dict], rtol: float = 1e-10) -> None:
    """Raise one ``AssertionError`` naming every case and quantity above ``rtol`` (or whose
    atom ids were lost or duplicated)."""
    failures = []
    for name, e in errors.items():
        if not e["ids"]:
            failures.append(f"{name}: atom ids lost or duplicated")
        failures += [f"{name} ({e.get('mode')}): {q} relative error {e[q]:.3e} > {rtol:g}"
                     for q in QUANTITIES if q in e and not e[q] <= rtol]
    if failures:
        raise AssertionError("decomposed != one process:\n  " + "\n  ".join(failures))


def check_decomposition(model, systems: dict[str, AtomicGraph] | None = None,
                        modes: Sequence[str] | None = None, world_size: int = 2,
                        rtol: float = 1e-10, timeout_s: float = 300.0) -> dict[str, dict]:
    """Decomposed equals one process: every mode on every system, on ``world_size`` gloo
    ranks spawned here (one spawn for all of them).

    Args:
        model: any :class:`~xnn.models.base.AtomisticModel` in float64 (its class importable:
            it is pickled to the ranks).
        systems: ``{name: one-system graph}`` (default
            :func:`default_decomposition_systems` of ``model.species``).
        modes: default :func:`decomposition_modes` of the model.
        world_size: ranks (2 or 3 cover a split in one and in two directions cheaply).
        rtol: largest relative error of energy, per-atom energies, forces (by atom id) and
            stress or virial (1e-10: round-off of float64).
    Returns:
        ``{"<system>-<mode>": errors}`` (see :func:`decomposition_errors`).
    Raises:
        AssertionError: listing every case and quantity beyond ``rtol``.
    """
    systems = systems or default_decomposition_systems(list(model.species or [18]))
    modes = tuple(modes or decomposition_modes(model))
    cases = [DecompositionCase(f"{s}-{m}", model, g, m) for s, g in systems.items()
             for m in modes]
    errors = run_decomposition_cases(cases, world_size, timeout_s)
    assert_decomposition_errors(errors, rtol)
    return errors
