"""Compiled thermostatted steps under domain decomposition
(xnn.distributed.domain.compiled_thermo, ``md.compile=true`` with ``md.ensemble=langevin|
csvr|nhc`` under torchrun): on 2 gloo ranks, with migrations and ghost-plan rebuilds, the
trajectory and thermostat state equal the one-process eager and compiled runs by global
atom id (fp64; the noise is hashed from seed, step and atom id, so it does not depend on the
split), with no recompile after the first step, with the direct exchange and with
``parallel.exchange=staged`` (the plan's routing sends the ghosts); ``xnn md compile=true
ensemble=langevin parallel.exchange=staged`` on 2 ranks logs the rows of ``compile=false``;
NPT stays refused.

One spawn of 2 ranks runs every case of the fast set (langevin and the app); csvr and nhc
(the same checks for the other thermostats) run in a spawn of their own under ``-m slow``."""

from __future__ import annotations

import csv
import time
from pathlib import Path

import pytest
import torch
from dist_helpers import FreshPorts, spawn
from helpers import lj, rattled_argon
from helpers import rel as _rel
from helpers.compiled import MD_ARGS as NVE_ARGS
from helpers.compiled import count_app_domain_steps, count_routed
from helpers.compiled import hot_crystal as _crystal
from helpers.compiled import unique_graphs as _unique_graphs

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

TOL = 1e-10
SKIN = 0.5
DT = 2.0
STEPS = 40
ENSEMBLES = ("langevin", "csvr", "nhc")
FAST = ("langevin",)  # the others under -m slow
ENSEMBLE_PARAMS = [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                   for n in ENSEMBLES]
PARAMS = {"langevin": dict(temperature=1500.0, friction=0.05, seed=7),
          "csvr": dict(temperature=1500.0, tau=20.0, seed=7),
          "nhc": dict(temperature=1500.0, tau=20.0)}


def _module(name):
    from xnn.dynamics import registry

    return registry.get_integrator(name)


def _compiled(manager, name, rank, exchange="direct"):
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled import steps_summary
    from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator

    pot = parallelize(lj(), manager, "halo", skin=SKIN, exchange=exchange)
    integ = CompiledDomainIntegrator(name, pot, backend="aot_eager")
    stepper = integ.stepper
    state = integ.init(pot.scatter(_crystal() if rank == 0 else None), pot,
                       reduce=pot.reducer, **PARAMS[name])
    graphs = _unique_graphs()
    state = integ.step(state, pot, DT)  # compiles
    first = {"compiles": stepper.n_compiles, "graphs": _unique_graphs(),
             "new_graphs": _unique_graphs() - graphs}
    steady = []  # per step without re-plan: (regions, exchanges, collectives, in-graph,
    routed = count_routed()  # staged forward and reverse calls)
    for _ in range(STEPS - 1):
        before = (stepper.n_replans, stepper.n_region_calls, stepper.n_exchanges,
                  stepper.n_collectives, stepper.n_graph_collectives, routed["forward"],
                  routed["reverse"])
        state = integ.step(state, pot, DT)
        if stepper.n_replans == before[0]:
            steady.append((stepper.n_region_calls - before[1], stepper.n_exchanges - before[2],
                           stepper.n_collectives - before[3],
                           stepper.n_graph_collectives - before[4],
                           routed["forward"] - before[5], routed["reverse"] - before[6]))
    full, _ = pot.gather(state.graph)
    out = {"stats": pot.stats(), "first": first, "compiles": stepper.n_compiles,
           "graphs": _unique_graphs(), "replans": stepper.n_replans,
           "steady": sorted(set(steady)), "summary": steps_summary(stepper),
           "conserved": integ.conserved(state, pot.reducer)}
    if rank == 0:
        out.update(positions=full.positions, velocities=full.velocities, ids=full.atom_id,
                   energy=state.energy, vars=dict(state.vars), step=state.step)
    return out


def _cli(structure, out_dir, compile_):
    from xnn.cli.main import main

    args = [*(a for a in NVE_ARGS if a != "ensemble=nve"), f"structure={structure}",
            f"output.dir={out_dir}", f"compile={str(compile_).lower()}", "ensemble=langevin",
            "temperature=400",
            "thermostat.friction=0.02"]
    if compile_:  # the compiled run sends its ghosts staged, the eager one direct
        args.append("parallel.exchange=staged")
    assert main(args) == 0, f"xnn md {' '.join(args)} failed"


def worker(rank, world, tmp, names, with_app):
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    out, seconds = {}, {}
    for name in names:
        t0 = time.perf_counter()
        out[name] = {**_compiled(manager, name, rank),
                     "staged": _compiled(manager, name, rank, "staged")}
        seconds[name] = time.perf_counter() - t0
    if not with_app:
        manager.cleanup()
        return {**out, "seconds": seconds}
    made = count_app_domain_steps()
    ports = FreshPorts(manager, 2)
    t0 = time.perf_counter()
    calls, routed = count_routed(), {}
    for flag in (False, True):
        ports.next()
        before = dict(calls)
        _cli(Path(tmp) / "ar.xyz", Path(tmp) / f"md_langevin_{flag}", flag)
        routed[flag] = {k: calls[k] - before[k] for k in calls}
    seconds["app"] = time.perf_counter() - t0
    return {**out, "app_steps": sorted(set(made)), "app_n_steps": len(made),
            "app_routed": routed, "seconds": seconds}


_CACHE: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compiled_domain_thermo")
    rattled_argon(rep=3, amp=0.05).write(tmp / "ar.xyz")
    return tmp


def results(tmp, slow=False):
    """The fast spawn (langevin and the app runs) or the slow one (the other thermostats)."""
    if slow not in _CACHE:
        names = tuple(n for n in ENSEMBLES if (n not in FAST) == slow)
        _CACHE[slow] = spawn(worker, 2, args=(str(tmp), names, not slow), timeout_s=500)
    return _CACHE[slow]


def reference(name, compiled: bool):
    """The one-process run (eager, or compiled with aot_eager), sorted by atom id."""
    from xnn.models import Potential

    mod, pot = _module(name), Potential(lj(), skin=SKIN)
    graph = _crystal()
    state = mod.init(graph, pot, **PARAMS[name])
    integ = None
    if compiled:
        from xnn.dynamics.compiled_thermo import CompiledIntegrator

        integ = CompiledIntegrator(name, pot, backend="aot_eager")
    for _ in range(STEPS):
        state = (integ or mod).step(state, pot, DT)
    order = torch.argsort(state.graph.atom_id)
    return {"positions": state.positions[order], "velocities": state.velocities[order],
            "ids": state.graph.atom_id[order], "energy": state.energy, "vars": state.vars,
            "start": graph.positions[torch.argsort(graph.atom_id)],
            "conserved": mod.conserved(state)}


@pytest.mark.parametrize("name", ENSEMBLE_PARAMS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decomposed_compiled_thermostat_matches_one_process(tmp, name, compiled):
    """Positions, velocities, energy, thermostat state (heat, eta, v_eta) and the conserved
    quantity by global atom id equal the one-process run; atoms migrated in and out of
    every rank and the ghost plans were rebuilt."""
    res = results(tmp, name not in FAST)
    ref, got = reference(name, compiled), res[0][name]
    assert got["step"] == STEPS
    assert torch.equal(got["ids"], ref["ids"])
    for key in ("velocities", "energy"):
        assert _rel(got[key], ref[key]) <= TOL, (key, _rel(got[key], ref[key]))
    moved = _rel(got["positions"] - ref["start"], ref["positions"] - ref["start"])
    assert moved <= TOL, moved
    assert set(got["vars"]) == set(ref["vars"])
    for k, v in ref["vars"].items():
        if v.is_floating_point():
            assert _rel(got["vars"][k], v) <= TOL, (k, got["vars"][k], v)
    assert float(ref["vars"].get("heat", ref["vars"].get("v_eta")).abs().max()) > 0
    for r in res:
        assert _rel(r[name]["conserved"], ref["conserved"]) <= TOL
        s = r[name]["stats"]
        assert s["migrations"] > 0 and s["migrated_in"] > 0 and s["migrated_out"] > 0, s
        assert s["rebuilds"] >= 2, s


@pytest.mark.parametrize("name", ENSEMBLE_PARAMS)
def test_no_recompiles_and_fixed_breaks_per_step(tmp, name):
    """3 regions compiled at the first step, none later (rebuilds and migrations included);
    a step without re-plan: 3 compiled calls, 2 exchanges, 1 collective and a fixed number
    of in-graph all-reduces (the thermostat's global sums)."""
    for r in results(tmp, name not in FAST):
        c = r[name]
        assert c["first"]["compiles"] == 3
        assert c["compiles"] == 3 and c["graphs"] == c["first"]["graphs"], c
        assert c["replans"] >= 2
        assert len(c["steady"]) == 1 and c["steady"][0][:3] == (3, 2, 1), c["steady"]
        assert c["steady"][0][3] > 0  # kinetic energy, degrees of freedom: all-reduced
        assert c["steady"][0][4:] == (0, 0)  # direct: no staged routing


@pytest.mark.parametrize("name", ENSEMBLE_PARAMS)
def test_staged_exchange_follows_one_process_and_direct(tmp, name):
    """``parallel.exchange=staged`` (the plan's routing sends the ghosts; 2 ranks, 1x1x2):
    positions, velocities, energy and thermostat state of the one-process eager run and of
    the direct compiled run to 1e-10, 3 regions compiled at the first step and none later,
    and on each step without re-plan one staged forward and one reverse exchange with the
    direct run's regions, exchanges, collectives and in-graph all-reduces."""
    res = results(tmp, name not in FAST)
    ref, got, direct = reference(name, False), res[0][name]["staged"], res[0][name]
    assert got["step"] == STEPS and torch.equal(got["ids"], ref["ids"])
    for run in (ref, direct):
        for key in ("velocities", "energy"):
            assert _rel(got[key], run[key]) <= TOL, (key, _rel(got[key], run[key]))
        moved = _rel(got["positions"] - ref["start"], run["positions"] - ref["start"])
        assert moved <= TOL, moved
        for k, v in run["vars"].items():
            if v.is_floating_point():
                assert _rel(got["vars"][k], v) <= TOL, (k, got["vars"][k], v)
    for r in res:
        c, d = r[name]["staged"], r[name]
        assert c["stats"]["exchange"] == "staged" and c["stats"]["migrations"] > 0, c["stats"]
        assert _rel(c["conserved"], ref["conserved"]) <= TOL
        assert c["first"]["compiles"] == 3 and c["first"]["new_graphs"] == 3, c["first"]
        assert c["compiles"] == 3 and c["graphs"] == c["first"]["graphs"] and c["replans"] >= 2
        assert c["steady"] == [(*d["steady"][0][:4], 1, 1)], (c["steady"], d["steady"])


def _rows(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_xnn_md_compile_langevin_on_two_ranks_logs_the_eager_rows(tmp):
    """``xnn md compile=true ensemble=langevin parallel.exchange=staged`` on 2 ranks runs
    the compiled decomposed scheme through the staged routing (a forward and a reverse per
    step at least) and writes the thermo rows of ``compile=false`` (direct; conserved
    quantity included)."""
    res = results(tmp)
    assert all(r["app_steps"] == ["CompiledDomainScheme"] and r["app_n_steps"] == 30
               for r in res)
    for r in res:
        eager, compiled = r["app_routed"][False], r["app_routed"][True]
        assert eager == {"forward": 0, "reverse": 0}, eager
        assert min(compiled.values()) >= 30, compiled
    eager, compiled = (_rows(tmp / f"md_langevin_{flag}" / "thermo.csv")
                       for flag in (False, True))
    assert len(compiled) == len(eager) == 30 // 5 + 2
    assert compiled[0] == eager[0]
    for a, b in zip(compiled[1:], eager[1:]):
        assert [float(x) for x in a] == pytest.approx([float(x) for x in b], rel=1e-9)


def test_npt_is_refused_on_several_ranks():
    """The decomposed run layer gets NPT refused with the one-process message."""
    from types import SimpleNamespace

    from xnn.app.md_setup import compiled_integrator
    from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator
    from xnn.errors import InputError

    par = SimpleNamespace(compiled_integrator=lambda *a, **k: pytest.fail("not refused"))
    cfg = SimpleNamespace(ensemble="npt", cuda_graph=False)
    with pytest.raises(InputError, match="compiles ensembles nve, langevin, csvr, nhc"):
        compiled_integrator(cfg, par)
    with pytest.raises(InputError, match="not 'npt'"):
        CompiledDomainIntegrator("npt", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ENSEMBLES)
def test_inductor_one_domain_on_cuda_matches_eager(name):
    """On a GPU, inductor (Triton) compiles the scheme regions of one domain (no process
    group: its own periodic images as ghosts) — the hashed noise, the sums over real rows —
    to the one-process eager trajectory, with no recompile after the first step."""
    from xnn.distributed import parallelize
    from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator
    from xnn.models import Potential

    dev = torch.device("cuda")
    mod, graph = _module(name), _crystal().to(dev)
    pot = Potential(lj().to(dev), skin=SKIN)
    dom = parallelize(lj().to(dev), None, "halo", skin=SKIN)
    integ = CompiledDomainIntegrator(name, dom, backend="inductor")
    eager = mod.init(graph, pot, **PARAMS[name])
    compiled = integ.init(dom.scatter(graph), dom, reduce=dom.reducer, **PARAMS[name])
    for _ in range(STEPS):
        eager, compiled = mod.step(eager, pot, DT), integ.step(compiled, dom, DT)
    assert integ.stepper.n_compiles == 3 and integ.stepper.n_replans >= 2
    order, ref = torch.argsort(compiled.graph.atom_id), torch.argsort(eager.graph.atom_id)
    assert torch.equal(compiled.graph.atom_id[order], eager.graph.atom_id[ref])
    assert _rel(compiled.velocities[order], eager.velocities[ref]) <= TOL
    for k, v in eager.vars.items():
        if v.is_floating_point():
            assert _rel(compiled.vars[k], v) <= TOL, k
