"""The one check of the structures a simulation starts from, where the structure file is read
(``xnn md``, ``xnn relax``, ``xnn run`` and ``xnn validate``), before anything is computed or
written: every system holds atoms, every velocity read from the file is finite, and no two
atoms are closer than :data:`~xnn.neighbors.coincident.MIN_DISTANCE` (a duplicated atom: the
shortest physical bond, H₂'s, is 0.74 Å). Each is otherwise met later and blamed on
something else: an empty frame runs as a system of energy 0 (or fails a temperature check),
coincident atoms give non-finite forces at step 0, and a NaN velocity a temperature of NaN
after step 1.
"""

from __future__ import annotations

import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.neighbors.coincident import MIN_DISTANCE, first_close_pair


def check_start_structures(graph: AtomicGraph, source: str) -> None:
    """Refuse a batch of structures no simulation can start from.

    Args:
        graph: the selected frames of a structure file, one system each (atom indices of
            the messages count from 0 in each system, as in the file).
        source: names the file in the message (``"structure file 's.xyz'"``).
    Raises:
        InputError: one line naming ``source``, the system and what is wrong: no atoms,
            non-finite velocities (the first atoms), or two atoms closer than
            :data:`~xnn.neighbors.coincident.MIN_DISTANCE` (the pair and its distance).
    """
    counts = graph.n_atoms_per_system
    empty = torch.nonzero(counts == 0).flatten()
    if empty.numel():
        raise InputError(f"{source}: system {int(empty[0])} has no atoms (an empty frame); "
                         "remove it from the file, or select other frames with index")
    _check_velocities(graph, source)
    _check_coincident(graph, source)


def _check_velocities(graph: AtomicGraph, source: str) -> None:
    if K.VELOCITIES not in graph:
        return
    bad = ~torch.isfinite(graph.velocities.detach()).all(-1)
    if not bool(bad.any()):
        return
    first = int(torch.nonzero(bad).flatten()[0])
    s = int(graph.batch[first])
    lo = int(graph.ptr[s])
    atoms = torch.nonzero(bad[lo:lo + int(graph.n_atoms_per_system[s])]).flatten().tolist()
    more = f" ({len(atoms)} atoms)" if len(atoms) > 5 else ""
    plural = "s" if len(atoms) > 1 else ""
    raise InputError(f"{source}: system {s}: the velocities of atom{plural} {atoms[:5]}{more} "
                     "are not finite (NaN or infinite); fix the file's velocities or remove "
                     "them")


def _check_coincident(graph: AtomicGraph, source: str) -> None:
    pair = first_close_pair(graph)
    if pair is not None:
        raise InputError(f"{source}: system {pair.system}: atoms {pair.i} and {pair.j} are "
                         f"{pair.distance:.3g} Å apart, closer than {MIN_DISTANCE} Å "
                         "(coincident atoms: a duplicated atom?); fix or remove that structure")


__all__ = ["check_start_structures"]
