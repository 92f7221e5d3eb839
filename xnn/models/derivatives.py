"""Energy, forces, stress and virial from any per-atom-energy model, by one autograd call.

A symmetric strain ``ε [n_systems, 3, 3]`` deforms positions and cell,
``r' = r (1 + ε)`` and ``cell' = cell (1 + ε)`` (row vectors). Then, with ``E`` the
total energy,

* forces ``F = -∂E/∂r``
* virial ``W = -∂E/∂ε`` (eV)
* stress ``σ = (1/V) ∂E/∂ε = -W / V`` (eV/Å³, ASE sign: negative under compression).

Both gradients come from a single ``torch.autograd.grad`` call; ``create_graph=True`` when
training so that force and stress losses can be differentiated (double backward).

A committee of K members (:class:`~xnn.models.committee.Committee`) gets K copies of the
position and strain leaves, one per member, so the same single call gives every member's
forces and virial (:func:`committee_properties`), and :func:`committee_results` forms their
means and standard deviations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph, rowvec_matmul
from xnn.models.base import AtomisticModel, sum_per_system


@dataclass
class StrainedGraph:
    """A graph whose positions and cell depend on leaf tensors we differentiate against."""

    graph: AtomicGraph
    positions: Tensor  # [n_atoms, 3] leaf
    strain: Tensor  # [n_systems, 3, 3] leaf


def symmetrized(strain: Tensor) -> Tensor:
    """``(ε + εᵀ) / 2`` of ``strain [..., 3, 3]``: the deformation every derivative path
    applies (rows ``x`` become ``x + x @ sym``)."""
    return 0.5 * (strain + strain.transpose(-1, -2))


def strain_rows(rows: Tensor, strain: Tensor) -> Tensor:
    """``rows [n, 3]`` of one system deformed by ``strain [3, 3]``: ``x (1 + sym(ε))``.

    The compiled decomposed MD step deforms its local positions (owned rows, ghost rows
    gathered and shifted) with it; :func:`apply_strain` deforms owned positions and the cell
    by the same map, equal by linearity."""
    return rows + rows @ symmetrized(strain)


def apply_strain(graph: AtomicGraph, with_strain: bool = True) -> StrainedGraph:
    """Make positions (and a zero strain) leaves of the autograd graph and deform the graph."""
    pos = graph.positions.detach().requires_grad_(True)
    strain = torch.zeros_like(graph.cell)
    if with_strain:
        strain.requires_grad_(True)
    sym = symmetrized(strain)
    new_pos = pos + rowvec_matmul(pos, sym, graph.batch)
    new_cell = graph.cell + torch.einsum("sij,sjk->sik", graph.cell, sym)
    return StrainedGraph(graph.replace({K.POSITIONS: new_pos, K.CELL: new_cell}), pos, strain)


def derive(
    total_energy: Tensor,
    strained: StrainedGraph,
    volume: Tensor,
    pbc: Tensor,
    forces: bool,
    stress: bool,
    create_graph: bool,
    reduce_strain: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, Tensor]:
    """Forces, virial and stress from ``total_energy`` (a scalar) by one autograd call.

    Args:
        total_energy: scalar, sum of the energies of all systems.
        strained: the leaves from :func:`apply_strain`.
        volume: ``[n_systems]`` Å³.
        pbc: ``[n_systems, 3]``; stress is zero for systems not periodic along all axes.
        reduce_strain: applied to ``∂E/∂ε [n_systems, 3, 3]`` before virial and stress are
            formed. Domain decomposition passes a sum over ranks: each rank differentiates
            its share of the energy, and the shares' strain gradients add up.
    """
    out: dict[str, Tensor] = {}
    inputs = []
    if forces:
        inputs.append(strained.positions)
    if stress:
        inputs.append(strained.strain)
    if not inputs:
        return out
    if not total_energy.requires_grad:  # a model with no dependence on positions
        grads = [torch.zeros_like(x) for x in inputs]
    else:
        grads = torch.autograd.grad(
            total_energy, inputs, create_graph=create_graph, allow_unused=True
        )
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    if forces:
        out[K.FORCES] = -grads[0]
    if stress:
        g = grads[-1] if reduce_strain is None else reduce_strain(grads[-1])
        out.update(virial_results(-g, volume, pbc))
    return out


def virial_results(virial: Tensor, volume: Tensor, pbc: Tensor) -> dict[str, Tensor]:
    """``virial`` and ``stress`` from a virial ``W = -∂E/∂ε [n_systems, 3, 3]`` (eV).

    :func:`derive` forms both with it; a step that sums the ranks' virial shares itself
    (the compiled decomposed step, whose sum travels in its one all-gather) forms them
    from the sum with it too.

    Args:
        volume: ``[n_systems]`` Å³.
        pbc: ``[n_systems, 3]``; stress is zero for systems not periodic along all axes.
    Returns:
        ``virial [n_systems, 3, 3]`` (eV) and ``stress = -W / V [n_systems, 3, 3]`` (eV/Å³).
    """
    g = -virial
    periodic = pbc.all(-1)
    vol = torch.where(periodic, volume, torch.ones_like(volume))
    return {K.VIRIAL: virial,
            K.STRESS: torch.where(periodic[:, None, None], g / vol[:, None, None],
                                  torch.zeros_like(g))}


def compute_properties(
    model: torch.nn.Module,
    graph: AtomicGraph,
    forces: bool = True,
    stress: bool = True,
    training: bool = False,
) -> dict[str, Tensor]:
    """Evaluate ``model`` on ``graph`` (which must carry edges) and derive its properties.

    Args:
        model: returns per-atom energies ``[n_atoms]`` for a graph.
        graph: an ``AtomicGraph`` with ``edge_index`` and ``shifts``.
        forces: compute ``forces [n_atoms, 3]`` (eV/Å).
        stress: compute ``stress [n_systems, 3, 3]`` (eV/Å³) and ``virial`` (eV).
        training: keep the autograd graph (``create_graph=True``) for double backward.
    Returns:
        dict with ``energy [n_systems]``, ``energies [n_atoms]`` and, as requested,
        ``forces``, ``stress``, ``virial``. For a committee (``model.committee_size > 1``)
        these are the members' means, with the members' own results and their spread
        (:func:`committee_properties`).
    """
    if isinstance(model, AtomisticModel) and model.committee_size > 1:
        return committee_properties(model, graph, forces, stress, training)
    need_grad = forces or stress
    # Training (even on energies only) needs the autograd graph of the energy itself.
    with torch.enable_grad() if (need_grad or training) else torch.no_grad():
        strained = apply_strain(graph, with_strain=stress) if need_grad else None
        g = strained.graph if strained is not None else graph
        energies = model(g)
        energy = sum_per_system(energies, graph.batch, graph.n_systems)
        out = {K.ENERGY: energy, K.ENERGIES: energies}
        if need_grad:
            out.update(
                derive(energy.sum(), strained, graph.volume(), graph.pbc, forces, stress, training)
            )
    if not training:
        out = {k: v.detach() for k, v in out.items()}
    return out


# --------------------------------------------------------------------------- committees
def committee_properties(
    model: AtomisticModel,
    graph: AtomicGraph,
    forces: bool = True,
    stress: bool = True,
    training: bool = False,
) -> dict[str, Tensor]:
    """:func:`compute_properties` of a committee (``model.committee_size`` K > 1, with
    ``model.member_energies`` and ``model.calibration``).

    Each member is evaluated on its own strained copy of ``graph`` (its own position and
    strain leaves); one autograd call on the sum of all members' energies then gives each
    member's forces and virial, equal to the member's alone.

    Returns:
        :func:`committee_results` of the members' ``energy [K, n_systems]``, ``energies
        [K, n_atoms]`` and, as asked, ``forces [K, n_atoms, 3]``, ``stress`` and ``virial
        [K, n_systems, 3, 3]``.
    """
    k = model.committee_size
    need_grad = forces or stress
    with torch.enable_grad() if (need_grad or training) else torch.no_grad():
        strained = [apply_strain(graph, with_strain=stress) for _ in range(k)] \
            if need_grad else []
        graphs = [s.graph for s in strained] if need_grad else [graph] * k
        energies = model.member_energies(graphs)
        energy = torch.stack([sum_per_system(e, graph.batch, graph.n_systems)
                              for e in energies])
        members = {K.ENERGY: energy, K.ENERGIES: energies}
        if need_grad:
            members.update(derive_members(energy.sum(), strained, graph.volume(), graph.pbc,
                                          forces, stress, training))
        out = committee_results(members, model.calibration)
    if not training:
        out = {key: v.detach() for key, v in out.items()}
    return out


def derive_members(
    total_energy: Tensor,
    strained: list[StrainedGraph],
    volume: Tensor,
    pbc: Tensor,
    forces: bool,
    stress: bool,
    create_graph: bool,
    reduce_strain: Callable[[Tensor], Tensor] | None = None,
) -> dict[str, Tensor]:
    """:func:`derive` for K members, each with its own leaves ``strained[k]``: forces
    ``[K, n_atoms, 3]``, virial and stress ``[K, n_systems, 3, 3]`` by one autograd call.

    Args:
        total_energy: scalar, the sum over members and systems of the members' energies.
        reduce_strain: applied to ``∂E_k/∂ε [K, n_systems, 3, 3]`` (see :func:`derive`).
    """
    out: dict[str, Tensor] = {}
    inputs = ([s.positions for s in strained] if forces else []) + \
        ([s.strain for s in strained] if stress else [])
    if not inputs:
        return out
    if not total_energy.requires_grad:
        grads = [torch.zeros_like(x) for x in inputs]
    else:
        grads = torch.autograd.grad(total_energy, inputs, create_graph=create_graph,
                                    allow_unused=True)
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, inputs)]
    k = len(strained)
    if forces:
        out[K.FORCES] = -torch.stack(grads[:k])
    if stress:
        g = torch.stack(grads[-k:])
        g = g if reduce_strain is None else reduce_strain(g)
        out.update(virial_results(-g, volume, pbc))
    return out


#: member keys of :func:`committee_results`: result key -> key of the stacked members
MEMBER_KEYS = {K.ENERGY: K.ENERGY_MEMBERS, K.ENERGIES: K.ENERGIES_MEMBERS,
               K.FORCES: K.FORCES_MEMBERS, K.STRESS: K.STRESS_MEMBERS,
               K.VIRIAL: K.VIRIAL_MEMBERS}


def committee_results(members: dict[str, Tensor],
                      calibration: dict[str, float] | None = None) -> dict[str, Tensor]:
    """Means, members and standard deviations of a committee's results.

    Args:
        members: ``{key: [K, ...]}`` stacked member results under the usual keys
            (``energy``, ``energies``, ``forces``, ``stress``, ``virial``; any present).
        calibration: factors ``{"energy", "forces", "stress": c}`` (default 1).
    Returns:
        the mean over members under each key (``energy [n_systems]``, ...), the members
        under ``energy_members``, ``forces_members`` ... (:data:`MEMBER_KEYS`), and, with
        population standard deviations over the K members (divisor K):

        * ``energy_std [n_systems]`` eV: ``c_E * sqrt(mean_k (E_k - Ē)^2)``;
        * ``forces_std [n_atoms]`` eV/Å: ``c_F * sqrt(mean_k |F_k,i - F̄_i|^2)`` per atom;
        * ``stress_std [n_systems, 3, 3]`` eV/Å³: ``c_S * sqrt(mean_k (σ_k - σ̄)^2)`` per
          component.
    """
    c = {"energy": 1.0, "forces": 1.0, "stress": 1.0, **(calibration or {})}
    out: dict[str, Tensor] = {}
    for key, stacked in members.items():
        out[key] = stacked.mean(0)
        out[MEMBER_KEYS[key]] = stacked
    if K.ENERGY in members:
        out[K.ENERGY_STD] = c["energy"] * _spread(members[K.ENERGY], out[K.ENERGY])
    if K.FORCES in members:
        dev = members[K.FORCES] - out[K.FORCES]
        out[K.FORCES_STD] = c["forces"] * (dev * dev).sum(-1).mean(0).sqrt()
    if K.STRESS in members:
        out[K.STRESS_STD] = c["stress"] * _spread(members[K.STRESS], out[K.STRESS])
    return out


def _spread(stacked: Tensor, mean: Tensor) -> Tensor:
    """``sqrt(mean_k (x_k - x̄)^2)`` elementwise over the leading axis."""
    dev = stacked - mean
    return (dev * dev).mean(0).sqrt()
