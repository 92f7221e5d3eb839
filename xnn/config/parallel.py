"""The ``parallel`` section shared by every command that runs under torchrun / srun
(``xnn train``, ``xnn md``, ``xnn relax``, ``xnn run``): one section, one meaning per key.

``parallel.mode`` takes the words of :data:`xnn.distributed.modes.MODES` (the same as
``xnn validate --mode``); the default ``spatial`` is what ``xnn md``'s former ``dd.mode=halo``
and ``xnn train``'s former ``parallel.mode=halo`` did. ``parallel.timeout_s`` is the
timeout of the process-group rendezvous and of every collective
(:meth:`xnn.distributed.DistributedManager.initialize`); a collective that times out stops
the run with one line naming the collective, the ranks that did not arrive and this key
(:data:`TIMEOUT_KEY`).
"""

from __future__ import annotations

from dataclasses import dataclass

from xnn.config.loader import ConfigError, check_range, field
from xnn.distributed.domain.balance import BALANCE
from xnn.distributed.domain.staged import EXCHANGES
from xnn.distributed.manager import DEFAULT_TIMEOUT_S
from xnn.distributed.modes import MODES, ORDERS

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


def mode_field():
    """The ``mode`` field of a ``parallel`` section: one word of
    :data:`xnn.distributed.modes.MODES`, with one meaning for every command."""
    words = "; ".join(f"{k}: {v}" for k, v in MODES.items())
    return field("spatial", f"how a decomposition (parallel.dd > 1) splits each structure "
                 f"over its ranks -- {words}", choices=tuple(MODES))


@dataclass
class ParallelConfig:
    """The ``parallel`` section of ``xnn train``, ``xnn md``, ``xnn relax`` and ``xnn run``:
    the ``dp × dd`` layout of a launch on several ranks (torchrun / srun), the decomposition
    mode, order, balance and exchange, and the collectives' timeout.

    Each command checks the degrees it uses: ``xnn train`` any ``dp × dd`` = world size;
    ``xnn md`` / ``relax`` decompose one simulation over every rank (``dp`` 1, ``dd`` the
    world size: -1); ``xnn run`` shares its systems among the ranks (``dp`` the world size:
    -1, ``dd`` 1, no decomposition).
    """

    dp: int = field(-1, "data-parallel degree: groups of ranks that work on different "
                    "structures (-1: world size / dd)")
    dd: int = field(1, "domain-decomposition degree: ranks that split each structure "
                    "(-1: world size / dp); xnn train: context parallel, every structure of a "
                    "dd group's share decomposed over its dd ranks (eager: not with "
                    "xnn train's compile)")
    mode: str = mode_field()
    order: str = field("morton", "atom order split into blocks by mode graph: morton "
                       "(space-filling curve, fewer cross-rank edges) or index (atom id)",
                       choices=ORDERS)
    balance: str = field("none", "how the spatial modes cut each structure into boxes -- "
                         + "; ".join(f"{k}: {v}" for k, v in BALANCE.items()),
                         choices=tuple(BALANCE))
    exchange: str = field("direct", "how the spatial modes send ghost rows between boxes -- "
                          + "; ".join(f"{k}: {v}" for k, v in EXCHANGES.items())
                          + " (mode graph and a host engine: direct only)",
                          choices=tuple(EXCHANGES))
    timeout_s: float = timeout_field()

    def __post_init__(self):
        check_timeout(self.timeout_s)
        for key in ("dp", "dd"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{key}={value} must be >= 1, or -1 (inferred "
                                  "from the world size)")

    def check_md(self) -> None:
        """``xnn md`` / ``relax``: one simulation decomposed over every rank."""
        if self.dp != 1:
            raise ConfigError(f"parallel.dp={self.dp}: xnn md and relax run one simulation "
                              "decomposed over every rank (parallel.dd); set parallel.dp: 1")

    def check_workflow(self) -> None:
        """``xnn run``: systems shared among the ranks, none decomposed."""
        if self.dd != 1:
            raise ConfigError(f"parallel.dd={self.dd}: xnn run shares its systems among the "
                              "ranks (each system on one rank); set parallel.dd: 1")
        for key, value, default in (("mode", self.mode, "spatial"),
                                    ("order", self.order, "morton"),
                                    ("balance", self.balance, "none"),
                                    ("exchange", self.exchange, "direct")):
            if value != default:
                raise ConfigError(f"parallel.{key} is a setting of a decomposition (xnn md, "
                                  "relax, train with parallel.dd > 1); xnn run decomposes "
                                  "no system: remove it")


def md_parallel() -> ParallelConfig:
    """The defaults of ``xnn md`` / ``relax``: every rank decomposes the one simulation."""
    return ParallelConfig(dp=1, dd=-1)


def parallel_field(default: ParallelConfig | None = None):
    """The ``parallel`` field of a command's config (``default``: its defaults)."""
    return field(default or ParallelConfig(), "runs launched on several ranks (torchrun / "
                 "srun): layout dp × dd, decomposition mode and order, timeout")
