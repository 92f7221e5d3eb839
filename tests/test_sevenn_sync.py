"""SevenNet-0 under domain decomposition with sync points (mode "sync", 5 Å halo) vs one process.

SevenNet-0 has 5 convolution layers of 5 Å: mode "halo" would need a 25 Å halo. In mode
"sync" the wrapper's sync points (before convolutions 1..4) exchange the gathered node
features, so the halo is cutoff + skin. Gloo ranks on CPU, float64, relative error 1e-10 on
energy, forces (by global atom id) and stress, on a rattled triclinic Cu cell.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from helpers import rel as _rel
from helpers import sevenn_0 as sevenn_fp64

from xnn.data.graph import AtomicGraph
from xnn.models.external._optional import MissingExtraError, import_extra

try:
    import_extra("sevenn", "sevenn.util")
except MissingExtraError as _err:
    pytest.skip(str(_err), allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore::UserWarning")]

TOL = 1e-10
SKIN = 0.4


def triclinic_cu() -> AtomicGraph:
    """32 rattled Cu atoms in a sheared cell (~7-8 Å edges), unwrapped, permuted ids."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.1, seed=7)
    cell = atoms.cell.array.copy()
    cell[1] += 0.4 * cell[0]
    cell[2] += -0.3 * cell[0] + 0.25 * cell[1]
    atoms.set_cell(cell, scale_atoms=True)
    atoms.positions += np.array([-5.0, 2.0, 9.0])
    ids = np.random.default_rng(7).permutation(len(atoms))
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   atom_id=ids, dtype=torch.float64)


def worker(rank, world):
    from xnn.distributed import DistributedManager, parallelize
    from xnn.models import Potential

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=60)
    model, graph = sevenn_fp64(), triclinic_cu()
    dd = parallelize(model, manager, "sync", skin=SKIN)
    out = dd.single_point(graph if rank == 0 else None)
    result = {"stats": dd.stats(), "sync": [type(m).__name__ for _, m in model.sync_points]}
    if rank == 0:
        ref = Potential(model, skin=SKIN)(graph)
        order = torch.argsort(graph.atom_id)
        result["errors"] = {"energy": _rel(out["energy"], ref["energy"]),
                            "forces": _rel(out["forces"], ref["forces"][order]),
                            "stress": _rel(out["stress"], ref["stress"])}
        result["ids_sorted"] = bool(torch.equal(out["atom_id"], graph.atom_id[order]))
        result["force_scale"] = float(ref["forces"].abs().max())
    return result


def test_sync_points_are_identities_in_one_process():
    """Single-process results equal SevenNet's own module sequence (no sync applied)."""
    from xnn.models.external.sevenn import _as_dtype
    from xnn.neighbors import with_edges

    model = sevenn_fp64()
    assert model.num_interactions == 5 and len(model.sync_points) == 4
    graph = with_edges(triclinic_cu(), model.cutoff + SKIN)
    plain = model.sevenn_inputs(graph)
    for module in model.model:  # SevenNet's modules, no sync point in between
        plain = _as_dtype(module(plain), torch.float64)  # as the wrapper did before
        if model.keys["ATOMIC_ENERGY"] in plain:
            break
    expected = plain[model.keys["ATOMIC_ENERGY"]].reshape(-1)
    seen = []

    class Spy(torch.nn.Module):  # records what each sync point receives
        def forward(self, features, graph):
            seen.append(features.shape)
            return features

    for name, _ in model.sync_points:
        model.set_sync_point(name, Spy())
    assert torch.equal(model(graph), expected)
    assert seen == [(graph.n_atoms, 480)] * 4  # 128x0e+64x1e+32x2e gathered per layer


@pytest.mark.parametrize("world", [2, 3])
def test_sync_mode_matches_single_process(world):
    res = spawn(worker, world, timeout_s=240)
    errors = res[0]["errors"]
    assert res[0]["ids_sorted"]
    assert res[0]["force_scale"] > 0.1  # a rattled cell: forces are not trivially zero
    assert max(errors.values()) <= TOL, errors
    for r in res:
        assert r["stats"]["halo_width"] == pytest.approx(5.0 + SKIN)  # not 5 x 5 Å
        assert r["sync"] == ["SyncPoint"] * 4  # originals restored after the call
    # the domain is genuinely split: every rank owns atoms and holds ghosts
    assert sum(r["stats"]["n_owned"] for r in res) == 32
    assert all(r["stats"]["n_ghost"] > 0 for r in res)
