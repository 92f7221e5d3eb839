"""The one bridge from the user's decomposition words (``parallel.mode``, ``xnn validate
--mode``: :data:`xnn.distributed.modes.MODES`) to the words today's library entries take.

Transitional: once :func:`~xnn.distributed.parallelize_md`,
:func:`~xnn.distributed.parallelize_train` and the validate decomposition take the words of
``MODES`` themselves, :func:`library_mode` returns its argument and goes away. Until then it
is the only place that translates them, and it refuses a word whose meaning an entry cannot
run yet instead of running another mode under its name.
"""

from __future__ import annotations

from xnn.distributed.modes import MODES
from xnn.errors import InputError

#: entry -> {user word: the word that entry takes today} (a word not listed: refused)
_TODAY = {
    # parallelize_md / DomainRun: "halo" = spatial boxes (sync where the model has sync points)
    "md": {"spatial": "halo", "graph": "graph", "auto": "auto"},
    # parallelize_train / cp_train: "auto" = spatial; "halo", "sync" as meant by MODES
    "train": {"spatial": "auto", "halo": "halo", "sync": "sync", "graph": "graph"},
    # graph.auto.decomposed: "auto" = the cost-model choice; "halo", "sync" as meant
    "validate": {"auto": "auto", "halo": "halo", "sync": "sync", "graph": "graph"},
}


def library_mode(mode: str, entry: str, key: str = "parallel.mode", model=None) -> str:
    """The word ``entry`` (``"md"``, ``"train"`` or ``"validate"``) takes for the user's
    ``mode``; ``model`` resolves ``spatial`` where the entry has no word for it (validate:
    ``sync`` for a model with sync points, else ``halo``).

    Raises:
        InputError: a word not in ``MODES``, or one ``entry`` cannot run yet (naming ``key``
            and the words it can).
    """
    if mode not in MODES:
        raise InputError(f"{key}={mode!r} is not a decomposition mode; choose one of "
                         f"{list(MODES)}")
    today = _TODAY[entry]
    if mode == "spatial" and mode not in today and model is not None:
        return "sync" if model.sync_points else "halo"
    if mode not in today:
        can = [w for w in MODES if w in today or w == "spatial" and model is not None]
        raise InputError(f"{key}={mode} is not available for this command yet; choose one "
                         f"of {can}")
    return today[mode]


def check_md_degrees(dd: int, world_size: int) -> None:
    """``xnn md`` / ``relax`` decompose one simulation over every rank: ``parallel.dd`` must
    be -1 (inferred) or the world size."""
    if dd not in (-1, world_size):
        raise InputError(f"parallel.dd={dd} but the launch has {world_size} ranks: xnn md and "
                         "relax decompose one simulation over every rank; set parallel.dd: -1 "
                         f"or {world_size}")
