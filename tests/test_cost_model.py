"""The step-cost model (xnn.distributed.cost): its counts of what one decomposed MD step
communicates equal what real gloo ranks exchange (instrumented with CollectiveTally), and
its composition and fits do the arithmetic they state. No timing is asserted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import spawn

from xnn.distributed.cost.counts import RankCounts, staged_messages, staged_messages_uniform
from xnn.distributed.cost.links import IB_NDR400, Link, fit_link
from xnn.distributed.cost.model import (
    ALL_REDUCE_BYTES,
    ALL_REDUCES_PER_STEP,
    TRAIN_ALL_REDUCE_BYTES,
    ComputeCost,
    ModelShape,
    Output,
    Rebuild,
    StepTime,
    all_reduces_per_step,
    efficiency,
    exchange_bytes,
    exchanges_per_step,
    gather_bytes,
    md_step,
    training_step,
)

CASES = (("lj", "halo"), ("schnet", "sync"), ("schnet", "graph"))


def _model(name):
    from xnn.models import build

    torch.manual_seed(0)
    if name == "lj":
        return build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0).double().eval()
    return build("schnet", species=[18], cutoff=4.5, num_interactions=2, num_features=8,
                 num_filters=8, num_basis=8).double().eval()


def _crystal():
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((4, 4, 2))
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   dtype=torch.float64)


def _rank_main(rank, world):
    from xnn.distributed import DistributedManager, parallelize
    from xnn.distributed.cost.tally import CollectiveTally
    from xnn.distributed.graph.auto import feature_size
    from xnn.dynamics import nve
    from xnn.dynamics.state import maxwell_boltzmann

    manager = DistributedManager.initialize(device="cpu")
    out = {}
    for name, mode in CASES:
        model = _model(name)
        pot = parallelize(model, manager, mode, skin=1.0)
        owned = pot.scatter(_crystal() if manager.is_main else None)
        state = nve.init(maxwell_boltzmann(owned, 40.0, seed=1, reduce=pot.reducer), pot,
                         reduce=pot.reducer)
        steps = []
        with CollectiveTally() as tally:
            for _ in range(3):
                c0, mark = pot.state.counters, tally.mark()
                state = nve.step(state, pot, 1.0, reduce=pot.reducer)
                state = pot.maybe_migrate(state)
                c1 = pot.state.counters
                quiet = c1.rebuilds == c0.rebuilds and c1.migrations == c0.migrations
                calls = tally.calls(since=mark)
                steps.append({"quiet": quiet, "calls": [(c.kind, c.bytes_sent, c.bytes_recv,
                                                         c.messages) for c in calls]})
        train = None
        if mode != "graph":  # one force-training evaluation: forward + double backward
            with CollectiveTally() as tally:
                res = pot(state.graph, training=True)
                ((res["forces"] ** 2).sum() + res["energy"].sum() / world).backward()
            train = [(c.kind, c.bytes_sent, c.bytes_recv, c.messages) for c in tally.log]
        st = pot.stats(count_within=True)
        whole, _ = pot.gather(state.graph)
        pairs = None
        if manager.is_main:  # directed pairs within the model's cutoff, by ASE
            from ase import Atoms
            from ase.neighborlist import neighbor_list

            atoms = Atoms(numbers=whole.numbers.numpy(), positions=whole.positions.numpy(),
                          cell=whole.cell[0].numpy(), pbc=whole.pbc[0].numpy())
            pairs = len(neighbor_list("i", atoms, float(model.cutoff)))
        out[(name, mode)] = {"steps": steps, "stats": st, "n_total": pot.n_total, "train": train,
                             "pairs_within": pairs,
                             "sync_points": len(list(model.sync_points)) if mode != "halo"
                             else 0, "width": feature_size(model)}
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_rank_main, 2, timeout_s=600)


def _counts(per_rank, mode):
    st = [r["stats"] for r in per_rank]
    arr = lambda k: np.array([s[k] for s in st], dtype=np.int64)  # noqa: E731
    return RankCounts(mode=mode, grid=(2, 1, 1), halo_width=0.0, owned=arr("n_owned"),
                      ghost=arr("n_ghost"), edges=arr("n_edges"), send_rows=arr("n_send"),
                      recv_rows=arr("n_recv"), peers=arr("n_peers"))


def _quiet_steps(res):
    steps = [s["calls"] for s in res["steps"] if s["quiet"]]
    assert len(steps) >= 2  # rebuilds and migrations are priced apart: count quiet steps
    return steps


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES[:2])
def test_spatial_counts_equal_the_exchanges_of_real_ranks(ranks, case):
    """Halo and sync modes, per quiet step (no rebuild, no migration) and rank: the model's
    all-reduces (count and bytes) and its exchanged messages and bytes, from the ranks'
    counts, equal the instrumented calls of the real run."""
    per_rank = [r[case] for r in ranks]
    counts = _counts(per_rank, case[1])
    shape = ModelShape(per_rank[0]["sync_points"], per_rank[0]["width"], 8)
    assert shape.sync_points == (0 if case[1] == "halo" else 1)
    messages, sent, received = exchange_bytes(counts, shape)
    for r, res in enumerate(per_rank):
        for calls in _quiet_steps(res):
            reduces = [c for c in calls if c[0] == "all_reduce"]
            assert len(reduces) == all_reduces_per_step(case[1]) == ALL_REDUCES_PER_STEP
            assert sorted(c[1] for c in reduces) == sorted(ALL_REDUCE_BYTES[case[1]])
            moved = [c for c in calls if c[0] == "p2p"]
            assert len(moved) == len(exchanges_per_step(case[1], shape))
            assert sum(c[3] for c in moved) == messages[r]
            assert sum(c[1] for c in moved) == sent[r]
            assert sum(c[2] for c in moved) == received[r]
            assert not [c for c in calls if c[0] in ("all_gather", "object")]


@pytest.mark.distributed
def test_edges_within_the_cutoff_add_up_to_the_systems_pairs(ranks):
    """Mode sync lists the edges of owned receivers only: over the ranks, the edges shorter
    than the model's cutoff at the last evaluation (the cost model's edge count) are the
    system's directed pairs within the cutoff, as ASE counts them at the same positions;
    the Verlet list holds more (its skin)."""
    per_rank = [r[("schnet", "sync")] for r in ranks]
    within = sum(r["stats"]["n_edges_within"] for r in per_rank)
    assert within == per_rank[0]["pairs_within"] > 0
    assert sum(r["stats"]["n_edges"] for r in per_rank) > within


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES[:2])
def test_training_step_exchanges_twice_what_md_does(ranks, case):
    """A force-training evaluation (forward and double backward) of real ranks: every
    exchange of the MD step runs twice more (the model's training exchange factor 2), and
    four scalar all-reduces (the MD step's three and the energy's adjoint)."""
    per_rank = [r[case] for r in ranks]
    counts = _counts(per_rank, case[1])
    shape = ModelShape(per_rank[0]["sync_points"], per_rank[0]["width"], 8)
    messages, sent, received = exchange_bytes(counts, shape)
    for r, res in enumerate(per_rank):
        moved = [c for c in res["train"] if c[0] == "p2p"]
        assert sum(c[3] for c in moved) == 2 * messages[r]
        assert sum(c[1] for c in moved) == 2 * sent[r]
        assert sum(c[2] for c in moved) == 2 * received[r]
        reduces = [c for c in res["train"] if c[0] == "all_reduce"]
        assert sorted(c[1] for c in reduces) == sorted(TRAIN_ALL_REDUCE_BYTES)


@pytest.mark.distributed
def test_graph_counts_equal_the_gathers_of_real_ranks(ranks):
    """Mode graph, per quiet step and rank: one all-gather per sync point and one for the
    positions, of the largest rank's rows padded; their backward on gloo is an all-reduce of
    the whole gathered tensor; and the scalar all-reduces lack the migration check."""
    per_rank = [r[("schnet", "graph")] for r in ranks]
    counts = _counts(per_rank, "graph")
    shape = ModelShape(per_rank[0]["sync_points"], per_rank[0]["width"], 8)
    gathers = gather_bytes(counts, shape)
    p = counts.n_ranks
    for res in per_rank:
        for calls in _quiet_steps(res):
            got = [c for c in calls if c[0] == "all_gather"]
            assert sorted(c[1] for c in got) == sorted(part for part, _ in gathers)
            assert sorted(c[2] for c in got) == sorted((p - 1) * part for part, _ in gathers)
            reduces = [c[1] for c in calls if c[0] == "all_reduce"]
            scalars = sorted(ALL_REDUCE_BYTES["graph"])
            assert sorted(reduces) == sorted(scalars + [whole for _, whole in gathers])
            assert len(reduces) - len(gathers) == all_reduces_per_step("graph")
            assert not [c for c in calls if c[0] == "p2p"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES[:2])
def test_lattice_counts_of_the_predictions_equal_the_real_decomposition(ranks, case):
    """The counts the predictions use where no at-scale plan row exists (an exact count of
    the perfect lattice in each box and its halo, on the project's grid) equal what the real
    2-rank run held: owned, ghost, rows sent and received, peers and (Verlet) edges."""
    from benchmarks.scaling_model import lattice_counts

    per_rank = [r[case] for r in ranks]
    real = _counts(per_rank, case[1])
    cutoff = 6.0 if case[0] == "lj" else 4.5
    grid = per_rank[0]["stats"]["grid"]
    c = lattice_counts((4, 4, 2), 5.26, 2, case[1], cutoff, 1.0, 1, grid=grid,
                       edge_cutoff=cutoff + 1.0)
    for key in ("owned", "ghost", "send_rows", "recv_rows", "peers", "edges"):
        np.testing.assert_array_equal(getattr(c, key), getattr(real, key), err_msg=key)


# ----------------------------------------------------------------------- the arithmetic


def _toy_counts(mode="halo"):
    return RankCounts(mode=mode, grid=(3, 1, 1), halo_width=7.0,
                      owned=np.array([100, 120, 80]), ghost=np.array([40, 50, 30]),
                      edges=np.array([2000, 2600, 1500]), send_rows=np.array([30, 45, 35]),
                      recv_rows=np.array([40, 50, 30]), peers=np.array([2, 2, 1]))


LINK = Link("toy", latency_s=1e-5, bandwidth=1e9, allreduce_latency_s=2e-5,
            bus_bandwidth=2e9, source="test")


def test_md_step_composes_compute_exchange_rebuild_and_reductions():
    counts = _toy_counts("sync")
    comp = ComputeCost(per_atom=1e-6, per_edge=1e-7, fixed=1e-4)
    shape = ModelShape(sync_points=2, feature_width=16, dtype_bytes=4)
    reb = Rebuild(per_atom=1e-5, interval=10)
    t = md_step(counts, comp, shape, LINK, rebuild=reb)
    held = counts.owned + counts.ghost
    np.testing.assert_allclose(t.compute, 1e-4 + 1e-6 * held + 1e-7 * counts.edges)
    # 2 exchanges of positions (3 numbers) and 2 per sync point (16 numbers)
    row_bytes = (2 * 3 + 2 * 2 * 16) * 4
    exch = (6 * counts.peers * LINK.latency_s
            + np.maximum(counts.send_rows, counts.recv_rows) * row_bytes / LINK.bandwidth)
    np.testing.assert_allclose(t.exchange, exch)
    np.testing.assert_allclose(t.rebuild, 1e-5 * held / 10)
    nbytes = np.mean(ALL_REDUCE_BYTES["sync"])
    red = ALL_REDUCES_PER_STEP * (LINK.allreduce_latency_s * np.log2(3)
                                  + 2 * 2 / 3 * nbytes / LINK.bus_bandwidth)
    assert t.reduction == pytest.approx(red)
    per_rank = t.compute + t.exchange + t.rebuild
    assert t.total == pytest.approx(per_rank.max() + red)
    assert t.slowest == int(np.argmax(per_rank)) == 1
    assert sum(v for k, v in t.split().items() if k != "total") == pytest.approx(t.total)


def test_staged_exchange_prices_the_stages_messages_and_the_same_rows():
    """parallel.exchange=staged: latency of the stages' messages, bytes of the same rows."""
    import dataclasses

    counts = dataclasses.replace(_toy_counts("sync"), staged_peers=np.array([1, 2, 1]))
    comp = ComputeCost(per_atom=1e-6, per_edge=1e-7, fixed=1e-4)
    shape = ModelShape(sync_points=2, feature_width=16, dtype_bytes=4)
    direct = md_step(counts, comp, shape, LINK)
    staged = md_step(counts, comp, shape, LINK, exchange="staged")
    np.testing.assert_allclose(direct.exchange - staged.exchange,
                               6 * (counts.peers - counts.staged_peers) * LINK.latency_s)
    np.testing.assert_array_equal(staged.compute, direct.compute)
    assert exchange_bytes(counts, shape, "staged")[0].tolist() == [6, 12, 6]
    with pytest.raises(ValueError, match="staged_peers"):
        md_step(_toy_counts("sync"), comp, shape, LINK, exchange="staged")


def _grid_peers(grid, reach):
    """Every rank's peers on a periodic grid of equal boxes whose halo reaches ``reach``
    boxes per axis (the ranks at those wrapped offsets)."""
    import itertools

    n = int(np.prod(grid))
    out = []
    for r in range(n):
        c = (r // (grid[1] * grid[2]), (r // grid[2]) % grid[1], r % grid[2])
        near = set()
        for d in itertools.product(*(range(-k, k + 1) for k in reach)):
            q = [(c[a] + d[a]) % grid[a] for a in range(3)]
            near.add((q[0] * grid[1] + q[1]) * grid[2] + q[2])
        out.append(sorted(near - {r}))
    return out


@pytest.mark.parametrize("grid,reach", [((8, 8, 8), (1, 1, 1)), ((2, 2, 2), (1, 1, 1)),
                                        ((4, 2, 1), (2, 1, 1)), ((6, 3, 5), (2, 1, 3)),
                                        ((4, 4, 1), (1, 3, 1))])
def test_staged_messages_of_a_uniform_grid(grid, reach):
    """The routing run on ranks (staged_messages) gives every rank of a periodic grid of
    equal boxes the closed form (2 per hop of an axis of more than 2 boxes, 1 on a tie or
    an axis of 2, none along an axis of 1), e.g. 6 on 8x8x8 against 26 peers."""
    peers = _grid_peers(grid, reach)
    sim = staged_messages(grid, [True] * 3, peers)
    assert (sim == staged_messages_uniform(grid, reach)).all(), sim
    if grid == (8, 8, 8):
        assert sim[0] == 6 and len(peers[0]) == 26
    if grid == (2, 2, 2):
        assert sim[0] == 3 and len(peers[0]) == 7


def test_staged_messages_of_a_non_periodic_axis():
    """Along a non-periodic axis of 4 boxes the end boxes talk to one side only."""
    peers = [[q for q in range(4) if 0 < abs(q - r) <= 1] for r in range(4)]
    assert staged_messages((4, 1, 1), [False, True, True], peers).tolist() == [1, 2, 2, 1]


def test_halo_mode_exchanges_positions_only_and_graph_mode_gathers():
    comp = ComputeCost(1e-6, 1e-7)
    shape = ModelShape(sync_points=2, feature_width=16, dtype_bytes=4)
    halo = md_step(_toy_counts("halo"), comp, shape, LINK)
    sync = md_step(_toy_counts("sync"), comp, shape, LINK)
    assert (sync.exchange > halo.exchange).all()
    c = _toy_counts("graph")
    g = md_step(c, comp, shape, LINK)
    part = c.owned.max() * 4
    want = sum(2 * LINK.allgather(part * w, 3) for w in (3, 16, 16))
    np.testing.assert_allclose(g.exchange, want)
    gloo = Link("gloo-toy", 1e-5, 1e9, 2e-5, 2e9, "test", reduce_scatter=False)
    g = md_step(c, comp, shape, gloo)
    want = sum(gloo.allgather(part * w, 3) + gloo.allreduce(3 * part * w, 3)
               for w in (3, 16, 16))
    np.testing.assert_allclose(g.exchange, want)
    assert g.reduction == pytest.approx(3 * gloo.allreduce(np.mean(ALL_REDUCE_BYTES["graph"]), 3))


def test_training_step_adds_the_gradient_all_reduce_over_the_mesh():
    counts = _toy_counts("sync")
    comp = ComputeCost(1e-6, 1e-7)
    shape = ModelShape(2, 16, 4, n_params=1_000_000)
    md = md_step(counts, comp, shape, IB_NDR400)
    tr = training_step(counts, comp, shape, IB_NDR400, dp=4, train_factor=3.0)
    np.testing.assert_allclose(tr.compute, 3 * md.compute)
    np.testing.assert_allclose(tr.exchange, 2 * md.exchange)
    scalars = len(TRAIN_ALL_REDUCE_BYTES) * IB_NDR400.allreduce(np.mean(TRAIN_ALL_REDUCE_BYTES), 3)
    assert tr.reduction == pytest.approx(scalars + IB_NDR400.allreduce(4e6, 12))


def test_compute_fit_recovers_per_atom_and_per_edge_costs():
    held = np.array([1000, 8000, 30000, 1000, 8000, 30000])
    edges = np.array([40, 40, 40, 25, 25, 25]) * held  # two lattice scales
    t = 2e-3 + 3e-7 * held + 5e-8 * edges
    fit = ComputeCost.fit(held, edges, t)
    assert fit.per_atom == pytest.approx(3e-7, rel=1e-6)
    assert fit.per_edge == pytest.approx(5e-8, rel=1e-6)
    assert fit.fixed == pytest.approx(2e-3, rel=1e-6)
    # one edges-per-atom ratio: the cost goes on the edges and reproduces the points
    one = ComputeCost.fit(held[:3], edges[:3], t[:3])
    assert one.per_atom == 0.0
    np.testing.assert_allclose(one.seconds(held[:3], edges[:3]), t[:3], rtol=1e-9)


def test_compute_fit_separates_owned_from_ghost_atoms_with_sizes_of_other_ghost_shares():
    # 1-rank rows of three sizes: periodic-image ghosts are 5.6, 3 and 2 times the owned
    owned = np.array([256, 864, 2048, 256, 864, 2048])
    held = owned * np.array([6.6, 4.0, 3.0, 6.6, 4.0, 3.0])
    edges = owned * np.array([78, 78, 78, 54, 54, 54])
    t = 1e-2 + 2e-5 * held + 1.2e-3 * owned + 3e-7 * edges
    fit = ComputeCost.fit(held, edges, t, owned=owned)
    assert fit.per_owned == pytest.approx(1.2e-3, rel=1e-6)
    assert fit.per_atom == pytest.approx(2e-5, rel=1e-6)
    assert fit.per_edge == pytest.approx(3e-7, rel=1e-6)
    # a rank of a decomposition: few owned, many ghosts
    assert float(fit.seconds(1687, 19968, 256)) == pytest.approx(
        1e-2 + 2e-5 * 1687 + 1.2e-3 * 256 + 3e-7 * 19968)
    # one size only: the owned share is fixed, so the atom cost stays on the held atoms
    one = ComputeCost.fit(held[::3], edges[::3], t[::3], owned=owned[::3])
    assert one.per_owned == 0.0


def test_compute_fit_of_one_size_has_no_fixed_cost():
    # two 1-rank rows of one system at two lattice scales with the same edges within the
    # cutoff (and noise between them): nothing separates a fixed cost from the edges', and a
    # fixed cost would price a rank with half the edges at the whole system's time
    held, edges, t = np.array([3429, 3429]), np.array([36294, 36288]), np.array([1.16, 1.32])
    fit = ComputeCost.fit(held, edges, t, owned=np.array([864, 864]))
    assert fit.fixed == 0.0 and fit.per_edge > 0.0
    half = float(fit.seconds(2346, 18144, 432)) / float(fit.seconds(3429, 36291, 864))
    assert 0.4 < half < 0.8


def test_link_fit_recovers_latency_and_bandwidth():
    msgs = [(1, 1_000), (2, 50_000), (1, 400_000), (3, 2_000_000)]
    p2p = [(m, b, m * 5e-5 + b / 2e9) for m, b in msgs]
    ar = [(2, 8, 1e-4), (4, 8, 2e-4), (8, 8, 3e-4)]
    got = fit_link(LINK, p2p, ar, name="fitted")
    assert got.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert got.bandwidth == pytest.approx(2e9, rel=1e-6)
    assert got.allreduce_latency_s == pytest.approx(1e-4)
    assert got.name == "fitted"


def test_efficiency_is_the_time_ratio():
    a = StepTime(np.array([1.0]), np.array([0.0]), np.array([0.0]), 0.0)
    b = StepTime(np.array([1.0, 1.1]), np.array([0.1, 0.2]), np.zeros(2), 0.05)
    assert efficiency(b, a) == pytest.approx(1.0 / 1.35)
    assert efficiency(b, a, scale=0.5) == pytest.approx(0.5 / 1.35)


def test_output_term_prices_sharded_writes_per_rank_and_gathered_writes_on_every_rank():
    counts = _toy_counts("halo")
    comp = ComputeCost(1e-6, 1e-7)
    shape = ModelShape(0, 3, 8)
    sharded = Output(bytes_per_atom=100.0, write_bandwidth=1e6, every=10)
    gathered = Output(100.0, 1e6, 10, sharded=False, gather_bandwidth=2e6)
    np.testing.assert_allclose(sharded.seconds(counts.owned), counts.owned * 100 / 1e6 / 10)
    n = counts.owned.sum()
    np.testing.assert_allclose(gathered.seconds(counts.owned),
                               (n * 100 / 2e6 + n * 100 / 1e6) / 10)
    bare = md_step(counts, comp, shape, LINK)
    t = md_step(counts, comp, shape, LINK, output=sharded)
    per_rank = t.compute + t.exchange + t.rebuild + sharded.seconds(counts.owned)
    assert t.total == pytest.approx(per_rank.max() + t.reduction)
    assert t.split()["output"] == pytest.approx(sharded.seconds(counts.owned)[t.slowest])
    assert bare.split()["output"] == 0.0
    assert md_step(counts, comp, shape, LINK, output=gathered).total > t.total


def test_graph_predictions_price_the_same_edges_from_a_plan_row_or_the_lattice():
    """Graph mode from an at-scale plan row and from the lattice count: the same owned atoms
    per rank and the same compute edges (owned receivers' edges within the model's cutoff,
    as in the spatial modes), though the plan row counts the Verlet list's reach."""
    from benchmarks.ghost_plan_scale import CUTOFF, WIDTHS, row
    from benchmarks.scaling_model import PLAN_LATTICE, lattice_counts, plan_counts_from_json

    r = row("strong", "fcc", 4000, 8, "graph")
    planned = plan_counts_from_json([r], r["n_atoms"], 8, "graph", CUTOFF, WIDTHS["graph"],
                                    PLAN_LATTICE)
    k = round((r["n_atoms"] / 4) ** (1 / 3))
    assert 4 * k ** 3 == r["n_atoms"]
    lattice = lattice_counts(k, PLAN_LATTICE, 8, "graph", CUTOFF, 1.0, 2)
    assert planned.owned.sum() == lattice.owned.sum() == r["n_atoms"]
    assert planned.edges.max() == lattice.edges.max() < r["edges_max"]
    assert sorted(planned.edges) == sorted(lattice.edges)
