"""The bad-input sweep's classifier (``scripts/bad_input_sweep.py``) on outcomes made on
purpose: real subprocesses that print a traceback, exit 2 with one line, or sleep past their
limit; python calls that raise an xnn error, another exception, or return; and the
catalogue itself (unique ids, the categories issue 42 asks for)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from xnn.errors import InputError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bad_input_sweep.py"


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("bad_input_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bad_input_sweep"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("bad_input_sweep", None)


def _outcome(sweep, tmp_path, **case_kw):
    case = sweep.Case(id=case_kw.pop("id", "c"), category="test", description="", **case_kw)
    fx = sweep.Fixtures(tmp_path / "fx")  # no inputs built: only the console script
    res, _ = sweep.run_case(case, fx, tmp_path / "cases")
    return sweep.classify(case, res)


def _python(code: str, sweep):
    return sweep.Proc([sys.executable, "-c", code], entry="raw")


def test_commands_are_classified_by_their_streams(sweep, tmp_path):
    one_line = "import sys; print('xnn md: error: steps=-1 must be >= 0', file=sys.stderr); " \
               "sys.exit(2)"
    assert _outcome(sweep, tmp_path, run=_python(one_line, sweep))[0] == sweep.CLEAR
    misleading = _outcome(sweep, tmp_path, run=_python(one_line, sweep), match="director")
    assert misleading[0] == sweep.MISLEADING
    crash = "def f():\n    raise ValueError('boom')\nf()"
    kind, detail = _outcome(sweep, tmp_path, run=_python(crash, sweep))
    assert kind == sweep.TRACEBACK and "ValueError: boom" in detail
    two_lines = "import sys; print('a\\nb', file=sys.stderr); sys.exit(2)"
    assert _outcome(sweep, tmp_path, run=_python(two_lines, sweep))[0] == sweep.UNCLEAR
    other_code = "import sys; print('x: error: y', file=sys.stderr); sys.exit(1)"
    assert _outcome(sweep, tmp_path, run=_python(other_code, sweep))[0] == sweep.UNCLEAR
    accepted = _python("print('done')", sweep)
    assert _outcome(sweep, tmp_path, run=accepted)[0] == sweep.SILENT
    assert _outcome(sweep, tmp_path, run=accepted, expect=sweep.ACCEPT)[0] == sweep.OK
    kind, detail = _outcome(sweep, tmp_path, run=_python("import time; time.sleep(30)", sweep),
                            timeout=1.0)
    assert kind == sweep.HANG and "1 s" in detail


def test_a_hang_stops_the_processes_it_started(sweep, tmp_path):
    """torchrun's ranks live in sessions of their own: a hung case must not leave them."""
    import os
    import time

    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "start_new_session=True)\n"
            "open('child.pid', 'w').write(str(child.pid))\n"
            "time.sleep(60)\n")
    start = time.monotonic()
    kind, _ = _outcome(sweep, tmp_path, id="orphan", run=_python(code, sweep), timeout=2.0)
    # a child left alive holds the case's pipes: the case would wait for its 60 s sleep
    assert kind == sweep.HANG and time.monotonic() - start < 30
    pid = int((tmp_path / "cases" / "orphan" / "child.pid").read_text())
    for _ in range(50):  # reaped by init once its parent is gone
        stat = Path(f"/proc/{pid}/stat")
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        raise AssertionError(f"the case's child {pid} outlived it")


def test_a_marker_file_means_code_ran(sweep, tmp_path):
    """A payload's marker in the case folder is "silent" even when the run then failed."""
    code = "import sys; open('MARKER-x', 'w').close(); print('e: error: no', " \
           "file=sys.stderr); sys.exit(2)"
    kind, detail = _outcome(sweep, tmp_path, run=_python(code, sweep))
    assert kind == sweep.SILENT and "MARKER-x" in detail


def test_python_calls_and_checks(sweep, tmp_path):
    def raise_(exc):
        def fn(ctx):
            raise exc
        return fn

    assert _outcome(sweep, tmp_path, run=sweep.Py(raise_(InputError("bad cutoff"))),
                    match="cutoff")[0] == sweep.CLEAR
    assert _outcome(sweep, tmp_path, run=sweep.Py(raise_(InputError("a\nb"))))[0] == \
        sweep.UNCLEAR
    assert _outcome(sweep, tmp_path, run=sweep.Py(raise_(KeyError("k"))))[0] == sweep.TRACEBACK
    # a legitimate input refused cleanly is not a good outcome either
    assert _outcome(sweep, tmp_path, run=sweep.Py(raise_(InputError("no"))),
                    expect=sweep.ACCEPT)[0] == sweep.REFUSED
    two = sweep.Py(lambda ctx: 2)
    assert _outcome(sweep, tmp_path, run=two)[0] == sweep.SILENT
    wrong = lambda ctx, res: None if res.value == 3 else f"got {res.value}"  # noqa: E731
    assert _outcome(sweep, tmp_path, run=two, expect=sweep.EITHER, check=wrong) == \
        (sweep.SILENT, "got 2")
    right = lambda ctx, res: None if res.value == 2 else "wrong"  # noqa: E731
    assert _outcome(sweep, tmp_path, run=two, expect=sweep.EITHER, check=right)[0] == sweep.OK
    slow = sweep.Py(lambda ctx: __import__("time").sleep(30))
    assert _outcome(sweep, tmp_path, run=slow, timeout=0.5)[0] == sweep.HANG


def test_grad_mode_left_off_is_found_and_restored(sweep, tmp_path):
    """A call that switches autograd off for its caller is "silent", and the next case runs
    with it on again (a later training would fail: its loss would have no grad_fn)."""
    import torch

    off = sweep.Py(lambda ctx: torch.set_grad_enabled(False))
    kind, detail = _outcome(sweep, tmp_path, run=off, expect=sweep.ACCEPT)
    assert (kind, detail) == (sweep.SILENT, "left torch's grad mode off for the caller")
    assert torch.is_grad_enabled()


def test_in_process_cli_and_argparse_refusals(sweep, tmp_path):
    """``xnn frobnicate`` through ``xnn.cli.main.main``: argparse's usage and error line."""
    kind, detail = _outcome(sweep, tmp_path, run=sweep.Cli(["frobnicate"]))
    assert kind == sweep.CLEAR and "frobnicate" in detail


def test_catalogue_covers_the_issue(sweep):
    cases = sweep.catalogue()
    assert len(cases) >= 250 and len({c.id for c in cases}) == len(cases)
    categories = {c.category for c in cases}
    for needed in ("config", "files-data", "files-structure", "files-model", "files-checkpoint",
                   "trust", "index", "md", "hooks", "relax", "run", "train", "eval", "validate",
                   "export", "data", "demo", "api", "long-range", "distributed", "entry",
                   "vocabulary"):
        assert needed in categories, needed
    assert all(c.expect in (sweep.ERROR, sweep.ACCEPT, sweep.EITHER) for c in cases)
    assert sum(c.issue for c in cases) >= 40


def test_every_former_spelling_is_swept(sweep):
    """Each renamed key of ``xnn/config/renamed.py`` is given to md, relax, run and train from
    a YAML file and from an override, and the catalogue uses none of them elsewhere (a case
    of a bad value must reach that value, not the rename refusal)."""
    from xnn.config.renamed import RENAMED, old_key

    swept = {old_key(override.split("=")[0]) for _, override, _ in sweep.OLD_SPELLINGS.values()}
    assert swept == set(RENAMED)
    ids = {c.id for c in sweep.catalogue()}
    for door in ("md", "relax", "run", "train"):
        for old in sweep.OLD_SPELLINGS:
            assert {f"vocab-{door}-{old}-yaml", f"vocab-{door}-{old}-dotlist"} <= ids
    assert {"vocab-validate-timeout-space", "vocab-validate-timeout-equals"} <= ids
    commands = (sweep.Cli, sweep.Proc, sweep.Torchrun)
    for case in sweep.catalogue():
        if case.category != "vocabulary" and isinstance(case.run, commands):
            for arg in case.run.argv:
                key = arg.split("=")[0]
                assert old_key(key) is None and key != "--timeout", (case.id, arg)


@pytest.mark.parametrize("case_id", ["vocab-md-dd.mode-halo-yaml", "vocab-train-model.add-dotlist",
                                     "vocab-validate-timeout-equals"])
def test_former_spellings_are_refused_in_one_line(sweep, tmp_path, case_id):
    """Real refusals through ``xnn.cli.main.main``: the config is read before any input, so
    the inputs' paths need not exist."""
    case = next(c for c in sweep.catalogue() if c.id == case_id)
    fx = sweep.Fixtures(tmp_path / "fx")
    fx.paths.update({name: str(tmp_path / f"{name}.xyz") for name in ("cu", "ar", "ar2", "lj")})
    res, _ = sweep.run_case(case, fx, tmp_path / "cases")
    kind, detail = sweep.classify(case, res)
    assert kind == sweep.CLEAR, detail
