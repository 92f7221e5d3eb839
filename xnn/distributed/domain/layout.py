"""``SpatialLayout``: each rank owns the atoms of a box of the cell (modes ``halo``, ``sync``).

The layout of a :class:`~xnn.distributed.potential.DecomposedPotential` whose ownership is
geometric: atoms go to their box at the scatter, ghosts are pushed by their owners
(:func:`~xnn.distributed.domain.local.build_local_domain`), the local graph is non-periodic
with explicit positions, sync points exchange ghost features in mode ``sync``, and atoms
migrate to their box between steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.balance import check_balance
from xnn.distributed.domain.local import build_local_domain, local_graph, min_pair_distance
from xnn.distributed.domain.longrange import domain_fields, long_range_modules
from xnn.distributed.domain.migrate import migrate
from xnn.distributed.domain.partition import (
    Partition,
    axis_histograms,
    balanced,
    check_grid,
    fractional_bounds,
    parse_grid,
    partition_from_bounds,
)
from xnn.distributed.domain.staged import check_exchange
from xnn.errors import InputError


class SpatialLayout:
    """Boxes of a ``px × py × pz`` grid of the cell, one per rank.

    Args:
        mode: ``"halo"`` (any local model: a ghost shell of the whole receptive field) or
            ``"sync"`` (ghost shell of one cutoff; ghost features exchanged at the model's
            sync points).
        grid: ``(px, py, pz)``, ``"2,1,1"``, or ``None`` (smallest halo surface).
        balance: ``none`` (equal widths) or ``shift`` (cuts at the atoms' quantiles per
            axis, :data:`~xnn.distributed.domain.balance.BALANCE`), placed at the scatter
            and again at every rebuild (:meth:`partition`, from one all-reduced histogram).
        exchange: how ghost rows travel, a key of
            :data:`~xnn.distributed.domain.staged.EXCHANGES`: ``direct`` (one message per
            peer box) or ``staged`` (x, then y, then z, to the -1 and +1 box of each axis).

    Attributes (after :meth:`configure`): ``halo_width`` (Å), ``receiver_width`` (Å),
    ``filters``, ``paired``, ``long_range``.
    """

    migrates = True

    def __init__(self, mode: str = "halo", grid=None, balance: str = "none",
                 exchange: str = "direct"):
        if mode not in ("halo", "sync"):
            raise InputError(f"a spatial layout's mode is 'halo' or 'sync', got {mode!r}")
        self.mode, self.grid = mode, parse_grid(grid)
        self.balance = check_balance(balance)
        self.exchange = check_exchange(exchange)

    @property
    def syncs(self) -> bool:
        """Whether the model's sync points become halo feature exchanges."""
        return self.mode == "sync"

    def configure(self, model, cutoff: float, hops: int, skin: float, size: int) -> None:
        """Check ``model`` for this mode and set the widths (called once by the potential)."""
        mode = self.mode
        if mode == "sync" and hops > 1 and not model.sync_points:
            raise InputError(f"mode 'sync' needs a model with sync points; "
                             f"{type(model).__name__} has none (use mode 'halo')")
        self.cutoff, self.skin = cutoff, skin
        #: with a skin the model sees the local edges within the cutoff only (the others it
        #: weighs zero): less edge work for the same result (False: the whole list)
        self.filters = skin > 0
        depth = 1 if mode == "sync" else hops
        reach = cutoff * depth
        if mode == "halo":  # a declared receptive field (e.g. D3's cutoff + cn_cutoff,
            # or a Coulomb term's cutoff + its charge model's receptive field)
            reach = float(model.receptive_field)
        # receivers farther than (depth - 1) hops + skin from the box never reach an owned
        # energy: their edges are dropped (all ghosts when depth is 1), unless the model
        # declares a wider ``receiver_field`` (ghosts whose predicted charges count)
        self.receiver_width = (min(cutoff * (depth - 1), reach) + skin if depth > 1 else 0.0)
        if mode == "halo" and model.receiver_field > 0.0:
            self.receiver_width = max(self.receiver_width, float(model.receiver_field) + skin)
        self.halo_width = reach + skin
        # long-range terms: k-space over owned atoms, their global sums all-reduced
        self.long_range = long_range_modules(model)
        #: arrange the local edges as reverse pairs (radial work once per pair) for a model
        #: that declares ``pairs_edges``, in mode halo, without long-range terms, while the
        #: model is not training (as the one-process :class:`~xnn.models.Potential`)
        self.paired = bool(model.pairs_edges) and mode == "halo" and not self.long_range
        if any(getattr(m, "charge_model", None) is not None for m in self.long_range) and (
                mode != "halo" or reach == float("inf")):
            raise InputError("domain decomposition of predicted charges (charge_model) needs "
                             "mode 'halo' and a charge model that declares its cutoff (and "
                             "num_interactions or receptive_field)")
        if self.grid is not None:
            self.grid = check_grid(self.grid, size)

    def stale(self, state) -> bool:
        """Rank-local: ghosts changed outside the potential (never: it builds them)."""
        return False

    # ------------------------------------------------------------------ ownership
    def owners(self, graph, group, rank: int, size: int) -> None:
        """Atoms go to their box at the scatter (no owners given)."""
        return None

    def partition(self, graph: AtomicGraph, group, size: int) -> Partition:
        """The partition at ``graph``'s cell; non-periodic axes split the global bounding box.

        With balance ``shift`` the cuts are placed from the sum of every rank's per-axis
        histograms (one more all-reduce), at every call: the scatter's partition and that
        of every rebuild (:meth:`build`, :meth:`migrate`) follow the atoms.
        """
        cell, pbc, pos = graph.cell[0].detach(), graph.pbc[0], graph.positions.detach()
        bounds = torch.zeros(6, dtype=pos.dtype, device=pos.device)
        if not bool(pbc.all()):
            bounds = C.all_reduce_max(fractional_bounds(pos, cell), group)
        part = partition_from_bounds(-bounds[3:], bounds[:3], cell, pbc, size,
                                     self.halo_width, self.grid)
        self.grid = part.grid
        if self.balance == "shift":
            hist = axis_histograms(part, part.fractional(pos)[0]).to(pos.device)
            part = balanced(part, C.all_reduce_(hist, group).cpu(), self.halo_width)
        return part

    def extents(self, part: Partition, graph: AtomicGraph, pot) -> Tensor:
        """``[n_ranks, 2, 3]`` every rank's owned region; checks the total atom count."""
        home, _ = part.home(graph.positions.detach(), pot.rank)
        mine = torch.cat([part.extent(pot.rank, home).flatten().double(),
                          home.new_tensor([graph.n_atoms], dtype=torch.float64)])
        every = C.all_gather_tensor(mine, pot.group)
        pot.check_total(int(every[:, 6].sum()))
        return every[:, :6].reshape(-1, 2, 3).to(home.dtype)

    def build(self, graph: AtomicGraph, pot, part: Partition | None = None):
        """The :class:`~xnn.distributed.domain.local.LocalDomain` of ``graph`` (collective)."""
        part = part or self.partition(graph, pot.group, pot.size)
        extents = self.extents(part, graph, pot)
        return build_local_domain(graph, part, extents, self.halo_width,
                                  self.cutoff + self.skin, pot.group, pot.backend,
                                  self.receiver_width, self.cutoff if self.filters else None,
                                  self.paired and not pot.model.training, self.exchange)

    def migrate(self, graph: AtomicGraph, extra, pot):
        """Atoms to the rank of their box: ``(graph, extra, sent, received, partition)``."""
        part = self.partition(graph, pot.group, pot.size)
        peers = part.peers(self.extents(part, graph, pot), self.halo_width, pot.rank)
        graph, extra, sent, received = migrate(graph, extra, part, peers, pot.group)
        return graph, extra, sent, received, part

    # ------------------------------------------------------------------ evaluation
    def local_positions(self, dom, positions: Tensor, cell: Tensor) -> Tensor:
        """``[n_local, 3]`` explicit positions of owned atoms, images and ghosts."""
        return dom.local_positions(positions, cell[0])

    def local_graph(self, graph: AtomicGraph, dom, x: Tensor, cell: Tensor) -> AtomicGraph:
        """The non-periodic local graph (see :func:`~.local.local_graph`)."""
        extra = (domain_fields(cell[0], graph.pbc[0], dom.n_owned) if self.long_range
                 else None)
        return local_graph(graph, dom, x, self.mode == "sync", extra,
                           self.cutoff if self.filters else None)

    def min_pair_distance(self, x: Tensor, dom, ids: Tensor, cell) -> tuple[Tensor, Tensor]:
        return min_pair_distance(x, dom, dom.local_field(K.ATOM_ID, ids))

    def stats(self, st) -> dict[str, object]:
        d = st.local
        return {"grid": list(d.partition.grid), "n_held": st.n_owned + d.n_ghost,
                "n_recv": d.plan.n_recv, "n_send": d.plan.sent_rows,
                "n_peers": len(d.plan.peers), "paired": d.paired,
                "exchange": self.exchange, "n_messages": d.plan.messages}
