"""``DomainDecomposed``: one structure on rank 0, evaluated decomposed over the ranks.

Rank 0 scatters its structure (each rank receives only the atoms of its box), the ranks
evaluate it with a :class:`~xnn.distributed.domain.potential.DomainPotential`, and the
owned results are gathered by atom id on every rank. Used for single points: ``xnn
validate``, :class:`~xnn.distributed.DistributedCalculator`, benchmarks.

Repeated calls on a structure whose atoms moved less than ``skin / 2`` since the last
partition keep each atom on its rank, so the ghosts and local edges are reused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.potential import (  # noqa: F401 - re-exported
    DomainPotential,
    model_cutoff,
    resolve_mode,
)


class DomainDecomposed:
    """Evaluate ``model`` on rank 0's structure spread over the ranks (every rank calls it).

    Args:
        model: per-atom-energy model with ``cutoff`` (Å) and ``num_interactions``.
        manager_or_group, grid, skin, mode, backend: see
            :class:`~xnn.distributed.domain.potential.DomainPotential`.
    """

    def __init__(self, model, manager_or_group=None, grid=None, skin: float = 0.0,
                 mode: str = "halo", backend: str = "auto"):
        self.potential = DomainPotential(model, manager_or_group, grid, skin, mode, backend)
        p = self.potential
        self.model, self.group, self.device, self.mode = p.model, p.group, p.device, p.mode
        self.size, self.rank, self.skin = p.size, p.rank, p.skin
        self.cutoff, self.halo_width = p.cutoff, p.halo_width
        self._root = None  # rank 0: the last fresh scatter and the owner of each atom id

    @property
    def n_builds(self) -> int:
        """Ghost-plan rebuilds so far."""
        st = self.potential.state
        return 0 if st is None else st.counters.rebuilds

    # ------------------------------------------------------------------ set-up
    def _owners(self, graph: AtomicGraph | None) -> Tensor | None:
        """Rank 0: the current rank of each atom, when ``graph`` is the last structure moved
        by less than ``skin / 2`` (then the domain's ghosts stay valid); else ``None``."""
        r = self._root
        if self.rank != 0 or r is None or graph is None or "ids" not in r:
            return None
        pos = graph.positions.detach()
        if (pos.shape != r["positions"].shape or not torch.equal(graph.atom_id, r["atom_id"])
                or not torch.equal(graph.cell, r["cell"]) or not torch.equal(graph.pbc, r["pbc"])):
            return None
        if self.skin == 0:
            if not torch.equal(pos, r["positions"]):
                return None
        elif pos.shape[0] and float((pos - r["positions"]).norm(dim=-1).max()) > 0.5 * self.skin:
            return None
        rows = torch.searchsorted(r["ids"], graph.atom_id.to(r["ids"].device))
        return r["owner"][rows].to(graph.device)

    def scatter(self, graph: AtomicGraph | None) -> AtomicGraph:
        """This rank's owned atoms of rank 0's ``graph`` (other ranks may pass ``None``)."""
        owner = self._owners(graph)
        owned = self.potential.scatter(graph, owner=owner)
        if self.rank == 0 and owner is None:
            g = graph.detach()
            self._root = {"atom_id": g.atom_id.clone(), "positions": g.positions.clone(),
                          "cell": g.cell.clone(), "pbc": g.pbc.clone()}
        return owned

    # ------------------------------------------------------------------ evaluation
    def evaluate_local(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                       training: bool = False) -> dict[str, Tensor]:
        """The owned ``graph``'s results (see ``DomainPotential.__call__``)."""
        return self.potential(graph, forces, stress, training)

    def _remember_owners(self, ids: Tensor, n_owned: int) -> None:
        counts = C.all_gather_tensor(torch.tensor([n_owned], device=ids.device), self.group)
        if self.rank == 0 and self._root is not None:
            owner = torch.repeat_interleave(torch.arange(self.size, device=ids.device),
                                            counts.flatten())
            order = torch.argsort(ids)
            self._root.update(ids=ids[order], owner=owner[order])

    def __call__(self, graph: AtomicGraph | None = None, forces: bool = True,
                 stress: bool = True) -> dict[str, Tensor]:
        """Energy, per-atom energies, forces and stress of rank 0's ``graph``, on every rank.

        Args:
            graph: one system (rank 0's copy is used; other ranks may pass ``None``).
        Returns:
            ``energy [1]`` eV, ``energies [n_atoms]`` eV, ``forces [n_atoms, 3]`` eV/Å,
            ``stress [1, 3, 3]`` eV/Å³ and ``virial [1, 3, 3]`` eV, and ``atom_id
            [n_atoms]``: per-atom rows sorted by global atom id.
        """
        owned = self.scatter(graph)
        local = self.evaluate_local(owned, forces, stress, training=False)
        ids = C.gather_rows(local[K.ATOM_ID], self.group)
        self._remember_owners(ids, owned.n_atoms)
        order = torch.argsort(ids)
        out = {K.ENERGY: local[K.ENERGY], K.ATOM_ID: ids[order]}
        for name in (K.ENERGIES, K.FORCES):
            if name in local:
                out[name] = C.gather_rows(local[name], self.group)[order]
        for name in (K.STRESS, K.VIRIAL):
            if name in local:
                out[name] = local[name]
        return out

    def stats(self) -> dict[str, object]:
        """Sizes of this rank's domain: owned, ghost and exchanged atoms, peers, grid."""
        return self.potential.stats()
