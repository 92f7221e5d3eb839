"""The committee's uncertainty guard in ``xnn relax`` (``safety.max_force_uncertainty``,
``safety.on_uncertainty``), with the semantics of ``xnn md``: stop at the first step above
the threshold with its rows, trajectory frame, ``uncertain.xyz`` and checkpoint written (exit
code 2, one line), or warn once per excursion; refused for a single model."""

from __future__ import annotations

import json
import warnings

import ase.io
import numpy as np
import pytest
from helpers.uncertainty import (
    committee,
    committee_files,
    first_record,
    read_columns,
    relax_args,
)

from xnn.app.relax import run_relax
from xnn.config.loader import load_config
from xnn.config.md import RelaxConfig
from xnn.dynamics.safety import SimulationError, UncertaintyWarning
from xnn.errors import InputError
from xnn.models.serialization import save_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def free_relax(tmp_path_factory):
    """One unguarded relaxation of the committee: its files and its log."""
    tmp = tmp_path_factory.mktemp("relax_uq")
    model, _ = committee_files(tmp)
    out = run_relax(load_config(RelaxConfig, None, relax_args(tmp / "cu.xyz", model,
                                                              tmp / "free")))
    return tmp, model, read_columns(out / "relax.csv")


def test_relax_guard_stops_at_the_first_step_above_with_the_frame_written(free_relax):
    tmp, model, log = free_relax
    k, threshold = first_record(log["max_force_std_eV_A"])
    out = tmp / "stop"
    with pytest.raises(SimulationError) as err:
        run_relax(load_config(RelaxConfig, None, relax_args(
            tmp / "cu.xyz", model, out, f"safety.max_force_uncertainty={threshold!r}")))
    msg = str(err.value)
    assert err.value.step == k and msg.startswith(f"step {k}: force uncertainty")
    assert "above safety.max_force_uncertainty" in msg and "stopped" in msg
    assert "\n" not in msg and "uncertain.xyz" in msg
    frames = ase.io.read(out / "relax_trajectory.xyz", ":")
    assert frames[-1].info["step"] == k  # written although k is not a multiple of 5
    uncertain = ase.io.read(out / "uncertain.xyz")
    assert uncertain.info["step"] == k
    np.testing.assert_allclose(uncertain.positions, frames[-1].positions, rtol=0, atol=0)
    stopped = read_columns(out / "relax.csv")
    assert stopped["step"][-1] == k
    np.testing.assert_allclose(stopped["max_force_std_eV_A"],
                               log["max_force_std_eV_A"][: k + 1], rtol=0, atol=0)
    from xnn.io import md_checkpoint as ckpt

    assert ckpt.load_checkpoint(out / "checkpoint.pt", kind="relax")[0].step == k


def test_relax_guard_warns_once_per_excursion(free_relax):
    tmp, model, log = free_relax
    k, threshold = first_record(log["max_force_std_eV_A"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run_relax(load_config(RelaxConfig, None, relax_args(
            tmp / "cu.xyz", model, tmp / "warn", f"safety.max_force_uncertainty={threshold!r}",
            "safety.on_uncertainty=warn")))
    above = [u > threshold for u in log["max_force_std_eV_A"]]
    excursions = sum(1 for i, a in enumerate(above) if a and (i == 0 or not above[i - 1]))
    got = [w for w in caught if issubclass(w.category, UncertaintyWarning)]
    assert len(got) == excursions >= 1
    assert str(got[0].message).startswith(f"step {k}: force uncertainty")
    assert read_columns(out / "relax.csv") == log  # the run went on, unchanged
    assert json.loads((out / "summary.json").read_text())


def test_relax_guard_cli_exit_code_and_one_line(free_relax, tmp_path, capsys):
    from xnn.cli.main import main

    tmp, model, log = free_relax
    k, threshold = first_record(log["max_force_std_eV_A"])
    rc = main(["relax", *relax_args(tmp / "cu.xyz", model, tmp_path / "cli",
                                    f"safety.max_force_uncertainty={threshold!r}")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert err[0].startswith(f"xnn relax: error: step {k}: force uncertainty")


def test_relax_guard_refused_for_a_single_model(free_relax, tmp_path):
    tmp, _, _ = free_relax
    one = save_model(committee().members[0], tmp_path / "one.pt")
    with pytest.raises(InputError, match="needs a committee model"):
        run_relax(load_config(RelaxConfig, None, relax_args(
            tmp / "cu.xyz", one, tmp_path / "a", "safety.max_force_uncertainty=0.1")))
    assert not (tmp_path / "a").exists()
