"""Graph parallelism: atoms split by index over the ranks, positions replicated, node
features all-gathered at the model's sync points (the complement of spatial halos)."""

from xnn.distributed.graph.decomposed import GraphDecomposed
from xnn.distributed.graph.potential import GraphPotential, check_graph_model

__all__ = ["GraphDecomposed", "GraphPotential", "check_graph_model"]
