"""Bad input gives one clear line of xnn error (library and CLI), and overwrites nothing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from ase.calculators.lj import LennardJones as AseLJ
from ase.calculators.singlepoint import SinglePointCalculator

import xnn
from xnn.cli.main import main
from xnn.data import AtomicGraph, from_ase, read, write
from xnn.errors import DataFileError, InputError, UnknownSpeciesError, XnnError
from xnn.models import Potential, build
from xnn.models.classical import LennardJones, Morse

SIGMA, EPS, RC = 3.4, 0.0104, 8.5


def raises_one_line(exc, fn, *args, match=None, **kw):
    """``fn`` raises ``exc`` (an xnn error) whose message is a single line."""
    with pytest.raises(exc, match=match) as info:
        fn(*args, **kw)
    assert isinstance(info.value, XnnError)
    msg = str(info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


def test_missing_and_unparseable_files(tmp_path):
    missing = tmp_path / "nope.xyz"
    assert str(missing) in raises_one_line(DataFileError, read, missing, match="not found")
    raises_one_line(DataFileError, read, tmp_path, match="directory")
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is\nnot an xyz file\n at all\n")
    raises_one_line(DataFileError, read, garbage, match="cannot parse")
    truncated = tmp_path / "truncated.xyz"
    truncated.write_text('5\nLattice="5 0 0 0 5 0 0 0 5" pbc="T T T"\nAr 0 0 0\nAr 1 1 1\n')
    raises_one_line(DataFileError, read, truncated, match="cannot parse")
    empty = tmp_path / "empty.xyz"
    empty.write_text("")
    raises_one_line(DataFileError, read, empty)


def test_missing_requested_labels(tmp_path, ar_periodic, ar_molecule):
    a = ar_periodic.copy()
    a.calc = SinglePointCalculator(a, energy=1.0, forces=np.zeros((len(a), 3)))
    m = ar_molecule.copy()
    m.calc = SinglePointCalculator(m, energy=2.0)  # no forces
    path = tmp_path / "partial.xyz"
    write(path, [a, m])
    msg = raises_one_line(DataFileError, read, path, require=("energy", "forces"))
    assert "structure 1" in msg and "forces" in msg and str(path) in msg
    raises_one_line(DataFileError, read, path, require=("energy",), energy_key="REF_energy")
    raises_one_line(InputError, from_ase, [a], require=("energie",), match="unknown required")
    assert read(path, require=("energy",), as_graph=True).energy.tolist() == [1.0, 2.0]


def test_malformed_labels(ar_periodic):
    a = ar_periodic.copy()
    a.arrays["forces"] = np.zeros((len(a), 2))
    raises_one_line(DataFileError, from_ase, a, match="forces")
    b = ar_periodic.copy()
    b.info["stress"] = np.zeros(5)
    raises_one_line(DataFileError, from_ase, b, match="6 .Voigt. or 9")


def test_mismatched_array_shapes():
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((4, 3)), [18] * 3)
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((4, 2)), [18] * 4)
    raises_one_line(InputError, AtomicGraph.from_arrays, np.zeros((2, 3)), [18] * 2, np.eye(2))


@pytest.mark.parametrize("where", ["positions", "cell"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_positions_or_cell(ar_periodic, where, value):
    atoms = ar_periodic.copy()
    if where == "positions":
        atoms.positions[3, 1] = value
    else:
        atoms.cell[1, 2] = value
    raises_one_line(
        InputError, from_ase, [ar_periodic, atoms], match=f"structure 1: non-finite {where}"
    )
    atoms.calc = xnn.Calculator(LennardJones(SIGMA, EPS, RC), device="cpu")
    raises_one_line(InputError, atoms.get_potential_energy, match="non-finite")
    raises_one_line(
        InputError, AtomicGraph.from_arrays, atoms.positions, atoms.numbers, atoms.cell[:]
    )


def test_singular_cell_only_matters_along_periodic_axes(ar_periodic):
    atoms = ar_periodic.copy()
    atoms.cell[2] = atoms.cell[0] + atoms.cell[1]  # coplanar lattice vectors
    raises_one_line(InputError, from_ase, atoms, match="singular cell")
    flat = ar_periodic.copy()
    flat.cell[2] = 0.0
    raises_one_line(InputError, from_ase, flat, match="singular cell along periodic axis z")
    # a slab: zero third vector, periodic in x and y only -> legal, and equal to ASE's LJ
    flat.pbc = (True, True, False)
    out = Potential(LennardJones(SIGMA, EPS, RC))(from_ase(flat), stress=False)
    flat.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC)
    np.testing.assert_allclose(out["forces"].numpy(), flat.get_forces(), atol=1e-12)
    assert float(out["energy"]) == pytest.approx(flat.get_potential_energy(), rel=1e-10)


def test_left_handed_cells_are_legal(ar_periodic):
    """A left-handed cell (as ASE allows) describes the same crystal as its right-handed twin."""
    right = ar_periodic
    left = right.copy()
    left.set_cell(right.cell[[1, 0, 2]])  # swap two lattice vectors: det < 0, same lattice
    assert np.linalg.det(left.cell[:]) < 0 < np.linalg.det(right.cell[:])
    pot = Potential(LennardJones(SIGMA, EPS, RC))
    out_l, out_r = pot(from_ase(left)), pot(from_ase(right))
    for k in ("energy", "energies", "forces", "stress"):
        torch.testing.assert_close(out_l[k], out_r[k], rtol=1e-12, atol=1e-14)
    left.calc = AseLJ(sigma=SIGMA, epsilon=EPS, rc=RC)
    np.testing.assert_allclose(out_l["forces"].numpy(), left.get_forces(), atol=1e-12)
    g = from_ase(left)
    frac = g.wrapped().positions.numpy() @ np.linalg.inv(left.cell[:])
    assert (frac >= 0).all() and (frac < 1).all()
    assert float(g.volume()) == pytest.approx(left.get_volume())


def test_unknown_species_and_bad_parameters(ar_periodic):
    model = build("lj", sigma={"Ar": SIGMA}, epsilon={"Ar": EPS}, cutoff=RC)
    atoms = ar_periodic.copy()
    atoms.numbers[[0, 2]] = [29, 36]
    msg = raises_one_line(UnknownSpeciesError, Potential(model), from_ase(atoms))
    assert "Cu" in msg and "Kr" in msg
    for bad in (0.0, -2.0, float("nan")):
        raises_one_line(InputError, LennardJones, SIGMA, EPS, bad, match="cutoff")
        raises_one_line(InputError, Morse, 0.3, 1.0, 3.0, bad, match="cutoff")
    raises_one_line(InputError, LennardJones, -1.0, EPS, RC, match="sigma")
    raises_one_line(InputError, LennardJones, SIGMA, EPS, RC, species=["Xx"], match="element")
    raises_one_line(InputError, build, "lj", sigma=1.0, epsilon=1.0, cutof=3.0)


def test_failed_write_overwrites_nothing(tmp_path, ar_periodic):
    path = tmp_path / "keep.xyz"
    write(path, ar_periodic)
    before = path.read_bytes()
    raises_one_line(DataFileError, write, path, ["not a structure"])
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.xyz"]  # no temporary left
    raises_one_line(DataFileError, write, tmp_path / "no" / "such" / "dir.xyz", ar_periodic)


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "xnn", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_errors_are_one_line_and_overwrite_nothing(tmp_path, capsys):
    target = tmp_path / "results.txt"
    target.write_text("precious\n")
    proc = run_cli("demo", "--out", str(target))  # a real process: exit code and stderr
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and len(err.splitlines()) == 1, proc.stderr
    assert err.startswith("xnn demo: error:") and str(target) in err
    assert target.read_text() == "precious\n"
    # in-process: a bad option is refused before the output folder is created
    assert main(["demo", "--out", str(tmp_path / "new"), "--repeat", "0"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--repeat" in err
    assert not (tmp_path / "new").exists()
