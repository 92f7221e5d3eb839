"""``GraphPotential``: graph-parallel evaluation of one system, the complement of halos.

Atoms are split over the ranks by index (blocks of an atom order, :mod:`.order`); each rank
holds its owned atoms (an ``AtomicGraph`` sorted by atom id, as under spatial domain
decomposition, so the MD drivers run unchanged on the owned atoms), the positions are
all-gathered at every evaluation (replicated), each rank evaluates the edges whose receiver
it owns, and at each of the model's sync points the owned node features are all-gathered
(:class:`~xnn.distributed.domain.sync.HaloSync` over the graph domain, whose
``gather_local`` is an all-gather; backward a reduce-scatter). The owned atoms' energies
are summed and all-reduced; ``F_owned = -∂E/∂x_owned`` (the all-gather's backward sums
every rank's partial gradients into the owners) and the strain gradients are all-reduced
(stress, virial).

There is no geometry in the ownership, so nothing ever migrates, the results are exact for
any atom order, and a halo wider than the cell costs nothing extra. The price: every rank
receives all ``N`` rows of each exchanged feature per layer (spatial halos receive only
their ghosts), and builds the whole system's neighbor list at a rebuild.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.longrange import long_range_modules
from xnn.distributed.domain.potential import (
    decomposed_results,
    model_cutoff,
    model_device,
    resolve_group,
)
from xnn.distributed.domain.state import Counters, gather, scatter
from xnn.distributed.domain.sync import swapped_sync_points
from xnn.distributed.graph.domain import GraphDomain, build_graph_domain, local_graph
from xnn.distributed.graph.order import assign_owners
from xnn.errors import InputError
from xnn.models.derivatives import apply_strain


def check_graph_model(model) -> tuple[float, int]:
    """``(cutoff, layers)``; ``InputError`` for models graph parallelism cannot split exactly:
    several layers without a sync point each, a receptive field beyond the cutoff, or
    long-range terms."""
    cutoff, hops = model_cutoff(model)
    name = type(model).__name__
    n_sync = len(getattr(model, "sync_points", []) or [])
    if hops > 1 and n_sync != hops - 1:
        raise InputError(f"mode 'graph' needs a sync point between every two interaction "
                         f"layers; {name} has {hops} layers and {n_sync} sync points (use "
                         "mode 'halo')")
    field = float(getattr(model, "receptive_field", cutoff * hops))
    if hops == 1 and field > cutoff + 1e-12:
        raise InputError(f"mode 'graph' needs a receptive field of one cutoff per layer; "
                         f"{name} declares {field:g} Å > cutoff {cutoff:g} Å (use mode 'halo')")
    if long_range_modules(model):
        raise InputError(f"mode 'graph' does not support long-range terms ({name}); use "
                         "mode 'halo'")
    return cutoff, hops


@dataclasses.dataclass(frozen=True)
class GraphState:
    """The last rebuild: owned atoms' reference positions and cell, the domain, counters."""

    graph: AtomicGraph
    local: GraphDomain
    counters: Counters = dataclasses.field(default_factory=Counters)

    @property
    def n_owned(self) -> int:
        return self.graph.n_atoms


class GraphPotential:
    """Evaluate ``model`` graph-parallel on a system whose atoms the ranks own by index.

    Same interface as :class:`~xnn.distributed.domain.potential.DomainPotential`, so that
    :class:`~xnn.distributed.md_run.DomainRun` and the integrators use either.

    Args:
        model: per-atom-energy model with ``cutoff`` (Å), ``num_interactions`` and a sync
            point between every two layers (see :func:`check_graph_model`).
        manager_or_group: a DistributedManager, ParallelDims (its ``dd`` axis), a group or
            ``None``.
        skin: Verlet skin (Å): the neighbor list is reused until an atom moved (plus the
            images' move by a changed cell) more than ``skin / 2``.
        order: ``"morton"`` (space-filling curve: fewer ghosts) or ``"index"`` (by atom id).
        backend: neighbor-list backend.
    """

    mode = "graph"
    grid = None

    def __init__(self, model, manager_or_group=None, skin: float = 0.0,
                 order: str = "morton", backend: str = "auto"):
        self.cutoff, self.hops = check_graph_model(model)
        if skin < 0:
            raise InputError(f"skin must be >= 0, got {skin}")
        self.model, self.skin, self.order, self.backend = model, float(skin), order, backend
        self.group, self.device = resolve_group(manager_or_group)
        self.size, self.rank = C.group_size(self.group), C.group_rank(self.group)
        self.halo_width = self.cutoff + self.skin  # the edges' reach (no halo of ghosts)
        self.state: GraphState | None = None
        self.n_total: int | None = None
        self.root_owner: Tensor | None = None
        self._last_eval = None

    # ------------------------------------------------------------------ start-up, output
    def scatter(self, graph: AtomicGraph | None, owner: Tensor | None = None) -> AtomicGraph:
        """This rank's owned atoms of rank 0's ``graph`` (collective). ``owner`` (rank 0):
        each atom's rank; default: blocks of the ``order``."""
        device = self.device or model_device(self.model)
        with C.guarded(self.group, "graph-parallel ownership"):
            if self.rank == 0 and owner is None and graph is not None:
                owner = assign_owners(graph, self.size, self.order)
        owned, _, self.n_total, self.root_owner = scatter(graph, self.group, self.halo_width,
                                                          None, device, owner)
        return owned

    def gather(self, graph: AtomicGraph, extra=None, dst: int = 0):
        """The whole system on rank ``dst`` by atom id (see :func:`state.gather`)."""
        return gather(graph, self.group, extra, dst)

    @property
    def reducer(self):
        from xnn.distributed.reducer import GroupReducer

        return GroupReducer(self.group)

    # ------------------------------------------------------------------ rebuilds
    def _rebuild(self, graph: AtomicGraph) -> None:
        check = getattr(self.model, "check_species", None)
        with C.guarded(self.group, "species check"):
            if graph.n_systems != 1:
                raise InputError(f"graph parallelism takes one system, got {graph.n_systems}")
            if check is not None:
                check(graph.numbers)
        dom = build_graph_domain(graph, self.cutoff + self.skin, self.group, self.backend)
        if self.n_total is None:
            self.n_total = dom.n_total
        elif dom.n_total != self.n_total:
            raise InputError(f"the ranks hold {dom.n_total} atoms, but {self.n_total} were "
                             "scattered; pass each rank its owned graph (from scatter)")
        c = self.state.counters if self.state else Counters()
        ref = graph.without_edges().replace(positions=graph.positions.detach().clone(),
                                            cell=graph.cell.detach().clone())
        self.state = GraphState(ref, dom, dataclasses.replace(c, rebuilds=c.rebuilds + 1))

    def _moved(self, graph: AtomicGraph) -> float:
        """How far (Å) the owned atoms and the edges' images moved since the rebuild
        (``inf`` for other atoms or pbc, and for any move without a skin)."""
        st = self.state
        if (st is None or graph.n_atoms != st.n_owned
                or not torch.equal(graph.atom_id, st.graph.atom_id)
                or not torch.equal(graph.pbc, st.graph.pbc)):
            return float("inf")
        pos, dcell = graph.positions.detach(), graph.cell.detach() - st.graph.cell
        disp = float((pos - st.graph.positions).norm(dim=-1).max()) if pos.shape[0] else 0.0
        shifts = st.local.shifts
        deform = float((shifts.to(dcell.dtype) @ dcell[0]).norm(dim=-1).max()) \
            if shifts.shape[0] and bool(dcell.any()) else 0.0
        moved = disp + deform
        if self.skin == 0 and (moved > 0 or bool(dcell.any())):
            return float("inf")
        return moved if moved == moved else float("inf")  # NaN positions rebuild too

    def update(self, graph: AtomicGraph) -> bool:
        """Rebuild the domain when any rank's atoms moved more than ``skin / 2``. Collective."""
        moved = C.all_reduce_max(torch.tensor([self._moved(graph)], dtype=torch.float64,
                                              device=graph.device), self.group)
        if float(moved[0]) <= 0.5 * self.skin and self.state is not None:
            return False
        self._rebuild(graph)
        return True

    def maybe_rebuild(self, graph: AtomicGraph, extra=None):
        """Between steps: nothing migrates (ownership is by index); returns the inputs."""
        return graph, extra

    def maybe_migrate(self, state):
        """The same MD state: atoms never change rank in graph mode."""
        return state

    def reference(self, graph: AtomicGraph) -> None:
        """Checkpoints hold no rebuild reference: a resumed run rebuilds at its first step."""
        return None

    # ------------------------------------------------------------------ evaluation
    def __call__(self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
                 training: bool = False) -> dict[str, Tensor]:
        """Energy and stress of the whole system; energies and forces of the owned atoms.

        Collective: every rank calls it with its owned ``graph``. With ``training=True`` the
        results stay differentiable (double backward through the all-gathers):
        backpropagate ``loss_r`` on every rank (replicated terms divided by the group
        size), then sum parameter gradients over the group.

        Returns:
            ``energy [1]`` (eV, total), ``energies [n_owned]`` (eV), ``forces [n_owned, 3]``
            (eV/Å), ``virial [1, 3, 3]`` (eV) and ``stress [1, 3, 3]`` (eV/Å³, totals),
            ``atom_id [n_owned]``.
        """
        self.update(graph)
        dom = self.state.local
        need_grad = forces or stress
        with torch.enable_grad() if (need_grad or training) else torch.no_grad():
            strained = apply_strain(graph.without_edges(), with_strain=stress) if need_grad \
                else None
            g = strained.graph if strained is not None else graph
            x = dom.gather_local(g.positions)
            tape: list[Tensor] = [x]
            with C.guarded(self.group, "model evaluation"), \
                    swapped_sync_points(self.model, dom, tape):
                energies = self.model(local_graph(graph, dom, x, g.cell))[: dom.n_owned]
            out = decomposed_results(energies, tape, strained, graph, forces, stress,
                                     training, self.group)
        self._last_eval = (x.detach(), g.cell.detach(), dom)
        if not training:
            out = {k: v.detach() for k, v in out.items()}
        return out

    # ------------------------------------------------------------------ diagnostics
    def min_pair_distance(self, graph: AtomicGraph | None = None) -> tuple[Tensor, Tensor]:
        """Shortest edge with an owned receiver at the last evaluation (rank-local).

        Returns:
            ``(distance [] Å, atom ids [2])``; ``inf`` and ``-1`` without edges.
        """
        if self._last_eval is None:
            raise InputError("min_pair_distance needs an evaluation first")
        x, cell, dom = self._last_eval
        ids = dom.fields[K.ATOM_ID]
        ei = dom.edge_index
        if not ei.shape[1]:
            return x.new_tensor(float("inf")), ids.new_full((2,), -1)
        vec = x[ei[0]] - x[ei[1]] + dom.shifts.to(x.dtype) @ cell[0]
        d = vec.norm(dim=-1)
        e = int(torch.argmin(d))
        return d[e], torch.stack([ids[ei[1, e]], ids[ei[0, e]]])

    def stats(self) -> dict[str, object]:
        """This rank's share: owned and ghost atoms, rows received per exchange, edges."""
        st = self.state
        if st is None:
            return {}
        d, c = st.local, st.counters
        return {"mode": "graph", "order": self.order, "grid": None, "n_owned": d.n_owned,
                "n_ghost": d.n_ghost, "n_held": d.n_local, "n_recv": d.n_total - d.n_owned,
                "n_send": d.n_owned, "n_peers": self.size - 1,
                "n_edges": int(d.edge_index.shape[1]), "halo_width": self.halo_width,
                "rebuilds": c.rebuilds, "migrations": 0, "migrated_out": 0, "migrated_in": 0}
