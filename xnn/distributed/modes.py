"""The decomposition modes: one list, one meaning for each word, for every command and the
library (``xnn md``/``relax``/``train``/``validate``, :func:`~xnn.distributed.parallelize`).
"""

from __future__ import annotations

from xnn.distributed.graph.order import ORDERS

#: mode -> what it means. ``spatial``, ``halo`` and ``sync`` split space into boxes;
#: ``graph`` splits the atoms into index blocks; ``auto`` chooses among them per system.
MODES: dict[str, str] = {
    "auto": "chosen per system on rank 0 by a cost model of the exchanges: graph, or "
            "spatial boxes (sync where the model has sync points, else halo)",
    "spatial": "spatial boxes: sync where the model has sync points, else halo",
    "halo": "spatial boxes with a ghost shell of the whole receptive field, no exchange "
            "between layers",
    "sync": "spatial boxes with a ghost shell of one cutoff and a feature exchange at every "
            "sync point of the model",
    "graph": "index blocks of atoms (graph parallelism, atoms ordered by `order`), features "
             "exchanged at every sync point",
}



def check_mode(mode: str) -> None:
    """``InputError`` naming the list when ``mode`` is not a key of :data:`MODES`."""
    from xnn.errors import InputError

    if mode not in MODES:
        raise InputError(f"mode must be one of {list(MODES)}, got {mode!r}")


def spatial_mode(model) -> str:
    """What ``spatial`` means for ``model``: ``"sync"`` where it has sync points, else
    ``"halo"``."""
    return "sync" if model.sync_points else "halo"


__all__ = ["MODES", "ORDERS", "check_mode", "spatial_mode"]
