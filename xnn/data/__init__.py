"""Batched atomic state, field keys, ASE/extxyz conversion."""

from xnn.data import keys
from xnn.data.graph import AtomicGraph, complete_cell, wrap_positions

__all__ = ["AtomicGraph", "keys", "complete_cell", "wrap_positions"]
