"""``python -m xnn`` imports no code from the working directory unless the user says so.

Python puts the working directory first on ``sys.path`` for ``-m``; the ``xnn`` command does
not. A hook ``target: mymod:fn`` must not import a ``./mymod.py`` that happens to lie where a
run starts: ``python -m xnn md`` refuses the target with one line that says how to opt in
(``PYTHONPATH=.``), before anything is written; with the folder on ``PYTHONPATH`` it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ase.io
from helpers import rattled_argon

ROOT = Path(__file__).resolve().parents[1]
LJ = ["model.name=lj", "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "model.device=cpu", "output.progress=false",
      "output.plot=false"]

MODULE = '''
from pathlib import Path

Path(__file__).with_name("imported").write_text("code from the working directory ran")


def energy(atoms, step):
    return {"e": 0.0}
'''


def _md(cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "xnn", "md", "structure=ar.xyz", "output.dir=out", "steps=2",
           "ensemble=nve", "temperature=10", *LJ, "hooks.0.name=callable",
           "hooks.0.target=mymod:energy", "hooks.0.every=1"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_python_m_xnn_imports_nothing_from_the_working_directory(tmp_path):
    ase.io.write(tmp_path / "ar.xyz", rattled_argon(rep=1))
    (tmp_path / "mymod.py").write_text(MODULE)
    refused = _md(tmp_path, [ROOT])
    err = refused.stderr.strip().splitlines()
    assert not (tmp_path / "imported").exists(), "python -m xnn imported ./mymod.py"
    assert refused.returncode == 2 and len(err) == 1, (refused.returncode, refused.stderr)
    assert err[0].startswith("xnn md: error: callable target 'mymod:energy'"), err
    assert "PYTHONPATH=." in err[0] and "working directory" in err[0], err
    assert not (tmp_path / "out").exists()
    opted_in = _md(tmp_path, [ROOT, tmp_path])  # the user's own choice: PYTHONPATH=.
    assert opted_in.returncode == 0, opted_in.stderr[-2000:]
    assert (tmp_path / "imported").exists()
    assert (tmp_path / "out" / "hooks" / "energy.csv").is_file()
