"""The ``parallel.timeout_s`` option shared by every command that runs under torchrun / srun
(``xnn train``, ``xnn md``, ``xnn relax``, ``xnn run``): one key, one meaning, one default.

It is the timeout of the process-group rendezvous and of every collective
(:meth:`xnn.distributed.DistributedManager.initialize`); a collective that times out stops
the run with one line naming the collective, the ranks that did not arrive and this key
(:data:`TIMEOUT_KEY`).
"""

from __future__ import annotations

from dataclasses import dataclass

from xnn.config.loader import check_range, field
from xnn.distributed.manager import DEFAULT_TIMEOUT_S

#: the key a timed-out collective's message names (``timeout_key`` of the manager)
TIMEOUT_KEY = "parallel.timeout_s"


def timeout_field():
    """The ``timeout_s`` field of a ``parallel`` section (one definition for all commands)."""
    return field(DEFAULT_TIMEOUT_S, "under torchrun / srun: timeout of the rendezvous and of "
                 "every collective (s); a rank that waits longer stops the run with one line "
                 "naming the collective and the ranks that did not arrive")


def check_timeout(value: float) -> None:
    """Refuse a ``parallel.timeout_s`` that is not a finite number > 0."""
    check_range(TIMEOUT_KEY, value, 0.0, low_inclusive=False)


@dataclass
class RunParallelConfig:
    """The ``parallel`` section of ``xnn md``, ``xnn relax`` (the decomposition itself is set
    in ``dd``) and ``xnn run`` (systems shared among the ranks)."""

    timeout_s: float = timeout_field()

    def __post_init__(self):
        check_timeout(self.timeout_s)
