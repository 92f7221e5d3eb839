"""``xnn md`` under torchrun: the model decomposed over the ranks (replicated dynamics)
gives the same trajectory as one process (gloo, 2 ranks, fp64)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from md_helpers import rattled_argon

from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.dynamics import checkpoint as ckpt
from xnn.dynamics.runner import run_md

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

CASES = {  # ensemble -> extra overrides (Langevin: replicated random numbers; NPT: cell moves)
    "langevin": ["temperature=60", "thermostat.friction=0.02"],
    "npt": ["temperature=60", "pressure=0.1", "barostat.tau_p=200", "thermostat.tau=50"],
}


def overrides(structure, out_dir, ensemble):
    return [f"structure={structure}", f"output.dir={out_dir}", f"ensemble={ensemble}",
            "model.name=lj", "model.params.sigma=3.405", "model.params.epsilon=0.0104",
            "model.params.cutoff=6.5", "model.skin=1.0", "steps=40", "timestep=4.0",
            "output.log_every=5", "output.trajectory_every=20", "output.progress=false",
            "output.plot=false", "seed=3", *CASES[ensemble]]


def worker(rank, world, structure, tmp):
    for ensemble in CASES:
        run_md(load_config(MDConfig, None, overrides(structure, f"{tmp}/dd_{ensemble}",
                                                      ensemble)))
    return rank


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("md_dd")
    atoms = rattled_argon(rep=3, amp=0.05)
    structure = tmp / "ar108.xyz"
    atoms.write(structure)
    assert spawn(worker, 2, args=(str(structure), str(tmp)), timeout_s=240) == [0, 1]
    for ensemble in CASES:
        run_md(load_config(MDConfig, None, overrides(structure, tmp / f"single_{ensemble}",
                                                      ensemble)))
    return tmp


def thermo(path):
    return np.genfromtxt(path, delimiter=",", names=True)


@pytest.mark.parametrize("ensemble", list(CASES))
def test_decomposed_md_matches_one_process(runs, ensemble):
    dd, single = runs / f"dd_{ensemble}", runs / f"single_{ensemble}"
    a, b = thermo(dd / "thermo.csv"), thermo(single / "thermo.csv")
    assert a.shape == b.shape and len(a) == 9
    for name in b.dtype.names:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-9, atol=1e-12, err_msg=name)
    s_dd, _ = ckpt.load_checkpoint(dd / "checkpoint.pt", torch.device("cpu"))
    s_1, _ = ckpt.load_checkpoint(single / "checkpoint.pt", torch.device("cpu"))
    assert s_dd.step == s_1.step == 40
    for x, y in ((s_dd.positions, s_1.positions), (s_dd.graph.velocities, s_1.graph.velocities),
                 (s_dd.graph.cell, s_1.graph.cell)):
        torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11)
    moved = (s_1.positions - thermo_start_positions(runs)).abs().max()
    assert moved > 0.05  # the atoms really moved (several neighbor-list rebuilds)


def test_decomposed_checkpoint_resumes_in_one_process(runs):
    """Checkpoints are the same on any number of ranks: a 2-rank run's checkpoint continues in
    one process like the single-process run continues from its own."""
    structure = runs / "ar108.xyz"
    ends = []
    for src in ("dd_langevin", "single_langevin"):
        out = runs / f"resumed_from_{src}"
        shutil.copytree(runs / src, out)  # resume continues the run's own output files
        run_md(load_config(MDConfig, None, overrides(structure, out, "langevin")
                           + ["steps=60", f"resume={out / 'checkpoint.pt'}"]))
        ends.append(ckpt.load_checkpoint(out / "checkpoint.pt", torch.device("cpu"))[0])
    assert ends[0].step == ends[1].step == 60
    torch.testing.assert_close(ends[0].positions, ends[1].positions, rtol=1e-9, atol=1e-11)


def thermo_start_positions(runs):
    from ase.io import read

    return torch.tensor(read(runs / "ar108.xyz").positions)
