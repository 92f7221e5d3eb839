"""Graph parallelism: atoms split by index over the ranks, positions replicated, node
features all-gathered at the model's sync points (the complement of spatial halos): the
:class:`~xnn.distributed.graph.layout.GraphLayout` of the one decomposed potential."""

from xnn.distributed.graph.layout import GraphLayout, check_graph_model

__all__ = ["GraphLayout", "check_graph_model"]
