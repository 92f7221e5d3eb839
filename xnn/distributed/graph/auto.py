"""``mode=auto``: spatial halos or graph parallelism, from a cost model measured on rank 0.

Both strategies give every rank ``N / P`` owned atoms to compute; they differ in what else a
rank holds and receives per evaluation. Rank 0 measures, on the actual structure:

* halo fraction ``h = n_ghost / n_owned`` of the spatial partition (the grid and halo
  a spatial layout would use; the slowest rank's ghosts, periodic images included: a
  halo wider than a box holds several images of the same atoms), and the peers per rank;
* the model's layers ``L`` and the width ``F`` of the features passed at a sync point.

Cost per evaluation of the slowest rank, in units of one atom-layer of model compute::

    halo  = L n_owned + [mode halo: (L-1) n_ghost] + γ (3 + (L-1) F) n_ghost
            + λ n_peers L_msg
    graph = L n_owned + γ (3 + (L-1) F) (N - n_owned) + λ ceil(log2 P) L

(mode halo recomputes the ghosts within ``(L-1)`` cutoffs of the box for ``L-1`` layers,
roughly ``(L-1) n_ghost``), with ``L_msg = L`` where ghosts' features are exchanged
(models with sync points, mode ``sync``), else 1; ``γ = 0.01`` (one received number costs
about 1% of an atom-layer) and ``λ = 20`` (one message's latency, in atom-layers), rough
CPU/gloo values. Graph mode wins when the halo holds more than the rest of the system
(``n_ghost > N - n_owned``, i.e. ``h > P - 1``: small dense cells, many ranks; up to the
latency terms) or when a halo mode would recompute many ghosts. Models graph mode cannot
split exactly (several layers without sync points, long-range terms) always take the
spatial halo. ``benchmarks/dd.py --modes halo,graph`` records the measured crossover and
this model's choice side by side.
"""

from __future__ import annotations

import math

import torch

from xnn.data.graph import AtomicGraph
from xnn.distributed.domain.partition import image_shifts, make_partition
from xnn.distributed.graph.layout import check_graph_model
from xnn.distributed.modes import spatial_mode
from xnn.distributed.potential import model_cutoff
from xnn.errors import InputError

GAMMA, LATENCY = 0.01, 20.0


def feature_size(model) -> int:
    """Numbers per atom passed at one sync point: the model's declared ``sync_width`` (the
    MACE wrapper's node features), else estimated from native models' hyperparameters, else
    64."""
    if model.sync_width is not None:
        return int(model.sync_width)
    hp = model.hparams or {}  # native models' hyperparameters, if any
    name = type(model).__name__.lower()
    if "channels" in hp:  # equivariant: channels x (l_max + 1)^2
        return int(hp["channels"]) * (int(hp.get("hidden_l_max", hp.get("l_max", 1))) + 1) ** 2
    if "num_features" in hp:
        return int(hp["num_features"]) * (4 if "painn" in name else 1)
    return 64


def halo_counts(graph: AtomicGraph, n_ranks: int, halo_width: float, grid=None,
                balance: str = "none") -> dict:
    """Owned and ghost atoms (periodic images included) per box of the spatial partition."""
    pos = graph.positions.detach().to(torch.float64)
    part = make_partition(pos, graph.cell[0].detach().to(torch.float64), graph.pbc[0],
                          n_ranks, halo_width, grid, balance)
    u, _ = part.fractional(pos)
    owner = part.owner(u)
    t = part.thickness(halo_width)
    owned, ghosts = [], []
    for r in range(n_ranks):
        lo, hi = part.box_bounds(r)
        held = int(image_shifts(u, lo - t, hi + t, part.pbc)[0].numel())
        n = int((owner == r).sum())
        owned.append(n)
        ghosts.append(max(held - n, 0))
    return {"grid": list(part.grid), "owned": owned, "ghost": ghosts}


def choose_mode(model, graph: AtomicGraph, n_ranks: int, grid=None,
                skin: float = 0.0, balance: str = "none") -> tuple[str, str]:
    """``(mode, reason)``: ``"graph"`` or the spatial mode (``"sync"``/``"halo"``) of the
    smaller estimated cost (see the module docstring), and one line saying why."""
    spatial = spatial_mode(model)
    cutoff, layers = model_cutoff(model)
    try:
        check_graph_model(model, cutoff, layers)
    except InputError as err:
        return spatial, f"auto: {spatial} ({err})"
    if n_ranks == 1:
        return spatial, f"auto: {spatial} (one rank)"
    width = cutoff * (1 if spatial == "sync" else layers) + skin
    c = halo_counts(graph, n_ranks, width, grid, balance)
    worst = max(range(n_ranks), key=lambda r: c["owned"][r] + c["ghost"][r])
    n_own, n_ghost = max(c["owned"]), c["ghost"][worst]
    f = feature_size(model)
    rows = 3 + (layers - 1) * f
    n_peers = min(n_ranks - 1, 26)
    halo = (layers * n_own + ((layers - 1) * n_ghost if spatial == "halo" else 0)
            + GAMMA * rows * n_ghost
            + LATENCY * n_peers * (layers if spatial == "sync" else 1))
    n = graph.n_atoms
    graph_cost = (layers * n_own + GAMMA * rows * (n - min(c["owned"]))
                  + LATENCY * math.ceil(math.log2(n_ranks)) * layers)
    h = n_ghost / max(c["owned"][worst], 1)
    mode = "graph" if graph_cost < halo else spatial
    reason = (f"auto: {mode} (halo fraction {h:.2f} ghosts/owned on grid "
              f"{'x'.join(map(str, c['grid']))} with a {width:.3g} Å halo, {layers} layer(s), "
              f"{f} features, {n} atoms on {n_ranks} ranks: estimated cost halo {halo:.4g} "
              f"vs graph {graph_cost:.4g} atom-layers)")
    return mode, reason
