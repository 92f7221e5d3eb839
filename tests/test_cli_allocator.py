"""The ``xnn`` command keeps glibc's large freed blocks mapped (xnn/cli/allocator.py): a CPU
force loop page-faults far less, users' own settings win, and in-process calls are left
alone."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from xnn.cli import allocator
from xnn.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import resource, sys
import torch
from xnn.cli.allocator import keep_large_blocks
if sys.argv[1] == "1":
    assert keep_large_blocks({})
torch.set_num_threads(1)
from ase.build import bulk
from xnn.data.graph import AtomicGraph
from xnn.models import build
from xnn.models.derivatives import compute_properties
from xnn.neighbors.api import with_edges
atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((8, 8, 8))
model = build("lj", sigma=2.3, epsilon=0.4, cutoff=6.0).double()
g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                            dtype=torch.float64)
def step():
    return compute_properties(model, with_edges(g, 7.0), True, True)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool) -> int:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if tuned else "0"], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="glibc only")
def test_a_cpu_force_loop_page_faults_far_less():
    """2,048 atoms, LJ forces and stress with a fresh neighbor list, 6 steps: glibc's
    defaults unmap and map again the freed blocks of every step (measured 154k faults at
    6.9k atoms); kept mapped, the steps reuse them (16k)."""
    default, tuned = _faults(False), _faults(True)
    assert tuned * 3 < default, (tuned, default)


def test_users_settings_win():
    for env in ({"XNN_ALLOCATOR": "system"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                {"MALLOC_MMAP_THRESHOLD_": "131072"},
                {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}):
        assert allocator.keep_large_blocks(env) is False
    # mallopt takes C ints: a value past 2**31 - 1 would wrap (4 GiB became 0: trim always)
    assert 0 < allocator.TRIM_THRESHOLD < 2 ** 31 and 0 < allocator.MMAP_THRESHOLD < 2 ** 31


def test_only_the_program_start_applies_it(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "keep_large_blocks", lambda: calls.append(1))
    assert cli.main([]) == 0  # a call from Python (tests, notebooks): the help, nothing else
    assert calls == []
    monkeypatch.setattr(sys, "argv", ["xnn"])
    assert cli.main() == 0  # the program's start
    assert calls == [1]
