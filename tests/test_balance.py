"""Load-balanced boxes (``parallel.balance: shift``, issue 47): per-axis cuts at atom-count
quantiles give the numbers of one process, follow the atoms through MD with migration, and
even out the owned atoms where equal widths leave boxes nearly empty.

One set of 4 gloo ranks is spawned for the module (sub-group of 3 for the rod); fp64, LJ with
a 5 Å cutoff and a 0.5 Å skin (halo 5.5 Å).
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import spawn
from helpers import hot, lj, rel, rod, vacuum_slab

from xnn.distributed.domain.partition import make_partition
from xnn.errors import InputError

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

SKIN, CUTOFF, TOL = 0.5, 5.0, 1e-10
STEPS, DT = 30, 1.0
#: name -> (structure, grid, ranks): equal widths are clearly imbalanced in each
CASES = {"slab": (vacuum_slab, (1, 1, 4), 4),
         "sheared_slab": (lambda: vacuum_slab(shear=True), (1, 1, 4), 4),
         "slab_auto_grid": (vacuum_slab, None, 4),
         "rod": (lambda: rod(11.0), (3, 1, 1), 3)}


def _ratio(owned) -> float:
    owned = torch.tensor(owned, dtype=torch.float64)
    return float(owned.max() / owned.mean())


def _single_points(manager, group, rank):
    from xnn.models import Potential
    from xnn.testing.decomposition import compare_by_id, decomposed

    out = {}
    for name, (make, grid, p) in CASES.items():
        if rank >= p:
            continue
        graph = make()
        for balance in ("none", "shift"):
            pot = decomposed(lj(CUTOFF), group[p], "halo", graph if rank == 0 else None,
                             grid=grid, skin=SKIN, balance=balance)
            res = pot.single_point(graph if rank == 0 else None)
            cuts = pot.state.partition.cuts
            row = {"n_owned": pot.stats()["n_owned"], "grid": pot.grid,
                   "cuts": None if cuts is None else [c.tolist() for c in cuts]}
            if rank == 0:
                row["errors"] = compare_by_id(res, Potential(lj(CUTOFF))(graph), graph)
            out[(name, balance)] = row
    return out


def _md(manager, rank):
    """NVE of a hot slab in vacuum on 4 balanced ranks, migrating after every step."""
    from xnn.distributed import parallelize
    from xnn.dynamics import nve

    pot = parallelize(lj(CUTOFF), manager, "halo", grid=(1, 1, 4), skin=SKIN,
                      balance="shift")
    graph = hot(vacuum_slab(), 3000.0)
    state = nve.init(pot.scatter(graph if rank == 0 else None), pot, reduce=pot.reducer)
    cuts = [pot.state.partition.cuts[2].tolist()]
    for _ in range(STEPS):
        state = nve.step(state, pot, DT, reduce=pot.reducer)
        state = pot.maybe_migrate(state)
        cuts.append(pot.state.partition.cuts[2].tolist())
    full, _ = pot.gather(state.graph)
    out = {"stats": pot.stats(), "cuts": cuts}
    if rank == 0:
        out.update(positions=full.positions, velocities=full.velocities, ids=full.atom_id)
    return out


#: the cost plan's case: a rod of the plan's systems whose equal-width middle box is fullest
PLAN = {"system": "cylinder", "n_atoms": 5000, "grid": (3, 1, 1), "mode": "sync",
        "cutoff": 5.0, "skin": 1.0}
PLAN_NAMES = ("owned", "ghost", "edges", "send_rows", "recv_rows", "peers")


def _plan_run(group, rank):
    """What the ranks' ghost plans hold for :data:`PLAN` (a 2-interaction SchNet in mode
    sync: halo 6 Å), balanced and not."""
    from xnn.data.graph import AtomicGraph
    from xnn.distributed.cost.systems import make_system
    from xnn.distributed.domain.layout import SpatialLayout
    from xnn.distributed.potential import DecomposedPotential
    from xnn.models.schnet import SchNet

    if rank >= 3:
        return None
    pos, cell, pbc = make_system(PLAN["system"], PLAN["n_atoms"]).build()
    graph = AtomicGraph.from_arrays(pos, torch.full((pos.shape[0],), 29), cell, pbc)
    torch.manual_seed(0)
    model = SchNet([29], cutoff=PLAN["cutoff"], num_features=4, num_filters=4,
                   num_interactions=2, num_basis=4).double().train()
    out = {}
    for balance in ("none", "shift"):
        layout = SpatialLayout(PLAN["mode"], PLAN["grid"], balance)
        pot = DecomposedPotential(model, group, layout, skin=PLAN["skin"])
        pot.scatter(graph if rank == 0 else None)
        st, dom = pot.stats(), pot.state.local
        out[balance] = (st["n_owned"], st["n_ghost"], dom.n_within, st["n_send"],
                        st["n_recv"], st["n_peers"], pot.halo_width)
    return out


def _worker(rank, world):
    import torch.distributed as dist

    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=300, device="cpu")
    group = {3: dist.new_group([0, 1, 2]), 4: None}
    return {"single": _single_points(manager, group, rank), "md": _md(manager, rank),
            "plan": _plan_run(group[3], rank)}


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, 4, timeout_s=600.0)


@pytest.mark.parametrize("name", list(CASES))
def test_balanced_boxes_equal_one_process(ranks, name):
    """Energy, per-atom energies, forces by atom id and stress (virial for the rod) of
    balanced boxes equal one process to fp64 round-off, on a slab in vacuum (orthogonal and
    sheared cell), the same with the grid chosen, and a rod in vacuum (non-periodic x, y)."""
    for balance in ("none", "shift"):
        errors = ranks[0]["single"][(name, balance)]["errors"]
        assert errors["ids"], (name, balance)
        for q in ("energy", "energies", "forces", "stress", "virial"):
            if q in errors:
                assert errors[q] <= TOL, (name, balance, q, errors[q])


@pytest.mark.parametrize("name", list(CASES))
def test_balance_evens_out_the_owned_atoms(ranks, name):
    """The fullest box's share drops: max/mean owned atoms under equal widths is clearly
    above 1 (vacuum or a rod's thin rims), with shift within 5 % of even; every rank saw
    the same cuts, and no box is thinner than the halo width."""
    p = CASES[name][2]
    rows = {b: [ranks[r]["single"][(name, b)] for r in range(p)] for b in ("none", "shift")}
    equal = _ratio([row["n_owned"] for row in rows["none"]])
    shift = _ratio([row["n_owned"] for row in rows["shift"]])
    assert equal > 1.2 and shift < 1.05, (name, equal, shift)
    assert rows["none"][0]["cuts"] is None
    cuts = rows["shift"][0]["cuts"]
    assert all(row["cuts"] == cuts for row in rows["shift"])  # bitwise the same on all ranks
    graph = CASES[name][0]()
    part = make_partition(graph.positions, graph.cell[0], graph.pbc[0], p, CUTOFF + SKIN,
                          rows["shift"][0]["grid"], "shift")
    for a, c in enumerate(cuts):
        widths = torch.diff(torch.tensor(c)) * part.heights[a]
        assert bool((widths >= (CUTOFF + SKIN) * (1 - 1e-9)).all()) or len(c) == 2, (a, c)
    # the scatter (rank 0, one process) cut the same planes as the ranks' all-reduced counts
    assert [x.tolist() for x in part.cuts] == cuts


def test_balanced_md_with_migration_equals_one_process(ranks):
    """A hot slab in vacuum, NVE with migration after every step on 4 balanced boxes: final
    positions and velocities equal one process by id; atoms migrated and the cuts moved
    with them (recomputed at every rebuild)."""
    from xnn.dynamics import nve
    from xnn.models import Potential

    pot = Potential(lj(CUTOFF), skin=SKIN)
    graph = hot(vacuum_slab(), 3000.0)
    state = nve.init(graph, pot)
    for _ in range(STEPS):
        state = nve.step(state, pot, DT)
    order = torch.argsort(state.graph.atom_id)
    md = ranks[0]["md"]
    assert torch.equal(md["ids"], state.graph.atom_id[order])
    assert rel(md["positions"], state.graph.positions[order]) < TOL
    assert rel(md["velocities"], state.graph.velocities[order]) < TOL
    stats = [ranks[r]["md"]["stats"] for r in range(4)]
    assert sum(s["migrated_out"] for s in stats) > 0 and stats[0]["rebuilds"] > 1
    assert len({tuple(c) for c in md["cuts"]}) > 1  # the cuts followed the atoms
    assert all(ranks[r]["md"]["cuts"] == md["cuts"] for r in range(4))


def test_balance_words_are_checked():
    from xnn.distributed import parallelize

    graph = vacuum_slab()
    with pytest.raises(InputError, match="balance must be one of"):
        make_partition(graph.positions, graph.cell[0], graph.pbc[0], 4, 5.5, None, "even")
    with pytest.raises(InputError, match="balance must be one of"):
        parallelize(lj(CUTOFF), None, "halo", balance="rcb")
    with pytest.raises(InputError, match="has none: set balance none"):
        parallelize(lj(CUTOFF), None, "graph", balance="shift")
    from xnn.distributed.cost.plan import plan_counts

    with pytest.raises(InputError, match="mode graph has none"):
        plan_counts("fcc", 1000, 2, mode="graph", cutoff=5.0, halo_width=6.0,
                    balance="shift")


def test_cost_plan_with_balance_equals_the_balanced_run(ranks):
    """The cost plan with balance shift (the same cut function on the streamed or factored
    histograms) gives every rank's owned, ghost, edge, sent, received and peer counts of
    the balanced run, exactly; and balancing moved atoms out of the full middle box."""
    from xnn.distributed.cost.plan import plan_counts

    for balance in ("none", "shift"):
        rows = [ranks[r]["plan"][balance] for r in range(3)]
        for stream in (False, True):
            plan = plan_counts(PLAN["system"], PLAN["n_atoms"], 3, mode=PLAN["mode"],
                               cutoff=PLAN["cutoff"], halo_width=rows[0][6],
                               grid=PLAN["grid"], balance=balance, stream=stream)
            for k, name in enumerate(PLAN_NAMES):
                got, want = getattr(plan, name).tolist(), [row[k] for row in rows]
                assert got == want, (balance, stream, name, got, want)
    owned = {b: [ranks[r]["plan"][b][0] for r in range(3)] for b in ("none", "shift")}
    assert max(owned["shift"]) < 0.9 * max(owned["none"]), owned
