"""Per-atom rows between ranks: any mix of field dtypes and shapes at any row count.

Migration, the ghost push, scatter and gather pack every per-atom field of a message into one
byte buffer. Fields of 1-byte (fixed-atom masks), 4-byte (float32, int32) and 8-byte dtypes
must come back intact whatever the number of rows, one row included. A direct test of
pack/unpack over dtype mixes and row counts, and one set of 2 gloo ranks that runs: MD with
fixed atoms through migrations against one process by atom id, a float32 system in which
each rank receives exactly one ghost, and single-row messages of mixed dtypes.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import spawn
from helpers import hot, lj, primitive
from helpers import rel as _rel

from xnn.distributed.domain.transport import layout_of, pack, unpack

TOL = 1e-10
ROWS = (0, 1, 2, 3, 7)


def mixed_fields(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-atom fields of every dtype size and several shapes, ``n`` rows (the same values
    whatever the default dtype)."""
    g = torch.Generator().manual_seed(seed + n)
    return {
        "fixed": torch.rand(n, generator=g, dtype=torch.float32) > 0.5,  # bool [n]: a FixAtoms mask
        "atom_id": torch.randperm(max(n, 1), generator=g)[:n] + 10**12,  # int64 [n]
        "positions": torch.randn(n, 3, generator=g, dtype=torch.float32),  # float32 [n, 3]
        "tags": torch.randint(-5, 5, (n, 3), generator=g, dtype=torch.int32),  # int32 [n, 3]
        "half": torch.randn(n, generator=g, dtype=torch.float32).to(torch.float16),  # 2 bytes [n]
        "masses": torch.rand(n, generator=g, dtype=torch.float64),  # float64 [n]
        "moments": torch.randn(n, 2, 3, generator=g, dtype=torch.float64),  # float64 [n, 2, 3]
        "bytes": torch.randint(0, 255, (n, 4), generator=g, dtype=torch.uint8),  # uint8 [n, 4]
    }


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a)


@pytest.mark.parametrize("n", ROWS)
def test_pack_unpack_any_dtype_mix_and_row_count(n):
    fields = mixed_fields(n)
    layout = layout_of(fields)
    buf = pack(fields, layout)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (n, layout.row_bytes)
    assert _same(unpack(buf, layout), fields)
    # every single row alone (a one-row message), also as a view into a larger buffer
    for r in range(n):
        one = {k: v[r:r + 1] for k, v in fields.items()}
        assert _same(unpack(pack(fields, layout, torch.tensor([r])), layout), one)
        assert _same(unpack(buf[r:r + 1], layout), one)
    # any subset of fields (each dtype first, last, alone)
    for drop in fields:
        part = {k: v for k, v in fields.items() if k != drop}
        lay = layout_of(part)
        assert _same(unpack(pack(part, lay), lay), part)


# ---------------------------------------------------------------------------- gloo ranks

STEPS = 120
DT = 1.0


def fixed_solid():
    """The hot 64-atom primitive FCC solid with every 5th atom (by id) fixed."""
    g = hot(primitive(), 2000.0)
    fixed = g.atom_id % 5 == 0
    return g.replace(fixed=fixed, velocities=torch.where(fixed[:, None], 0.0, g.velocities))


def _fixed_md(manager, rank):
    """Velocity Verlet on the owned atoms with fixed atoms, migrating after every step."""
    from xnn.distributed import parallelize
    from xnn.dynamics import nve

    pot = parallelize(lj(), manager, "halo", skin=0.5)
    graph = fixed_solid()
    state = nve.init(pot.scatter(graph if rank == 0 else None), pot, reduce=pot.reducer)
    for _ in range(STEPS):
        state = nve.step(state, pot, DT, reduce=pot.reducer)
        state = pot.maybe_migrate(state)
    full, extra = pot.gather(state.graph, {"forces": state.forces})
    out = {"stats": pot.stats()}
    if rank == 0:
        out.update(positions=full.positions, velocities=full.velocities, ids=full.atom_id,
                   fixed=full.fixed, forces=extra["forces"])
    return out


def chain(dtype):
    """Four atoms on a line in vacuum, 2.2 Å apart: split in two boxes of two atoms, each
    rank's halo (the 3 Å cutoff) reaches exactly one atom of the other box."""
    from xnn.data.graph import AtomicGraph

    x = torch.tensor([0.0, 2.2, 4.4, 6.6])
    pos = torch.stack([x, 0.1 * x.sin(), 0.05 * x.cos()], -1)
    return AtomicGraph.from_arrays(pos.numpy(), [29] * 4, torch.zeros(3, 3).numpy(),
                                   [False] * 3, atom_id=[2, 0, 3, 1], dtype=dtype)


def _one_ghost(manager, rank):
    """A float32 single point on the chain: energy, forces by id, ghost counts."""
    from xnn.distributed import parallelize

    pot = parallelize(lj(3.0, torch.float32), manager, "halo", grid=(2, 1, 1))
    graph = chain(torch.float32)
    owned = pot.scatter(graph if rank == 0 else None)
    res = pot(owned)
    _, extra = pot.gather(owned, {"forces": res["forces"]})
    out = {"stats": pot.stats()}
    if rank == 0:
        out.update(energy=res["energy"], forces=extra["forces"])
    return out


def _single_rows(rank):
    """Each rank sends the other 0, 1 and 2 rows of mixed fields; returns what arrived."""
    from xnn.distributed.domain.transport import exchange_packed

    got = {}
    for n in (0, 1, 2):
        fields = mixed_fields(n, seed=rank)
        layout = layout_of(fields)
        buf, = exchange_packed([1 - rank], [pack(fields, layout)], layout, None)
        got[n] = unpack(buf, layout)
    return got


def worker(rank, world):
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    out = {}
    for name, case in (("rows", lambda: _single_rows(rank)),
                       ("one_ghost", lambda: _one_ghost(manager, rank)),
                       ("fixed_md", lambda: _fixed_md(manager, rank))):
        try:
            out[name] = case()
        except Exception as e:  # report which case failed, keep the ranks in step
            out[name] = f"{type(e).__name__}: {e}"
            break
    return out


_CACHE: list = []


def results():
    if not _CACHE:
        _CACHE.append(spawn(worker, 2, timeout_s=240))
    return _CACHE[0]


def _case(name):
    res = [r.get(name, "not run: an earlier case failed") for r in results()]
    for r in res:
        assert not isinstance(r, str), f"{name}: {r}"
    return res


@pytest.mark.distributed
def test_single_row_messages_of_mixed_dtypes_between_ranks():
    res = _case("rows")
    for rank, got in enumerate(res):
        for n in (0, 1, 2):
            assert _same(got[n], mixed_fields(n, seed=1 - rank)), (rank, n)


@pytest.mark.distributed
def test_float32_rank_receiving_exactly_one_ghost():
    from xnn.models import Potential

    res = _case("one_ghost")
    assert [r["stats"]["n_ghost"] for r in res] == [1, 1]
    assert [r["stats"]["n_owned"] for r in res] == [2, 2]
    graph = chain(torch.float64)
    ref = Potential(lj(3.0))(graph)
    order = torch.argsort(graph.atom_id)
    r = res[0]
    assert r["energy"].dtype == torch.float32 and r["forces"].dtype == torch.float32
    assert _rel(r["energy"].double(), ref["energy"]) < 1e-5
    assert _rel(r["forces"].double(), ref["forces"][order]) < 1e-5


@pytest.mark.distributed
def test_md_with_fixed_atoms_through_migrations_matches_one_process():
    from xnn.dynamics import nve
    from xnn.models import Potential

    res = _case("fixed_md")
    stats = [r["stats"] for r in res]
    assert all(s["migrations"] > 0 for s in stats), stats
    assert sum(s["migrated_out"] for s in stats) > 0, stats
    graph = fixed_solid()
    pot = Potential(lj(), skin=0.5)
    state = nve.init(graph, pot)
    for _ in range(STEPS):
        state = nve.step(state, pot, DT)
    order = torch.argsort(graph.atom_id)
    ref = state.graph.select_atoms(order)
    r = res[0]
    assert torch.equal(r["ids"], ref.atom_id)
    assert torch.equal(r["fixed"], ref.fixed) and int(r["fixed"].sum()) == 13
    start = graph.positions[order]
    assert torch.equal(r["positions"][r["fixed"]], start[ref.fixed])  # fixed atoms stayed
    assert _rel(r["positions"] - start, ref.positions - start) <= TOL
    assert _rel(r["velocities"], ref.velocities) <= TOL
    assert _rel(r["forces"], state.forces[order]) <= TOL
