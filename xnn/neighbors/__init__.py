"""Neighbor lists: brute-force reference, pure-torch cell list, vesin; Verlet skin."""

from xnn.neighbors.api import (
    VerletList,
    available_backends,
    neighbor_list,
    register_backend,
    with_edges,
)

__all__ = ["neighbor_list", "VerletList", "with_edges", "register_backend", "available_backends"]
