"""A time limit for every test, so that one stuck test cannot take the whole suite.

Each phase of a test (setup, call, teardown) gets the test's limit: 300 s, or more for
tests marked ``slow`` (1200 s), ``gpu`` or ``distributed`` (600 s each; the largest applies),
or exactly ``seconds`` with ``@pytest.mark.time_limit(seconds)``. ``--time-limit-scale F``
multiplies every limit (a slow or shared machine); ``0`` turns the limits off (debugging).

Two stages:

1. at the limit, ``SIGALRM`` (Unix, main thread): the stack of every thread is written to
   the test's captured stderr and the test fails with ``test time limit of N s exceeded``;
   the suite goes on with the next test. Python handles the signal between two bytecodes,
   so this works whenever the stuck test runs Python code now and then;
2. at the limit plus :data:`GRACE_S` (a test stuck inside one C call: a collective, a
   kernel, a compiler), :func:`faulthandler.dump_traceback_later` writes the stack of every
   thread to the terminal and ends the pytest process (exit code 1): the run fails, naming
   the test, instead of hanging until CI's own limit.

Loaded by ``tests/conftest.py`` (a plain module, not a pytest-timeout dependency); pytest's
own ``faulthandler_timeout`` shares the one faulthandler timer and should stay unset.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import traceback

import pytest

DEFAULT_S = 300.0
MARKER_S = {"slow": 1200.0, "gpu": 600.0, "distributed": 600.0}
# a C call may run minutes before Python can act on the alarm (a Triton compile of a large
# unrolled kernel: about 3 min on a CPU core); a hang inside one is ended after this
GRACE_S = 180.0

_STDERR_FD = pytest.StashKey[int]()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--time-limit-scale", type=float, default=1.0, metavar="F",
        help="multiply every test's time limit (tests/time_limit.py: 300 s, slow 1200 s, gpu "
        "and distributed 600 s, or @pytest.mark.time_limit(seconds)) by F; 0 turns them off")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "time_limit(seconds): this test's time limit per phase (default 300 s; "
        "slow 1200 s, gpu and distributed 600 s)")
    # the terminal's stderr, for the last-resort dump (fd 2 is captured during tests)
    config.stash[_STDERR_FD] = os.dup(sys.__stderr__.fileno())


def pytest_unconfigure(config) -> None:
    if _STDERR_FD in config.stash:
        os.close(config.stash.get(_STDERR_FD, -1))
        del config.stash[_STDERR_FD]


def time_limit(item) -> float:
    """The limit (s) of each phase of ``item``; 0: none."""
    scale = float(item.config.getoption("--time-limit-scale"))
    marker = item.get_closest_marker("time_limit")
    if marker is not None:
        seconds = float(marker.args[0] if marker.args else marker.kwargs["seconds"])
    else:
        seconds = max([DEFAULT_S] + [s for name, s in MARKER_S.items()
                                     if item.get_closest_marker(name) is not None])
    return max(seconds * scale, 0.0)


def _stacks() -> str:
    """The stack of every thread of this process, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n")
        parts.extend(traceback.format_stack(frame))
    return "".join(parts)


class _Alarm:
    """Stage 1 and 2 of the module doc around one phase of one test."""

    def __init__(self, item, phase: str):
        self.limit = time_limit(item)
        self.name, self.phase = item.nodeid, phase
        self.stderr_fd = item.config.stash.get(_STDERR_FD, sys.__stderr__.fileno())
        self.previous = None
        self.signals = (self.limit > 0 and hasattr(signal, "SIGALRM")
                        and threading.current_thread() is threading.main_thread())

    def _expired(self, signum, frame) -> None:
        __tracebackhide__ = True
        os.write(self.stderr_fd, f"\n{self.name}: {self.phase} passed its time limit of "
                 f"{self.limit:g} s\n".encode())
        sys.stderr.write(f"\n+++ {self.name}: {self.phase} passed its time limit of "
                         f"{self.limit:g} s; stacks:\n{_stacks()}")
        pytest.fail(f"test time limit of {self.limit:g} s exceeded in {self.phase} (stacks "
                    "of all threads in the captured stderr; @pytest.mark.time_limit(seconds) "
                    "or --time-limit-scale changes it)", pytrace=True)

    def __enter__(self) -> _Alarm:
        if self.limit <= 0:
            return self
        if self.signals:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, self.limit)
        faulthandler.dump_traceback_later(self.limit + GRACE_S, exit=True,
                                          file=self.stderr_fd)
        return self

    def __exit__(self, *exc) -> None:
        if self.limit <= 0:
            return
        faulthandler.cancel_dump_traceback_later()
        if self.signals:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous or signal.SIG_DFL)


def _limited(item, phase: str):
    with _Alarm(item, phase):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _limited(item, "setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _limited(item, "call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _limited(item, "teardown"))


@pytest.hookimpl(tryfirst=True)
def pytest_enter_pdb() -> None:
    """No limit while a person debugs."""
    _cancel()


@pytest.hookimpl(tryfirst=True)
def pytest_exception_interact() -> None:
    _cancel()


def _cancel() -> None:
    faulthandler.cancel_dump_traceback_later()
    if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():
        signal.setitimer(signal.ITIMER_REAL, 0)
