"""Blocking collectives per decomposed MD step (issue 47 item 5), counted for real.

Two gloo ranks (one spawned set for the module) run each integrator on the owned atoms of a
hot FCC crystal through :class:`~xnn.distributed.DecomposedPotential` (``integrator.step``
with ``reduce=pot.reducer``, then ``pot.maybe_migrate``), counting every collective of every
step with :func:`xnn.distributed.collectives.count_collectives`. Each step's count must equal
the table of ``docs/distributed.md`` ("Collectives per step"), so a new unfused all-reduce in
the step fails here; and the final state must equal one process's by atom id. The compiled
decomposed step (NVE, Langevin, CSVR, NHC; its own spawn, slow) is counted the same way.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import spawn
from helpers.models import lj, native
from helpers.structures import fcc, graph, hot

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

STEPS = 12
DT = 2.0
SKIN = 0.3  # small: the hot crystal rebuilds (and migrates) every few steps
TOL = 1e-10

#: (model, mode, ensemble) -> blocking collectives per step by kind, on a step without a
#: ghost-plan rebuild and on one with a migration and rebuild (docs/distributed.md)
PLAIN_HALO = {"all_reduce": 3, "exchange": 2}
EXPECTED = {
    ("lj", "halo", "nve"): PLAIN_HALO,
    ("lj", "halo", "langevin"): {"all_reduce": 5, "exchange": 2},
    ("lj", "halo", "csvr"): {"all_reduce": 7, "exchange": 2},
    ("lj", "halo", "nhc"): {"all_reduce": 5, "exchange": 2},
    ("lj", "halo", "npt"): {"all_reduce": 9, "exchange": 2},
    ("schnet", "sync", "nve"): {"all_reduce": 3, "exchange": 4},
    # graph: 2 feature all-gathers forward, their adjoints backward (gloo has no
    # reduce-scatter: an all-reduce each), and the 3 scalar all-reduces
    ("schnet", "graph", "nve"): {"all_reduce": 5, "all_gather": 2},
}
#: what a step with a migration and ghost-plan rebuild adds (spatial layouts)
REBUILD_EXTRA = {"all_reduce": 6, "all_gather": 2, "exchange": 4}
#: the compiled decomposed step (xnn.distributed.domain.compiled) on a step without re-plan:
#: 2 exchanges and 1 all-gather (energy, virial, look-ahead), and the thermostat's fused
#: in-graph all-reduces, one per point of the scheme: its ``pre`` runs in region 1 and again
#: in region 3's look-ahead (Langevin 2 + 2, CSVR 2 + 2 + 2 with its ``post``, NHC 1 + 1 + 1)
COMPILED_NVE = {"exchange": 2, "all_gather": 1}
COMPILED = {"nve": COMPILED_NVE, "langevin": {**COMPILED_NVE, "all_reduce": 4},
            "csvr": {**COMPILED_NVE, "all_reduce": 6}, "nhc": {**COMPILED_NVE, "all_reduce": 3}}


def _model(name):
    return lj() if name == "lj" else native("schnet")


def _structure():
    return hot(graph(fcc((3, 3, 3), rattle=0.05, seed=2), seed=3), 1500.0)


def _init(ensemble, g, pot, reduce):
    from xnn.dynamics import csvr, langevin, nhc, npt, nve

    if ensemble == "nve":
        return nve, nve.init(g, pot, reduce=reduce)
    if ensemble == "langevin":
        return langevin, langevin.init(g, pot, 1500.0, friction=0.02, seed=5, reduce=reduce)
    if ensemble == "csvr":
        return csvr, csvr.init(g, pot, 1500.0, tau=20.0, seed=5, reduce=reduce)
    if ensemble == "nhc":
        return nhc, nhc.init(g, pot, 1500.0, tau=20.0, reduce=reduce)
    return npt, npt.init(g, pot, 1500.0, 0.0, tau=20.0, tau_p=50.0, compressibility=0.5,
                         seed=5, reduce=reduce)


def _case(manager, key):
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives

    name, mode, ensemble = key
    pot = parallelize(_model(name), manager, mode, skin=SKIN)
    owned = pot.scatter(_structure() if manager.rank == 0 else None)
    integrator, state = _init(ensemble, owned, pot, pot.reducer)
    steps = []
    for _ in range(STEPS):
        before = (pot.state.counters.rebuilds, pot.state.counters.migrations)
        with count_collectives() as n:
            state = integrator.step(state, pot, DT, reduce=pot.reducer)
            state = pot.maybe_migrate(state)
        after = (pot.state.counters.rebuilds, pot.state.counters.migrations)
        steps.append({"calls": dict(n.calls), "blocking": n.blocking,
                      "rebuilt": after[0] - before[0], "migrated": after[1] - before[1]})
    return _final(manager, pot, state, steps)



def _final(manager, pot, state, steps) -> dict:
    """``{"steps": steps}``, with the final state (ids, positions, velocities, cell) gathered
    on rank 0."""
    full, _ = pot.gather(state.graph)
    out = {"steps": steps}
    if manager.rank == 0:
        out.update(ids=full.atom_id, positions=full.positions, velocities=full.velocities,
                   cell=full.cell)
    return out


def _compiled_case(manager, ensemble):
    """The compiled decomposed step (aot_eager) of ``ensemble``: per-step counts (steps
    without a re-plan) and the final state."""
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives
    from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator

    pot = parallelize(lj(), manager, "halo", skin=SKIN)
    integ = CompiledDomainIntegrator(ensemble, pot, backend="aot_eager")
    owned = pot.scatter(_structure() if manager.rank == 0 else None)
    _, state = _init(ensemble, owned, pot, pot.reducer)
    steps = []
    for _ in range(STEPS):
        replans = integ.stepper.n_replans
        with count_collectives() as n:
            state = integ.step(state, pot, DT)
        steps.append({"calls": dict(n.calls), "replanned": integ.stepper.n_replans - replans})
    return _final(manager, pot, state, steps)


def _instrumentation(manager):
    """Known calls through the wrappers: counted by kind, bytes and messages."""
    from xnn.distributed import collectives as C

    peer = 1 - manager.rank
    with C.count_collectives() as outer:
        C.all_reduce_(torch.zeros(3, dtype=torch.float64))
        with C.count_collectives() as inner:
            C.all_reduce_max(torch.zeros(2, dtype=torch.float32))
            C.exchange([(peer, torch.zeros(5, dtype=torch.float64))],
                       [(peer, torch.empty(5, dtype=torch.float64))])
            C.exchange([(peer, torch.zeros(0))], [(peer, torch.empty(0))])  # skipped
        C.all_reduce_sum_many([torch.ones(2, dtype=torch.float64),
                               torch.ones(3, 3, dtype=torch.float64),
                               torch.ones(1, dtype=torch.float32)])
        C.gather_rows(torch.zeros(manager.rank + 1, 2, dtype=torch.float64))
    timed = set(outer.seconds) == set(outer.calls) and all(v > 0 for v in outer.seconds.values())
    return {"timed": timed,
            "outer": (dict(outer.calls), dict(outer.nbytes), outer.messages, outer.blocking),
            "inner": (dict(inner.calls), dict(inner.nbytes), inner.messages, inner.blocking)}


def _moved_in_place(manager):
    """The migration criteria that :meth:`update` reduced are reused only for the very
    positions it saw: after an in-place move of the evaluated positions, ``maybe_migrate``
    reduces them again and migrates."""
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives
    from xnn.dynamics import nve

    pot = parallelize(lj(), manager, "halo", skin=SKIN)
    owned = pot.scatter(_structure() if manager.rank == 0 else None)
    state = nve.step(nve.init(owned, pot, reduce=pot.reducer), pot, 0.1, reduce=pot.reducer)
    with count_collectives() as reused:
        same = pot.maybe_migrate(state)
    state = nve.step(same, pot, 0.1, reduce=pot.reducer)
    before = pot.state.counters.migrations
    with torch.no_grad():
        state.graph.positions.add_(torch.tensor([0.2, 0.0, 0.0], dtype=torch.float64))
    with count_collectives() as n:
        pot.maybe_migrate(state)
    return {"reused": dict(reused.calls), "migrated": pot.state.counters.migrations - before,
            "all_reduce": n.calls["all_reduce"]}


def _worker(rank, world_size):
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(backend="gloo")
    torch.set_num_threads(1)
    out = {"instrumentation": _instrumentation(manager), "in_place": _moved_in_place(manager)}
    for key in EXPECTED:
        out[key] = _case(manager, key)
    out[("lj", "halo", "langevin", "committee")] = _committee_case(manager)
    manager.cleanup()
    return out


def _committee_case(manager):
    from helpers.uncertainty import committee

    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives
    from xnn.dynamics import langevin

    pot = parallelize(committee(), manager, "halo", skin=SKIN)
    owned = pot.scatter(_structure() if manager.rank == 0 else None)
    state = langevin.init(owned, pot, 1500.0, friction=0.02, seed=5, reduce=pot.reducer)
    counts = []
    for _ in range(4):
        before = pot.state.counters.rebuilds
        with count_collectives() as n:
            state = langevin.step(state, pot, DT, reduce=pot.reducer)
            state = pot.maybe_migrate(state)
        if pot.state.counters.rebuilds == before:
            counts.append(dict(n.calls))
    return counts


def _compiled_worker(rank, world_size):
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(backend="gloo")
    torch.set_num_threads(1)
    out = {ensemble: _compiled_case(manager, ensemble) for ensemble in COMPILED}
    manager.cleanup()
    return out


_RESULTS: list = []
_COMPILED: list = []


def compiled_results():
    """The compiled cases in their own spawn (about 2 min on 2 shared cores: slow)."""
    if not _COMPILED:
        _COMPILED.extend(spawn(_compiled_worker, 2, timeout_s=600.0))
    return _COMPILED


def results():
    if not _RESULTS:
        _RESULTS.extend(spawn(_worker, 2, timeout_s=600.0))
    return _RESULTS


_REF: dict = {}


def reference(key):
    """One process: the final state sorted by atom id."""
    if key not in _REF:
        from xnn.dynamics.reduce import LOCAL
        from xnn.models import Potential

        name, _, ensemble = key
        pot = Potential(_model(name), skin=SKIN)
        integrator, state = _init(ensemble, _structure(), pot, LOCAL)
        for _ in range(STEPS):
            state = integrator.step(state, pot, DT)
        g = state.graph
        order = torch.argsort(g.atom_id)
        _REF[key] = {"ids": g.atom_id[order], "positions": g.positions[order],
                     "velocities": g.velocities[order], "cell": g.cell}
    return _REF[key]


def _plus(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b)}


def test_count_collectives_counts_kind_bytes_and_messages():
    for r in results():
        calls, nbytes, messages, blocking = r["instrumentation"]["inner"]
        assert calls == {"all_reduce": 1, "exchange": 1}  # the empty exchange sends nothing
        assert nbytes == {"all_reduce": 8, "exchange": 80} and messages == 2
        assert blocking == 2
        calls, nbytes, messages, blocking = r["instrumentation"]["outer"]
        # nested blocks both count; sums of two dtypes: one all-reduce per dtype; a
        # gather_rows is two all-gathers (counts, then padded rows)
        assert calls == {"all_reduce": 4, "exchange": 1, "all_gather": 2}
        assert nbytes["all_reduce"] == 24 + 8 + 11 * 8 + 4
        assert blocking == 7
        assert r["instrumentation"]["timed"]  # wall time inside the calls, per kind


def test_count_collectives_counts_nothing_in_one_process():
    from xnn.distributed import collectives as C

    with C.count_collectives() as n:
        C.all_reduce_(torch.zeros(3))
        assert C.all_reduce_sum_many([torch.ones(2)])[0].tolist() == [1.0, 1.0]
    assert n.blocking == 0 and not n.calls


@pytest.mark.parametrize("key", list(EXPECTED), ids="-".join)
def test_collectives_per_step_are_the_documented_ones(key):
    """Every step of every rank: exactly the documented collectives (steps with a
    migration and rebuild add the rebuild's); at least one step of each kind is seen."""
    for r in results():
        steps = r[key]["steps"]
        plain = [s for s in steps if not s["rebuilt"]]
        rebuilt = [s for s in steps if s["rebuilt"] and s["migrated"]]
        assert plain, key
        for s in plain:
            assert s["calls"] == EXPECTED[key], (key, s)
        if key[1] != "graph":  # graph mode never migrates
            assert rebuilt, key
            for s in rebuilt:
                assert s["calls"] == _plus(EXPECTED[key], REBUILD_EXTRA), (key, s)


def test_migration_check_is_reduced_again_after_an_in_place_move():
    for r in results():
        m = r["in_place"]
        assert m["reused"] == {}, m  # right after the evaluation: update()'s criteria
        assert m["migrated"] == 1 and m["all_reduce"] >= 1, m


def test_committee_step_adds_its_separate_agreement():
    """A committee's evaluation keeps its own agreement all-reduce before the members'
    energies (the members' reductions live in xnn.distributed.committee): one more than a
    single model's Langevin step, and its exchanges are per member (3 members)."""
    for r in results():
        counts = r[("lj", "halo", "langevin", "committee")]
        assert counts
        for c in counts:
            assert c == {"all_reduce": EXPECTED[("lj", "halo", "langevin")]["all_reduce"] + 1,
                         "exchange": 6}, c


@pytest.mark.parametrize("key", list(EXPECTED), ids="-".join)
def test_fused_steps_follow_one_process_by_atom_id(key):
    got, ref = results()[0][key], reference(key)
    assert torch.equal(got["ids"], ref["ids"])
    for name in ("positions", "velocities", "cell"):
        err = float((got[name] - ref[name]).abs().max())
        assert err <= TOL, (key, name, err)


@pytest.mark.slow
@pytest.mark.parametrize("ensemble", list(COMPILED))
def test_compiled_decomposed_step_fuses_its_reductions(ensemble):
    """The compiled decomposed step, counted by the same count_collectives: on every step
    without a re-plan of every rank exactly the fused collectives of :data:`COMPILED` (the
    thermostat's in-graph all-reduces counted per call of their region); the run re-planned
    (migrated) at least once; the final state equals one process's by atom id."""
    for r in compiled_results():
        steps = r[ensemble]["steps"]
        plain = [s for s in steps[1:] if not s["replanned"]]  # step 1 plans and compiles
        assert plain and any(s["replanned"] for s in steps[1:]), steps
        for s in plain:
            assert s["calls"] == COMPILED[ensemble], (ensemble, s)
    got, ref = compiled_results()[0][ensemble], reference(("lj", "halo", ensemble))
    assert torch.equal(got["ids"], ref["ids"])
    for name in ("positions", "velocities"):
        err = float((got[name] - ref[name]).abs().max())
        assert err <= TOL, (ensemble, name, err)
