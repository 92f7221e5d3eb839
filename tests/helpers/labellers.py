"""Labellers of the active-learning tests (``xnn learn``), named as
``label.calculator=helpers.labellers:counting_emt`` with ``PYTHONPATH`` holding ``tests/``.

:func:`counting_emt` returns ASE's EMT that appends ``start HASH`` before and ``end HASH``
after each calculation to the file ``$XNN_TEST_LABEL_LOG`` (HASH: the structure's content
hash): a test counts the labeller's calls per structure across killed and resumed runs.
With ``$XNN_TEST_LABEL_HOLD_AT=N`` the call that writes the log's N-th ``start`` line waits
there (up to 60 s) to be killed mid-label; the calls before it do not wait."""

from __future__ import annotations

import os
import time

from ase.calculators.emt import EMT

from xnn.app.learn_label import structure_hash


class CountingEMT(EMT):
    """EMT that logs each calculation's start and end by structure hash."""

    def calculate(self, atoms=None, properties=("energy",), system_changes=None):
        log = os.environ["XNN_TEST_LABEL_LOG"]
        key = structure_hash(atoms)
        _append(log, f"start {key}")
        hold_at = int(os.environ.get("XNN_TEST_LABEL_HOLD_AT", "0"))
        if hold_at and _starts(log) >= hold_at:
            time.sleep(60.0)  # the test kills this process here
        if system_changes is None:
            super().calculate(atoms, properties)
        else:
            super().calculate(atoms, properties, system_changes)
        _append(log, f"end {key}")


def _starts(path: str) -> int:
    with open(path, encoding="utf-8") as fh:
        return sum(line.startswith("start ") for line in fh)


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def counting_emt() -> CountingEMT:
    """The factory ``xnn learn`` calls: a fresh counting EMT."""
    return CountingEMT()
