"""Energy, forces, stress and virial from any per-atom-energy model, by one autograd call.

A symmetric strain ``ε [n_systems, 3, 3]`` deforms positions and cell,
``r' = r (1 + ε)`` and ``cell' = cell (1 + ε)`` (row vectors). Then, with ``E`` the
total energy,

* forces ``F = -∂E/∂r``
* virial ``W = -∂E/∂ε`` (eV)
* stress ``σ = (1/V) ∂E/∂ε = -W / V`` (eV/Å³, ASE sign: negative under compression).

Both gradients come from a single ``torch.autograd.grad`` call; ``create_graph=True`` when
training so that force and stress losses can be differentiated (double backward).

Per-atom virials (on request, :class:`EdgeGradients`): the same autograd call also yields
``∂E/∂r_ij`` of every edge; edge ``e``'s virial ``-r_e ⊗ ∂E/∂r_e`` goes half to each of its
two atoms (LAMMPS's ML-IAP ``v_tally`` and pair styles; MACE also symmetrises each atom's
tensor), so the per-atom virials sum to ``W`` (up to the model's torque, zero for a
rotation-invariant energy).

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
from xnn.errors import InputError
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


class EdgeGradients:
    """Records ``∂E/∂r_ij`` of a graph's edges during the derivative's autograd call: the
    seam of per-atom virials (:data:`xnn.data.keys.VIRIALS`).

    :meth:`edge_form` gives the graph whose only geometry is its edge vectors ``r_ij``
    (differentiable in the positions and the strain): atoms at the origin, an identity cell
    and ``shifts = r_ij`` (non-periodic), so ``graph.edge_vectors()`` returns ``r_ij``
    bitwise and the model's energy, forces and virial are unchanged. A hook on ``r_ij``
    keeps ``∂E/∂r_ij`` when :func:`derive` (or any backward through it) runs. The model's
    geometry must come from ``graph.edge_vectors()`` (every xnn model's does; models with
    long-range terms, which read positions and the cell, are refused by the callers).

    Example::

        rec = EdgeGradients()
        energies = model(rec.edge_form(strained.graph))
        out = derive(energies.sum(), strained, ...)
        w = rec.virials(n_atoms)            # [n_atoms, 3, 3] eV, sums to out["virial"]
    """

    def __init__(self):
        self.vectors: Tensor | None = None
        self.edge_index: Tensor | None = None
        self.grad: Tensor | None = None

    def edge_form(self, graph: AtomicGraph) -> AtomicGraph:
        """``graph`` with its edge vectors as its only geometry (see the class)."""
        vec = graph.edge_vectors()
        self.vectors, self.edge_index, self.grad = vec, graph.edge_index, None
        if vec.requires_grad:
            vec.register_hook(self._keep)
        n_sys = graph.n_systems
        return graph.replace({
            K.POSITIONS: vec.new_zeros(graph.positions.shape),
            K.CELL: torch.eye(3, dtype=vec.dtype, device=vec.device).repeat(n_sys, 1, 1),
            K.PBC: torch.zeros_like(graph.pbc), K.SHIFTS: vec})

    def _keep(self, grad: Tensor) -> None:
        self.grad = grad

    def virials(self, n_atoms: int) -> Tensor:
        """``[n_atoms, 3, 3]`` (eV) per-atom virials of the recorded edges (zeros where no
        gradient reached them); call after the autograd call."""
        vec = self.vectors
        if vec is None or self.grad is None:
            dtype = torch.float64 if vec is None else vec.dtype
            return torch.zeros(n_atoms, 3, 3, dtype=dtype,
                               device=None if vec is None else vec.device)
        return edge_virials(vec.detach(), self.grad, self.edge_index, n_atoms)


def edge_virials(vectors: Tensor, grad: Tensor, edge_index: Tensor, n_atoms: int) -> Tensor:
    """``[n_atoms, 3, 3]`` (eV): edge ``e``'s virial ``-r_e ⊗ ∂E/∂r_e`` (``[a, b] = -r_a
    ∂E/∂r_b``, not symmetrised: LAMMPS reads the upper triangle, as ML-IAP's ``v_tally``
    forms it) half to its sender, half to its receiver (``edge_index [2, E]``); they sum to
    ``-∂E/∂ε`` up to the antisymmetric torque, zero for a rotation-invariant energy."""
    w = -0.5 * vectors.unsqueeze(-1) * grad.unsqueeze(-2)
    out = w.new_zeros(n_atoms, 3, 3)
    return out.index_add(0, edge_index[0], w).index_add(0, edge_index[1], w)


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

    The one-member case of :func:`derive_members` (the derivative code exists once): its
    results without the leading member axis, bitwise.

    Args:
        total_energy: scalar, sum of the energies of all systems.
        strained: the leaves from :func:`apply_strain`.
        volume: ``[n_systems]`` Å³.
        pbc: ``[n_systems, 3]``; stress is zero for systems not periodic along all axes.
        reduce_strain: applied to ``∂E/∂ε`` before virial and stress are formed (to
            ``[1, n_systems, 3, 3]``: an elementwise reduction). Domain decomposition passes
            a sum over ranks: each rank differentiates its share of the energy, and the
            shares' strain gradients add up.
    """
    members = derive_members(total_energy, [strained], volume, pbc, forces, stress,
                             create_graph, reduce_strain)
    return {key: value[0] for key, value in members.items()}


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
    peratom_virial: bool = False,
) -> dict[str, Tensor]:
    """Evaluate ``model`` on ``graph`` (which must carry edges) and derive its properties.

    Args:
        model: returns per-atom energies ``[n_atoms]`` for a graph.
        graph: an ``AtomicGraph`` with ``edge_index`` and ``shifts``.
        forces: compute ``forces [n_atoms, 3]`` (eV/Å).
        stress: compute ``stress [n_systems, 3, 3]`` (eV/Å³) and ``virial`` (eV).
        training: keep the autograd graph (``create_graph=True``) for double backward.
        peratom_virial: also ``virials [n_atoms, 3, 3]`` (eV, :class:`EdgeGradients`; the
            model's geometry must come from its edge vectors).
    Returns:
        dict with ``energy [n_systems]``, ``energies [n_atoms]`` and, as requested,
        ``forces``, ``stress``, ``virial``, ``virials``. For a committee
        (``model.committee_size > 1``) these are the members' means, with the members' own
        results and their spread (:func:`committee_properties`); per-atom virials of a
        committee are refused.
    """
    if isinstance(model, AtomisticModel) and model.committee_size > 1:
        if peratom_virial:
            raise InputError("per-atom virials of a committee are not available; evaluate "
                             "one member (or a single model) for them")
        return committee_properties(model, graph, forces, stress, training)
    need_grad = forces or stress or peratom_virial
    # Training (even on energies only) needs the autograd graph of the energy itself.
    with torch.enable_grad() if (need_grad or training) else torch.no_grad():
        strained = apply_strain(graph, with_strain=stress) if need_grad else None
        g = strained.graph if strained is not None else graph
        record = EdgeGradients() if peratom_virial else None
        energies = model(g if record is None else record.edge_form(g))
        energy = sum_per_system(energies, graph.batch, graph.n_systems)
        out = {K.ENERGY: energy, K.ENERGIES: energies}
        if need_grad:
            # per-atom virials alone: the edges' gradients come with the forces' call
            derived = derive(energy.sum(), strained, graph.volume(), graph.pbc,
                             forces or not stress, stress, training)
            out.update(derived if forces else
                       {k: v for k, v in derived.items() if k != K.FORCES})
        if record is not None:
            out[K.VIRIALS] = record.virials(graph.n_atoms)
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
    """Forces ``[K, n_atoms, 3]``, virial and stress ``[K, n_systems, 3, 3]`` of K members,
    each with its own leaves ``strained[k]``, by one autograd call (:func:`derive` is the
    case K = 1).

    Args:
        total_energy: scalar, the sum over members and systems of the members' energies.
        strained: one :func:`apply_strain` result per member.
        volume: ``[n_systems]`` Å³.
        pbc: ``[n_systems, 3]``; stress is zero for systems not periodic along all axes.
        forces: compute forces (``-∂E/∂r`` of every member's positions).
        stress: compute virial and stress (from every member's strain).
        create_graph: keep the autograd graph (training: double backward).
        reduce_strain: applied to ``∂E_k/∂ε [K, n_systems, 3, 3]`` before virial and stress
            are formed; domain decomposition passes an elementwise sum over ranks.
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
