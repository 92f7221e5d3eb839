"""ASE index strings reach every command as typed (issue 42, item 2).

YAML 1.1 reads ``1:3`` as the base-60 number 63 and ``-3:`` as a mapping; ``xnn md``,
``xnn relax`` and ``xnn run`` take ``index`` from a dotlist or a YAML file and must select
the frames ASE selects for the string. Frame ``k`` of the test file has ``k + 2`` atoms, so
the atom counts of a run's output say which frames it used.
"""

from __future__ import annotations

import csv

import ase.io
import numpy as np
import pytest
from ase import Atoms

from xnn.cli.main import main
from xnn.config.loader import ConfigError, load_config
from xnn.config.md import MDConfig

pytestmark = pytest.mark.usefixtures("one_thread")

LJ = ["model.name=lj", "model.hyperparameters={sigma: 3.405, epsilon: 0.0104}", "model.cutoff=6.0"]
#: index string -> frames ASE selects from 6 frames
CASES = {"1:3": [1, 2], "-3:": [3, 4, 5], "::2": [0, 2, 4]}
#: each command: its overrides (no steps) and how its output says which frames it used
COMMANDS = {
    "md": (["ensemble=nve", "steps=0", "output.plot=false"], "trajectory.xyz"),
    "relax": (["max_steps=0"], "relaxed.xyz"),
    "run": (["stages.0.type=relax", "stages.0.max_steps=0", "output.progress=false"],
            "final.xyz"),
}


@pytest.fixture(scope="module")
def frames_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    grid = np.array([[i, j, k] for i in range(2) for j in range(2) for k in range(2)]) * 3.8
    frames = [Atoms(f"Ar{n}", positions=grid[:n] + rng.normal(scale=0.05, size=(n, 3)))
              for n in range(2, 8)]
    path = tmp_path_factory.mktemp("index") / "six.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


def _used_frames(command: str, out) -> list[int]:
    """The frames of the test file a run used (frame k has k + 2 atoms)."""
    sizes = [len(a) for a in ase.io.read(out / COMMANDS[command][1], index=":")]
    if command == "run":
        with open(out / "results.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert [int(r["id"]) for r in rows] == list(range(len(sizes)))
        assert [int(r["n_atoms"]) for r in rows] == sizes
    return [n - 2 for n in sizes]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("index", list(CASES))
@pytest.mark.parametrize("where", ["dotlist", "yaml"])
def test_every_command_selects_the_frames_ase_selects(frames_file, tmp_path, command, index,
                                                       where):
    """``index=1:3`` (base-60 63 to YAML 1.1), ``-3:`` (a YAML mapping) and ``::2``, given
    on the command line or unquoted in a YAML file (``-3:`` must be quoted there), select
    the same frames as ``ase.io.read(path, index=...)``."""
    out = tmp_path / "out"
    args = [command]
    if where == "yaml":
        text = f'"{index}"' if index.endswith(":") else index  # YAML needs quotes for -3:
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"structure: {frames_file}\nindex: {text}\n")
        args += [str(cfg)]
    else:
        args += [f"structure={frames_file}", f"index={index}"]
    args += [*LJ, f"output.dir={out}", *COMMANDS[command][0]]
    assert main(args) == 0
    want = [len(a) - 2 for a in ase.io.read(frames_file, index=index)]
    assert want == CASES[index]
    assert _used_frames(command, out) == want


def test_base60_and_colon_values_stay_strings(tmp_path):
    """Any string key keeps a time-like ``1:30`` or a path ending in ``:`` as typed, in an
    override and in a YAML file; flow mappings and lists are still read as YAML; an
    unquoted ``index: -3:`` in a file is refused with one line saying to quote it."""
    cfg = load_config(MDConfig, None, ["index=1:30", "output.dir=run:1", "structure=a:",
                                       "model.hyperparameters={a: 1:3, b: [2:10, 3], c: 1e-3}",
                                       "timestep=5e-1"])
    assert (cfg.index, cfg.output.dir, cfg.structure) == ("1:30", "run:1", "a:")
    assert cfg.model.hyperparameters == {"a": "1:3", "b": ["2:10", 3], "c": 1e-3}
    assert cfg.timestep == 0.5
    path = tmp_path / "cfg.yaml"
    path.write_text("index: &i 1:3\noutput: {dir: 10:20}\nstructure: x.xyz\n")
    cfg = load_config(MDConfig, path)
    assert (cfg.index, cfg.output.dir) == ("1:3", "10:20")
    path.write_text("index: -3:\n")
    with pytest.raises(ConfigError, match=r"must be quoted, e\.g\. index: \"-3:\"") as e:
        load_config(MDConfig, path)
    assert "\n" not in str(e.value)
