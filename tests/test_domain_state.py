"""Each rank owns its atoms: scatter, owner-pushed ghosts, migration, decomposed NVE, gather.

gloo ranks on CPU, fp64, compared with one process by global atom id. One set of ranks is
spawned per world size (2, 3, 4, 8); each runs all of its cases and returns their results.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from dist_helpers import spawn
from helpers import corner, hot, lj, molecule, primitive, slab, tiny, triclinic
from helpers import rel as _rel

from xnn.data import keys as K

pytestmark = pytest.mark.distributed

TOL = 1e-10
SKIN = 0.5
K.register_field("test_tag", K.ATOM)  # a user field: [n_atoms, 2] float, moves with atoms


# ---------------------------------------------------------------------------- systems


STRUCTURES = {"triclinic": triclinic, "slab": slab, "molecule": molecule, "corner": corner,
              "tiny": tiny}


# ---------------------------------------------------------------------------- cases


def _single_point(pot, name, grid, rank):
    """Energy, forces by id, stress/virial of a decomposed evaluation vs one process."""
    from xnn.models import Potential

    graph = STRUCTURES[name]()
    owned = pot.scatter(graph if rank == 0 else None)
    out = pot(owned)
    full, extra = pot.gather(owned, {"forces": out["forces"], "energies": out["energies"]})
    result = {"stats": pot.stats()}
    if rank == 0:
        ref = Potential(pot.model)(graph)
        order = torch.argsort(graph.atom_id)
        key = "stress" if bool(graph.pbc.all()) else "virial"
        result["errors"] = {"energy": _rel(out["energy"], ref["energy"]),
                            "forces": _rel(extra["forces"], ref["forces"][order]),
                            "energies": _rel(extra["energies"], ref["energies"][order]),
                            key: _rel(out[key], ref[key])}
        result["ids"] = bool(torch.equal(full.atom_id, graph.atom_id[order]))
        result["positions"] = bool(torch.equal(full.positions, graph.positions[order]))
    return result


def _nve(pot, graph, steps, dt, rank):
    """``steps`` of velocity Verlet on the owned atoms, migrating between steps."""
    from xnn.dynamics import nve
    from xnn.models import Potential

    state = nve.init(pot.scatter(graph if rank == 0 else None), pot)
    for _ in range(steps):
        state = nve.step(state, pot, dt, reduce=pot.reducer)
        state = pot.maybe_migrate(state)
    full, extra = pot.gather(state.graph, {"forces": state.forces})
    out = {"stats": pot.stats()}
    if rank == 0:
        single = Potential(pot.model, skin=SKIN)
        ref = nve.init(graph, single)
        for _ in range(steps):
            ref = nve.step(ref, single, dt)
        order = torch.argsort(graph.atom_id)
        g = ref.graph
        out["errors"] = {"positions": _rel(full.positions - graph.positions[order],
                                           g.positions[order] - graph.positions[order]),
                         "velocities": _rel(full.velocities, g.velocities[order]),
                         "forces": _rel(extra["forces"], ref.forces[order]),
                         "energy": _rel(state.energy, ref.energy)}
        out["moved"] = float((g.positions - graph.positions).norm(dim=-1).max())
    return out


def _held(pot, graph, steps, rank):
    """Atoms held per rank during MD, and the first dimension of every tensor made then."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from xnn.dynamics import nve

    sizes = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.update(t.shape[0] for t in tree_leaves(out)
                         if isinstance(t, torch.Tensor) and t.ndim)
            return out

    state = nve.init(pot.scatter(graph if rank == 0 else None), pot)
    with Record():
        for _ in range(steps):
            state = nve.step(state, pot, 1.0, reduce=pot.reducer)
            state = pot.maybe_migrate(state)
    st, local = pot.state, pot.state.local
    ghosts = {k: int(v.shape[0]) for k, v in local.ghost_fields.items()}
    return {"sizes": sorted(sizes), "stats": pot.stats(), "state_atoms": state.graph.n_atoms,
            "domain_atoms": st.graph.n_atoms, "n_local": local.n_local,
            "ghost_rows": sorted(set(ghosts.values())), "x_last": pot._last_eval[0].shape[0]}


def _unknown_ownership(pot, graph, rank, world):
    """Shards by id (as after a restart on another rank count) with a user field: the
    first rebuild migrates every atom to its box, with the user field and an extra."""
    from xnn.models import Potential

    tag = torch.stack([graph.atom_id.double(), graph.positions[:, 0] * 2], dim=1)
    graph = graph.replace(test_tag=tag)
    shard = graph.select_atoms(torch.nonzero(graph.atom_id % world == rank).flatten())
    extra = {"marker": shard.atom_id * 10}
    owned, extra = pot.maybe_rebuild(shard, extra)
    out = pot(owned)
    result = {"stats": pot.stats(),
              "marker_ok": bool(torch.equal(extra["marker"], owned.atom_id * 10)),
              "sorted": bool((owned.atom_id[1:] > owned.atom_id[:-1]).all())}
    full, gathered = pot.gather(owned, {"forces": out["forces"]})
    if rank == 0:
        order = torch.argsort(graph.atom_id)
        ref = Potential(pot.model)(graph)
        result["forces"] = _rel(gathered["forces"], ref["forces"][order])
        result["tag_ok"] = bool(torch.equal(full.test_tag, tag[order]))
    return result


def _strain_and_errors(pot, rank):
    """A changed cell (as under NPT) re-partitions; an owner beyond the peers fails on every
    rank; the shortest pair is the one process's."""
    from xnn.distributed.domain.migrate import migrate
    from xnn.errors import XnnError
    from xnn.models import Potential

    graph = triclinic()
    owned = pot.scatter(graph if rank == 0 else None)
    pot(owned)
    deform = torch.eye(3) + torch.tensor([[0.02, 0.01, 0.0], [0.01, -0.01, 0.0], [0, 0, 0.03]])
    strained = owned.replace(positions=owned.positions @ deform, cell=owned.cell @ deform)
    out = pot(strained)
    distance, pair = pot.min_pair_distance()
    result = {"rebuilds": pot.stats()["rebuilds"], "distance": float(distance),
              "pair": sorted(pair.tolist())}
    part = pot.state.partition  # boxes moved by half a box: half of rank 0's atoms are in box 1
    moved = dataclasses.replace(part, lo=part.lo - 0.5 * part.width)
    try:  # ... but rank 0 is told it has no peers
        migrate(strained, None, moved, [], pot.group)
    except XnnError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        full = graph.replace(positions=graph.positions @ deform, cell=graph.cell @ deform)
        ref = Potential(pot.model)(full)
        result["energy"] = _rel(out["energy"], ref["energy"])
        result["stress"] = _rel(out["stress"], ref["stress"])
        from xnn.neighbors import with_edges

        g = with_edges(full, 4.0)
        d = g.edge_vectors().norm(dim=-1)
        e = int(torch.argmin(d))
        result["ref_distance"] = float(d[e])
        result["ref_pair"] = sorted(full.atom_id[g.edge_index[:, e]].tolist())
    return result


# ---------------------------------------------------------------------------- workers

CASES = {  # world size -> [(structure, grid)]
    2: [("triclinic", None), ("slab", None), ("molecule", None)],
    3: [("triclinic", None), ("slab", None)],
    4: [("triclinic", None), ("corner", (1, 1, 4)), ("molecule", None)],
    8: [("triclinic", None), ("tiny", None), ("corner", None)],
}
# world size -> NVE steps in its default spawn (4 ranks: a spawn under -m slow). 8 ranks run
# only under -m slow: their single points and test_nve_1000_steps[8] share one spawn of 8
# processes instead of two (-m slow -k 8: 211 s -> 166 s on the loaded 2-core dev machine).
MD = {2: 300, 8: 1000}
MD_REPS = {3: (6, 4, 4)}  # box faces on lattice planes: 3 boxes along the 6 cells
MD_TEMPERATURE = 2000.0  # K: a hot solid; atoms on the box faces cross them back and forth


def worker(rank, world, md_steps):
    from xnn.distributed import DistributedManager, parallelize

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    results = {}
    for name, grid in CASES[world]:
        pot = parallelize(lj(), manager, "halo", grid=grid)
        results[name] = _single_point(pot, name, grid, rank)
    if world == 2:
        pot = parallelize(lj(), manager, "halo", skin=SKIN)
        results["unknown"] = _unknown_ownership(pot, triclinic(), rank, world)
        results["strain"] = _strain_and_errors(parallelize(lj(), manager, "halo", skin=SKIN), rank)
        cluster = hot(molecule((6, 2, 2)), 1000.0)  # 96 atoms, 21 Å long: nobody holds all
        results["held"] = _held(parallelize(lj(3.0), manager, "halo", grid=(2, 1, 1), skin=0.3),
                                cluster, 5, rank)
    if md_steps.get(world):
        t0 = time.perf_counter()
        pot = parallelize(lj(), manager, "halo", skin=SKIN)
        graph = hot(primitive(MD_REPS.get(world, (4, 4, 4))), MD_TEMPERATURE)
        results["md"] = _nve(pot, graph, md_steps[world], 1.0, rank)
        results["md"]["seconds"] = time.perf_counter() - t0
    return results


_CACHE: dict[tuple, list] = {}


def results(world, md_steps=None):
    md_steps = MD if md_steps is None else md_steps
    key = (world, md_steps.get(world))  # a spawn runs only its own world size's MD
    if key not in _CACHE:
        _CACHE[key] = spawn(worker, world, args=(md_steps,), timeout_s=300)
    return _CACHE[key]


# ---------------------------------------------------------------------------- tests

# 8 ranks on CI's 2 cores: the slow set (2, 3 and 4 ranks keep every kind of case fast)
SINGLE = [pytest.param(w, name, id=f"{w}-{name}", marks=[pytest.mark.slow] if w == 8 else [])
          for w in CASES for name, _ in CASES[w]]


@pytest.mark.parametrize("world,name", SINGLE)
def test_single_point_matches_one_process(world, name):
    res = results(world)
    r = res[0][name]
    assert r["ids"] and r["positions"], "gather lost the global-id order"
    for key, err in r["errors"].items():
        assert err <= TOL, f"{key}: relative error {err:.2e} on {world} ranks ({name})"
    owned = [x[name]["stats"]["n_owned"] for x in res]
    assert sum(owned) == STRUCTURES[name]().n_atoms


def test_empty_boxes_and_wide_halos():
    """The cases really have empty boxes (4 ranks; 8 below, under -m slow)."""
    corner4 = [r["corner"]["stats"] for r in results(4)]
    assert min(s["n_owned"] for s in corner4) == 0
    assert max(s["n_peers"] for s in corner4) <= 2  # a periodic chain of 4 slabs


@pytest.mark.slow  # 8 ranks on CI's 2 cores
def test_empty_boxes_and_wide_halos_on_8_ranks():
    """Empty boxes, ghost shells wider than a box, peers beyond the neighbouring boxes."""
    corner8 = [r["corner"]["stats"] for r in results(8)]
    assert sum(s["n_owned"] == 0 for s in corner8) >= 3
    tiny8 = [r["tiny"]["stats"] for r in results(8)]
    assert min(s["n_owned"] for s in tiny8) == 0 and max(s["n_owned"] for s in tiny8) <= 1
    assert all(s["n_ghost"] > 100 for s in tiny8)  # 5 Å halo over a 3.6 Å cell
    assert all(s["n_peers"] == 7 for s in tiny8)  # every box is within reach of every other
    assert sorted(results(8)[0]["triclinic"]["stats"]["grid"]) == [2, 2, 2]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_nve_with_migration_matches_one_process(world):
    # 4 ranks (-m slow) check test_nve_1000_steps[4]'s spawn instead of spawning again for 300
    # steps (12.6 s on the dev machine): every assertion below holds over 1000 steps as well
    # (measured: moved 0.37 Å, 53 migrations and 54 rebuilds per rank, errors 2e-13)
    res = results(world, {world: 300 if world == 2 else 1000})
    md = res[0]["md"]
    assert md["moved"] > 0.2, md
    for key, err in md["errors"].items():
        assert err <= TOL, f"{key}: relative error {err:.2e} after NVE on {world} ranks"
    for r in res:
        st = r["md"]["stats"]
        assert st["migrations"] > 0 and st["migrated_out"] + st["migrated_in"] > 0, st
        assert st["rebuilds"] == st["migrations"] + 1, st  # no rebuild inside a step
    assert sum(r["md"]["stats"]["n_owned"] for r in res) == 64
    assert res[0]["md"]["stats"]["migrations"] < 60  # the skin spares most rebuilds


def test_ranks_hold_only_owned_and_ghost_atoms():
    """No rank holds the whole system: the state has its owned atoms, the plan its ghosts,
    and no tensor made during the MD steps has the size of the system (96 atoms)."""
    res = results(2)
    held = [r["held"] for r in res]
    assert sum(h["stats"]["n_owned"] for h in held) == 96
    for h in held:
        st = h["stats"]
        assert h["state_atoms"] == h["domain_atoms"] == st["n_owned"]
        assert h["n_local"] == h["x_last"] == st["n_held"] == st["n_owned"] + st["n_ghost"]
        assert h["ghost_rows"] == [st["n_recv"]]
        assert st["n_held"] < 80, st
        assert 96 not in h["sizes"], "a tensor of the whole system's size was built"
        assert st["n_owned"] in h["sizes"]  # the recorder saw the owned-atom tensors


def test_unknown_ownership_migrates_every_field():
    res = results(2)
    for r in res:
        u = r["unknown"]
        assert u["marker_ok"] and u["sorted"]
        assert u["stats"]["migrations"] == 1 and u["stats"]["migrated_in"] > 0
    assert res[0]["unknown"]["tag_ok"]
    assert res[0]["unknown"]["forces"] <= TOL


def test_cell_change_min_distance_and_migration_error():
    res = results(2)
    r0 = res[0]["strain"]
    assert r0["energy"] <= TOL and r0["stress"] <= TOL, r0
    assert all(r["strain"]["rebuilds"] == 2 for r in res)  # the new cell re-partitioned
    d = min(r["strain"]["distance"] for r in res)
    assert abs(d - r0["ref_distance"]) <= 1e-12 * d
    pairs = [r["strain"]["pair"] for r in res if r["strain"]["distance"] == d]
    assert r0["ref_pair"] in pairs
    assert "left box 0 for boxes [1] beyond the halo" in r0["error"], r0["error"]
    assert res[1]["strain"]["error"].startswith("RemoteRankError: rank 0 failed during "
                                                "migration"), res[1]["strain"]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_nve_1000_steps(world):
    res = results(world, {world: 1000})
    for key, err in res[0]["md"]["errors"].items():
        assert err <= TOL, f"{key}: relative error {err:.2e} after 1000 steps on {world} ranks"
    for r in res:
        st = r["md"]["stats"]
        assert st["migrated_out"] + st["migrated_in"] > 0, st
