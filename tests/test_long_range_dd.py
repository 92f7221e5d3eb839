"""Long-range models under domain decomposition vs one process: gloo ranks, fp64, 1e-10.

``ewald``, ``pme`` (with the slab correction), ``coulomb``, ``d3`` and an ``equivariant +
d3 + pme`` sum on a rattled triclinic NaCl crystal, a slab, a cluster and cells with empty
boxes; energies, per-atom energies and forces by global atom id, stress (or virial). One set
of ranks is spawned per world size and runs every case; plus a short decomposed NVE run of
molten NaCl (LJ + PME) whose atoms, charges included, migrate between ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from helpers import rel as _rel

from xnn.data.graph import AtomicGraph
from xnn.testing import compare_by_id

TOL = 1e-10
A = 5.64  # NaCl lattice constant (Å)

# ---------------------------------------------------------------------------- structures


def _graph(atoms, seed):
    ids = np.random.default_rng(seed).permutation(len(atoms))
    q = np.where(atoms.numbers == 11, 1.0, -1.0)
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   atom_id=ids, extra={"charges": q})


def _conventional(reps, rattle, seed):
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=A, cubic=True).repeat(reps)
    atoms.rattle(rattle, seed=seed)
    return atoms


def bulk_nacl():
    """54 ions in the (triclinic) primitive cell of rock salt, sheared, rattled, unwrapped."""
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=A).repeat((3, 3, 3))
    cell = atoms.cell.array.copy()
    cell[2] += 0.15 * cell[0]
    atoms.set_cell(cell, scale_atoms=True)
    atoms.rattle(0.1, seed=1)
    atoms.positions += np.array([-4.0, 2.0, 9.0])
    return _graph(atoms, 1)


def slab_nacl():
    """A (001) slab of 32 ions, periodic in x, y, with vacuum along z (pbc T, T, F)."""
    atoms = _conventional((2, 2, 1), 0.1, 2)
    atoms.cell[2] *= 4.0
    atoms.pbc = (True, True, False)
    return _graph(atoms, 2)


def cluster_nacl():
    atoms = _conventional((2, 2, 1), 0.15, 3)
    atoms.pbc = False
    atoms.cell[:] = 0.0
    return _graph(atoms, 3)


def corner_nacl():
    """8 ions in one corner of a 3x larger periodic cell: most boxes are empty."""
    atoms = _conventional((1, 1, 1), 0.05, 4)
    atoms.set_cell(atoms.cell.array * 3.0, scale_atoms=False)
    atoms.positions += 1.0  # none wraps to the far side
    return _graph(atoms, 4)


def tiny_nacl():
    """8 ions in a 5.64 Å cell: the halo is wider than the cell."""
    return _graph(_conventional((1, 1, 1), 0.1, 5), 5)


STRUCTURES = {"bulk": bulk_nacl, "slab": slab_nacl, "cluster": cluster_nacl,
              "corner": corner_nacl, "tiny": tiny_nacl}

# ---------------------------------------------------------------------------- models


def _kspace(name):
    from xnn.models import build

    def make(slab=False):
        return build(name, cutoff=5.0, accuracy=1e-5, slab_correction=slab)
    return make


def _d3(slab=False):
    from xnn.models import build

    # with the ATM term, its cutoff beyond the two-body one: the halo is 6 + 4 Å
    return build("d3", functional="pbe", cutoff=5.0, cn_cutoff=4.0, s9=1.0, atm_cutoff=6.0)


def _coulomb(slab=False):
    from xnn.models import build

    return build("coulomb")


def _predicted(slab=False):
    """PME on charges predicted by a 2-layer SchNet (cutoff 3 Å), neutralised: the halo is
    5 + 6 Å, ghosts within 5 Å of a box compute their charges locally."""
    from xnn.models import build

    torch.manual_seed(1)
    qmodel = build("schnet", species=[11, 17], cutoff=3.0, num_interactions=2, num_features=8,
                   num_filters=8, num_basis=8).double()
    with torch.no_grad():
        for p in qmodel.parameters():
            p.add_(0.2 * torch.randn_like(p))
    qmodel.set_statistics(scale=300.0)  # charges of a few tenths of e
    return build("pme", cutoff=5.0, accuracy=1e-5, slab_correction=slab, charge_model=qmodel,
                 neutral=True)


def _mixed(slab=False):
    """A tiny equivariant MLIP + D3 + PME (the composition of an MD run)."""
    from xnn.models import Sum, build

    torch.manual_seed(0)
    mlip = build("equivariant", species=[11, 17], cutoff=3.0, num_interactions=2, channels=4,
                 l_max=1, hidden_l_max=1, correlation=2, radial_mlp=(8,), readout_hidden=4,
                 num_bessel=4).double()
    with torch.no_grad():
        for p in mlip.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return Sum([mlip, _d3(), _kspace("pme")(slab)])


MODELS = {"ewald": _kspace("ewald"), "pme": _kspace("pme"), "d3": _d3, "coulomb": _coulomb,
          "sum": _mixed, "qpme": _predicted}

# (case, model, structure, grid)
BASE = [(f"{m}-{s}", m, s, None) for m in ("ewald", "pme", "d3", "sum")
        for s in ("bulk", "slab", "cluster")] + [
    ("coulomb-cluster", "coulomb", "cluster", None),
    ("pme-corner", "pme", "corner", None),
    ("ewald-tiny", "ewald", "tiny", None)]
PREDICTED = [(f"qpme-{s}", "qpme", s, None) for s in ("bulk", "slab", "cluster", "tiny")]
CASES = {
    2: BASE + PREDICTED + [("pme-tiny-grid", "pme", "tiny", (2, 1, 1))],
    3: [c for c in BASE if c[1] in ("pme", "sum", "coulomb")],
    4: BASE + PREDICTED + [("pme-corner-grid", "pme", "corner", (1, 1, 4)),
               ("sum-corner-grid", "sum", "corner", (2, 2, 1))],
    8: [c for c in BASE if c[1] in ("pme", "sum") or c[0] == "coulomb-cluster"]
    + [("ewald-tiny-grid", "ewald", "tiny", (2, 2, 2)),
       ("pme-corner-grid", "pme", "corner", (2, 2, 2))],
}


# ---------------------------------------------------------------------------- workers


def _md_run(potential, graph, steps, reduce=None):
    from xnn.dynamics import nve

    state = nve.init(graph, potential)
    for _ in range(steps):
        state = nve.step(state, potential, dt=2.0, **({} if reduce is None
                                                      else {"reduce": reduce}))
        if reduce is not None:
            state = potential.maybe_migrate(state)
    return state, nve.conserved(state, **({} if reduce is None else {"reduce": reduce}))


def molten_nacl():
    """64 ions of NaCl at about 4000 K: fast enough to cross boxes within 100 fs."""
    graph = _graph(_conventional((2, 2, 2), 0.05, 6), 6)
    rng = np.random.default_rng(6)
    sd = 0.0982269 * np.sqrt(8.617e-5 * 4000.0 / graph.masses.numpy())  # Å/fs
    v = torch.tensor(rng.normal(size=(graph.n_atoms, 3)) * sd[:, None])
    return graph.replace(velocities=v - v.mean(0))


def md_model():
    from xnn.models import Sum, build

    lj = build("lj", sigma={"Na": 2.439, "Cl": 4.478}, epsilon={"Na": 0.00379, "Cl": 0.00154},
               cutoff=5.0)
    return Sum([lj, build("pme", cutoff=5.0, accuracy=1e-5)])


def _md_case(manager, rank):
    """50 NVE steps decomposed over the ranks, atoms (and their charges) migrating."""
    from xnn.distributed import collectives as C
    from xnn.distributed import parallelize
    from xnn.models import Potential

    model, graph = md_model(), molten_nacl()
    dec = parallelize(model, manager, "halo", skin=0.5)
    state, energy = _md_run(dec, dec.scatter(graph if rank == 0 else None), 50, dec.reducer)
    c = dec.state.counters
    sent = C.all_reduce_sum(torch.tensor([float(c.sent)]), dec.group)
    # every owned atom still carries its own charge (+1 Na, -1 Cl)
    own = state.graph
    charges_ok = bool(torch.equal(own["charges"], torch.where(own.numbers == 11, 1.0, -1.0)))
    full, _ = dec.gather(state.graph)
    out = {"migrations": c.migrations, "sent": float(sent), "charges_ok": charges_ok}
    if rank == 0:
        ref, ref_energy = _md_run(Potential(model, skin=0.5), graph, 50)
        order = torch.argsort(graph.atom_id)
        x0 = graph.positions[order]
        out["positions"] = _rel(full.positions - x0, ref.graph.positions[order] - x0)
        out["energy"] = _rel(energy, ref_energy)
        out["charges"] = bool(torch.equal(full["charges"], graph["charges"][order]))
    return out


def _worker(rank, world, with_md):
    from xnn.distributed import DistributedManager, parallelize
    from xnn.models import Potential

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    results = {}
    for name, model_name, struct, grid in CASES[world]:
        graph = STRUCTURES[struct]()
        model = MODELS[model_name](slab=struct == "slab")
        dd = parallelize(model, manager, "halo", grid=grid)
        out = dd.single_point(graph if rank == 0 else None)
        entry = {"n_owned": dd.stats()["n_owned"], "halo": dd.halo_width}
        if rank == 0:
            entry["errors"] = compare_by_id(out, Potential(model)(graph), graph)
        results[name] = entry
    if with_md:
        results["md"] = _md_case(manager, rank)
        results["nan"] = _nan_charge_case(manager, rank)
    return results


def _nan_charge_case(manager, rank):
    """A NaN data charge (atom id 7): every rank refuses with one line, none waits in a
    collective; the owner (k-space) or every rank (direct sum, gathered) names the atom."""
    from xnn.distributed import parallelize
    from xnn.errors import InputError

    out = {}
    for name, struct in (("pme", bulk_nacl), ("coulomb", cluster_nacl)):
        graph = struct()
        q = graph["charges"].clone()
        q[graph.atom_id == 7] = float("nan")
        graph = graph.replace(charges=q)
        dd = parallelize(MODELS[name](), manager, "halo")
        try:
            dd.single_point(graph if rank == 0 else None)
            out[name] = "no error"
        except InputError as err:
            out[name] = str(err)
    return out


# ---------------------------------------------------------------------------- tests


def _check(results, world):
    root = results[0]
    for name, *_ in CASES[world]:
        errors = root[name]["errors"]
        assert errors.pop("ids"), name
        for key, err in errors.items():
            assert err <= TOL, f"{world} ranks, {name}: {key} relative error {err:.2e}"
    # empty boxes were part of it
    empty = [name for name, *_ in CASES[world] if any(r[name]["n_owned"] == 0 for r in results)]
    assert empty, "no case with an empty box"
    # D3 (atm_cutoff 6, cn_cutoff 4) needs a halo of its receptive field, not 2 x 6 Å
    assert root["d3-bulk"]["halo"] == pytest.approx(10.0) if "d3-bulk" in root else True
    # predicted charges: PME's 5 Å plus the charge model's 2 x 3 Å
    assert root["qpme-bulk"]["halo"] == pytest.approx(11.0) if "qpme-bulk" in root else True


def _run(world, with_md=False):
    return spawn(_worker, world, (with_md,), timeout_s=900)


@pytest.mark.distributed
def test_two_ranks_equal_one_process_and_md_with_migrating_charges():
    results = _run(2, with_md=True)
    _check(results, 2)
    md = [r["md"] for r in results]
    assert md[0]["sent"] > 0 and md[0]["migrations"] > 0, md[0]
    assert all(m["charges_ok"] for m in md)
    assert md[0]["charges"]
    assert md[0]["positions"] <= TOL and md[0]["energy"] <= TOL, md[0]
    nan = [r["nan"] for r in results]
    assert all(m["pme"].startswith("non-finite charges on ") for m in nan), nan
    assert any("atoms with ids [7] (values [nan])" in m["pme"] for m in nan), nan
    assert all("atoms with ids [7] (values [nan])" in m["coulomb"] for m in nan), nan


@pytest.mark.distributed
@pytest.mark.slow  # the 2-rank test's check (empty boxes included) at more ranks
def test_four_ranks_equal_one_process():
    _check(_run(4), 4)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 8])
def test_three_and_eight_ranks_equal_one_process(world):
    _check(_run(world), world)


def test_molten_nacl_example_runs(tmp_path):
    """examples/molten_nacl/md.yaml runs under ``xnn md``: NVE conserves energy and the
    cohesive energy is that of NaCl (about -7.9 eV per ion pair: LJ + PME with +-1 charges)."""
    import csv
    from pathlib import Path

    from xnn.cli.main import main

    folder = Path(__file__).resolve().parents[1] / "examples" / "molten_nacl"
    rc = main(["md", str(folder / "md.yaml"), f"structure={folder / 'nacl_216.xyz'}",
               f"output.dir={tmp_path / 'md'}", "ensemble=nve", "steps=4", "timestep=1.0",
               "output.plot=false", "output.progress=false", "output.log_every=1"])
    assert rc == 0
    rows = list(csv.DictReader(open(tmp_path / "md" / "thermo.csv")))
    assert len(rows) == 5
    e = [float(r["conserved_eV"]) for r in rows]
    assert max(e) - min(e) < 1e-3 * 216 * 0.01
    assert -8.5 < float(rows[0]["epot_eV"]) / 108 < -7.0
