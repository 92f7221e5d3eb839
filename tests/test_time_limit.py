"""The per-test time limit (tests/time_limit.py): a stuck test fails with the stacks of its
threads and the suite goes on; a test stuck where no signal reaches ends pytest after a
grace period, with the stacks on the terminal. Real pytest processes (pytester)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SUITE = """
import time

import pytest


def wait_forever():
    time.sleep(60)


def test_default_limit():
    wait_forever()


@pytest.mark.slow
def test_slow_has_more_time():
    time.sleep(1.0)


@pytest.mark.time_limit(250)
def test_own_limit():
    wait_forever()


def test_after():
    pass
"""


@pytest.fixture
def plugin_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))


def test_a_stuck_test_fails_by_its_limit_and_the_suite_goes_on(pytester, plugin_path):
    pytester.makepyfile(test_stuck=SUITE)
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n")
    t0 = time.perf_counter()
    # scale 0.002: default 0.6 s, slow 2.4 s, time_limit(250) 0.5 s
    result = pytester.runpytest_subprocess("-p", "time_limit", "--time-limit-scale", "0.002",
                                           "-p", "no:cacheprovider", timeout=120)
    assert time.perf_counter() - t0 < 40
    result.assert_outcomes(passed=2, failed=2)
    # the stuck test's stack: in the failure's traceback and, for every thread, in its stderr
    result.stdout.fnmatch_lines([
        "*_ test_default_limit _*", "*wait_forever()*", "*time.sleep(60)*",
        "E*Failed: test time limit of 0.6 s exceeded in call*",
        "*Captured stderr call*", "*--- thread MainThread ---*", "*in wait_forever*",
        "*_ test_own_limit _*", "E*Failed: test time limit of 0.5 s exceeded in call*",
        "FAILED test_stuck.py::test_default_limit*", "FAILED test_stuck.py::test_own_limit*"])
    assert "passed its time limit of 0.6 s" in result.stderr.str()


BLOCKED = """
import signal
import time

import time_limit

time_limit.GRACE_S = 1.0


def test_blocked():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # no Python handler runs
    time.sleep(60)


def test_never_reached():
    pass
"""


def test_a_test_deaf_to_signals_ends_pytest_with_its_stack(pytester, plugin_path):
    pytester.makepyfile(test_blocked=BLOCKED)
    t0 = time.perf_counter()
    result = pytester.runpytest_subprocess("-p", "time_limit", "--time-limit-scale", "0.002",
                                           "-p", "no:cacheprovider", timeout=120)
    assert time.perf_counter() - t0 < 40
    assert result.ret == 1
    err = result.stderr.str()
    assert "Timeout" in err and "test_blocked" in err, err
    assert "test_never_reached" not in result.stdout.str()


def test_limits_by_marker(pytester):
    pytester.makepyfile(test_m="""
        import pytest

        def test_plain(): pass

        @pytest.mark.distributed
        @pytest.mark.slow
        def test_both(): pass

        @pytest.mark.gpu
        def test_gpu(): pass

        @pytest.mark.time_limit(7)
        @pytest.mark.slow
        def test_own(): pass
    """)
    pytester.makeini("[pytest]\nmarkers =\n    slow: long\n    gpu: cuda\n    distributed: ranks\n")
    from time_limit import time_limit

    items, _ = pytester.inline_genitems("-p", "time_limit", "-p", "no:cacheprovider",
                                        "--strict-markers")
    assert {i.name: time_limit(i) for i in items} == {
        "test_plain": 300.0, "test_both": 1200.0, "test_gpu": 600.0, "test_own": 7.0}
