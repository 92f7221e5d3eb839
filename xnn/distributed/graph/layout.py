"""``GraphLayout``: graph parallelism, the complement of spatial halos (mode ``graph``).

Atoms are split over the ranks by index (blocks of an atom order, :mod:`.order`); each rank
holds its owned atoms (sorted by atom id, as in a spatial layout, so the MD drivers run
unchanged on them), the positions are all-gathered at every evaluation (replicated), each
rank evaluates the edges whose receiver it owns, and at each of the model's sync points the
owned node features are all-gathered (:class:`~xnn.distributed.domain.sync.HaloSync` over
the :class:`~.domain.GraphDomain`, whose ``gather_local`` is an all-gather; backward a
reduce-scatter).

There is no geometry in the ownership, so nothing ever migrates, the results are exact for
any atom order, and a halo wider than the cell costs nothing extra. The price: every rank
receives all ``N`` rows of each exchanged feature per layer (spatial halos receive only
their ghosts), and builds the whole system's neighbor list at a rebuild.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.longrange import long_range_modules
from xnn.distributed.graph.domain import build_graph_domain, local_graph
from xnn.distributed.graph.order import ORDERS, assign_owners
from xnn.errors import InputError


def check_graph_model(model, cutoff: float, hops: int) -> None:
    """``InputError`` for models graph parallelism cannot split exactly: several layers
    without a sync point each, a receptive field beyond the cutoff, or long-range terms."""
    name = type(model).__name__
    n_sync = len(model.sync_points)
    k = int(model.committee_size)  # a committee's points are its members' (each hops - 1)
    if hops > 1 and n_sync != k * (hops - 1):
        per = f" ({k} members)" if k > 1 else ""
        raise InputError(f"mode 'graph' needs a sync point between every two interaction "
                         f"layers; {name}{per} has {hops} layers and {n_sync} sync points "
                         "(use mode 'halo')")
    field = float(model.receptive_field)
    if hops == 1 and field > cutoff + 1e-12:
        raise InputError(f"mode 'graph' needs a receptive field of one cutoff per layer; "
                         f"{name} declares {field:g} Å > cutoff {cutoff:g} Å (use mode 'halo')")
    if long_range_modules(model):
        raise InputError(f"mode 'graph' does not support long-range terms ({name}); use "
                         "mode 'halo'")


class GraphLayout:
    """Index blocks of an atom order, one per rank.

    Args:
        order: ``"morton"`` (space-filling curve: fewer ghosts) or ``"index"`` (by atom id).
    """

    mode = "graph"
    migrates = False
    syncs = True
    grid = None
    balance = "none"  #: boxes are not cut (see SpatialLayout)
    filters = False
    long_range: list = []

    def __init__(self, order: str = "morton"):
        if order not in ORDERS:
            raise InputError(f"order must be one of {list(ORDERS)}, got {order!r}")
        self.order = order

    def configure(self, model, cutoff: float, hops: int, skin: float, size: int) -> None:
        """Check that ``model`` splits exactly by index; the edges' reach is the halo width."""
        check_graph_model(model, cutoff, hops)
        self.cutoff, self.skin = cutoff, skin
        self.halo_width = cutoff + skin  # the edges' reach (no halo of ghosts)

    def stale(self, state) -> bool:
        """Rank-local: ghosts changed outside the potential (never: it builds them)."""
        return False

    def owners(self, graph, group, rank: int, size: int) -> Tensor | None:
        """Rank 0: each atom's rank, blocks of the atom order (collective)."""
        owner = None
        with C.guarded(group, "graph-parallel ownership"):
            if rank == 0 and graph is not None:
                owner = assign_owners(graph, size, self.order)
        return owner

    def build(self, graph: AtomicGraph, pot, part=None):
        """The :class:`~.domain.GraphDomain` of ``graph`` (collective)."""
        dom = build_graph_domain(graph, self.cutoff + self.skin, pot.group, pot.backend)
        pot.check_total(dom.n_total)
        return dom

    def migrate(self, graph, extra, pot):  # pragma: no cover - never called (migrates False)
        raise RuntimeError("atoms never change rank in graph mode")

    def local_positions(self, dom, positions: Tensor, cell: Tensor) -> Tensor:
        """``[n_local, 3]``: owned positions, then the ghosts' (all-gathered)."""
        return dom.gather_local(positions)

    def local_graph(self, graph: AtomicGraph, dom, x: Tensor, cell: Tensor) -> AtomicGraph:
        """The periodic local graph (see :func:`~.domain.local_graph`)."""
        return local_graph(graph, dom, x, cell)

    def min_pair_distance(self, x: Tensor, dom, ids: Tensor, cell) -> tuple[Tensor, Tensor]:
        """Shortest edge with an owned receiver: ``(distance [] Å, atom ids [2])``."""
        ids = dom.fields[K.ATOM_ID]
        ei = dom.edge_index
        if not ei.shape[1]:
            return x.new_tensor(float("inf")), ids.new_full((2,), -1)
        vec = x[ei[0]] - x[ei[1]] + dom.shifts.to(x.dtype) @ cell[0]
        d = vec.norm(dim=-1)
        e = int(torch.argmin(d))
        return d[e], torch.stack([ids[ei[1, e]], ids[ei[0, e]]])

    def stats(self, st) -> dict[str, object]:
        d = st.local
        return {"mode": "graph", "order": self.order, "grid": None, "n_held": d.n_local,
                "n_recv": d.n_total - d.n_owned, "n_send": d.n_owned,
                "n_peers": C.group_size(d.group) - 1}
