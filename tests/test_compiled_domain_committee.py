"""A committee in the compiled decomposed MD step (``md.compile=true`` under torchrun,
issue 46): on 2 gloo ranks, NVE and Langevin of a 3-member SchNet committee through
:class:`~xnn.distributed.domain.compiled_thermo.CompiledDomainIntegrator` (aot_eager) follow
the eager decomposed step and one process by atom id in fp64 — positions, velocities, the mean
forces, each owned atom's force spread ``forces_std``, the total energy, its spread
``energy_std`` and the stress — through migrations and ghost-plan rebuilds; a steady step keeps
the collectives of one model (2 exchanges of the members' rows side by side, 1 all-gather);
the uncertainty guard (``safety.max_force_uncertainty``) decides the same on both ranks,
also on the rank whose own atoms stay below the threshold; and ``xnn md compile=true`` of a
committee on 2 ranks (refused before; with ``parallel.exchange=staged``) logs the thermo
rows, uncertainty columns included, of ``compile=false``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from dist_helpers import FreshPorts, spawn
from helpers import rel
from helpers.compiled import count_app_domain_steps, count_routed
from helpers.structures import fcc, graph, hot
from helpers.uncertainty import committee, compressed_cu, md_args

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

TOL = 1e-10
SKIN = 0.3
DT = 2.0
STEPS = 8
PARAMS = {"nve": {}, "langevin": dict(temperature=1500.0, friction=0.02, seed=5)}


def _structure():
    return hot(graph(fcc((3, 3, 3), rattle=0.05, seed=2), seed=3), 1500.0)


def _fields(state, graph_=None):
    g = state.graph if graph_ is None else graph_
    return {"positions": g.positions, "velocities": g.velocities, "forces_std": g["forces_std"]}


def _run(manager, ensemble, compiled):
    from xnn.distributed import parallelize
    from xnn.distributed.collectives import count_collectives
    from xnn.distributed.domain.compiled_thermo import CompiledDomainIntegrator
    from xnn.dynamics import registry
    from xnn.dynamics.safety import SimulationError, UncertaintyGuard

    pot = parallelize(committee(), manager, "halo", skin=SKIN)
    module = registry.get_integrator(ensemble)
    integ = CompiledDomainIntegrator(ensemble, pot, backend="aot_eager") if compiled else None
    state = module.init(pot.scatter(_structure() if manager.rank == 0 else None), pot,
                        reduce=pot.reducer, **PARAMS[ensemble])
    steady = []
    for _ in range(STEPS):
        replans = integ.stepper.n_replans if integ else 0
        with count_collectives() as n:
            if integ:
                state = integ.step(state, pot, DT)
            else:
                state = pot.maybe_migrate(module.step(state, pot, DT, reduce=pot.reducer))
        if integ and integ.stepper.n_replans == replans:
            steady.append(dict(n.calls))
    g = state.graph
    # the guard at a threshold between the two ranks' own largest spreads: both stop
    local = pot.reducer.gather_small(g["forces_std"].max().reshape(1)).flatten()
    guard, stopped = UncertaintyGuard(float(local.mean())), None
    try:
        guard.check(state, pot.reducer)
    except SimulationError as e:
        stopped = str(e)
    full, _ = pot.gather(g, {"forces": state.forces})
    out = {"steady": steady, "stats": pot.stats(), "local_max": local.tolist(),
           "stopped": stopped, "mine_below": float(g["forces_std"].max()) < guard.threshold}
    if manager.rank == 0:
        order = torch.argsort(full.atom_id)
        out.update(ids=full.atom_id[order], energy=state.energy, stress=state.stress,
                   energy_std=g["energy_std"], **{k: v[order] for k, v in _fields(
                       state, full).items()})
    return out


def worker(rank, world, tmp):
    from xnn.cli.main import main
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(backend="gloo", timeout_s=300)
    torch.set_num_threads(1)
    out = {(e, c): _run(manager, e, c) for e in PARAMS for c in (False, True)}
    made, calls, routed = count_app_domain_steps(), count_routed(), {}
    ports = FreshPorts(manager, 2)
    for flag in ("false", "true"):
        ports.next()
        args = md_args(Path(tmp) / "cu.xyz", Path(tmp) / "committee.pt",
                       Path(tmp) / f"md_{flag}", f"compile={flag}")
        if flag == "true":  # the compiled run sends its ghosts staged, the eager one direct
            args.append("parallel.exchange=staged")
        before = dict(calls)
        assert main(["md", *args]) == 0, f"xnn md {' '.join(args)} failed"
        routed[flag] = {k: calls[k] - before[k] for k in calls}
    return {**out, "app_steps": len(made), "app_routed": routed}


_CACHE: dict = {}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    from xnn.models.serialization import save_model

    tmp = tmp_path_factory.mktemp("compiled_domain_committee")
    compressed_cu(tmp / "cu.xyz")
    save_model(committee(), tmp / "committee.pt")
    return tmp


@pytest.fixture(scope="module")
def res(tmp):
    if "res" not in _CACHE:
        _CACHE["res"] = spawn(worker, 2, args=(str(tmp),), timeout_s=900)
    return _CACHE["res"]


def reference(ensemble):
    """One process, eager, sorted by atom id."""
    from xnn.dynamics import registry
    from xnn.models import Potential

    module, pot = registry.get_integrator(ensemble), Potential(committee(), skin=SKIN)
    state = module.init(_structure(), pot, **PARAMS[ensemble])
    for _ in range(STEPS):
        state = module.step(state, pot, DT)
    order = torch.argsort(state.graph.atom_id)
    return {"ids": state.graph.atom_id[order], "energy": state.energy, "stress": state.stress,
            "energy_std": state.graph["energy_std"],
            **{k: v[order] for k, v in _fields(state).items()}}


@pytest.mark.parametrize("ensemble", list(PARAMS))
def test_compiled_decomposed_committee_follows_eager_and_one_process(res, ensemble):
    ref = reference(ensemble)
    for got in (res[0][ensemble, True], res[0][ensemble, False]):
        assert torch.equal(got["ids"], ref["ids"])
        for key in ("positions", "velocities", "forces_std", "energy", "energy_std", "stress"):
            err = rel(got[key], ref[key])
            assert err <= TOL, (ensemble, key, err)
    assert float(ref["energy_std"].min()) > 0 and float(ref["forces_std"].min()) > 0
    for r in res:
        s = r[ensemble, True]["stats"]
        assert s["migrations"] > 0 and s["rebuilds"] >= 2, s


@pytest.mark.parametrize("ensemble", list(PARAMS))
def test_compiled_decomposed_committee_keeps_one_models_collectives(res, ensemble):
    """A steady step: the members' forces travel side by side in the 2 exchanges, their
    energies and virials in the 1 all-gather; Langevin adds its 4 fused in-graph sums."""
    want = {"exchange": 2, "all_gather": 1, **({"all_reduce": 4} if ensemble == "langevin"
                                                 else {})}
    for r in res:
        assert r[ensemble, True]["steady"], r[ensemble, True]
        for calls in r[ensemble, True]["steady"]:
            assert calls == want, calls


@pytest.mark.parametrize("ensemble", list(PARAMS))
def test_uncertainty_guard_stops_every_rank_alike(res, ensemble):
    """Threshold between the ranks' own largest spreads: one rank's atoms stay below it, yet
    both ranks stop, with the same message."""
    a, b = (r[ensemble, True] for r in res)
    assert a["local_max"] == b["local_max"] and a["local_max"][0] != a["local_max"][1]
    assert a["mine_below"] or b["mine_below"]
    assert a["stopped"] is not None and a["stopped"] == b["stopped"]


def _rows(path):
    with open(path) as f:
        return list(csv.reader(f))


def test_xnn_md_compile_runs_a_committee_on_two_ranks(res, tmp):
    """``xnn md compile=true parallel.exchange=staged`` with a committee on 2 ranks runs the
    compiled decomposed step on every rank, the members' force rows side by side through
    the staged routing (a forward and a reverse per step at least), and logs the rows of
    ``compile=false`` (direct), the uncertainty columns included."""
    from helpers.uncertainty import STEPS as MD_STEPS

    assert all(r["app_steps"] == MD_STEPS for r in res)
    for r in res:
        assert r["app_routed"]["false"] == {"forward": 0, "reverse": 0}, r["app_routed"]
        assert min(r["app_routed"]["true"].values()) >= MD_STEPS, r["app_routed"]
    eager, compiled = (_rows(tmp / f"md_{flag}" / "thermo.csv") for flag in ("false", "true"))
    assert compiled[0] == eager[0] and any("std" in c for c in eager[0]), eager[0]
    assert len(compiled) == len(eager) == MD_STEPS + 2
    for a, b in zip(compiled[1:], eager[1:]):
        assert [float(x) for x in a] == pytest.approx([float(x) for x in b], rel=1e-9)
