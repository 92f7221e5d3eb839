"""Graph mode's owners at scale (:mod:`xnn.distributed.cost.blocks`): the rank starts found
as order statistics of streamed Morton codes give every atom the rank that the project's
own :func:`~xnn.distributed.graph.order.assign_owners` (a sort of all codes) gives it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from xnn.data.graph import AtomicGraph
from xnn.distributed.cost.blocks import graph_owners, owners, rank_starts
from xnn.distributed.cost.plan import plan_counts
from xnn.distributed.cost.systems import SYSTEMS, make_system
from xnn.distributed.graph.order import _spread, assign_owners, morton_codes

pytestmark = pytest.mark.usefixtures("one_thread")
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks/results/ghost_plan_scale_cpu.json"


@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("n_atoms", [3000, 100_000])
def test_owners_equal_assign_owners_atom_by_atom(system, n_atoms):
    sys = make_system(system, n_atoms)
    pos, cell, pbc = sys.build()
    graph = AtomicGraph.from_arrays(pos, torch.full((pos.shape[0],), 29), cell, pbc)
    for n_ranks in (8, 64, 1000, 5000):  # 1000 does not divide N; 5000 > N for 3000 atoms
        ref = assign_owners(graph, n_ranks, "morton").numpy()
        for block in (1 << 21, 777):  # one block; many (non-periodic bounds carried along)
            got = graph_owners(sys, n_ranks, "morton", block)
            np.testing.assert_array_equal(got, ref)
        assert np.bincount(got, minlength=n_ranks).max() - np.bincount(
            got, minlength=n_ranks).min() <= 1


@pytest.mark.parametrize("span", [1, 5, 1 << 30])
def test_rank_starts_order_ties_by_id(span):
    """Codes with many ties (span 1: all equal; 5: five values) or none: the owners equal
    those of a lexicographic sort by (code, id), in blocks smaller than a bin's run."""
    rng = np.random.default_rng(span)
    codes = rng.integers(0, span, 20_011).astype(np.uint32)
    seq = np.lexsort((np.arange(len(codes)), codes))  # by code, then by id
    for n_ranks in (2, 7, 64, 30_000):
        ref = np.empty(len(codes), dtype=np.int64)
        ref[seq] = np.arange(len(codes)) * n_ranks // len(codes)
        starts = rank_starts(codes, n_ranks, block=1000)
        got = np.concatenate([owners(codes[lo: lo + 1000], starts, lo, np.int64)
                              for lo in range(0, len(codes), 1000)])
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("system", ["fcc", "liquid"])
def test_graph_rows_at_a_million_atoms_reproduce_the_committed_ones(system):
    """The plans with these owners equal the committed rows (made with a sort of all codes),
    sampled ghosts and edges included: the same owners and the same seeded sample."""
    rows = [r for r in json.loads(RESULTS.read_text())["rows"]
            if r["mode"] == "graph" and r["system"] == system and r["n_atoms"] < 2 * 10**6
            and r["n_ranks"] in (8, 1024)]
    assert len(rows) == 2
    for r in rows:
        c = plan_counts(system, r["n_atoms"], r["n_ranks"], mode="graph",
                        cutoff=r["cutoff"], halo_width=r["halo_width"])
        assert c.n_atoms == r["n_atoms"]
        assert (int(c.owned.min()), int(c.owned.max())) == (r["owned_min"], r["owned_max"])
        assert (int(c.ghost.max()), float(c.ghost.mean())) == (r["ghost_max"],
                                                               r["ghost_mean"])
        assert (int(c.edges.max()), float(c.edges.mean())) == (r["edges_max"],
                                                               r["edges_mean"])
        assert "sampled: a seeded 0.05 of the atoms" in c.method


def test_morton_code_interleaves_the_bits_of_the_three_axes():
    """Bit ``b`` of axis ``a``'s 10-bit cell index is bit ``3 b + a`` of the code, for every
    cell index (the codes that the owners above are blocks of)."""
    q = torch.arange(1024)
    spread = _spread(q)
    for b in range(10):
        np.testing.assert_array_equal(((spread >> (3 * b)) & 1).numpy(), ((q >> b) & 1).numpy())
    assert int((spread & ~sum(1 << (3 * b) for b in range(10))).abs().max()) == 0
    cell, pbc = torch.eye(3, dtype=torch.float64) * 8.0, torch.tensor([True] * 3)
    pos = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64) * 8.0 / 1024 + 1e-9
    assert int(morton_codes(pos, cell, pbc)) == int(spread[1] | spread[2] << 1 | spread[3] << 2)


def test_benchmark_only_reruns_the_named_rows_and_keeps_the_others(tmp_path):
    """``ghost_plan_scale.py --only``: the named job runs again (here one a copy lists as
    skipped), its skipped entry goes, every other row, skip and check is kept as it was."""
    import sys

    sys.path.insert(0, str(RESULTS.parents[2]))
    from benchmarks import ghost_plan_scale

    data = json.loads(RESULTS.read_text())
    job = ["strong", "fcc", 10**6, 8, "graph"]
    target = next(r for r in data["rows"] if r["mode"] == "graph" and r["system"] == "fcc"
                  and r["n_ranks"] == 8 and r["n_atoms"] < 2 * 10**6)
    copy = dict(data, rows=[r for r in data["rows"] if r is not target],
                skipped=data["skipped"] + [{"job": job, "reason": "not run"}])
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(copy))
    ghost_plan_scale.main(["--json", str(path), "--only", "mode=graph,n=1e6,system=fcc,ranks=8"])
    out = json.loads(path.read_text())
    assert out["skipped"] == data["skipped"]
    assert len(out["rows"]) == len(data["rows"])
    for old, new in zip(data["rows"], out["rows"]):
        same = [k for k in old if k not in ("seconds", "peak_rss_bytes", "method")]
        assert {k: new[k] for k in same} == {k: old[k] for k in same}
        if old is not target:
            assert new == old
    assert out["dd_md_check"] == data["dd_md_check"]
    assert out["merged_runs"][-1]["only"] == "mode=graph,n=1e6,system=fcc,ranks=8"
