"""``DecomposedPotential``: a drop-in for :class:`xnn.models.Potential` whose model evaluation
is spread over the ranks by domain decomposition (replicated dynamics).

Every rank holds the whole system and runs the same integrator on it; only the model
evaluation is decomposed, and the forces are gathered to every rank in the graph's atom
order. Integrators, thermostats (seeded identically) and reducers stay single-process. A
checksum of the positions is compared across ranks on every call, so ranks that drift apart
stop with an error instead of computing garbage.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.decomposed import DomainDecomposed
from xnn.errors import InputError
from xnn.neighbors import VerletList


class DecomposedPotential:
    """Same call as :class:`xnn.models.Potential`, evaluated over the ranks of a group.

    Args:
        model: per-atom-energy model with a ``cutoff``.
        manager_or_group: see :class:`~xnn.distributed.DomainDecomposed`.
        skin: Verlet skin (Å): the partition and local edges are reused until an atom moved
            more than ``skin / 2``.
        grid, mode, backend: see :class:`~xnn.distributed.DomainDecomposed`.
    """

    def __init__(self, model, manager_or_group=None, skin: float = 0.0, grid=None,
                 mode: str = "halo", backend: str = "auto"):
        self.model = model
        self.dd = DomainDecomposed(model, manager_or_group, grid=grid, skin=skin, mode=mode,
                                   backend=backend)
        # the whole system's Verlet list, for the dynamics' safety checks (replicated)
        self.neighbors = VerletList(float(model.cutoff), skin, backend)

    def _check_replicated(self, graph: AtomicGraph) -> None:
        pos = graph.positions.detach().to(torch.float64)
        s = torch.stack([pos.sum(), (pos * pos).sum()])
        both = torch.cat([s, -s])
        C.all_reduce_(both, self.dd.group, op=torch.distributed.ReduceOp.MAX)
        if not torch.equal(both[:2], -both[2:]):
            raise InputError("ranks hold different positions: replicated dynamics diverged "
                             "(seed every rank's random numbers identically)")

    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                 training: bool = False) -> dict[str, Tensor]:
        """``energy [1]``, ``energies [n_atoms]``, ``forces [n_atoms, 3]`` in ``graph``'s atom
        order, ``stress``/``virial [1, 3, 3]``: identical on every rank."""
        if training:
            raise InputError("DecomposedPotential evaluates only; train with "
                             "DomainDecomposed.evaluate_local(training=True)")
        if graph.n_systems != 1:
            raise InputError(f"domain decomposition takes one system, got {graph.n_systems}")
        self._check_replicated(graph)
        out = self.dd(graph, forces=forces, stress=stress, replicated=True)
        rows = torch.searchsorted(out[K.ATOM_ID], graph.atom_id.to(out[K.ATOM_ID].device))
        result = {K.ENERGY: out[K.ENERGY], K.ENERGIES: out[K.ENERGIES][rows]}
        if forces:
            result[K.FORCES] = out[K.FORCES][rows]
        for name in (K.STRESS, K.VIRIAL):
            if name in out:
                result[name] = out[name]
        return result
