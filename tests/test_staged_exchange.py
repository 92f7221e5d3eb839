"""The staged halo exchange (``parallel.exchange=staged``) against the direct one and one
process: gloo ranks on CPU, fp64.

One set of 8 ranks is spawned for the module, with sub-groups of 2 and 4 (world ranks 0-1 and
0-3) and of 3 (world ranks 5-7: group ranks that are not world ranks). Every case runs
direct and staged on the same structure: energies, forces by atom id and stress/virial
equal one process to 1e-10 relative; the staged forward exchange gives the direct one's
ghost rows bit for bit; its reverse is its adjoint (``<F(x), g> == <x, R(g)>``); and the
point-to-point messages of one exchange, counted by
:class:`~xnn.distributed.cost.tally.CollectiveTally`, are at most 2 per stage, with one
stage per axis of more than one box and box-width of halo.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import spawn
from helpers import corner, hot, lj, molecule, native, rel, slab, tiny, triclinic

from xnn.distributed.cost.counts import staged_messages
from xnn.errors import InputError
from xnn.testing import compare_by_id

TOL = 1e-10

# (group size, model, structure, grid, mode[, balance])
CASES = {
    "lj-triclinic-2x1x1": (2, "lj", "triclinic", (2, 1, 1), "halo"),
    "equivariant-triclinic-2-sync": (2, "equivariant", "triclinic", None, "sync"),
    # 3 boxes along a periodic axis: the -1 and +1 boxes differ, no tie
    "lj-triclinic-3x1x1": (3, "lj", "triclinic", (3, 1, 1), "halo"),
    "lj-corner-1x1x4": (4, "lj", "corner", (1, 1, 4), "halo"),
    "lj-triclinic-4x1x1": (4, "lj", "triclinic", (4, 1, 1), "halo"),
    "painn-triclinic-2x2x1-sync": (4, "painn", "triclinic", (2, 2, 1), "sync"),
    "lj-triclinic-2x2x2": (8, "lj", "triclinic", (2, 2, 2), "halo"),
    "lj-triclinic-4x2x1": (8, "lj", "triclinic", (4, 2, 1), "halo"),
    # a 5 A halo over 8 boxes of 1.1 A: 4 hops, the shorter way round (+ on the tie)
    "lj-triclinic-8x1x1": (8, "lj", "triclinic", (8, 1, 1), "halo"),
    "lj-tiny-2x2x2": (8, "lj", "tiny", (2, 2, 2), "halo"),
    # a slab (z not periodic, 4 boxes: 3 hops the straight way), boxes cut at quantiles
    "lj-slab-1x2x4-shift": (8, "lj", "slab", (1, 2, 4), "halo", "shift"),
    "equivariant-molecule-2x2x2-sync": (8, "equivariant", "molecule", (2, 2, 2), "sync"),
    # a molecule split over 8 boxes along a non-periodic axis; 3 layers: 2 sync points
    "painn3-molecule-1x1x8-sync": (8, "painn3", "molecule", (1, 1, 8), "sync"),
}
MODELS = {"lj": lj, "equivariant": lambda: native("equivariant"),
          "painn": lambda: native("painn"), "painn3": lambda: native("painn", layers=3)}
STRUCTURES = {"triclinic": triclinic, "corner": corner, "tiny": tiny, "molecule": molecule,
              "slab": slab}
#: world ranks of the group of each size (3: ranks 5-7, whose group ranks are 0-2)
MEMBERS = {2: [0, 1], 3: [5, 6, 7], 4: [0, 1, 2, 3], 8: list(range(8))}


def _reference(model, graph):
    from xnn.models import Potential

    return Potential(model)(graph)


def _hops(grid, pbc, peers) -> int:
    """Stages of a staged exchange: per axis of more than one box, the largest box offset
    (the shorter way round a periodic axis) from any rank to a peer it sends rows to."""
    n = len(peers)
    box = [(r // (grid[1] * grid[2]), (r // grid[2]) % grid[1], r % grid[2]) for r in range(n)]
    total = 0
    for a in range(3):
        far = 0
        for r in range(n):
            for q in peers[r]:
                d = (box[q][a] - box[r][a]) % grid[a] if pbc[a] else box[q][a] - box[r][a]
                far = max(far, min(d, grid[a] - d) if pbc[a] else abs(d))
        total += far if grid[a] > 1 else 0
    return total


def _messages(plan, x) -> tuple:
    """Ghost rows of one forward exchange of ``x`` and the messages of each of its
    point-to-point calls, as the tally counts them."""
    from xnn.distributed.cost.tally import CollectiveTally

    tally = CollectiveTally()
    with tally:
        ghosts = plan.forward_comm(x)
    return ghosts, [c.messages for c in tally.log if c.kind == "p2p"]


def _adjoint(plan, group, seed: int) -> tuple[float, float]:
    """``(<F(x), g>, <x, R(g)>)`` summed over the group for random ``x``, ``g`` (fp64)."""
    from xnn.distributed import collectives as C

    gen = torch.Generator().manual_seed(seed + C.group_rank(group))
    x = torch.randn(plan.n_owned, 3, generator=gen)
    g = torch.randn(plan.n_recv, 3, generator=gen)
    sums = torch.stack([(plan.forward_comm(x) * g).sum(), (x * plan.reverse_comm(g)).sum()])
    return tuple(C.all_reduce_(sums, group).tolist())


def _case(manager, group, rank, name):
    from xnn.distributed import parallelize

    _, model_name, struct, grid, mode, *balance = CASES[name]
    model, graph = MODELS[model_name](), STRUCTURES[struct]()
    out = {"pbc": graph.pbc[0].tolist()}
    plans = {}
    for exchange in ("direct", "staged"):
        dd = parallelize(model, group, mode, grid=grid, exchange=exchange,
                         balance=balance[0] if balance else "none")
        res = dd.single_point(graph if rank == 0 else None)
        plan = dd.state.local.plan
        plans[exchange] = plan
        x = torch.randn(plan.n_owned, 3, generator=torch.Generator().manual_seed(rank))
        ghosts, messages = _messages(plan, x)
        out[exchange] = {"stats": dd.stats(), "ghosts": ghosts, "messages": messages,
                         "peers": [q for q, r in zip(plan.peers, plan.send_index) if r.numel()],
                         "stages": len(plan.routing.stages) if plan.routing else 0,
                         "adjoint": _adjoint(plan, group, 5),
                         "forces": res["forces"]}
        if rank == 0:
            out[exchange]["errors"] = compare_by_id(res, _reference(model, graph), graph)
    out["same_ghosts"] = torch.equal(out["direct"]["ghosts"], out["staged"]["ghosts"])
    out["forces_vs_direct"] = rel(out["staged"]["forces"], out["direct"]["forces"])
    for exchange in ("direct", "staged"):
        del out[exchange]["ghosts"], out[exchange]["forces"]
    return out


def _md(manager, rank):
    """20 NVE steps of hot LJ on a 2 x 2 x 2 staged grid (rebuilds and migrations) vs one
    process."""
    from xnn.distributed import parallelize
    from xnn.dynamics import nve
    from xnn.models import Potential

    model, graph = lj(), hot(triclinic(), 3000.0)

    def run(potential, start, reduce=None):
        state = nve.init(start, potential)
        for _ in range(20):
            state = nve.step(state, potential, dt=2.0,
                             **({} if reduce is None else {"reduce": reduce}))
            if reduce is not None:
                state = potential.maybe_migrate(state)
        return state

    dec = parallelize(model, manager, "halo", grid=(2, 2, 2), skin=0.5, exchange="staged")
    state = run(dec, dec.scatter(graph if rank == 0 else None), dec.reducer)
    full, extra = dec.gather(state.graph, {"forces": state.forces})
    c = dec.state.counters
    out = {"rebuilds": c.rebuilds, "migrations": c.migrations,
           "staged": dec.state.local.plan.routing is not None}
    if rank == 0:
        ref = run(Potential(model, skin=0.5), graph)
        order = torch.argsort(graph.atom_id)
        out["positions"] = rel(full.positions - graph.positions[order],
                                ref.graph.positions[order] - graph.positions[order])
        out["forces"] = rel(extra["forces"], ref.forces[order])
    return out


def _worker(rank, world):
    import torch.distributed as dist

    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=300, device="cpu")
    groups = {size: dist.new_group(members) for size, members in MEMBERS.items() if size < 8}
    groups[8] = None
    out = {}
    for name, (size, *_rest) in CASES.items():
        if rank in MEMBERS[size]:
            out[name] = _case(manager, groups[size], MEMBERS[size].index(rank), name)
    out["md"] = _md(manager, rank)
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_worker, 8, timeout_s=600.0)


@pytest.mark.slow  # 8 ranks on CI's 2 cores
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_staged_equals_direct_and_one_process(ranks, name):
    size = CASES[name][0]
    for rank in MEMBERS[size]:
        case = ranks[rank][name]
        assert case["same_ghosts"], f"{name}: staged ghost rows differ on rank {rank}"
        assert case["forces_vs_direct"] <= TOL
        for exchange in ("direct", "staged"):
            f, r = case[exchange]["adjoint"]
            assert abs(f - r) <= 1e-12 * max(abs(f), 1.0), (name, exchange, f, r)
    for exchange in ("direct", "staged"):
        errors = dict(ranks[MEMBERS[size][0]][name][exchange]["errors"])
        assert errors.pop("ids")
        for key, err in errors.items():
            assert err <= TOL, f"{name} {exchange}: {key} relative error {err:.2e}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_staged_messages_per_stage(ranks, name):
    """At most 2 messages per stage (1 on a periodic axis of 2 boxes), one stage per box of
    the farthest peer's offset along each split axis (the shorter way round a periodic
    axis), fewer messages than peers on 3-D grids."""
    size, _, _, grid, _, *_balance = CASES[name]
    stats = [ranks[r][name] for r in MEMBERS[size]]
    for case in stats:
        direct, staged = case["direct"], case["staged"]
        assert len(direct["messages"]) <= 1 and sum(direct["messages"]) <= direct[
            "stats"]["n_peers"]
        assert len(staged["messages"]) <= staged["stages"]
        assert all(m <= 2 for m in staged["messages"])
        assert sum(staged["messages"]) == staged["stats"]["n_messages"]
        assert direct["stats"]["exchange"] == "direct" and staged["stats"]["exchange"] == "staged"
    grid = grid or stats[0]["direct"]["stats"]["grid"]
    pbc = stats[0]["pbc"]
    peers = [c["direct"]["peers"] for c in stats]
    assert all(c["staged"]["stages"] == _hops(grid, pbc, peers) for c in stats)
    if name == "lj-triclinic-4x2x1":  # 5 Å halo, 2.0 Å boxes along x: 2 hops, 1 along y
        assert stats[0]["staged"]["stages"] == 3
    if name == "lj-triclinic-8x1x1":  # 8 boxes, the tie at 4: 4 hops, the last one + only
        assert stats[0]["staged"]["stages"] == 4
        assert max(max(c["staged"]["messages"]) for c in stats) == 2
    # rows travel once per stage and neighbour, not once per image and peer (a rank that owns
    # no atom may forward some: the group's sum)
    assert sum(c["staged"]["stats"]["n_send"] for c in stats) <= sum(
        c["direct"]["stats"]["n_send"] for c in stats)
    assert [sum(c["staged"]["messages"]) for c in stats] == list(
        staged_messages(grid, pbc, peers)), "the cost model's count of staged messages"
    if grid == (2, 2, 2):
        assert max(c["direct"]["stats"]["n_peers"] for c in stats) == 7
        assert max(sum(c["staged"]["messages"]) for c in stats) == 3


@pytest.mark.slow
@pytest.mark.distributed
def test_staged_md_with_migration_equals_one_process(ranks):
    out = ranks[0]["md"]
    assert all(r["md"]["staged"] for r in ranks)
    assert out["rebuilds"] > 1 and out["migrations"] > 0, out
    assert out["positions"] <= 1e-9 and out["forces"] <= 1e-9, out


def test_exchange_words_are_checked():
    from xnn.config.loader import validate_choices
    from xnn.config.parallel import ParallelConfig
    from xnn.distributed import parallelize

    with pytest.raises(InputError, match="exchange must be one of"):
        parallelize(lj(), None, "halo", exchange="ring")
    with pytest.raises(InputError, match=r"mode 'graph'.*set exchange direct "
                       r"\(parallel.exchange: direct\) or mode spatial"):
        parallelize(lj(), None, "graph", exchange="staged")
    with pytest.raises(InputError, match="host engine"):
        parallelize(lj(), None, "halo", host=True, exchange="staged")
    from xnn.distributed.domain.compiled_run import CompiledDomainRun

    with pytest.raises(InputError, match="exchange must be one of"):  # staged compiles
        CompiledDomainRun(lj(), None, 0.0, "auto", exchange="ring")
    with pytest.raises(Exception, match="exchange"):
        validate_choices(ParallelConfig(exchange="ring"))
    with pytest.raises(Exception, match="parallel.exchange"):
        ParallelConfig(dd=1, exchange="staged").check_workflow()
