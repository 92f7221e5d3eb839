"""Who owns a host ghost, with traffic proportional to the ghosts (no rank holds every id).

A host engine (LAMMPS) gives each rank its owned atoms and its ghosts (global ids and
positions, each an image of an atom some rank owns) but not the ghosts' owners. Each rank
all-gathers only its owned atoms' count and bounding box in the cell's fractional
coordinates (``O(n_ranks)`` numbers). A ghost's owner holds the atom at the ghost's position
minus whole cell vectors, so the owner's box, widened by the image tolerance, contains that
position: the ranks whose boxes do (along periodic axes after some integer shift) are the
ghost's candidates. The ghost ids go to the candidates only; each answers with its row of
the id, or ``-1``. Under a host's spatial decomposition (LAMMPS's bricks or tiles, any
processor grid, triclinic or open axes) the owned boxes are disjoint, so a ghost has one
candidate unless it lies within the tolerance of a box face; the answer is exact whatever
the boxes, since every candidate is asked and exactly one must own the atom.

Per rank and lookup: the requests it sends are its remote ghosts (times their candidates),
the requests it receives are its owned atoms that other ranks hold as ghosts, and the
answers mirror the requests; nothing is proportional to the system.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.distributed import collectives as C
from xnn.distributed.domain.halo import HaloPlan
from xnn.errors import InputError


@dataclass
class GhostOwners:
    """The ghosts of one host ghost list, by owner.

    Attributes:
        plan: the halo plan: remote ghosts received from their owners, in ``order[n_self:]``.
        self_src: ``[n_self]`` owned rows of the ghosts that are images of this rank's atoms.
        order: ``[n_ghost]`` indices into the host's ghost list: the images of owned atoms
            first, then the remote ghosts in the plan's receive order.
        n_total: number of atoms owned by all ranks together.
        ids_received: ids (requests) plus rows (answers) this rank received in the lookup.
    """

    plan: HaloPlan
    self_src: Tensor
    order: Tensor
    n_total: int
    ids_received: int


def ghost_owners(ids: Tensor, positions: Tensor, cell: Tensor, pbc: Tensor,
                 ghost_ids: Tensor, ghost_positions: Tensor, group, tolerance: float
                 ) -> GhostOwners:
    """Find every ghost's owner rank and row there (collective over ``group``).

    Args:
        ids: ``[n_owned]`` global ids of this rank's atoms.
        positions: ``[n_owned, 3]`` Å their positions.
        cell: ``[3, 3]`` Å lattice vectors (rows); along open axes any row.
        pbc: ``[3]`` periodic axes.
        ghost_ids: ``[n_ghost]`` global ids of the host's ghosts on this rank.
        ghost_positions: ``[n_ghost, 3]`` Å their positions (images of their owners).
        group: the process group (``None`` in one process).
        tolerance: Å, how far a ghost may sit from an exact image of its owner.

    Raises:
        InputError: on every rank, when a ghost has no owner, two ranks own an id, or a
            rank owns an id twice.
    """
    rank, size = C.group_rank(group), C.group_size(group)
    with C.guarded(group, "ghost owners"):
        own_order, own_sorted = _sorted_ids(ids)
        at, mine = _find(own_sorted, ghost_ids)
        self_idx = torch.nonzero(mine).flatten()
        self_src = own_order[at[self_idx]]
        rest = torch.nonzero(~mine).flatten()
        frame = _frame(cell, pbc)
        box = _box(ids.numel(), positions, frame)
    boxes = C.all_gather_tensor(box, group)
    with C.guarded(group, "ghost candidates"):
        eps = _fractional_tolerance(frame, torch.cat([positions.detach(),
                                                      ghost_positions.to(positions)]),
                                    tolerance)
        frac = ghost_positions[rest].double() @ frame
        cand = _candidates(frac, boxes[:, 1:4], boxes[:, 4:7], pbc.to(torch.bool).tolist(),
                           eps)
        cand[:, rank] = False  # this rank's own atoms were found by id
        j, q = torch.nonzero(cand, as_tuple=True)
        by_rank = torch.argsort(q, stable=True)
        j, q = j[by_rank], q[by_rank]
        want = torch.bincount(q, minlength=size)
    asked = _all_to_all_counts(want, group)
    peers = [p for p in range(size) if p != rank and (int(want[p]) or int(asked[p]))]
    requests = ghost_ids[rest[j]]
    got = _swap(requests, want, asked, peers, group)
    rows = _answer(own_order, own_sorted, got)
    answers = _swap(rows, asked, want, peers, group)
    with C.guarded(group, "ghost owners"):
        found = answers >= 0
        _check_unique(found, j, rest, ghost_ids)
        remote = rest[j[found]]
        recv = torch.bincount(q[found], minlength=size)
    sends = torch.split(rows, asked.tolist())
    send_index = {p: s[s >= 0] for p, s in enumerate(sends)}
    plan_peers = [p for p in peers if int(recv[p]) or send_index[p].numel()]
    plan = HaloPlan(ids.numel(), plan_peers, [send_index[p] for p in plan_peers],
                    [int(recv[p]) for p in plan_peers], group)
    return GhostOwners(plan, self_src, torch.cat([self_idx, remote]),
                       int(boxes[:, 0].sum()), int(asked.sum() + want.sum()))


def _sorted_ids(ids: Tensor) -> tuple[Tensor, Tensor]:
    order = torch.argsort(ids)
    s = ids[order]
    if s.numel() > 1 and bool((s[1:] == s[:-1]).any()):
        k = int(torch.nonzero(s[1:] == s[:-1])[0])
        raise InputError(f"a rank owns the atom of id {int(s[k])} twice")
    return order, s


def _find(sorted_ids: Tensor, wanted: Tensor) -> tuple[Tensor, Tensor]:
    """Positions of ``wanted`` in ``sorted_ids`` (clamped) and whether each is there."""
    if not sorted_ids.numel():
        return (torch.zeros_like(wanted),
                torch.zeros(wanted.shape, dtype=torch.bool, device=wanted.device))
    at = torch.searchsorted(sorted_ids, wanted).clamp(max=sorted_ids.numel() - 1)
    return at, sorted_ids[at] == wanted


def _answer(own_order: Tensor, own_sorted: Tensor, requested: Tensor) -> Tensor:
    """``[n]`` this rank's row of each requested id, ``-1`` where it owns none."""
    at, there = _find(own_sorted, requested)
    if not own_sorted.numel():
        return torch.full_like(requested, -1)
    return torch.where(there, own_order[at], torch.full_like(requested, -1))


def _frame(cell: Tensor, pbc: Tensor) -> Tensor:
    """``[3, 3]`` (fp64) the map from Cartesian to fractional coordinates: the inverse of the
    cell (LAMMPS's lamda coordinates, in which its subdomains are boxes, along open axes
    too); where the cell is singular (no box along an open axis), with unit rows there."""
    periodic = pbc.to(torch.bool)
    eye = torch.eye(3, dtype=torch.float64, device=cell.device)
    c = cell.double()
    full = torch.where((periodic | (c.norm(dim=1) > 0))[:, None], c, eye)
    if float(torch.linalg.det(full).abs()) > 1e-9 * float(full.norm(dim=1).prod()):
        return torch.linalg.inv(full)
    return torch.linalg.inv(torch.where(periodic[:, None], c, eye))


def _box(n: int, positions: Tensor, frame: Tensor) -> Tensor:
    """``[7]`` (fp64): the owned count, the lower and upper corner of the owned atoms'
    fractional coordinates (``+inf``, ``-inf`` for a rank without atoms)."""
    if not n:
        inf = torch.full((3,), float("inf"), dtype=torch.float64, device=frame.device)
        return torch.cat([inf.new_zeros(1), inf, -inf])
    f = positions.detach().double() @ frame
    return torch.cat([f.new_tensor([float(n)]), f.min(0).values, f.max(0).values])


def _fractional_tolerance(frame: Tensor, positions: Tensor, tolerance: float) -> Tensor:
    """``[3]`` how far along each fractional axis a ghost may miss its owner's image: the
    image tolerance plus the round-off of ``positions`` (owned and ghost, Å) in their dtype."""
    reach = float(positions.abs().max()) if positions.numel() else 0.0
    slack = 2.0 * tolerance + 8.0 * torch.finfo(positions.dtype).eps * (1.0 + reach)
    return slack * frame.norm(dim=0) + 1e-12


def _candidates(frac: Tensor, lo: Tensor, hi: Tensor, periodic: list[bool], eps: Tensor,
                chunk: int = 1 << 22) -> Tensor:
    """``[n, n_ranks]``: whether rank ``q``'s widened box holds ghost ``i``'s position
    (shifted by whole cell vectors along periodic axes); ``chunk`` bounds the temporaries
    (ghosts times ranks per piece)."""
    low, high = lo - eps, hi + eps
    rows = max(1, chunk // max(1, lo.shape[0]))
    out = []
    for f in torch.split(frac, rows):
        ok = torch.ones(f.shape[0], lo.shape[0], dtype=torch.bool, device=f.device)
        for k in range(3):
            a, b = f[:, k, None] - low[None, :, k], f[:, k, None] - high[None, :, k]
            if bool(periodic[k]):  # some integer n with low <= f - n <= high
                ok &= torch.floor(a) >= torch.ceil(b)
            else:
                ok &= (a >= 0) & (b <= 0)
        out.append(ok)
    return torch.cat(out) if out else torch.zeros(0, lo.shape[0], dtype=torch.bool,
                                                  device=frac.device)


def _all_to_all_counts(want: Tensor, group) -> Tensor:
    """``[n_ranks]``: how many rows each rank sends this one, from ``want`` (rows this rank
    sends each rank); ``O(n_ranks)`` per rank."""
    if not C.is_active(group):
        return want.clone()
    got = torch.empty_like(want)
    C.all_to_all_single_(got, want.contiguous(), group)
    return got


def _swap(values: Tensor, send: Tensor, recv: Tensor, peers: list[int], group) -> Tensor:
    """Send ``values`` (split by ``send`` counts per rank) to the peers; the rows received
    (``recv`` counts per rank), concatenated in rank order."""
    parts = torch.split(values, send.tolist())
    out = [values.new_empty(int(n)) for n in recv.tolist()]
    C.exchange([(p, parts[p]) for p in peers], [(p, out[p]) for p in peers], group)
    return torch.cat(out) if out else values.new_empty(0)


def _check_unique(found: Tensor, j: Tensor, rest: Tensor, ghost_ids: Tensor) -> None:
    """Every remote ghost has exactly one owner."""
    hits = torch.bincount(j[found], minlength=rest.numel())
    if bool((hits == 0).any()):
        k = int(rest[torch.nonzero(hits == 0)[0]])
        raise InputError(f"the host's ghosts include atoms no rank owns (id {int(ghost_ids[k])}"
                         ", or a ghost that is no periodic image of its owner)")
    if bool((hits > 1).any()):
        k = int(rest[torch.nonzero(hits > 1)[0]])
        raise InputError(f"two ranks own an atom of the same id ({int(ghost_ids[k])})")
