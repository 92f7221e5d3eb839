"""The compiled decomposed NVE step (xnn.distributed.domain.compiled, ``md.compile=true``
under torchrun): 200 steps with ghost-plan rebuilds and migrations on every rank follow the
eager decomposed run and the one-process run by atom id (fp64), with no recompile after the
first step and a fixed number of compiled regions and communication points per step; LJ
also with ``parallel.exchange=staged`` (the ghosts through the plan's staged routing).

gloo ranks on CPU; one spawn per world size runs every case (library LJ, SchNet, and
``xnn md compile=true`` against ``compile=false`` through the CLI)."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import FreshPorts, spawn
from helpers import corner, hot, lj, rattled_argon
from helpers import rel as _rel
from helpers.compiled import MD_ARGS as ARGS
from helpers.compiled import count_routed
from helpers.compiled import hot_crystal as _crystal
from helpers.compiled import unique_graphs as _unique_graphs

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

TOL = 1e-10
SKIN = 0.5
DT = 1.0
CASES = {"lj": 200, "schnet": 40, "corner": 60}  # steps
SLOW = ("schnet",)  # its own spawn, under -m slow
WORLD4 = ("lj", "corner")  # on 4 ranks (under -m slow); corner: 32 atoms, 4 slabs, empty boxes
STAGED = ("lj",)  # compiled once more with parallel.exchange=staged (2 ranks: 1x1x2; 4: 1x2x2)


def _model(name):
    if name in ("lj", "corner"):
        return lj(3.0 if name == "corner" else 5.0)
    from xnn.models import build

    torch.manual_seed(0)
    before = torch.get_default_dtype()  # the same weights in the ranks (fp64 default) and here
    torch.set_default_dtype(torch.float32)
    try:
        model = build("schnet", species=[29], cutoff=3.5, num_interactions=2, num_features=16,
                      num_filters=16, num_basis=12)
    finally:
        torch.set_default_dtype(before)
    return model.double().eval()  # evaluation: its local edges as reverse pairs


def _graph(name):
    return hot(corner(), 1500.0) if name == "corner" else _crystal()


def _grid(name):
    return (1, 1, 4) if name == "corner" else None


def _final(pot, state, rank, extra=None):
    full, _ = pot.gather(state.graph)
    out = {"stats": pot.stats(), **(extra or {})}
    if rank == 0:
        out.update(positions=full.positions, velocities=full.velocities, ids=full.atom_id,
                   energy=state.energy, stress=state.stress)
    return out


def _eager(manager, name, steps, rank):
    from xnn.distributed import parallelize
    from xnn.dynamics import nve

    pot = parallelize(_model(name), manager, "halo", grid=_grid(name), skin=SKIN)
    state = nve.init(pot.scatter(_graph(name) if rank == 0 else None), pot,
                     reduce=pot.reducer)
    for _ in range(steps):
        state = nve.step(state, pot, DT, reduce=pot.reducer)
        state = pot.maybe_migrate(state)
    return _final(pot, state, rank)


def _compiled(manager, name, steps, rank, exchange="direct"):
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives
    from xnn.distributed.domain.compiled import CompiledDomainVerlet, steps_summary
    from xnn.dynamics import nve

    pot = parallelize(_model(name), manager, "halo", grid=_grid(name), skin=SKIN,
                      exchange=exchange)
    stepper = CompiledDomainVerlet(pot, backend="aot_eager")
    state = nve.init(pot.scatter(_graph(name) if rank == 0 else None), pot,
                     reduce=pot.reducer)
    graphs = _unique_graphs()
    state = stepper.step(state, DT)  # compiles
    first = {"compiles": stepper.n_compiles, "graphs": _unique_graphs(),
             "new_graphs": _unique_graphs() - graphs, "calls": stepper.n_region_calls,
             "exchanges": stepper.n_exchanges, "collectives": stepper.n_collectives}
    steady = []  # per step without re-plan: (region calls, exchanges, collectives)
    wire = set()  # per step without re-plan: (point-to-point calls, messages, stages, routed)
    owned = [state.graph.n_atoms]
    routed = count_routed()
    for _ in range(steps - 1):
        before = (stepper.n_replans, stepper.n_region_calls, stepper.n_exchanges,
                  stepper.n_collectives, routed["forward"], routed["reverse"])
        with count_collectives() as n:
            state = stepper.step(state, DT)
        if stepper.n_replans == before[0]:
            steady.append((stepper.n_region_calls - before[1], stepper.n_exchanges - before[2],
                           stepper.n_collectives - before[3]))
            routing = stepper.plan.routing
            wire.add((n.calls["exchange"], n.messages, len(routing.stages) if routing else 0,
                      routed["forward"] - before[4], routed["reverse"] - before[5]))
        owned.append(state.graph.n_atoms)
    dist = pot.min_pair_distance()[0]
    return _final(pot, state, rank, {
        "first": first, "compiles": stepper.n_compiles, "graphs": _unique_graphs(),
        "replans": stepper.n_replans, "steady": sorted(set(steady)), "wire": sorted(wire),
        "summary": steps_summary(stepper), "min_distance": float(dist),
        "min_owned": min(owned)})


def _adjoint(manager, rank):
    """The halo exchange's reverse (the compiled step's force sum into owners) against its
    forward on this rank's real plan: ``<forward(x), y>`` and ``<x, reverse(y)>`` for random
    owned rows ``x`` and ghost rows ``y`` (their sums over the ranks must agree), and
    whether the exchange's autograd backward gives ``reverse(y)`` bit for bit."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.halo import halo_exchange

    pot = parallelize(lj(), manager, "halo", skin=SKIN)
    pot.update(pot.scatter(_crystal() if rank == 0 else None))
    plan = pot.state.local.plan
    gen = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(plan.n_owned, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(plan.n_recv, 3, generator=gen, dtype=torch.float64)
    back = plan.reverse_comm(y)
    leaf = x.clone().requires_grad_(True)
    (halo_exchange(leaf, plan) * y).sum().backward()
    return {"forward": float((plan.forward_comm(x) * y).sum()), "reverse": float((x * back).sum()),
            "backward_is_reverse": torch.equal(leaf.grad, back), "n_recv": plan.n_recv,
            "n_send": plan.n_send}


def reference(name, steps):
    """One process, sorted by atom id."""
    from xnn.dynamics import nve
    from xnn.models import Potential

    pot = Potential(_model(name), skin=SKIN)
    graph = _graph(name)
    state = nve.init(graph, pot)
    for _ in range(steps):
        state = nve.step(state, pot, DT)
    order = torch.argsort(state.graph.atom_id)
    return {"positions": state.positions[order], "velocities": state.velocities[order],
            "ids": state.graph.atom_id[order], "energy": state.energy, "stress": state.stress,
            "start": graph.positions[torch.argsort(graph.atom_id)]}


# ---------------------------------------------------------------------------- app

def _cli(structure, out_dir, compile_):
    from xnn.cli.main import main

    args = [*ARGS, f"structure={structure}", f"output.dir={out_dir}",
            f"compile={str(compile_).lower()}"]
    assert main(args) == 0, f"xnn md {' '.join(args)} failed"


def worker(rank, world, tmp, names, with_app):
    from xnn.distributed import DistributedManager
    from xnn.distributed.domain import local

    torch.set_default_dtype(torch.float64)
    local.PAIR_EXTRA_EDGES = float("inf")  # pair these small domains' lists all the same
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    out, seconds = {}, {}
    for name in names:
        steps = CASES[name]
        t0 = time.perf_counter()
        out[name] = {"eager": _eager(manager, name, steps, rank),
                     "compiled": _compiled(manager, name, steps, rank)}
        if name in STAGED:
            out[name]["staged"] = _compiled(manager, name, steps, rank, "staged")
        seconds[name] = time.perf_counter() - t0
    if "lj" in names and world == 2:
        out["adjoint"] = _adjoint(manager, rank)
    if not with_app:
        return {**out, "seconds": seconds}
    import xnn.distributed.domain.compiled as compiled
    import xnn.dynamics.compiled as one_process

    one_process.DEFAULT_BACKEND = "aot_eager"  # the app's backend here: no C++ compile
    calls, step = [0], compiled.CompiledDomainVerlet.step

    def counted(self, state, dt):
        calls[0] += 1
        return step(self, state, dt)

    compiled.CompiledDomainVerlet.step = counted
    ports = FreshPorts(manager, 2)
    tmp = Path(tmp)
    t0 = time.perf_counter()
    for flag in (False, True):
        ports.next()
        _cli(tmp / "ar.xyz", tmp / f"md_{world}_{flag}", flag)
    seconds["app"] = time.perf_counter() - t0
    return {**out, "app_compiled_steps": calls[0], "seconds": seconds}


_CACHE: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled_domain")
    rattled_argon(rep=3, amp=0.05).write(tmp / "ar.xyz")
    return tmp


def results(world, tmp, slow=False):
    """Per-rank results of a world size's spawn: on 2 ranks the fast cases and the app, or
    the slow cases; on 4 ranks :data:`WORLD4`."""
    key = (world, slow)
    if key not in _CACHE:
        names = WORLD4 if world == 4 else [n for n in CASES if n != "corner"
                                           and (n in SLOW) == slow]
        _CACHE[key] = spawn(worker, world, args=(str(tmp), names, not slow), timeout_s=500)
    return _CACHE[key]


def _params(corner_case=True):
    """(world, name) cases; those in their own spawn are slow."""
    out = [(2, n) for n in CASES if n != "corner"] + [(4, n) for n in WORLD4
                                                      if corner_case or n != "corner"]
    return [pytest.param(w, n, marks=pytest.mark.slow) if w == 4 or n in SLOW else (w, n)
            for w, n in out]


@pytest.mark.parametrize("world,name", _params())
def test_compiled_decomposed_nve_matches_eager_and_one_process(tmp, world, name):
    res = results(world, tmp, world == 4 or name in SLOW)
    ref = reference(name, CASES[name])
    r0 = res[0][name]
    for run in ("eager", "compiled"):
        got = r0[run]
        assert torch.equal(got["ids"], ref["ids"])
        for key in ("velocities", "energy", "stress"):
            assert _rel(got[key], ref[key]) <= TOL, (run, key, _rel(got[key], ref[key]))
        moved = _rel(got["positions"] - ref["start"], ref["positions"] - ref["start"])
        assert moved <= TOL, (run, moved)
    c, e = r0["compiled"], r0["eager"]
    assert _rel(c["positions"] - ref["start"], e["positions"] - ref["start"]) <= TOL
    assert _rel(c["velocities"], e["velocities"]) <= TOL
    if name == "lj":  # 200 steps: atoms crossed box faces, in and out, on every rank
        stats = [r[name]["compiled"]["stats"] for r in res]
        assert all(s["migrations"] > 0 and s["migrated_in"] > 0 and s["migrated_out"] > 0
                   for s in stats), stats
        assert all(s["rebuilds"] >= 3 for s in stats), stats
    if name == "schnet":  # filters once per reverse pair of local edges, eager and compiled
        assert all(r[name][run]["stats"]["paired"] for r in res for run in ("eager", "compiled"))
    if name == "corner":  # boxes without atoms (padding only) take part in every step
        assert min(r[name]["compiled"]["min_owned"] for r in res) == 0


@pytest.mark.parametrize("world,name", _params(corner_case=False))
def test_no_recompiles_and_fixed_breaks_per_step(tmp, world, name):
    """After the first step (3 regions compiled): the same compiled graphs over every later
    step with rebuilds and migrations on each rank; a step without re-plan is 3 compiled
    calls, 2 point-to-point exchanges and 1 collective."""
    for r in results(world, tmp, world == 4 or name in SLOW):
        c = r[name]["compiled"]
        assert c["first"]["compiles"] == 3
        assert c["compiles"] == 3 and c["graphs"] == c["first"]["graphs"], c
        assert c["replans"] >= 2  # rebuilds did happen after the first step
        assert c["steady"] == [(3, 2, 1)], c["steady"]
        assert c["min_distance"] > 1.5  # the safety check sees this step's local positions


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_staged_exchange_follows_direct_and_one_process(tmp, world):
    """``parallel.exchange=staged`` in the compiled step (LJ, 200 steps with rebuilds and
    migrations): the trajectory, energy and stress of one process and of the direct compiled
    run to 1e-10; 3 regions compiled at the first step and none later; on every step without
    re-plan of every rank, one staged forward and one reverse (the direct run: none), 2
    point-to-point calls per stage (the direct run: 2), 3 compiled calls, 2 exchanges and 1
    collective. On 4 ranks (1x2x2: the three other boxes are peers) fewer messages than
    direct; on 2 ranks (1x1x2: one peer) as many."""
    res = results(world, tmp, world == 4)
    ref = reference("lj", CASES["lj"])
    got, direct = res[0]["lj"]["staged"], res[0]["lj"]["compiled"]
    assert torch.equal(got["ids"], ref["ids"])
    for key in ("velocities", "energy", "stress"):
        assert _rel(got[key], ref[key]) <= TOL, (key, _rel(got[key], ref[key]))
        assert _rel(got[key], direct[key]) <= TOL, (key, _rel(got[key], direct[key]))
    for run in (ref, direct):
        moved = _rel(got["positions"] - ref["start"], run["positions"] - ref["start"])
        assert moved <= TOL, moved
    for r in res:
        c, d = r["lj"]["staged"], r["lj"]["compiled"]
        assert c["stats"]["exchange"] == "staged" and d["stats"]["exchange"] == "direct"
        assert c["stats"]["migrations"] > 0 and c["stats"]["rebuilds"] >= 3, c["stats"]
        assert c["first"]["compiles"] == 3 and c["first"]["new_graphs"] == 3, c["first"]
        assert c["compiles"] == 3 and c["graphs"] == c["first"]["graphs"], c
        assert c["replans"] >= 2 and c["steady"] == [(3, 2, 1)], c["steady"]
        assert c["wire"] and all(calls == 2 * stages and stages >= 1 and fwd == rev == 1
                                 for calls, _, stages, fwd, rev in c["wire"]), c["wire"]
        assert all(calls == 2 and stages == fwd == rev == 0
                   for calls, _, stages, fwd, rev in d["wire"]), d["wire"]
        staged_msgs, direct_msgs = c["stats"]["n_messages"], d["stats"]["n_messages"]
        assert staged_msgs < direct_msgs if world == 4 else staged_msgs == direct_msgs, (
            staged_msgs, direct_msgs)
        if world == 4:  # sent and received, both exchanges of a step
            assert max(m for _, m, *_ in c["wire"]) < min(m for _, m, *_ in d["wire"])


def test_reverse_exchange_is_the_adjoint_of_the_halo_exchange(tmp):
    """The one reverse exchange (``exchange_rows`` back, then ``add_returned``: what the
    exchange's autograd backward and the compiled step's force sum run) is the adjoint of
    the forward exchange on real 2-rank plans: ``sum_r <F(x), y> = sum_r <x, R(y)>``."""
    got = [r["adjoint"] for r in results(2, tmp)]
    assert all(a["n_recv"] > 0 and a["n_send"] > 0 for a in got), got  # both directions
    assert all(a["backward_is_reverse"] for a in got)
    fwd, rev = sum(a["forward"] for a in got), sum(a["reverse"] for a in got)
    assert abs(fwd - rev) <= 1e-12 * max(abs(fwd), 1.0), (fwd, rev)


def _rows(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_xnn_md_compile_on_two_ranks_logs_the_eager_rows(tmp):
    """``xnn md compile=true`` under torchrun-like ranks: the thermo rows of compile=false."""
    res = results(2, tmp)
    assert all(r["app_compiled_steps"] == 30 for r in res)  # the compiled decomposed step
    eager, compiled = (_rows(tmp / f"md_2_{flag}" / "thermo.csv") for flag in (False, True))
    assert len(compiled) == len(eager) == 30 // 5 + 2
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1:], eager[1:]):
        assert [float(x) for x in a] == pytest.approx([float(x) for x in b], rel=1e-9)


# ---------------------------------------------------------------------------- one process


def test_refuses_sync_mode_long_range_and_graph_mode():
    """Exchanges inside the model (sync points, long-range sums) would sit inside the compiled
    model region: refused with what to set instead."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled import CompiledDomainVerlet
    from xnn.errors import InputError
    from xnn.models import build

    with pytest.raises(InputError, match="parallel.mode: halo"):
        CompiledDomainVerlet(parallelize(_model("schnet"), None, "sync"))
    coulomb = build("ewald", cutoff=6.0)
    with pytest.raises(InputError, match="long-range"):
        CompiledDomainVerlet(parallelize(coulomb, None, "halo"))
    from xnn.distributed.domain.compiled_run import CompiledDomainRun

    with pytest.raises(InputError, match="parallel.mode halo, not graph"):
        CompiledDomainRun(lj(), None, 0.3, "auto", mode="graph")


def test_one_process_domain_follows_eager_with_a_grown_capacity():
    """Without a process group (one domain, its own periodic images as ghosts): the compiled
    step follows the eager one, and an overflowing rebuild grows the capacities once (the
    only recompile) while the trajectory stays the eager one."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled import CompiledDomainVerlet
    from xnn.dynamics import nve

    graph = _crystal()
    eager_pot = parallelize(lj(), None, "halo", skin=SKIN)
    pot = parallelize(lj(), None, "halo", skin=SKIN)
    stepper = CompiledDomainVerlet(pot, backend="aot_eager", headroom=1.0, slack=0)
    eager = nve.init(eager_pot.scatter(graph), eager_pot)
    compiled = nve.init(pot.scatter(graph), pot)
    for i in range(60):
        eager = eager_pot.maybe_migrate(nve.step(eager, eager_pot, DT))
        compiled = stepper.step(compiled, DT)
        if i == 0:
            stepper.caps.sizes = {k: int(0.9 * n) for k, n in stepper.caps.sizes.items()}
            stepper._plan = None  # as if the last rebuild had fewer of everything
    assert stepper.n_compiles == 6  # the first step, then once for the grown capacities
    assert torch.equal(compiled.graph.atom_id, eager.graph.atom_id)
    assert _rel(compiled.velocities, eager.velocities) <= TOL
    assert _rel(compiled.positions, eager.positions) <= TOL
    assert _rel(compiled.energy, eager.energy) <= TOL


def test_active_edges_overflow_grows_and_repeats_the_step():
    """The model region sees only the local edges within the cutoff (compacted into the
    active capacity); a step that finds more than the capacity holds is repeated at a grown
    one, so the trajectory stays the eager one (which filters the same edges eagerly)."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled import CompiledDomainVerlet
    from xnn.dynamics import nve

    graph = _crystal()
    eager_pot = parallelize(lj(), None, "halo", skin=SKIN)
    pot = parallelize(lj(), None, "halo", skin=SKIN)
    stepper = CompiledDomainVerlet(pot, backend="aot_eager")
    assert stepper.filters
    eager = nve.init(eager_pot.scatter(graph), eager_pot)
    compiled = nve.init(pot.scatter(graph), pot)
    for i in range(30):
        eager = eager_pot.maybe_migrate(nve.step(eager, eager_pot, DT))
        compiled = stepper.step(compiled, DT)
        if i == 2:  # as if the capacity held 20 edges fewer than the last step found
            n = stepper.n_active
            plan = stepper.plan
            assert 0 < n < plan.fields["edge_index"].shape[1]  # a real filter
            stepper.caps.sizes["active"] = n - 20
            plan.caps["active"] = n - 20
            from xnn.distributed.domain.compiled_plan import inert_edges

            plan.active = inert_edges(n - 20, plan.caps["local"], "cpu")
    assert stepper.n_active_overflows >= 1
    assert stepper.caps.sizes["active"] >= stepper.n_active
    assert stepper.n_steps == 30
    assert torch.equal(compiled.graph.atom_id, eager.graph.atom_id)
    assert _rel(compiled.positions, eager.positions) <= TOL
    assert _rel(compiled.velocities, eager.velocities) <= TOL
    assert _rel(compiled.energy, eager.energy) <= TOL


def test_local_graph_keeps_the_edges_within_the_cutoff():
    """With a skin the eager decomposed potential gives the model the local edges shorter
    than the cutoff (those of a list built at the cutoff), and its results equal those of
    the whole Verlet list."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.local import local_graph
    from xnn.neighbors import neighbor_list

    graph = _crystal()
    pot = parallelize(lj(), None, "halo", skin=SKIN)
    owned = pot.scatter(graph)
    out = pot(owned)
    dom = pot.state.local
    x = dom.local_positions(owned.positions, owned.cell[0])
    whole = local_graph(owned, dom, x)
    kept = local_graph(owned, dom, x, cutoff=pot.cutoff)
    zero_cell = torch.zeros(1, 3, 3, dtype=x.dtype)
    ref, _ = neighbor_list(x, zero_cell, torch.zeros(1, 3, dtype=torch.bool), pot.cutoff)
    key = lambda ei: sorted(map(tuple, ei.T.tolist()))  # noqa: E731
    assert kept.n_edges < whole.n_edges
    assert set(key(kept.edge_index)) == set(key(ref)) & set(key(whole.edge_index))
    assert dom.n_within == kept.n_edges  # counted at the build (same positions here)
    e_whole = pot.model(whole)[: dom.n_owned].sum()
    assert torch.allclose(out["energy"].sum(), e_whole, rtol=1e-12, atol=0)


@pytest.mark.slow
def test_inductor_domain_step_follows_eager():
    """The default backend (inductor's C++) compiles the model region's forces, virial and
    the force sum into owners to the eager decomposed step's numbers (one domain, 256-atom
    argon at its lattice sites: the forces come from the slight disorder of the velocities'
    first steps). A form of the strain that inductor miscompiled gave wrong forces."""
    from ase.build import bulk

    from xnn.data.graph import AtomicGraph
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled import CompiledDomainVerlet
    from xnn.dynamics import nve
    from xnn.models import build

    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((4, 4, 4))
    graph = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                    dtype=torch.float64)
    v = 0.002 * torch.randn(graph.n_atoms, 3, generator=torch.Generator().manual_seed(0),
                            dtype=torch.float64)
    graph = graph.replace(velocities=v - v.mean(0))

    def pot():
        model = build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0).double().eval()
        return parallelize(model, None, "halo", skin=1.0)

    eager_pot, compiled_pot = pot(), pot()
    stepper = CompiledDomainVerlet(compiled_pot, backend="inductor")
    eager = nve.init(eager_pot.scatter(graph), eager_pot)
    compiled = nve.init(compiled_pot.scatter(graph), compiled_pot)
    for _ in range(4):
        eager = eager_pot.maybe_migrate(nve.step(eager, eager_pot, 5.0))
        compiled = stepper.step(compiled, 5.0)
        assert torch.equal(compiled.graph.atom_id, eager.graph.atom_id)
        for key in ("forces", "stress", "energy", "velocities"):
            a, b = getattr(compiled, key), getattr(eager, key)
            assert _rel(a, b) <= TOL, (key, _rel(a, b))
    assert stepper.n_compiles == 3
