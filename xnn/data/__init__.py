"""Batched atomic state, field keys, ASE/extxyz conversion, datasets opened lazily
(:func:`open_source`)."""

from xnn.data import keys
from xnn.data.ase_io import from_ase, read, to_ase, write
from xnn.data.graph import AtomicGraph, complete_cell, wrap_positions
from xnn.data.sources import open_source

__all__ = [
    "AtomicGraph",
    "keys",
    "complete_cell",
    "wrap_positions",
    "from_ase",
    "to_ase",
    "read",
    "write",
    "open_source",
]
