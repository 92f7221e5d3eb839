"""Output at scale: sharded checkpoints and a trajectory every rank writes (gloo, fp64).

Two ranks run the same Langevin MD twice, once with the gathered outputs (one
``checkpoint.pt``, one HDF5 trajectory, written by rank 0) and once sharded
(``checkpoint.pt.d/``, ``trajectory.d/``: each rank writes its own atoms). The sharded
trajectory read back in id order equals the gathered one exactly; the sharded checkpoint
resumes on 1, 2 and 3 ranks exactly as the gathered checkpoint does (bitwise), and on as
many ranks as the uninterrupted run bitwise.

Ranks are spawned once per world size (2, then 3) for the module; the 3-rank resume (a
repeat at more ranks of the 1- and 2-rank ones) is under ``-m slow``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.errors import DataFileError
from xnn.io import md_checkpoint as ckpt
from xnn.io import sharded_checkpoint as shards
from xnn.io.sharded_trajectory import read_sharded_trajectory, sharded_frames
from xnn.io.trajectory import read_hdf5_trajectory

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

GATHERED = ["output.checkpoint_format=gathered", "output.trajectory_format=hdf5"]
SHARDED = ["output.checkpoint_format=sharded", "output.trajectory_format=sharded"]


def md(structure, out_dir, *extra, steps=40, resume=None):
    args = [f"structure={structure}", f"output.dir={out_dir}", "ensemble=langevin",
            "temperature=150", "thermostat.friction=0.02", "model.device=cpu",
            "model.name=lj", "model.hyperparameters.sigma=3.405",
            "model.hyperparameters.epsilon=0.0104", "model.cutoff=6.5", "model.skin=0.3",
            f"steps={steps}", "timestep=4.0", "initial_temperature=150", "output.log_every=5",
            "output.trajectory_every=10", "output.checkpoint_every=20", "output.plot=false",
            "output.progress=false", "seed=3", *extra]
    if resume is not None:
        args.append(f"resume={resume}")
    return run_md(load_config(MDConfig, None, args))


#: one process resumes the sharded run with the formats left to ``auto``: its trajectory goes
#: on sharded (the format the checkpoint records), its checkpoint is gathered (one process)
AUTO = ["output.checkpoint_format=auto", "output.trajectory_format=auto"]


def resume_both(tmp: Path, ranks: int) -> None:
    """Continue the 2-rank gathered and sharded runs to step 60 on this many ranks."""
    for kind, extra in (("gathered", GATHERED), ("sharded", AUTO if ranks == 1 else SHARDED)):
        out = tmp / f"{kind}_on_{ranks}"
        md(tmp / "ar108.xyz", out, *extra, steps=60, resume=out / "checkpoint.pt")


def copy_runs(tmp: Path, ranks: int) -> None:
    for kind in ("gathered", "sharded"):
        shutil.copytree(tmp / kind, tmp / f"{kind}_on_{ranks}")


def first_runs(rank, world, tmp):
    tmp = Path(tmp)
    md(tmp / "ar108.xyz", tmp / "gathered", *GATHERED)
    md(tmp / "ar108.xyz", tmp / "sharded", *SHARDED)
    md(tmp / "ar108.xyz", tmp / "uninterrupted", *GATHERED, steps=60)
    if rank == 0:
        for n in (1, 2, 3):
            copy_runs(tmp, n)
    resume_both(tmp, 2)  # the copies are read by rank 0 after the run's first collective
    return rank, shards_read(tmp / "sharded" / "checkpoint.pt.d")


def shards_read(path: Path) -> tuple[list, list[int]]:
    """On this rank: the shards :meth:`DomainRun.scatter_shards` asked for (reading them
    with the real reader) and the ids of the atoms it then owns."""
    from xnn.distributed import DistributedManager
    from xnn.distributed.entries import parallelize_md
    from xnn.models.classical import LennardJones

    manager = DistributedManager.initialize(device="cpu")
    try:
        model = LennardJones(3.405, 0.0104, 6.5).double()
        par = parallelize_md(model, manager, skin=0.3, mode="spatial")
        index, asked = shards.read_index(path), []

        def read(ranks):
            asked.append(list(ranks))
            return shards.read_state(path, index, ranks)

        st = par.scatter_shards(len(index["shards"]), read, index["meta"])
        return asked, st.graph.atom_id.tolist()
    finally:
        manager.cleanup()


def three_ranks(rank, world, tmp):
    asked = shards_read(Path(tmp) / "sharded" / "checkpoint.pt.d")
    resume_both(Path(tmp), 3)
    return rank, asked


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharded_io")
    rattled_argon(rep=3, amp=0.05).write(tmp / "ar108.xyz")
    two = spawn(first_runs, 2, args=(str(tmp),), timeout_s=300)
    assert [r for r, _ in two] == [0, 1]
    resume_both(tmp, 1)
    (tmp / "asked.json").write_text(json.dumps({2: [a for _, a in two]}))
    return tmp


@pytest.fixture(scope="module")
def runs3(runs):
    """The 2-rank runs, also resumed on 3 ranks."""
    three = spawn(three_ranks, 3, args=(str(runs),), timeout_s=300)
    assert [r for r, _ in three] == [0, 1, 2]
    asked = json.loads((runs / "asked.json").read_text())
    asked["3"] = [a for _, a in three]
    (runs / "asked.json").write_text(json.dumps(asked))
    return runs


#: resumed on 1 and 2 ranks fast, on 3 under -m slow (a spawn of its own)
RANKS = [1, 2, pytest.param(3, marks=pytest.mark.slow)]


def resumed(request, ranks: int) -> Path:
    return request.getfixturevalue("runs3" if ranks == 3 else "runs")


def state(path: Path):
    return ckpt.load_checkpoint(path / "checkpoint.pt", torch.device("cpu"))


def assert_same_state(a, b, tol):
    assert a.step == b.step
    assert torch.equal(a.graph.atom_id, b.graph.atom_id)
    for name in a.graph.fields:
        torch.testing.assert_close(a.graph.fields[name], b.graph.fields[name], rtol=tol,
                                   atol=tol, msg=name)
    for x, y in ((a.forces, b.forces), (a.energy, b.energy), (a.stress, b.stress)):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert a.vars.keys() == b.vars.keys()
    for k in a.vars:
        torch.testing.assert_close(a.vars[k], b.vars[k], rtol=tol, atol=tol)


def test_sharded_checkpoint_holds_the_gathered_state(runs):
    """Each rank wrote its own shard; assembled by id it is the gathered checkpoint, with
    the same meta (each atom's rank, the ghost plan's reference)."""
    folder = runs / "sharded" / "checkpoint.pt.d"
    assert not (runs / "sharded" / "checkpoint.pt").exists()
    index = shards.read_index(folder)
    assert [s["file"] for s in index["shards"]] == ["rank-0000.pt", "rank-0001.pt"]
    assert sum(s["n_atoms"] for s in index["shards"]) == index["n_atoms"] == 108
    assert all(s["n_atoms"] > 0 for s in index["shards"])
    assert [p.name for p in folder.iterdir() if p.is_dir()] == [index["generation"]]
    (s_sh, m_sh), (s_g, m_g) = state(runs / "sharded"), state(runs / "gathered")
    assert_same_state(s_sh, s_g, 0.0)
    assert torch.equal(s_sh.rng, s_g.rng)
    dom_sh, dom_g = m_sh["domain"], m_g["domain"]
    assert dom_sh.keys() == dom_g.keys() and "ref_positions" in dom_sh
    for k in dom_g:
        if isinstance(dom_g[k], torch.Tensor):
            assert torch.equal(dom_sh[k], dom_g[k]), k
        else:
            assert dom_sh[k] == dom_g[k], k


@pytest.mark.parametrize("ranks", RANKS)
def test_sharded_checkpoint_resumes_like_the_gathered_one(request, ranks):
    """2 ranks -> 1, 2 and 3: the sharded checkpoint continues bitwise like the gathered
    one, and like the uninterrupted run (bitwise on as many ranks, 1e-10 otherwise)."""
    runs = resumed(request, ranks)
    sh, g = runs / f"sharded_on_{ranks}", runs / f"gathered_on_{ranks}"
    assert_same_state(state(sh)[0], state(g)[0], 0.0)
    assert (sh / "thermo.csv").read_bytes() == (g / "thermo.csv").read_bytes()
    ref = state(runs / "uninterrupted")[0]
    assert_same_state(state(sh)[0], ref, 0.0 if ranks == 2 else 1e-10)


@pytest.mark.parametrize("ranks", RANKS)
def test_sharded_trajectory_equals_the_gathered_one(request, ranks):
    """Read in id order, the ranks' trajectory files are the gathered HDF5 trajectory:
    the first run's 5 frames, and after a resume on another rank count (new ranks start
    files at the resumed frame; a rank that is gone keeps its earlier frames) all 7."""
    runs = resumed(request, ranks)
    for run in ("sharded", f"sharded_on_{ranks}"):
        got = read_sharded_trajectory(runs / run / "trajectory.d")
        want = read_hdf5_trajectory(runs / run.replace("sharded", "gathered") /
                                    "trajectory.h5")
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert len(got["step"]) == 7 and got["step"].tolist() == list(range(0, 70, 10))
    files = sorted(p.name for p in (runs / f"sharded_on_{ranks}" / "trajectory.d").iterdir())
    assert files == [f"rank-{r:04d}.h5" for r in range(max(2, ranks))]


def test_formats_left_to_auto_on_resume(runs):
    """Resumed in one process with ``auto``: the checkpoint is written gathered (the sharded
    form it replaces is removed, one form only) and the trajectory goes on sharded."""
    run = runs / "sharded_on_1"
    assert (run / "checkpoint.pt").is_file() and not (run / "checkpoint.pt.d").exists()
    assert not (run / "trajectory.h5").exists() and (run / "trajectory.d").is_dir()
    assert state(run)[1]["files"]["trajectory_format"] == "sharded"


def test_sharded_frames_and_merge_command(runs, tmp_path):
    """``xnn traj merge`` writes the frames as extxyz in id order, readable by ASE."""
    from ase.io import read

    from xnn.cli.main import main

    folder = runs / "sharded" / "trajectory.d"
    frames, want = sharded_frames(folder), read_hdf5_trajectory(runs / "gathered" /
                                                               "trajectory.h5")
    assert len(frames) == 5
    np.testing.assert_array_equal(frames[-1].positions, want["positions"][-1])
    np.testing.assert_array_equal(frames[-1].get_forces(), want["forces"][-1])
    assert main(["traj", "merge", str(folder), "-o", str(tmp_path / "all.extxyz")]) == 0
    back = read(tmp_path / "all.extxyz", ":")
    assert [a.info["step"] for a in back] == [0, 10, 20, 30, 40]
    np.testing.assert_allclose(back[-1].positions, want["positions"][-1], atol=1e-7)


def assert_each_atom_owned_once(asked: list) -> None:
    owned = [ids for _, ids in asked]
    assert all(len(ids) > 0 for ids in owned)
    assert sorted(i for ids in owned for i in ids) == list(range(108))


def test_each_rank_reads_only_its_shards(runs):
    """Resumed from 2 shards, no rank reads the whole checkpoint: on 2 ranks rank r reads
    shard r and keeps its atoms: together each atom once."""
    asked = json.loads((runs / "asked.json").read_text())
    assert [a for a, _ in asked["2"]] == [[[0]], [[1]]]
    index = shards.read_index(runs / "sharded" / "checkpoint.pt.d")
    assert [len(ids) for _, ids in asked["2"]] == [s["n_atoms"] for s in index["shards"]]
    assert_each_atom_owned_once(asked["2"])


@pytest.mark.slow
def test_each_rank_reads_only_its_shards_on_more_ranks(runs3):
    """Resumed from 2 shards on 3 ranks: rank r reads shards r, r + 3, ... (rank 2: none)
    and, after one all-to-all, owns the atoms of its box: together each atom once."""
    asked = json.loads((runs3 / "asked.json").read_text())
    assert [a for a, _ in asked["3"]] == [[[0]], [[1]], [[]]]
    assert_each_atom_owned_once(asked["3"])


def test_a_checkpoint_without_its_index_is_not_one(runs, tmp_path):
    """A sharded write killed before its index landed leaves the previous checkpoint; with
    no index at all there is no checkpoint (one line)."""
    run = tmp_path / "run"
    shutil.copytree(runs / "sharded", run)
    folder = run / "checkpoint.pt.d"
    before = state(run)[0]
    torn = folder / "step-000000000060-deadbeef"
    torn.mkdir()
    (torn / "rank-0000.pt").write_bytes(b"torn")
    assert_same_state(state(run)[0], before, 0.0)
    (folder / "index.pt").unlink()
    with pytest.raises(DataFileError, match="no index.pt"):
        state(run)
