"""``GraphDecomposed``: rank 0's structure evaluated graph-parallel over the ranks.

The graph-parallel counterpart of :class:`~xnn.distributed.domain.decomposed.DomainDecomposed`
(single points: ``xnn validate --mode graph``, benchmarks): rank 0 scatters blocks of its
atoms, the ranks evaluate them with a :class:`~.potential.GraphPotential`, and the owned
results are gathered by atom id on every rank.
"""

from __future__ import annotations

from xnn.distributed.domain.decomposed import DomainDecomposed
from xnn.distributed.graph.potential import GraphPotential


class GraphDecomposed(DomainDecomposed):
    """Evaluate ``model`` graph-parallel on rank 0's structure (every rank calls it).

    Args:
        model: see :class:`~.potential.GraphPotential`.
        manager_or_group, skin, order, backend: see :class:`~.potential.GraphPotential`.
    """

    def __init__(self, model, manager_or_group=None, skin: float = 0.0,
                 order: str = "morton", backend: str = "auto"):
        self.potential = GraphPotential(model, manager_or_group, skin, order, backend)
        p = self.potential
        self.model, self.group, self.device, self.mode = p.model, p.group, p.device, p.mode
        self.size, self.rank, self.skin = p.size, p.rank, p.skin
        self.cutoff, self.halo_width = p.cutoff, p.halo_width
        self._root = None
