"""The host layout's ghost-owner lookup (:func:`xnn.distributed.host.owners.ghost_owners`) on
3 gloo ranks: every ghost's owner and row equal the truth on a triclinic periodic cell, a
slab and a cluster, for slab partitions thinner than the ghost reach (ghosts from
non-adjacent ranks and from several images), a rank that owns nothing, a random partition
(overlapping owned boxes) and fp32 positions; the ids a rank receives follow its ghosts and
the atoms it sends, not the system; a ghost nobody owns is refused on every rank."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_helpers import spawn

pytestmark = pytest.mark.distributed

WORLD = 3


def _structure(kind: str, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    cell = torch.tensor([[9.0, 0.0, 0.0], [2.5, 8.0, 0.0], [-1.5, 2.0, 7.5]],
                        dtype=torch.float64)
    pbc = {"triclinic": [True] * 3, "slab": [True, True, False],
           "cluster": [False] * 3}[kind]
    frac = torch.rand(n, 3, generator=g, dtype=torch.float64)
    return frac @ cell, cell, torch.tensor(pbc)


def _owner_of(kind: str, x: torch.Tensor, cell: torch.Tensor, partition: str, world: int):
    """``[n]`` the rank owning each atom."""
    if partition == "random":
        return torch.randint(0, world, (x.shape[0],), generator=torch.Generator().manual_seed(3))
    if partition == "empty":  # rank 1 owns nothing
        f = x @ torch.linalg.inv(cell)
        return torch.where(f[:, 0] < 0.5, 0, 2)
    f = x @ torch.linalg.inv(cell)
    return (f[:, 0] * world).floor().long().clamp(0, world - 1)


def _ghosts(x, cell, pbc, mine: torch.Tensor, reach: float):
    """Every image of every atom within ``reach`` of an owned atom, but the owned atoms:
    ``(atom index, image shift [3])`` per ghost."""
    ranges = [range(-2, 3) if p else range(0, 1) for p in pbc.tolist()]
    own = x[mine]
    atoms, shifts = [], []
    for n in itertools.product(*ranges):
        nv = torch.tensor(n, dtype=torch.float64)
        img = x + nv @ cell
        near = torch.cdist(img, own).min(1).values < reach if own.numel() else \
            torch.zeros(x.shape[0], dtype=torch.bool)
        if not any(n):
            near &= ~mine
        k = torch.nonzero(near).flatten()
        atoms.append(k)
        shifts.append(nv.expand(k.numel(), 3))
    return torch.cat(atoms), torch.cat(shifts)


def _case(rank, world, kind, partition, reach, dtype=torch.float64, n=90):
    from xnn.distributed.host.owners import ghost_owners

    x, cell, pbc = _structure(kind, n, seed=11)
    owner = _owner_of(kind, x, cell, partition, world)
    mine = owner == rank
    ids = torch.arange(n) * 7 + 5  # global ids, not rows
    own_rows = torch.nonzero(mine).flatten()
    atom, shift = _ghosts(x, cell, pbc, mine, reach)
    perm = torch.randperm(atom.numel(), generator=torch.Generator().manual_seed(rank))
    atom, shift = atom[perm], shift[perm]
    gpos = (x[atom] + shift @ cell).to(dtype)
    found = ghost_owners(ids[own_rows], x[own_rows].to(dtype), cell.to(dtype), pbc,
                         ids[atom], gpos, None if world == 1 else _group(), 1e-6)
    n_self = found.self_src.numel()
    got_ids = torch.cat([ids[own_rows][found.self_src],
                         found.plan.forward_comm(ids[own_rows])])
    return {"ghost_ids_in_order": got_ids, "expected": ids[atom][found.order],
            "order_is_permutation": torch.equal(found.order.sort().values,
                                                torch.arange(atom.numel())),
            "self_ok": bool((owner[atom][found.order[:n_self]] == rank).all()),
            "n_ghost": atom.numel(), "n_send": found.plan.n_send, "n_total": found.n_total,
            "received": found.ids_received, "n_atoms": n}


def _group():
    import torch.distributed as dist

    return dist.group.WORLD


CASES = [("triclinic", "slabs", 4.0), ("triclinic", "slabs", 9.5), ("slab", "slabs", 4.0),
         ("cluster", "slabs", 3.0), ("triclinic", "empty", 4.0), ("triclinic", "random", 3.0),
         ("cluster", "random", 2.5)]


def worker(rank, world):
    from xnn.distributed import DistributedManager
    from xnn.errors import XnnError

    DistributedManager.initialize(backend="gloo", timeout_s=60)
    out = {}
    for kind, partition, reach in CASES:
        out[(kind, partition, reach)] = _case(rank, world, kind, partition, reach)
    out["fp32"] = _case(rank, world, "triclinic", "slabs", 4.0, dtype=torch.float32)
    out["sparse"] = _case(rank, world, "cluster", "slabs", 0.5, n=900)
    from xnn.distributed.host.owners import ghost_owners

    try:  # rank 0 holds a ghost of an id nobody owns
        ghost = torch.tensor([10**6 if rank == 0 else 5])
        ghost_owners(torch.tensor([5 + rank]) if rank else torch.tensor([5]),
                     torch.zeros(1, 3, dtype=torch.float64),
                     torch.eye(3, dtype=torch.float64) * 10, torch.tensor([True] * 3), ghost,
                     torch.zeros(1, 3, dtype=torch.float64), _group(), 1e-6)
        out["error"] = "accepted"
    except XnnError as err:
        out["error"] = f"{type(err).__name__}: {err}"
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(worker, WORLD, timeout_s=300)


@pytest.mark.parametrize("case", CASES + ["fp32", "sparse"], ids=str)
def test_every_ghost_gets_its_owners_row(ranks, case):
    for r in ranks:
        c = r[case]
        assert c["order_is_permutation"] and c["self_ok"]
        assert torch.equal(c["ghost_ids_in_order"], c["expected"])
        assert c["n_total"] == c["n_atoms"]
    assert sum(r[case]["n_ghost"] for r in ranks) > 0


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "random"] + ["sparse"],
                         ids=str)
def test_lookup_receives_ids_of_ghosts_and_sent_atoms_only(ranks, case):
    """With disjoint owned boxes a rank receives one id per remote ghost it asked for and
    one per owned row it sends, nothing per atom of the system."""
    for r in ranks:
        c = r[case]
        assert c["received"] <= (c["n_ghost"] + c["n_send"])
    sparse = ranks[1]["sparse"]  # the middle rank of a 900-atom cluster: a thin shell
    assert 0 < sparse["received"] < sparse["n_atoms"] // 2


def test_a_ghost_nobody_owns_is_refused_on_every_rank(ranks):
    assert "no rank owns" in ranks[0]["error"] and "1000000" in ranks[0]["error"]
    for r in ranks[1:]:
        assert "rank 0 failed" in r["error"] and "no rank owns" in r["error"]


def test_candidates_in_pieces_equal_candidates_at_once():
    """The candidate matrix computed a few ghosts at a time (bounded temporaries for many
    ranks) is the one computed at once, and holds each ghost's owner box."""
    from xnn.distributed.host.owners import _candidates

    g = torch.Generator().manual_seed(5)
    lo = torch.rand(7, 3, generator=g, dtype=torch.float64) * 0.8
    hi = lo + 0.15
    lo[4], hi[4] = float("inf"), -float("inf")  # a rank without atoms
    owner = torch.randint(0, 4, (50,), generator=g)
    frac = lo[owner] + torch.rand(50, 3, generator=g, dtype=torch.float64) * 0.15
    frac[:, :2] += torch.randint(-2, 3, (50, 2), generator=g)  # periodic images along a, b
    eps = torch.full((3,), 1e-9, dtype=torch.float64)
    whole = _candidates(frac, lo, hi, [True, True, False], eps)
    assert torch.equal(_candidates(frac, lo, hi, [True, True, False], eps, chunk=10), whole)
    assert bool(whole[torch.arange(50), owner].all()) and not bool(whole[:, 4].any())
    assert not bool(_candidates(frac + torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64),
                                lo, hi, [True, True, False], eps).any())  # open axis c
