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



def resolve_mode(model, mode: str, graph=None, group=None, grid=None,
                 skin: float = 0.0) -> tuple[str, str | None]:
    """The one place a word of :data:`MODES` becomes a layout's mode.

    Args:
        model: the model to decompose (its ``sync_points`` decide ``spatial``).
        mode: a key of :data:`MODES`.
        graph: ``auto`` only: the structure on group rank 0 (``None`` elsewhere).
        group: ``auto`` only: the process group whose rank 0 decides.
        grid, skin: ``auto`` only: the spatial layout the cost model weighs.
    Returns:
        ``(mode, reason)``: ``"halo"``, ``"sync"`` or ``"graph"``, and for ``auto`` one line
        saying why (printed on group rank 0), else ``None``. ``auto`` is decided on group
        rank 0 by the cost model of :func:`xnn.distributed.graph.auto.choose_mode` and
        broadcast: collective.
    """
    from xnn.errors import InputError

    if mode not in MODES:
        raise InputError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if mode == "spatial":
        return ("sync" if model.sync_points else "halo"), None
    if mode != "auto":
        return mode, None
    from xnn.distributed import collectives as C
    from xnn.distributed.graph.auto import choose_mode

    choice = None
    with C.guarded(group, "choosing the decomposition mode"):
        if C.group_rank(group) == 0:
            choice = choose_mode(model, graph, C.group_size(group), grid, skin)
    mode, reason = C.broadcast_object(choice, group)
    if C.group_rank(group) == 0:
        print(f"xnn: {reason}", flush=True)
    return mode, reason


__all__ = ["MODES", "ORDERS", "resolve_mode"]
