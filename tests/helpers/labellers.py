"""Labellers of the active-learning tests (``xnn learn``), named as
``label.calculator=helpers.labellers:counting_emt`` with ``PYTHONPATH`` holding ``tests/``.

:func:`counting_emt` returns ASE's EMT that appends ``start HASH`` before and ``end HASH``
after each calculation to the file ``$XNN_TEST_LABEL_LOG`` (HASH: the structure's content
hash), sleeping ``$XNN_TEST_LABEL_SLEEP`` seconds in between: a test counts the labeller's
calls per structure across killed and resumed runs, and has time to kill one mid-label.
"""

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
        time.sleep(float(os.environ.get("XNN_TEST_LABEL_SLEEP", "0")))
        if system_changes is None:
            super().calculate(atoms, properties)
        else:
            super().calculate(atoms, properties, system_changes)
        _append(log, f"end {key}")


def _append(path: str, line: str) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def counting_emt() -> CountingEMT:
    """The factory ``xnn learn`` calls: a fresh counting EMT."""
    return CountingEMT()
