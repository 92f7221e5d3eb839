"""Decomposed evaluation of a committee (:class:`~xnn.models.committee.Committee`, declared
by ``model.committee_size > 1``): each rank evaluates every member on its owned + ghost
atoms, and the members' results are combined exactly as in one process
(:func:`~xnn.models.derivatives.committee_results`).

Each member gets its own strained copy of the owned atoms (its own position and strain
leaves) and its own exchange of the local positions, so one backward pass gives every
member's forces on the owned atoms, the exchanges' adjoints summing the ghosts' gradients
into their owners. The members' energies are summed over the ranks *before* their spread is
taken (``energy_std`` is the standard deviation of the members' total energies, not a sum of
per-rank spreads); member stresses are summed over the ranks likewise; ``forces_std`` is per
owned atom (``[n_owned]``), each atom's spread from its own forces.
"""

from __future__ import annotations

from functools import partial

from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.models.derivatives import apply_strain, committee_results, derive_members


def member_graphs(graph: AtomicGraph, k: int, forces: bool, stress: bool):
    """``(strained copies, their graphs)``: ``k`` copies of the owned atoms, each with its own
    leaves, when forces or stress are asked; else no copies and ``[graph]`` (one local graph
    serves every member)."""
    if not (forces or stress):
        return [], [graph]
    strained = [apply_strain(graph.without_edges(), with_strain=stress) for _ in range(k)]
    return strained, [s.graph for s in strained]


def committee_results_decomposed(model, energies: Tensor, tape: list[Tensor], strained,
                                 graph: AtomicGraph, forces: bool, stress: bool,
                                 training: bool, group) -> dict[str, Tensor]:
    """The results of one decomposed committee evaluation.

    Args:
        model: the committee (``committee_size`` K, ``calibration``).
        energies: ``[K, n_owned]`` the members' energies of the owned atoms (eV).
        tape: every exchanged tensor of this evaluation (all members').
        strained: the members' strained owned atoms (:func:`member_graphs`; empty without
            forces and stress).
    Returns:
        the keys of :func:`~xnn.models.derivatives.committee_results` (means, members and
        spreads: ``energy [1]``, ``energy_members [K, 1]``, ``energy_std [1]`` totals over
        the ranks; ``forces [n_owned, 3]``, ``forces_members [K, n_owned, 3]``,
        ``forces_std [n_owned]``; stress and virial totals) and ``atom_id [n_owned]``.
    """
    # every exchange must be part of every rank's backward (see decomposed_results)
    zero = sum((0.0 * t.sum() for t in tape), tape[0].new_zeros(()))
    e_local = energies.sum(1) + zero  # [K]
    members = {K.ENERGY: C.all_reduce_sum(e_local, group).reshape(-1, 1),
               K.ENERGIES: energies}
    if forces or stress:
        members.update(derive_members(e_local.sum(), strained, graph.volume(), graph.pbc,
                                      forces, stress, training,
                                      partial(C.all_reduce_sum, group=group)))
    out = committee_results(members, model.calibration)
    out[K.ATOM_ID] = graph.atom_id
    return out


#: the per-atom results of a committee that a single point gathers by atom id
PER_ATOM = (K.FORCES_STD,)
#: the members' per-atom results ``[K, n_atoms, ...]`` a single point gathers by atom id
MEMBER_ROWS = (K.ENERGIES_MEMBERS, K.FORCES_MEMBERS)
#: its per-system results (totals, the same on every rank)
PER_SYSTEM = (K.ENERGY_STD, K.STRESS_STD, K.ENERGY_MEMBERS, K.STRESS_MEMBERS,
              K.VIRIAL_MEMBERS)
