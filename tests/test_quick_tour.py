"""The first day works as written: every command block of README.md's "Quick tour" and of the
docs (``docs/*.md``) runs, in order, in an empty folder, and the test fails if any fails.

Each page runs in its own fresh folder, which holds only a copy of ``examples/`` (the pages
say to run from the repository root). ``xnn``, ``torchrun`` and ``python`` resolve to this
checkout through small scripts on PATH (``python -m xnn`` with this interpreter). The
commands are the ones the reader sees, with only their sizes shrunk so the test fits in CI
(:data:`SHRINK`, :data:`APPEND`; README.md says so): fewer structures (``--n``), smaller
crystals (``--repeat``), fewer MD/relax steps (``steps=``, ``max_steps=``), one training
epoch (``max_epochs=1`` appended to ``xnn train``) and a one-epoch demo.

Not run: the ``make demo`` / ``make test`` lines of README.md's introduction (they set up a
virtual environment from PyPI; CI runs ``make test`` itself) and SLURM batch scripts
(``#SBATCH`` blocks: they need ``srun``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

#: where the blocks are: (page, heading of the section to run, or None for the whole page)
PAGES = [("README.md", "Quick tour"), ("docs/user-guide.md", None),
         ("docs/distributed.md", None), ("docs/train-your-data.md", None)]

#: sizes shrunk in every command (pattern, replacement)
SHRINK = [
    (re.compile(r"--n \d+"), lambda m: "--n 12"),
    (re.compile(r"--repeat \d+"), lambda m: "--repeat 3"),
    (re.compile(r"(?<![\w.])steps=(\d+)"), lambda m: f"steps={max(2, int(m[1]) // 200)}"),
    (re.compile(r"(?<![\w.])max_steps=(\d+)"), lambda m: f"max_steps={max(2, int(m[1]) // 50)}"),
]
#: options appended to commands (pattern of the command, what is appended)
APPEND = [
    (re.compile(r"(^|\s)(xnn|-m xnn) train (?!.*--print-config)"), "max_epochs=1"),
    (re.compile(r"(^|\s)(xnn|-m xnn) demo "), "--n-structures 10 --epochs 1 --md-steps 4"),
]


def blocks(page: str, section: str | None) -> list[tuple[str, str]]:
    """``(language, text)`` of the bash and python blocks of ``page`` (of its ``section``
    only, when given), in order; SLURM batch scripts left out."""
    text = (ROOT / page).read_text()
    if section is not None:
        start = text.index(f"\n## {section}\n")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end > 0 else None]
    found = [(lang, body) for lang, body in FENCE.findall(text)
             if lang == "bash" or section is not None and lang == "python"]
    return [(lang, body) for lang, body in found if "#SBATCH" not in body]


def shrink(line: str) -> str:
    """``line`` with only its sizes shrunk (:data:`SHRINK`, :data:`APPEND`)."""
    code, hash_, comment = line.partition("  #")
    for pattern, repl in SHRINK:
        code = pattern.sub(repl, code)
    for pattern, extra in APPEND:
        if pattern.search(code) and code.strip():
            code = code.rstrip() + " " + extra
    return code + (hash_ + comment if hash_ else "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shims(folder: Path) -> Path:
    """``xnn``, ``torchrun`` and ``python`` of this interpreter and checkout."""
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, target in (("xnn", "-m xnn"), ("torchrun", "-m torch.distributed.run"),
                         ("python", ""), ("python3", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)
    return bin_dir


def run_page(page: str, section: str | None, folder: Path) -> None:
    """Run the blocks of ``page`` in order in ``folder``; fail at the first that fails."""
    shutil.copytree(ROOT / "examples", folder / "examples")
    env = {**os.environ, "PATH": f"{_shims(folder)}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    for k, (lang, body) in enumerate(blocks(page, section)):
        if lang == "python":
            script = folder / f".block{k}.py"
            script.write_text(body)
            body = f'python "{script}"'
        script = "\n".join(shrink(line) for line in body.splitlines())
        env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port
        proc = subprocess.run(["bash", "-c", f"set -euxo pipefail\n{script}"], cwd=folder,
                              env=env, capture_output=True, text=True, timeout=1800)
        assert proc.returncode == 0, (
            f"{page}: block {k} failed (exit {proc.returncode}):\n{script}\n--- stderr "
            f"(commands after +):\n{proc.stderr[-4000:]}\n--- stdout:\n{proc.stdout[-2000:]}")


def test_blocks_are_found_and_have_no_placeholders():
    """Every page has blocks, none holds a ``...`` placeholder, and shrinking changes only
    sizes."""
    for page, section in PAGES:
        found = blocks(page, section)
        assert found, page
        for lang, body in found:
            if lang == "bash":
                assert "..." not in body, f"{page}: a placeholder in\n{body}"
    assert shrink("xnn md a.yaml steps=1000 max_steps=300 stages.1.steps=40") == \
        "xnn md a.yaml steps=5 max_steps=6 stages.1.steps=40"
    assert shrink("xnn train cfg.yaml x=1  # note") == "xnn train cfg.yaml x=1 max_epochs=1  # note"
    assert shrink("xnn train cfg.yaml --print-config") == "xnn train cfg.yaml --print-config"


@pytest.mark.slow
@pytest.mark.parametrize("page, section", PAGES, ids=[p for p, _ in PAGES])
def test_page_runs_in_order_in_an_empty_folder(page, section, tmp_path):
    run_page(page, section, tmp_path)
