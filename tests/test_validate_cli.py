"""``xnn validate`` in one process: a perfect crystal (forces zero by symmetry) passes, an ASE
index that starts with ``-`` reaches the command, ``--parallel.timeout_s`` is its timeout,
wrong options are one line before any work."""

from __future__ import annotations

import json

import pytest
from ase.build import bulk
from ase.io import write
from error_helpers import cli_fails

from xnn.cli.main import main

LJ = "lj:sigma=3.4,epsilon=0.0104,cutoff=6.0"


def _frames(path):
    write(path, [bulk("Ar", "fcc", a=5.26 + 0.01 * i).repeat(2) for i in range(4)])
    return str(path)


def test_forces_zero_by_symmetry_pass(tmp_path, capsys):
    """Round-off over round-off is not a relative error: the forces of a perfect fcc crystal
    (about 1e-16 eV/Å) are judged on the energy per atom per Å (was: 0.16, FAIL)."""
    data, out = _frames(tmp_path / "ar.xyz"), tmp_path / "report.json"
    assert main(["validate", "--model", LJ, "--structure", data, "--index", "-2",
                 "--json", str(out)]) == 0
    assert "PASS" in capsys.readouterr().out
    report = json.loads(out.read_text())
    forces = report["report"]["forces"]
    assert forces["max_abs"] < 1e-14 and forces["scale"] > 1e-3 and forces["max_rel"] < 1e-12


def test_index_starting_with_a_dash_and_timeout_spelling(tmp_path, capsys):
    data = _frames(tmp_path / "ar.xyz")
    # argparse took "-3:" for an option ("expected one argument", exit 2 from argparse)
    assert main(["validate", "--model", LJ, "--structure", data, "--index", "-3:"]) == 2
    err = capsys.readouterr().err
    assert "index '-3:' selects 3 structures" in err and "expected one argument" not in err
    assert main(["validate", "--model", LJ, "--structure", data, "--index", "-1",
                 "--parallel.timeout_s", "30"]) == 0


def test_options_are_checked_before_any_work(tmp_path, capsys):
    """Was: ``--tol nan`` always passed, ``--device tpu`` torch's RuntimeError, ``--output``
    naming a folder accepted (ASE wrote a BundleTrajectory into it), ``--json`` a folder
    IsADirectoryError after the whole comparison."""
    data = _frames(tmp_path / "ar.xyz")
    base = ["validate", "--model", LJ, "--structure", data]
    for tol in ("nan", "inf", "0"):
        cli_fails(capsys, [*base, "--tol", tol], f"--tol must be a finite number > 0, got "
                  f"{float(tol)}")
    cli_fails(capsys, [*base, "--device", "tpu"], "invalid device 'tpu'", "cpu, cuda")
    folder = tmp_path / "d"
    folder.mkdir()
    for option in ("--output", "--json"):
        cli_fails(capsys, [*base, option, folder], f"{option} '{folder}' is a folder")
    assert not any(folder.iterdir())
    # files in folders that do not exist yet: the folders are made (as xnn eval does)
    out, report = tmp_path / "new" / "ar.xyz", tmp_path / "new2" / "report.json"
    assert main([*base, "--output", str(out), "--json", str(report), "--device", "cpu"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert json.loads(report.read_text())["report"]["energy"]["max_rel"] < 1e-12
    from ase.io import read

    assert read(out).get_potential_energy() == pytest.approx(
        json.loads(report.read_text())["energy"], rel=1e-12)
