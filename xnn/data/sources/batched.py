"""Structures of an ASE source converted into one batched graph at once
(:meth:`~xnn.data.sources.frames.AtomsSource.read_batch`): equal field by field to the
per-structure graphs of :func:`~xnn.data.sources.frames.graph_of`, concatenated."""

from __future__ import annotations

import numpy as np
import torch

from xnn.data import ase_io
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.data.rows import row_ranges
from xnn.errors import DataFileError, InputError

#: the label fields :func:`graph_of` fills with NaN where a structure has none
_NAN_SHAPES = {K.ENERGY: (), K.FORCES: None, K.STRESS: (3, 3)}
_FIELD_OF = {"energy": K.ENERGY, "forces": K.FORCES, "stress": K.STRESS, "virial": K.VIRIAL}


def _partial_labels(g: AtomicGraph, atoms_list, keys: dict[str, str]) -> dict | None:
    """``{field: [value or None per structure]}`` of the labels that some structures of
    ``g`` (:func:`~xnn.data.ase_io.from_ase` of ``atoms_list``, which keeps a label only
    where every structure has it) have and others lack; ``None`` where the batch needs the
    per-structure path (a label of the wrong shape, a virial where a stress is missing)."""
    partial = {}
    for prop, field in _FIELD_OF.items():
        if keys[f"{prop}_key"] is None or field in g:
            continue
        try:
            values = [ase_io._label(a, keys[f"{prop}_key"], prop, i)
                      for i, a in enumerate(atoms_list)]
        except DataFileError:
            return None
        if any(v is not None for v in values):
            partial[field] = values
    if (K.VIRIAL in g or K.VIRIAL in partial) and K.STRESS not in g:
        return None  # a stress from the virial: the per-structure path's volume
    return partial


def batch_graph_of(atoms_list, indices: np.ndarray, first_atoms: np.ndarray,
                   keys: dict[str, str], weight: float) -> AtomicGraph | None:
    """The structures ``atoms_list`` (indices ``indices`` of one file, their first atoms'
    ids ``first_atoms``) as one batched graph built at once, equal field by field to
    concatenating :func:`graph_of` of each (labels some structures lack are NaN there); or
    ``None`` where that needs the per-structure path: a structure :func:`graph_of` would
    refuse (read again one by one, it is refused there with its message), a stress taken
    from a virial, charges."""
    try:
        g = ase_io.from_ase(list(atoms_list), **keys)
    except (DataFileError, InputError):
        return None
    partial = _partial_labels(g, atoms_list, keys)
    if partial is None or K.CHARGES in g:
        return None
    if not all(bool(torch.isfinite(g[f]).all()) for f in _FIELD_OF.values() if f in g):
        return None
    if not all(np.isfinite(v).all() for values in partial.values() for v in values
               if v is not None):
        return None
    k, n, dt = g.n_systems, g.n_atoms, g.dtype
    counts = g.n_atoms_per_system.cpu().numpy().astype(np.int64)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    new: dict[str, torch.Tensor | None] = {}
    for field, shape in _NAN_SHAPES.items():
        if field in g:
            continue
        full = np.full((n, 3) if shape is None else (k, *shape), np.nan)
        for s, v in enumerate(partial.get(field, [])):
            if v is not None:
                full[slice(ptr[s], ptr[s + 1]) if shape is None else s] = v
        new[field] = torch.as_tensor(full).to(dt)
    new.update({K.VIRIAL: None, K.VELOCITIES: None,
                K.WEIGHT: torch.full((k,), float(weight), dtype=dt),
                K.ATOM_ID: torch.as_tensor(row_ranges(np.asarray(first_atoms, np.int64),
                                                      counts)),
                K.SYSTEM_ID: torch.as_tensor(np.asarray(indices, dtype=np.int64))})
    return g.replace(new)


__all__ = ["batch_graph_of"]
