"""Fixed-capacity arrays of one rank's decomposed domain, for the compiled decomposed step.

Between two ghost-plan rebuilds a rank's owned atoms, ghosts, messages and local edges keep
their counts; a rebuild (or a migration) changes them. :class:`PaddedPlan` pads every array
that the compiled regions of :mod:`xnn.distributed.domain.compiled` read to a *capacity*,
so that their shapes (and the compiled graphs) survive rebuilds:

* owned rows ``[cap_owned]`` (positions, velocities, forces, ``m MVV2E`` with ``inf`` on
  padding and fixed atoms: padding rows never move and have zero acceleration);
* the exchange base ``[cap_owned + cap_recv]``: owned rows, then the ghost rows received
  from other ranks; each local atom ``[cap_local]`` is ``base[src] + shift @ cell``, padding
  local atoms copy row 0 and own no energy (masked out of the rank's sum);
* send rows ``[cap_send]`` (the owned rows every peer needs, concatenated in peer order);
* local edges ``[cap_edges]``: padding edges are self-edges shifted by one lattice vector of
  a fictitious local cell ``diag(L)`` with ``L`` beyond every reach, so they carry no weight
  (real edges have zero shifts: their vectors are unchanged);
* with a skin, the *active* edges ``[cap_active]``: inert edges of that kind, into which the
  model region compacts the local edges shorter than the cutoff at the force call's
  positions (:func:`xnn.dynamics.compiled.within_cutoff`), so the model's edge work is that
  of the edges it weighs.

A paired local list (``LocalDomain.paired``: its second half reverses its first) is padded
half by half, ``[first half, padding, second half, the same padding]``, and so are the
active edges (:func:`~xnn.dynamics.compiled.within_cutoff_paired` keeps the pairs): the two
capacities are even.

Capacities grow geometrically when a rebuild overflows one (the only event that compiles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.distributed.domain.local import _SYSTEM_RESULTS
from xnn.units import MVV2E

#: capacity names, in the order of :attr:`PaddedPlan.capacities`
CAPACITIES = ("owned", "recv", "send", "local", "edges", "active")


@dataclass
class Capacities:
    """Capacities of the padded arrays, grown by ``growth`` when a rebuild overflows one, and
    at least to ``headroom n + 4 sqrt(n) + slack`` for a count ``n`` (counts per rank
    fluctuate by a few ``sqrt(n)`` as atoms migrate: small domains need relatively more)."""

    growth: float = 1.25
    headroom: float = 1.25
    slack: int = 16
    sizes: dict | None = None

    def fit(self, counts: dict[str, int]) -> bool:
        """Grow to hold ``counts``; True if any capacity changed."""
        old = dict(self.sizes or {})
        new = {}
        for name in CAPACITIES:
            n, cap = counts[name], old.get(name, 0)
            new[name] = cap if n <= cap and cap > 0 else self.grown(n, cap)
        for name in ("edges", "active"):  # even: a paired list's halves
            new[name] += new[name] % 2
        self.sizes = new
        return new != old

    def grown(self, n: int, cap: int) -> int:
        """The capacity that replaces ``cap`` when it cannot hold ``n``."""
        return max(math.ceil(n * self.headroom + 4.0 * math.sqrt(n)) + self.slack,
                   math.ceil(cap * self.growth), 1)


@dataclass
class PaddedPlan:
    """One rebuild's padded arrays (see the module docstring). ``n_*``: true counts."""

    state: object  # the DomainState it pads
    n_owned: int
    n_recv: int
    send_counts: list[int]
    recv_counts: list[int]
    peers: list[int]
    caps: dict
    src: Tensor  # [cap_local] rows of the base
    shifts: Tensor  # [cap_local, 3] float
    owned_mask: Tensor  # [cap_local] bool
    send_index: Tensor  # [cap_send]
    inv_m: Tensor  # [cap_owned, 1] m MVV2E, inf on fixed and padding rows
    ref: Tensor  # [cap_owned, 3] positions at the rebuild
    migrated: Tensor  # [cap_owned, 3] positions at the last migration (inf: unknown)
    fields: dict  # the local graph's fields but positions
    recv_buf: Tensor  # [cap_recv, 3] received ghost positions
    back_buf: Tensor  # [cap_send, 3 k] received ghost gradients (k members), in send order
    active: tuple = ()  # (edge_index [2, cap_active], shifts) inert; () without a filter
    paired: bool = False  # the local edges (and the active ones) are reverse pairs
    routing: object = None  # the ghost plan's StagedRouting (parallel.exchange=staged) or None


def pad_rows(t: Tensor, n: int, value=0) -> Tensor:
    """``t`` with ``n - len(t)`` rows of ``value`` appended."""
    extra = t.new_full((n - t.shape[0], *t.shape[1:]), value)
    return torch.cat([t, extra])


def local_box(reach: float, like: Tensor) -> Tensor:
    """``[1, 3, 3]`` the fictitious cell of the local graph: ``diag(L)``, ``L > 2 reach``."""
    return torch.eye(3, dtype=like.dtype, device=like.device)[None] * (2.0 * reach + 10.0)


def plan_counts(state) -> list[int]:
    """The counts of :data:`CAPACITIES` in ``state`` (a
    :class:`~xnn.distributed.domain.state.DomainState`)."""
    dom = state.local
    return [dom.n_owned, dom.plan.n_recv, dom.plan.n_send, dom.n_local,
            int(dom.edge_index.shape[1]), dom.n_within]


def pad_plan(state, graph, caps: Capacities, pad_z: int, reach: float,
             fit: list[int] | None = None, filters: bool = False, width: int = 3
             ) -> PaddedPlan:
    """Pad the arrays of ``state`` (a :class:`~xnn.distributed.domain.state.DomainState`)
    and its owned ``graph`` (same atoms, same order) to the (grown) capacities.

    ``pad_z``: atomic number of the padding atoms (one the model knows); ``reach``: Å, an
    upper bound of every length the model looks at (the padding edges are longer);
    ``fit``: the counts the capacities must hold (default: this rank's, :func:`plan_counts`;
    the compiled step passes the maxima over the ranks, so that all ranks share capacities);
    ``filters``: make the inert active edges (the model region filters to the cutoff);
    ``width``: the columns of the returned ghost forces (``3 k`` for ``k`` committee members).
    """
    dom, dev, dtype = state.local, graph.positions.device, graph.positions.dtype
    plan = dom.plan
    n_o, n_r = dom.n_owned, plan.n_recv
    caps.fit(dict(zip(CAPACITIES, fit or plan_counts(state))))
    c = caps.sizes
    base_rows = torch.arange(n_o, device=dev)
    src = torch.cat([base_rows, dom.self_src.to(dev), c["owned"] + torch.arange(n_r, device=dev)])
    sends = [s.to(dev) for s in plan.send_index]
    send_index = torch.cat(sends) if sends else torch.zeros(0, dtype=torch.long, device=dev)
    free = ~graph[K.FIXED].to(torch.bool) if K.FIXED in graph else torch.ones(
        n_o, dtype=torch.bool, device=dev)
    m = torch.where(free, graph.masses * MVV2E, torch.full_like(graph.masses, math.inf))
    migrated = state.migrated
    if migrated is None:  # ownership unknown: the first look-ahead asks for a migration
        migrated = torch.full_like(graph.positions, math.inf)
    return PaddedPlan(
        state, n_o, n_r, [int(s.numel()) for s in sends], list(plan.recv_counts),
        list(plan.peers), dict(c), pad_rows(src, c["local"]),
        pad_rows(dom.shifts.to(device=dev, dtype=dtype), c["local"]),
        torch.arange(c["local"], device=dev) < n_o, pad_rows(send_index, c["send"]),
        pad_rows(m[:, None], c["owned"], math.inf),
        pad_rows(state.ref_positions.detach(), c["owned"]),
        pad_rows(migrated.detach(), c["owned"]), _local_fields(dom, graph, c, pad_z, reach),
        torch.zeros(c["recv"], 3, dtype=dtype, device=dev),
        torch.zeros(c["send"], width, dtype=dtype, device=dev),
        inert_active(c["active"], c["local"], dev, dom.paired) if filters else (), dom.paired,
        plan.routing)


def inert_active(n: int, n_local: int, device, paired: bool) -> tuple[Tensor, Tensor]:
    """The ``n`` inert active edges (:func:`inert_edges`), as two equal halves for a paired
    list (``n`` even)."""
    if not paired:
        return inert_edges(n, n_local, device)
    ei, sh = inert_edges(n // 2, n_local, device)
    return torch.cat([ei, ei], 1), torch.cat([sh, sh])


def inert_edges(n: int, n_local: int, device) -> tuple[Tensor, Tensor]:
    """``n`` padding edges of the local graph: self-edges of local atoms ``0, 1, ...`` in
    turn, shifted by the first lattice vector of :func:`local_box` (beyond every reach)."""
    atoms = torch.arange(n, device=device) % max(n_local, 1)
    shifts = torch.zeros(n, 3, dtype=torch.long, device=device)
    shifts[:, 0] = 1
    return torch.stack([atoms, atoms]), shifts


def _local_fields(dom, graph, c: dict, pad_z: int, reach: float) -> dict[str, Tensor]:
    """The local graph's fields (as :func:`~xnn.distributed.domain.local.local_graph`
    makes them) padded to ``cap_local`` atoms and ``cap_edges`` edges; no positions."""
    dev = graph.positions.device
    fields = {}
    for name in dom.ghost_fields:
        value = dom.local_field(name, graph[name])
        fields[name] = pad_rows(value, c["local"], pad_z if name == K.NUMBERS else 0)
    for name, value in graph.fields.items():
        if K.scope_of(name) == K.SYSTEM and name not in _SYSTEM_RESULTS:
            fields[name] = value
    fields[K.BATCH] = torch.zeros(c["local"], dtype=torch.long, device=dev)
    fields[K.CELL] = local_box(reach, graph.positions)
    fields[K.PBC] = torch.zeros(1, 3, dtype=torch.bool, device=dev)
    ei = dom.edge_index.to(dev)
    parts = 2 if dom.paired else 1  # paired: [first half, padding, second half, padding]
    pad_ei, pad_sh = inert_edges((c["edges"] - ei.shape[1]) // parts, c["local"], dev)
    sh = torch.zeros(ei.shape[1], 3, dtype=torch.long, device=dev)
    fields[K.EDGE_INDEX] = torch.cat([x for e in ei.tensor_split(parts, 1) for x in (e, pad_ei)],
                                     1)
    fields[K.SHIFTS] = torch.cat([x for e in sh.tensor_split(parts) for x in (e, pad_sh)])
    return fields
