"""The one constructor of a decomposition, :func:`parallelize`, and the one place a mode word
becomes a layout, :func:`resolve_mode`.

Kept apart from the run entries of :mod:`xnn.distributed.entries` (MD, relaxation,
training), which build on it, so that the runs and the training predictor construct their
decomposition without importing the entries that construct them.
"""

from __future__ import annotations


def resolve_mode(model, mode: str, graph=None, group=None, grid=None,
                 skin: float = 0.0, balance: str = "none") -> tuple[str, str | None]:
    """The one place a word of :data:`~xnn.distributed.modes.MODES` becomes a layout's mode.

    Args:
        model: the model to decompose (its ``sync_points`` decide ``spatial``).
        mode: a key of :data:`~xnn.distributed.modes.MODES`.
        graph: ``auto`` only: the structure on group rank 0 (``None`` elsewhere).
        group: ``auto`` only: the process group whose rank 0 decides.
        grid, skin, balance: ``auto`` only: the spatial layout the cost model weighs.
    Returns:
        ``(mode, reason)``: ``"halo"``, ``"sync"`` or ``"graph"``, and for ``auto`` one line
        saying why (printed on group rank 0), else ``None``. ``auto`` is decided on group
        rank 0 by the cost model of :func:`xnn.distributed.graph.auto.choose_mode` and
        broadcast: collective.
    """
    from xnn.distributed.modes import check_mode, spatial_mode

    check_mode(mode)
    if mode == "spatial":
        return spatial_mode(model), None
    if mode != "auto":
        return mode, None
    from xnn.distributed import collectives as C
    from xnn.distributed.graph.auto import choose_mode

    choice = None
    with C.guarded(group, "choosing the decomposition mode"):
        if C.group_rank(group) == 0:
            choice = choose_mode(model, graph, C.group_size(group), grid, skin, balance)
    mode, reason = C.broadcast_object(choice, group)
    if C.group_rank(group) == 0:
        print(f"xnn: {reason}", flush=True)
    return mode, reason


def parallelize(model, manager_or_group=None, mode: str = "spatial", *, graph=None,
                grid=None, skin: float = 0.0, order: str = "morton", backend: str = "auto",
                host: bool = False, balance: str = "none", exchange: str = "direct"):
    """``model`` decomposed over the ranks of a group: the one constructor.

    Args:
        model: per-atom-energy model (:class:`~xnn.models.base.AtomisticModel`) with a
            finite cutoff, the same on every rank.
        manager_or_group: a :class:`~xnn.distributed.DistributedManager` (all ranks), a
            :class:`~xnn.distributed.ParallelDims` (its ``dd`` axis), a process group, or
            ``None`` (all ranks if ``torch.distributed`` is initialised, else one process).
        mode: a key of :data:`~xnn.distributed.modes.MODES` (``spatial``, ``halo``,
            ``sync``, ``graph`` or ``auto``).
        graph: mode ``auto`` only: the structure on group rank 0, which the cost model
            weighs (collective: every rank calls with its own, ``None`` off rank 0).
        grid: boxes of a spatial layout, ``(px, py, pz)`` or ``"2,1,1"`` (``None``: the
            smallest halo surface).
        skin: Verlet skin (Å).
        order: atom order of mode ``graph`` (``morton`` or ``index``).
        backend: neighbor-list backend.
        balance: how a spatial layout cuts its boxes, a word of
            :data:`~xnn.distributed.domain.balance.BALANCE`: ``none`` (equal widths) or
            ``shift`` (per-axis cuts at atom-count quantiles, at the scatter and at every
            rebuild); mode ``graph`` and a host engine take ``none`` only.
        exchange: how a spatial layout's ghost rows travel, a key of
            :data:`~xnn.distributed.domain.staged.EXCHANGES`: ``direct`` (one message per
            peer box) or ``staged`` (along x, then y, then z, to the -1 and +1 box of each
            axis); mode ``graph`` and a host engine take ``direct`` only.
        host: a host MD engine (LAMMPS) owns the atoms, their ghosts and their migration:
            a :class:`~xnn.distributed.host.layout.HostLayout` (modes ``spatial``,
            ``halo``, ``sync``; ``auto`` is ``spatial``), whose ``ghosts`` the host sets
            before each evaluation.
    Returns:
        a :class:`~xnn.distributed.potential.DecomposedPotential` (its ``reason`` says why
        ``auto`` chose its layout).
    """
    from xnn.distributed.domain.balance import check_balance
    from xnn.distributed.domain.layout import SpatialLayout
    from xnn.distributed.domain.staged import check_exchange
    from xnn.distributed.graph.layout import GraphLayout
    from xnn.distributed.potential import DecomposedPotential, model_cutoff, resolve_group
    from xnn.errors import InputError

    model_cutoff(model)  # the one check of a decomposable model, before any collective
    check_balance(balance)
    check_exchange(exchange)
    if exchange != "direct" and (host or mode == "graph"):
        raise InputError(f"exchange {exchange!r} routes the ghosts of a spatial layout's "
                         f"boxes; mode {mode!r}{' in a host engine' if host else ''} has "
                         "none" + (" (the engine sends the ghosts): set exchange direct" if host
                                   else ": set exchange direct (parallel.exchange: direct) "
                                   "or mode spatial"))
    if balance != "none" and (host or mode == "graph"):
        raise InputError(f"balance {balance!r} cuts the boxes of a spatial layout; mode "
                         f"{mode!r}{' in a host engine' if host else ''} has none: set "
                         "balance none")
    group, _ = resolve_group(manager_or_group)
    if host:
        from xnn.distributed.host.layout import HostLayout

        if mode == "graph":
            raise InputError("mode 'graph' cannot run inside a host engine's decomposition "
                             "(its ranks own regions); use 'spatial', 'halo' or 'sync'")
        mode, reason = resolve_mode(model, "spatial" if mode == "auto" else mode)
        layout = HostLayout(mode)
    else:
        mode, reason = resolve_mode(model, mode, graph, group, grid, skin, balance)
        if exchange != "direct" and mode == "graph":  # auto chose it (the same on every rank)
            raise InputError(f"exchange {exchange!r} routes the ghosts of a spatial layout's "
                             f"boxes, and mode auto chose graph here -- {reason}: set "
                             "exchange direct (parallel.exchange: direct) or mode spatial")
        layout = (GraphLayout(order) if mode == "graph"
                  else SpatialLayout(mode, grid, balance, exchange))
    potential = DecomposedPotential(model, manager_or_group, layout, skin, backend)
    potential.reason = reason
    return potential
