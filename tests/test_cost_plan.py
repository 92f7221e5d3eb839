"""Ghost plans at scale (:func:`xnn.distributed.cost.plan.plan_counts`) against actual
decomposed runs: the per-rank counts of the at-scale plan equal those of the real layouts.

One set of 8 gloo ranks is spawned for the module; sub-groups of 2, 3, 4 and 8 of them
scatter each test system through a :class:`~xnn.distributed.DecomposedPotential` (a
2-interaction SchNet, cutoff 5 Å, skin 1 Å: halo width 11 Å in mode halo, 6 Å in mode
sync) or a graph layout, and report what their ghost plans hold.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import spawn

from xnn.distributed.cost.plan import plan_counts
from xnn.distributed.cost.systems import SYSTEMS, make_system
from xnn.errors import InputError

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

N_ATOMS = 2000
CUTOFF, SKIN = 5.0, 1.0
SIZES = (2, 3, 4, 8)
WIDTHS = {"halo": 2 * CUTOFF + SKIN, "sync": CUTOFF + SKIN, "graph": CUTOFF + SKIN}
CASES = [(s, m, p) for s in SYSTEMS for m in ("halo", "sync", "graph") for p in SIZES]


def _model():
    from xnn.models.schnet import SchNet

    torch.manual_seed(0)
    model = SchNet([29], cutoff=CUTOFF, num_features=4, num_filters=4, num_interactions=2,
                   num_basis=4).double()
    return model.train()  # no reverse-pair edge lists (they add edges into far ghosts)


def _graph(name):
    from xnn.data.graph import AtomicGraph

    pos, cell, pbc = make_system(name, N_ATOMS).build()
    return AtomicGraph.from_arrays(pos, torch.full((pos.shape[0],), 29), cell, pbc)


def _real_counts(rank, world):
    """Every case's counts on every rank of its sub-group (``None`` outside it)."""
    import torch.distributed as dist

    from xnn.distributed import DistributedManager
    from xnn.distributed.domain.layout import SpatialLayout
    from xnn.distributed.graph.layout import GraphLayout
    from xnn.distributed.potential import DecomposedPotential

    DistributedManager.initialize(backend="gloo", timeout_s=300, device="cpu")
    groups = {p: dist.new_group(list(range(p))) for p in SIZES}
    graphs = {s: _graph(s) for s in SYSTEMS}
    out = {}
    for system, mode, p in CASES:
        if rank >= p:
            continue
        layout = GraphLayout("morton") if mode == "graph" else SpatialLayout(mode)
        pot = DecomposedPotential(_model(), groups[p], layout, skin=SKIN)
        owned = pot.scatter(graphs[system] if rank == 0 else None)
        pot.update(owned)  # graph mode builds its plan when first needed (spatial: no-op)
        st, dom = pot.stats(), pot.state.local
        edges = dom.n_within if mode != "graph" else int(dom.edge_index.shape[1])
        out[(system, mode, p)] = (st["n_owned"], st["n_ghost"], edges, st["n_send"],
                                  st["n_recv"], st["n_peers"], tuple(st["grid"] or ()),
                                  pot.halo_width)
    return out


@pytest.fixture(scope="module")
def real():
    per_rank = spawn(_real_counts, 8, timeout_s=900.0)
    return {case: [per_rank[r][case] for r in range(case[2])] for case in CASES}


@pytest.mark.parametrize("system", SYSTEMS)
def test_plan_counts_equal_an_actual_decomposed_run(real, system):
    """Owned, ghost, edges, sent and received rows and peers of every rank, exactly, for
    halo and sync boxes and graph blocks on 2, 3, 4 and 8 ranks."""
    for _, mode, p in [c for c in CASES if c[0] == system]:
        rows = real[(system, mode, p)]
        width = rows[0][7]
        assert width == pytest.approx(WIDTHS[mode])
        plan = plan_counts(system, N_ATOMS, p, mode=mode, cutoff=CUTOFF, halo_width=width)
        names = ("owned", "ghost", "edges", "send_rows", "recv_rows", "peers")
        for k, name in enumerate(names):
            got = getattr(plan, name).tolist()
            want = [row[k] for row in rows]
            assert got == want, f"{system} {mode} {p} ranks: {name} plan {got} run {want}"
        if mode != "graph":
            assert plan.grid == rows[0][6], (system, mode, p)
        assert plan.method.startswith("exact") and "sampled" not in plan.method
        assert plan.n_atoms == make_system(system, N_ATOMS).n_atoms


def test_system_neighbours_equal_the_neighbor_list():
    """The systems' lattice neighbour counts (the plan's edges) equal the project's
    neighbor list on the generated positions, in every geometry."""
    from xnn.neighbors import neighbor_list

    for name in SYSTEMS:
        sys = make_system(name, 1500, seed=3)
        pos, cell, pbc = sys.build()
        ei, _ = neighbor_list(pos, cell, pbc, 5.5)
        want = np.bincount(ei[1].numpy(), minlength=sys.n_atoms)
        got = (sys.neighbors(np.arange(sys.n_atoms), 5.5) >= 0).sum(1)
        assert (got == want).all(), name


def test_sampled_counts_are_close_and_say_so():
    """Above the exact limit the liquid's edges are sampled: within a few standard errors
    of the exact counts, and the method says how."""
    exact = plan_counts("liquid", 20000, 8, mode="sync", cutoff=5.0, halo_width=6.0)
    est = plan_counts("liquid", 20000, 8, mode="sync", cutoff=5.0, halo_width=6.0,
                      exact_edges=1000, sample=0.25)
    assert (est.ghost == exact.ghost).all() and (est.owned == exact.owned).all()
    rel = float(est.method.split("relative standard error of a rank's edges ")[1].split(";")[0])
    assert 0 < rel < 0.05
    assert np.abs(est.edges / exact.edges - 1).max() < 4 * rel
    assert "sampled: edges" in est.method


def test_bad_arguments_are_refused():
    with pytest.raises(InputError, match="mode must be one of"):
        plan_counts("fcc", 1000, 2, mode="spatial", cutoff=5.0, halo_width=6.0)
    with pytest.raises(InputError, match="system must be one of"):
        plan_counts("bcc", 1000, 2, mode="halo", cutoff=5.0, halo_width=6.0)
    with pytest.raises(InputError, match="below the cutoff"):
        plan_counts("fcc", 1000, 2, mode="halo", cutoff=5.0, halo_width=4.0)


@pytest.mark.parametrize("system", ["fcc", "slab", "cylinder"])
def test_factored_crystal_counts_equal_the_streamed_ones(system):
    """A crystal's counts summed factor by factor (:mod:`xnn.distributed.cost.separable`,
    what the plan uses at scale) equal those of every atom streamed (what the decomposed
    runs above check), also for boxes thinner than the halo (27 and 64 ranks)."""
    for mode, width in (("halo", 11.0), ("sync", 6.0)):
        for p in (2, 3, 8, 27, 64):
            fact = plan_counts(system, 3000, p, mode=mode, cutoff=5.0, halo_width=width)
            streamed = plan_counts(system, 3000, p, mode=mode, cutoff=5.0, halo_width=width,
                                   stream=True)
            assert "products" in fact.method and "streamed" in streamed.method
            assert fact.grid == streamed.grid
            for name in ("owned", "ghost", "edges", "send_rows", "recv_rows", "peers"):
                assert (getattr(fact, name) == getattr(streamed, name)).all(), (system, p, name)


def test_plan_counts_equal_the_committed_million_atom_run():
    """The owned and ghost atoms of every rank of the committed 1,000,188-atom LJ argon run
    (``benchmarks/results/dd_md_cpu16.json``: FCC a = 5.26 Å, 63^3 cells, halo 6 + 1 Å, on
    1, 2, 4 and 8 gloo ranks of a 16-core host), the grid and the boundary atoms' split
    (125,024 / 125,023) included."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/dd_md_cpu16.json"
    data = json.loads(path.read_text())
    assert data["settings"]["cutoff"] == 6.0 and data["settings"]["skin"] == 1.0
    for row in data["rows"]:
        plan = plan_counts("fcc", row["n_atoms"], row["ranks"], mode="halo", cutoff=6.0,
                           halo_width=7.0, lattice_constant=5.26)
        assert plan.n_atoms == row["n_atoms"] and list(plan.grid) == row["grid"]
        assert plan.owned.tolist() == [r["n_owned"] for r in row["per_rank"]]
        assert plan.ghost.tolist() == [r["n_ghost"] for r in row["per_rank"]]
