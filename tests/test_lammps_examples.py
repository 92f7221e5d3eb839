"""The example inputs of ``examples/lammps/`` run through ``xnn lammps`` (a real subprocess; the
2-rank run under MPICH's ``mpirun``), shrunk with ``-var`` to 2x2x2 / 3x3x3 cells and 5 steps.

Checked against xnn itself: the potential energy LAMMPS reports at step 0 is the model's
energy of the same crystal, the pressure is the model's virial plus LAMMPS's kinetic term,
``compute pe/atom`` sums to ``pe``, the dump and the restart file are written and read back,
the barostat moves the box, and 2 MPI ranks print the 1-rank thermo rows.
Skipped (with the reason) without LAMMPS's Python module, mpi4py or ``mpirun``.
"""

from __future__ import annotations

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

import xnn
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.interop.lammps import require_lammps
from xnn.models import Potential, build

try:
    lammps = require_lammps()
    lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"]).close()
except (InputError, OSError) as err:  # not installed, or its library does not load
    pytest.skip(f"LAMMPS unavailable: {err}", allow_module_level=True)
try:
    import mpi4py  # noqa: F401  (xnn lammps shares MPI_COMM_WORLD with LAMMPS)
except ImportError as err:
    pytest.skip(f"mpi4py unavailable: {err}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "lammps"
MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
LJ = dict(sigma=2.338, epsilon=0.409, cutoff=5.8)  # Cu-like, as benchmarks/md.py
A = 3.615  # the inputs' lattice constant
EV_A3_TO_BAR = 1.602176634e6  # eV/Å^3 in bar (LAMMPS metal nktv2p)
KB = 8.617343e-5  # LAMMPS metal boltz (eV/K)
SMALL = ["-var", "steps", "5", "-var", "every", "1", "-var", "dump_every", "5"]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model") / "lj.pt"
    xnn.save_model(build("lj", species=["Cu"], **LJ), path)
    return path


def xnn_lammps(folder: Path, example: str, model: Path, cells: int, ranks: int = 1,
               log: str = "log.lammps") -> list[dict]:
    """Run ``examples/lammps/<example>`` copied into ``folder`` (its dumps and restarts land
    there); returns the thermo rows of its log."""
    shutil.copy(EXAMPLES / example, folder / example)
    cmd = [sys.executable, "-m", "xnn", "lammps", example, "--model", str(model),
           "-var", "n", str(cells), *SMALL, "--log", log, "--quiet"]
    if ranks > 1:
        cmd = [MPIRUN, "-np", str(ranks), *cmd]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"xnn lammps: {ranks} rank(s)" in out.stdout
    return thermo_rows((folder / log).read_text())


def thermo_rows(log: str) -> list[dict]:
    """The rows of the (last) thermo table of a LAMMPS log, as ``{column: value}``."""
    lines = log.splitlines()
    start = max(i for i, ln in enumerate(lines) if ln.split()[:1] == ["Step"])
    header, rows = lines[start].split(), []
    for ln in lines[start + 1:]:
        if ln.startswith("Loop time"):
            break
        rows.append(dict(zip(header, map(float, ln.split()))))
    return rows


def crystal(cells: int) -> AtomicGraph:
    atoms = bulk("Cu", "fcc", a=A, cubic=True).repeat((cells,) * 3)
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                   dtype=torch.float64)


def read_dump(path: Path) -> tuple[int, np.ndarray]:
    """The last frame of a ``dump custom``: its step and its rows (columns as in the inputs:
    id type x y z fx fy fz c_peatom)."""
    lines = path.read_text().splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.startswith("ITEM: TIMESTEP"))
    step, n = int(lines[last + 1]), int(lines[last + 3])
    rows = np.array([[float(v) for v in ln.split()] for ln in lines[last + 9:last + 9 + n]])
    return step, rows


def test_nvt_example_energy_per_atom_energies_dump_and_restart(tmp_path, model_file):
    rows = xnn_lammps(tmp_path, "in.nvt.lammps", model_file, cells=2)
    assert [int(r["Step"]) for r in rows] == list(range(6))
    model = build("lj", species=["Cu"], **LJ).double()
    energy = float(Potential(model)(crystal(2))["energy"].sum())
    assert rows[0]["PotEng"] == pytest.approx(energy, rel=1e-9)  # thermo prints 10 digits
    assert rows[0]["Temp"] == pytest.approx(300.0, rel=1e-9)
    for r in rows:  # compute pe/atom holds the model's per-atom energies
        assert r["c_pesum"] == pytest.approx(r["PotEng"], rel=1e-9)
    step, dump = read_dump(tmp_path / "nvt.lammpstrj")
    assert step == 5 and dump.shape == (32, 9)
    # (a dump prints 6 digits)
    assert dump[:, 8].sum() == pytest.approx(rows[-1]["PotEng"], rel=1e-5)
    assert np.abs(dump[:, 5:8].sum(axis=0)).max() < 1e-4  # Newton's third law
    assert np.abs(dump[:, 5:8]).max() > 1e-2  # the atoms moved off the lattice: forces
    lmp = lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    try:  # the restart file is LAMMPS's own, readable without xnn
        lmp.command(f"read_restart {tmp_path / 'nvt.restart'}")
        assert lmp.get_natoms() == 32
        assert lmp.extract_global("ntimestep") == 5
    finally:
        lmp.close()


@pytest.fixture(scope="module")
def npt_one_rank(tmp_path_factory, model_file) -> list[dict]:
    return xnn_lammps(tmp_path_factory.mktemp("npt1"), "in.npt.lammps", model_file, cells=3)


def test_npt_example_pressure_is_the_models_virial(npt_one_rank):
    rows = npt_one_rank
    graph = crystal(3)
    model = build("lj", species=["Cu"], **LJ).double()
    out = Potential(model)(graph, stress=True)
    volume = float(torch.linalg.det(graph.cell.reshape(3, 3)))
    assert rows[0]["Volume"] == pytest.approx(volume, rel=1e-9)
    # LAMMPS: P = (dof kB T + W_xx + W_yy + W_zz) / (3 V), dof = 3N - 3, W = -V sigma
    virial = -float(out["stress"].reshape(3, 3).trace()) * volume
    dof = 3 * graph.n_atoms - 3
    pressure = (dof * KB * rows[0]["Temp"] + virial) / (3 * volume) * EV_A3_TO_BAR
    assert rows[0]["Press"] == pytest.approx(pressure, rel=1e-6)
    # the sum of compute stress/atom (per-atom virials) is the virial part of the pressure
    # (LAMMPS's eV/Å³ -> bar, 1.6021765e6, has 8 digits: 1e-6 as for Press)
    assert rows[0]["v_pvirial"] == pytest.approx(virial / (3 * volume) * EV_A3_TO_BAR,
                                                 rel=1e-6)
    for r in rows[1:]:
        assert r["v_pvirial"] != rows[0]["v_pvirial"]  # recomputed at every thermo step
    # compressed LJ crystal (27 kbar): the barostat expands the box at once
    volumes = [r["Volume"] for r in rows]
    assert all(b > a for a, b in zip(volumes, volumes[1:]))


@pytest.mark.skipif(MPIRUN is None, reason="mpirun (MPICH: pip install mpich) not found")
def test_npt_example_on_two_ranks_prints_the_one_rank_rows(tmp_path, model_file, npt_one_rank):
    rows = xnn_lammps(tmp_path, "in.npt.lammps", model_file, cells=3, ranks=2)
    assert len(rows) == len(npt_one_rank)
    for two, one in zip(rows, npt_one_rank):
        for key, value in one.items():
            assert two[key] == pytest.approx(value, rel=1e-9, abs=1e-9), (key, two, one)


@pytest.mark.slow
@pytest.mark.skipif(MPIRUN is None, reason="mpirun (MPICH: pip install mpich) not found")
def test_benchmark_script_times_lammps_and_xnn_md(tmp_path):
    """``benchmarks/lammps.py`` on 32 atoms: LAMMPS's loop time on 1 and 2 ranks, atoms and
    peak memory per rank, and ``xnn md`` on the same crystal."""
    out = tmp_path / "lammps.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lammps.py"), "--models",
                          "lj", "--sizes", "32", "--ranks", "1,2", "--steps", "3", "--warmup",
                          "1", "--json", str(out)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ranks"], r["n_atoms"]) for r in rows] == [(1, 32), (2, 32)]
    for r in rows:
        lmp = r["lammps"]
        assert "error" not in lmp and lmp["steps"] == 3 and lmp["s_per_step"] > 0
        assert lmp["owned_per_rank"]["ave"] * r["ranks"] == pytest.approx(32)
        assert len(lmp["peak_rss_bytes_per_rank"]) == r["ranks"]
        assert min(lmp["peak_rss_bytes_per_rank"]) > 50 * 2**20  # python + torch + LAMMPS
    assert rows[1]["lammps"]["mode"] == "halo" and rows[1]["lammps"]["ghost_cutoff_A"] == 6.8
    md = rows[0]["xnn_md"]
    assert md["n_atoms"] == 32 and md["s_per_step"] > 0
    assert rows[0]["lammps_over_xnn_md"] == pytest.approx(
        rows[0]["lammps"]["s_per_step"] / md["s_per_step"])
