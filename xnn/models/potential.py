"""``Potential``: a model plus its (Verlet) neighbor list, evaluated on plain graphs; and
:class:`PotentialInterface`, what integrators, relaxation, safety checks and the MD runs
call on any potential (this one, or the decomposed one :mod:`xnn.distributed` builds)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, as_model, pairing_edges, squared_lengths
from xnn.models.derivatives import compute_properties
from xnn.neighbors import VerletList
from xnn.neighbors.pairs import pair_order


class Evaluator(Protocol):
    """What the integrators (``init``/``step`` of :mod:`xnn.dynamics`) and FIRE evaluate:
    energy, forces and stress of a graph without edges.

    ``__call__(graph, forces=True, stress=True, training=False)`` returns ``energy
    [n_systems]`` (eV) and, as asked, ``forces [n_atoms, 3]`` (eV/Å), ``stress`` and
    ``virial [n_systems, 3, 3]``; ``training=True`` keeps the results differentiable.
    """

    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                 training: bool = False) -> dict[str, Tensor]: ...


@runtime_checkable
class PotentialInterface(Evaluator, Protocol):
    """The potential protocol: what the MD and relaxation runs (:mod:`xnn.app.md`,
    :mod:`xnn.app.relax`), their safety checks (:mod:`xnn.dynamics.safety`) and the
    integrators call on a potential, whether it holds every atom (:class:`Potential`) or
    this process's share of them (the decomposed potential of :mod:`xnn.distributed`,
    collective in every call). ``isinstance(p, PotentialInterface)`` checks the members;
    :func:`xnn.testing.check_potential` checks that they behave.

    Attributes:
        model: the :class:`~xnn.models.base.AtomisticModel` evaluated (species checks, the
            compiled steps).
    """

    model: AtomisticModel

    def min_pair_distance(self, graph: AtomicGraph) -> tuple[Tensor, Tensor]:
        """The shortest distance between two atoms that this process evaluates, in
        ``graph`` (the graph last given to ``__call__``: a decomposed potential answers from
        that evaluation, an atom of each pair owned here).

        Returns:
            ``(distance [] Å, global atom ids [2])``; ``inf`` and ``-1`` without pairs
            within the neighbor list's reach.
        """
        ...


class Potential:
    """Evaluate a per-atom-energy model on graphs without edges.

    Args:
        model: an :class:`~xnn.models.base.AtomisticModel` (declares ``cutoff``); anything
            else is refused (:class:`~xnn.errors.InputError`).
        skin: Verlet skin (Å); the list is rebuilt when an atom moved more than ``skin / 2``.
        backend: neighbor-list backend (``"auto"``, ``"torch"``, ``"vesin"``, ``"brute"``).
        compile: run the model's hot path through ``torch.compile`` where it has one (see
            :meth:`~xnn.models.base.AtomisticModel.compile_for_inference`); energy, forces
            and stress only, not ``training=True``.

    Attributes:
        paired: give a model that declares ``pairs_edges`` its edges as reverse pairs
            (:func:`xnn.neighbors.pairs.pair_order`, arranged once per list build; edge
            ``h + k`` reverses edge ``k``), so that it runs its length-only edge work once
            per pair (:func:`~xnn.models.base.edges_paired`); not under ``training=True``.
            Set it to false for the list's own order.
    """

    def __init__(self, model: AtomisticModel, skin: float = 0.0, backend: str = "auto",
                 compile: bool = False):
        self.model = as_model(model, "the Potential's model")
        self.compiled = bool(compile) and bool(model.compile_for_inference(True))
        self.neighbors = VerletList(float(model.cutoff), skin, backend)
        self._checked: tuple[Tensor, int] | None = None  # numbers last checked, its version
        self.paired = bool(model.pairs_edges)
        self._pairs: tuple | None = None  # (an edge_index seen, the paired list or None)

    def __call__(
        self,
        graph: AtomicGraph,
        forces: bool = True,
        stress: bool = True,
        training: bool = False,
    ) -> dict[str, Tensor]:
        if training and self.compiled:
            raise InputError("a Potential built with compile=True evaluates energy, forces "
                             "and stress only; training needs the eager model")
        self._check_species(graph.numbers)
        g, paired = self.edges_for_model(graph, paired=self.paired and not training)
        with pairing_edges(paired):
            return compute_properties(self.model, g, forces, stress, training)

    def model_graph(self, graph: AtomicGraph) -> AtomicGraph:
        """``graph`` with the edges the model sees: the Verlet list's, and with a skin only
        those shorter than the cutoff at these positions (in the list's order; the model
        weighs the others zero, so the result is the same, for less edge work: in FCC Cu at
        5 + 1 Å, 42 of the list's 78 neighbours per atom; one host sync)."""
        return self.edges_for_model(graph)[0]

    def edges_for_model(self, graph: AtomicGraph, paired: bool = False
                        ) -> tuple[AtomicGraph, bool]:
        """:meth:`model_graph`, with ``paired`` as reverse pairs where the list allows it
        (a full list does); returns the graph and whether its edges are paired."""
        g = self.neighbors(graph)
        pairs = self._paired_edges(g) if paired and g.n_edges else None
        if pairs is not None:
            g = g.replace({K.EDGE_INDEX: pairs[0], K.SHIFTS: pairs[1]})
        if self.neighbors.skin == 0.0 or g.n_edges == 0:
            return g, pairs is not None
        with torch.no_grad():
            vec = g.edge_vectors(g.positions.detach())
            inside = squared_lengths(vec) < self.neighbors.cutoff ** 2
            if pairs is None:
                keep = inside.nonzero().squeeze(1)
            else:  # a pair's two lengths are bitwise equal: both edges or neither
                h = g.n_edges // 2
                first = inside[:h].nonzero().squeeze(1)
                if bool((inside[:h] != inside[h:]).any()):  # pragma: no cover
                    raise RuntimeError("the paired neighbor list parted a pair at the "
                                       "cutoff: please report this (xnn bug)")
                keep = torch.cat([first, first + h])
        return g.replace({K.EDGE_INDEX: g.edge_index.index_select(1, keep),
                          K.SHIFTS: g.shifts.index_select(0, keep)}), pairs is not None

    def _paired_edges(self, g: AtomicGraph) -> tuple[Tensor, Tensor] | None:
        """The edges of the list ``g`` carries in reverse-pair order (``None``: the list is
        not full). Arranged once per build, in the Verlet list itself (no second copy)."""
        cached = self._pairs
        if cached is None or cached[0] is not g.edge_index:
            order = pair_order(g.edge_index, g.shifts)
            arranged = None if order is None else self.neighbors.reorder(order)
            cached = self._pairs = (g.edge_index if arranged is None else arranged[0],
                                    arranged)
        return cached[1]

    def min_pair_distance(self, graph: AtomicGraph) -> tuple[Tensor, Tensor]:
        """The shortest pair of ``graph``'s neighbor list at its positions (see
        :class:`PotentialInterface`): ``(distance [] Å, atom ids [2])``, ``inf`` and ``-1``
        without pairs."""
        g = self.neighbors(graph)
        d = g.edge_vectors().norm(dim=-1)
        if not d.numel():
            return d.new_tensor(float("inf")), g.atom_id.new_full((2,), -1)
        e = int(torch.argmin(d))
        return d[e], g.atom_id[g.edge_index[:, e].flip(0)]

    def _check_species(self, numbers: Tensor) -> None:
        """The model's species check, skipped for the tensor checked last if unchanged (an
        MD run passes the same ``numbers`` every step; the check costs a host sync)."""
        last = self._checked
        if last is not None and last[0] is numbers and last[1] == numbers._version:
            return
        self.model.check_species(numbers)
        self._checked = (numbers, numbers._version)


def label_structures(potential: Evaluator, graphs: Sequence[AtomicGraph],
                     batch_size: int = 8) -> list[dict[str, Tensor]]:
    """A potential's own labels of one-system graphs, evaluated ``batch_size`` at a time.

    Args:
        potential: e.g. a :class:`Potential` (in the dtype of ``graphs``).
        graphs: one-system graphs (edges are the potential's own).
        batch_size: structures per evaluation.
    Returns:
        one dict per graph: ``energy []`` eV, ``forces [n_atoms, 3]`` eV/Å and, for a
        structure periodic along every axis, ``stress [3, 3]`` eV/Å³ (detached).
    """
    out: list[dict[str, Tensor]] = []
    for lo in range(0, len(graphs), batch_size):
        chunk = list(graphs[lo:lo + batch_size])
        g = AtomicGraph.concat(chunk)
        periodic = g.pbc.all(dim=1).tolist()
        res = potential(g, forces=True, stress=any(periodic))
        ptr = g.ptr.tolist()
        for s in range(len(chunk)):
            row = {K.ENERGY: res[K.ENERGY][s].detach(),
                   K.FORCES: res[K.FORCES][ptr[s]:ptr[s + 1]].detach()}
            if periodic[s]:
                row[K.STRESS] = res[K.STRESS][s].detach()
            out.append(row)
    return out
