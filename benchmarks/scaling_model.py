"""Calibrate the step-cost model on 1-rank runs, check it against every multi-rank result we
have, and predict weak and strong scaling to 512 GPUs (issue 47; the model is
:mod:`xnn.distributed.cost.model`, its links :mod:`xnn.distributed.cost.links`).

Validation (predicted vs measured, error per row), each calibrated on its own 1-rank rows:

* ``benchmarks/results/dd_components_*.json`` (``benchmarks/dd_components.py``, gloo, LJ,
  SchNet, the equivariant model; compute from the 1-rank rows, the gloo link fitted on the
  2-rank rows' measured exchanges and all-reduces, per row the rank that waited least);
* ``dd_md_cpu16.json`` (LJ MD, gloo, 1/2/4/8 ranks of a 16-core host; rows hold atoms, no
  edges: the compute is priced per held atom);
* ``dd_equivariant_h200x2.json``, ``dd_equivariant_h200x4.json``, ``dd_painn_h200x4.json``,
  ``dd_sevenn_h200x2.json`` (NCCL single points on 2 and 4 H200, per edge from the 1-GPU
  row of the smallest size).

Predictions: an FCC crystal (copper for the ML models, argon for LJ), weak scaling at 250k
and 1M atoms per GPU and strong scaling of 10^7 and 10^8 atoms on 8-512 GPUs (8 per node:
NVLink within a node, InfiniBand NDR across), modes halo, sync and graph. Per-rank counts
come from ``benchmarks/results/ghost_plan_scale_cpu.json`` (the project's partition code at
scale) where it has the row, else from :func:`lattice_counts`: the project's grid choice
(:func:`~xnn.distributed.domain.partition.choose_grid`) and an exact count of the perfect
lattice's sites in each box and its halo (``method: lattice``)::

    python benchmarks/scaling_model.py --json benchmarks/results/scaling_model_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

try:
    from benchmarks.common import write_json
except ImportError:  # run as `python benchmarks/scaling_model.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import write_json

from xnn.distributed.cost.counts import RankCounts, staged_messages_uniform
from xnn.distributed.cost.links import GLOO_HOST, IB_NDR400, NVLINK_H100, Link, fit_link
from xnn.distributed.cost.model import (
    ComputeCost,
    ModelShape,
    Output,
    Rebuild,
    StepTime,
    all_reduces_per_step,
    md_step,
    messages,
)

RESULTS = Path(__file__).resolve().parent / "results"
GPUS_PER_NODE = 8
FCC = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
LATTICE = {"lj": 5.26, "equivariant": 3.61, "mace": 3.61}  # Å: Ar, Cu
CUTOFF = {"lj": 6.0, "equivariant": 5.0, "mace": 5.0}  # Å: each model's cutoff in the predictions
PLAN_LATTICE = 3.61  # Å: the fcc system of ghost_plan_scale_cpu.json (copper)
#: peak GPU bytes per held atom of one evaluation (from the calibration rows) and the card
BYTES_PER_HELD: dict[str, float] = {}
GPU_BYTES = 80e9  # H100 80 GB


# ---------------------------------------------------------------------------- counts


def _axis_count(lo: float, hi: float, a: float, b: float) -> int:
    """Integers n with lo <= (n + b) a < hi."""
    return max(0, math.ceil(hi / a - b) - math.ceil(lo / a - b))


def _sites(lo, hi, a: float) -> int:
    """FCC sites (lattice constant ``a``, infinite lattice) in the box ``[lo, hi)`` (Å)."""
    return sum(math.prod(_axis_count(lo[d], hi[d], a, basis[d]) for d in range(3))
               for basis in FCC)


def coordination(r: float, a: float) -> int:
    """Neighbours of an FCC site within ``r`` (Å)."""
    n = int(math.ceil(r / a)) + 1
    pts = (np.array(list(itertools.product(range(-n, n + 1), repeat=3)))[:, None, :]
           + FCC[None]).reshape(-1, 3) * a
    d = np.linalg.norm(pts, axis=1)
    return int(((d > 1e-9) & (d <= r)).sum())


def lattice_counts(k, a: float, n_ranks: int, mode: str, cutoff: float, skin: float,
                   layers: int, grid=None, edge_cutoff: float | None = None) -> RankCounts:
    """Per-rank counts of a periodic ``k×k×k`` (or ``kx×ky×kz``) FCC supercell on
    ``n_ranks`` boxes of the project's grid (or ``grid``), counted exactly for the perfect
    lattice (``method: lattice``).

    Halo mode: ghosts within ``layers * cutoff + skin`` of a box, receivers of edges within
    ``(layers - 1) * cutoff + skin``; sync mode: ghosts within ``cutoff + skin``, edges of
    owned receivers; graph mode: blocks of ``N / P`` atoms, the rest received. Edges are
    within ``edge_cutoff`` (default the cutoff: what the model evaluates; ``cutoff + skin``
    counts a Verlet list's edges, as the layouts' stats do).
    """
    from xnn.distributed.domain.partition import choose_grid

    ks = np.array([k] * 3 if np.isscalar(k) else list(k))
    n = 4 * int(np.prod(ks))
    z = coordination(cutoff if edge_cutoff is None else edge_cutoff, a)
    length = ks * a
    if mode == "graph":
        owned = np.full(n_ranks, n // n_ranks, dtype=np.int64)
        owned[: n % n_ranks] += 1
        return RankCounts("graph", (n_ranks, 1, 1), 0.0, owned, n - owned, owned * z,
                          owned.copy(), n - owned, np.full(n_ranks, n_ranks - 1),
                          "lattice")
    width = (layers if mode == "halo" else 1) * cutoff + skin
    inner = ((layers - 1) * cutoff + skin) if mode == "halo" and layers > 1 else 0.0
    grid = tuple(grid) if grid else choose_grid(n_ranks, list(length), [True] * 3, width)
    cols = {k_: [] for k_ in ("owned", "held", "recv", "edges", "peers")}
    for ix, iy, iz in itertools.product(*(range(g) for g in grid)):
        lo = np.array([ix, iy, iz]) / np.array(grid) * length
        hi = (np.array([ix, iy, iz]) + 1) / np.array(grid) * length
        owned = _sites(lo, hi, a)
        held = _sites(lo - width, hi + width, a)
        local = np.array([g == 1 for g in grid])  # own images along unsplit axes
        own_img = _sites(np.where(local, lo - width, lo), np.where(local, hi + width, hi), a)
        recv = held - own_img
        box = length / np.array(grid)
        reach = np.ceil(width / box).astype(int)
        peers = math.prod(min(g, 2 * r + 1) for g, r in zip(grid, reach)) - 1
        receivers = _sites(lo - inner, hi + inner, a) if inner > 0 else owned
        for key, v in zip(cols, (owned, held, recv, receivers * z, peers)):
            cols[key].append(v)
    c = {key: np.array(v, dtype=np.int64) for key, v in cols.items()}
    staged = np.full(n_ranks, staged_messages_uniform(grid, reach), dtype=np.int64)
    return RankCounts(mode, tuple(grid), width, c["owned"], c["held"] - c["owned"],
                      c["edges"], c["recv"], c["recv"], c["peers"], "lattice", staged)


def plan_counts_from_json(rows: list[dict], n_atoms: int, n_ranks: int, mode: str,
                          cutoff: float, halo_width: float, lattice: float):
    """RankCounts from a ghost_plan_scale row (the at-scale plan), if any: rank 0 carries the
    row's maxima (owned, ghost, edges: the rank that sets the step), the other ranks the
    rest of the atoms and the mean ghosts and edges (rows and peers: the maxima), so the
    atoms add up to the planned system and an all-reduce spans ``n_ranks``."""
    if abs(lattice - PLAN_LATTICE) > 1e-9:  # the plan's crystal is copper
        return None
    for r in rows:
        if r.get("n_ranks") == n_ranks and r.get("mode") == mode and r.get("system") == "fcc" \
                and abs(r.get("n_atoms", 0) - n_atoms) <= 0.02 * n_atoms \
                and r.get("cutoff") == cutoff and abs(r["halo_width"] - halo_width) < 1e-9:
            rest = max(n_ranks - 1, 1)

            def arr(first, others):
                a = np.full(n_ranks, int(round(others)), dtype=np.int64)
                a[0] = int(first)
                return a

            owned = arr(r["owned_max"], (r["n_atoms"] - r["owned_max"]) / rest)
            if n_ranks == 1:
                owned = np.array([r["n_atoms"]], dtype=np.int64)
            edges = arr(r["edges_max"], r["edges_mean"])
            if mode == "graph":  # the plan counts the list (the reach); a model evaluates
                # the edges within its cutoff, as priced in the spatial modes: on the perfect
                # crystal every owned receiver has coordination(cutoff) of them
                edges = owned * coordination(cutoff, lattice)
            return RankCounts(mode, tuple(r.get("grid") or (n_ranks, 1, 1)), r["halo_width"],
                              owned, arr(r["ghost_max"], r["ghost_mean"]), edges,
                              arr(r["send_rows_max"], r["send_rows_max"]),
                              arr(r["recv_rows_max"], r["recv_rows_max"]),
                              arr(r["peers_max"], r["peers_max"]), r.get("method", "exact"))
    return None


# ---------------------------------------------------------------------------- validation


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def validate_dd_md(path: Path) -> list[dict]:
    """LJ MD on gloo ranks of one host: compute per held atom from the 1-rank row."""
    if not path.exists():
        return []
    d = json.loads(path.read_text())
    rows = [r for r in d["rows"] if "error" not in r and r["layout"] == "domain"]
    one = next(r for r in rows if r["ranks"] == 1)
    comp = ComputeCost(per_atom=one["step_s"] / one["held_max"], per_edge=0.0,
                       source=f"{path.name}: 1 rank")
    out = []
    for r in rows:
        pr = r["per_rank"]
        owned = np.array([q["n_owned"] for q in pr])
        ghost = np.array([q["n_ghost"] for q in pr])
        # no exchange counts in these rows: ghosts (an upper bound) from <= 26 peers
        peers = np.full(len(pr), min(r["ranks"] - 1, 26))
        c = RankCounts("halo", tuple(r["grid"]), 7.0, owned, ghost, np.zeros_like(owned),
                       ghost, ghost, peers, "measured")
        t = md_step(c, comp, ModelShape(0, 0, 8), GLOO_HOST)
        out.append(_row("dd_md_cpu16 (LJ, gloo)", r["ranks"], r["n_atoms"], t, r["step_s"],
                        "per held atom from the 1-rank row; gloo link defaults"))
    return out


def _row(source, ranks, n_atoms, t: StepTime, measured, note) -> dict:
    return {"source": source, "ranks": ranks, "n_atoms": n_atoms, "predicted_s": t.total,
            "measured_s": measured, "error": _err(t.total, measured), "split": t.split(),
            "note": note}


def _dd_shape(model: str) -> ModelShape:
    from xnn.distributed.graph.auto import feature_size
    from xnn.models import build

    if model == "sevenn":
        from xnn.models.external.sevenn import SevenNetWrapper

        m = SevenNetWrapper("7net-0")
    else:
        m = build(model, species=[29], cutoff=5.0)
    return ModelShape(len(list(m.sync_points)), feature_size(m), 4,
                      sum(p.numel() for p in m.parameters()))


def validate_dd_gpu(path: Path) -> list[dict]:
    """NCCL single points on 2/4 H200 (benchmarks/dd.py): per edge from the 1-GPU row."""
    if not path.exists():
        return []
    d = json.loads(path.read_text())
    out = []
    for model, res in d["results"].items():
        shape = _dd_shape(model)
        pts = [p for kind in ("strong", "weak") for p in res.get(kind, [])]
        singles = [p["single"] for p in pts if p["single"].get("time_s")]
        cal = min(singles, key=lambda s: s["n_atoms"])
        comp = ComputeCost(0.0, cal["time_s"] / cal["n_edges"],
                           source=f"{path.name}: 1 GPU, {cal['n_atoms']} atoms")
        for kind in ("strong", "weak"):
            for p in res.get(kind, []):
                dec = p["decomposed"]
                one = lambda key, d=dec: np.array([d[key]], dtype=np.int64)  # noqa: E731
                c = RankCounts(dec["mode"], tuple(dec["grid"]), dec["halo_width"],
                               one("owned_max"), one("ghost_atoms_max"), one("edges_max"),
                               one("recv_atoms_max"), one("recv_atoms_max"), one("peers_max"),
                               "measured")
                t = md_step(c, comp, shape, NVLINK_H100, all_reduces=4)
                out.append(_row(f"{path.stem} ({model}, {kind})", p["ranks"], p["n_atoms"], t,
                                dec["time_s"], f"per edge from the 1-GPU {cal['n_atoms']}-atom "
                                "row; NVLink link (cited); single point: 4 all-reduces"))
    return out


def validate_cp(path: Path) -> list[dict]:
    """Context-parallel SchNet training on gloo ranks (``cp_training.py``): the training
    step's compute per owned atom from the dd = 1 row of each size (sync mode: edges are the
    owned atoms' only, ghosts are senders), exchanges 4 per point, 5 scalar all-reduces and
    the gradient all-reduce (:func:`~xnn.distributed.cost.model.training_step`)."""
    if not path.exists():
        return []
    from xnn.distributed.cost.model import training_step
    from xnn.models import build

    d = json.loads(path.read_text())
    a = d["args"]
    if a["model"] != "schnet" or a.get("checkpointing"):
        return []
    m = build("schnet", species=[29], cutoff=a["cutoff"], **json.loads(a["hparams"]))
    shape = ModelShape(len(list(m.sync_points)), int(json.loads(a["hparams"])["num_features"]),
                       8, sum(q.numel() for q in m.parameters()))
    out = []
    for n in sorted({r["requested_atoms"] for r in d["rows"]}):
        rows = [r for r in d["rows"] if r["requested_atoms"] == n and "step_s" in r]
        one = next((r for r in rows if r["dd"] == 1), None)
        if one is None:
            continue
        comp = ComputeCost(0.0, one["step_s"] / one["n_atoms"], source=f"{path.name} dd = 1")
        for r in rows:
            pr = r["ranks"]
            arr = lambda key, pr=pr: np.array([q[key] for q in pr], dtype=np.int64)  # noqa: E731
            owned, ghost = arr("n_owned"), arr("n_ghost")
            peers = np.full(len(pr), min(len(pr) - 1, 26))
            c = RankCounts("sync", (len(pr), 1, 1), a["cutoff"], owned, ghost, owned, ghost,
                           ghost, peers, "measured")
            t = training_step(c, comp, shape, GLOO_HOST, dp=1, train_factor=1.0,
                              grad_bytes=8)
            out.append(_row(f"{path.stem} (schnet, context-parallel training)", r["dd"],
                            r["n_atoms"], t, r["step_s"],
                            "compute per owned atom from dd = 1; ghost rows as exchanged rows "
                            "(an upper bound); gloo link defaults"))
    return out


def _rebuild_cost(per_rank: list[dict], steps: list[int]) -> Rebuild:
    """Rebuild + migration cost per held atom and the measured steps between rebuilds, from
    1-rank dd_components rows (``steps``: each row's timed steps; no rebuild measured: zero
    cost)."""
    done = [(q, n) for q, n in zip(per_rank, steps) if q["rebuilds"] + q["migrations"] > 0]
    if not done:
        return Rebuild(0.0, float(max(steps)))
    per_atom = np.mean([(q["seconds_per_step"]["rebuild"] + q["seconds_per_step"]["migration"])
                        * n / max(q["rebuilds"], q["migrations"]) / q["n_held"]
                        for q, n in done])
    interval = np.mean([n / max(q["rebuilds"], q["migrations"]) for q, n in done])
    return Rebuild(float(per_atom), float(interval))


def _edges(q: dict) -> int:
    """A rank's edges within the model's cutoff (the work of models that drop the Verlet
    list's skin edges, as the at-scale plans count them), or its list edges in files
    written before ``n_edges_within`` was recorded."""
    return q["n_edges_within"] if q.get("n_edges_within") is not None else q["n_edges"]


def validate_components(path: Path) -> tuple[list[dict], dict]:
    """dd_components rows: compute fitted on 1 rank, gloo link on 2 ranks, all checked."""
    if not path.exists():
        return [], {}
    d = json.loads(path.read_text())
    rows = [r for r in d["rows"] if "error" not in r]
    # a rank's measured exchange or all-reduce time includes waiting for a slower peer; per
    # 2-rank row and collective, the rank that waited least is the closest to its own cost
    two = [min(r["per_rank"], key=lambda q: q["seconds_per_step"]["p2p"])
           for r in rows if r["ranks"] == 2]
    p2p = [(q["per_step"]["p2p"]["messages"], q["per_step"]["p2p"]["bytes_sent"],
            q["seconds_per_step"]["p2p"]) for q in two if "p2p" in q["per_step"]]
    ar = [(2, 0, min(q["seconds_per_step"]["all_reduce"] / q["per_step"]["all_reduce"]["calls"]
                     for q in r["per_rank"]))
          for r in rows if r["ranks"] == 2 and "all_reduce" in r["per_rank"][0]["per_step"]]
    link = fit_link(GLOO_HOST, p2p, ar, source=f"fitted on the 2-rank rows of {path.name}")
    out, fits = [], {"link": vars(link)}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        ones = [r for r in mine if r["ranks"] == 1]
        if not ones:
            continue
        q1 = [r["per_rank"][0] for r in ones]
        comp = ComputeCost.fit([q["n_held"] for q in q1], [_edges(q) for q in q1],
                               [q["seconds_per_step"]["evaluate"]
                                + q["seconds_per_step"]["integrate"] for q in q1],
                               source=f"{path.name}: 1-rank rows of {model}",
                               owned=[q["n_owned"] for q in q1])
        fits[model] = vars(comp)
        # rows record their own timed steps (a file joins calls of other --steps); older
        # files have one setting for all
        rebuild = _rebuild_cost(q1, [r.get("steps", d["settings"]["steps"]) for r in ones])
        fits[model + "_rebuild"] = vars(rebuild)
        for r in mine:
            pr = r["per_rank"]
            arr = lambda key, pr=pr: np.array([q[key] for q in pr], dtype=np.int64)  # noqa: E731
            c = RankCounts(r["mode"], tuple(r["grid"] or (r["ranks"], 1, 1)), r["halo_width"],
                           arr("n_owned"), arr("n_ghost"),
                           np.array([_edges(q) for q in pr], dtype=np.int64), arr("n_send"),
                           arr("n_recv"), arr("n_peers"), "measured")
            shape = ModelShape(r["sync_points"], r["feature_width"], r["dtype_bytes"])
            t = md_step(c, comp, shape, link, rebuild=rebuild)
            row = _row(f"{path.stem} ({model}, gloo)", r["ranks"], r["n_atoms"], t,
                       r["step_s"], f"lattice x{r['scale']}; compute fitted on 1 rank, link "
                       "on 2 ranks")
            row["measured_split"] = {k: max(q["seconds_per_step"][k] for q in pr)
                                     for k in pr[0]["seconds_per_step"]}
            out.append(row)
    return out, fits


# ---------------------------------------------------------------------------- predictions


def gpu_calibrations() -> dict:
    """Per model: (ComputeCost on one H200, ModelShape, source) from committed 1-GPU rows."""
    cal = {}
    p = RESULTS / "dd_equivariant_h200x4.json"
    if p.exists():
        res = json.loads(p.read_text())["results"]["equivariant"]
        s = min((q["single"] for q in res["strong"] + res["weak"] if q["single"].get("time_s")),
                key=lambda s: s["n_atoms"])
        cal["equivariant"] = (ComputeCost(0.0, s["time_s"] / s["n_edges"],
                                          source=f"{p.name} 1-GPU {s['n_atoms']} atoms"),
                              _dd_shape("equivariant"))
        BYTES_PER_HELD["equivariant"] = s["peak_memory_bytes"] / s["n_atoms"]
    p = RESULTS / "dd_md_h200.json"
    if p.exists():
        rows = [r for r in json.loads(p.read_text())["rows"] if r["ranks"] == 1]
        held = np.array([r["held_max"] for r in rows], float)
        t = np.array([r["step_s"] for r in rows])
        comp = ComputeCost.fit(held, held * coordination(6.0, LATTICE["lj"]), t,
                               source=f"{p.name} 1-GPU MD steps")
        cal["lj"] = (comp, ModelShape(0, 0, 4))
        BYTES_PER_HELD["lj"] = max(r["peak_bytes_max"] / r["held_max"] for r in rows)
    for path in sorted(RESULTS.glob("dd_components_h*.json")):  # one GPU, the lead's run
        every = json.loads(path.read_text())["rows"]
        rows = [r for r in every
                if "error" not in r and r["ranks"] == 1 and r["model"] == "mace"]
        if rows:
            q = [r["per_rank"][0] for r in rows]
            comp = ComputeCost.fit([x["n_held"] for x in q], [_edges(x) for x in q],
                                   [r["step_s"] for r in rows], source=path.name,
                                   owned=[x["n_owned"] for x in q])
            cal["mace"] = (comp, ModelShape(rows[0]["sync_points"], rows[0]["feature_width"],
                                            4, rows[0]["n_params"]))
            BYTES_PER_HELD["mace"] = _mace_bytes(every)
    return cal


def _mace_bytes(rows: list[dict]) -> float:
    """GPU bytes per held atom of MACE from a ``dd_components`` file's ``rows``: the largest
    measured peak per held atom, or, in files written before ``cuda_peak_bytes`` was
    recorded, a lower bound from the smallest size that ran out of memory (the card's bytes
    over that size's atoms)."""
    peaks = [q["cuda_peak_bytes"] / q["n_held"] for r in rows if "error" not in r
             and r["model"] == "mace" for q in r["per_rank"] if q.get("cuda_peak_bytes")]
    if peaks:
        return max(peaks)
    oom = [r["n_atoms_target"] for r in rows
           if r["model"] == "mace" and "OutOfMemoryError" in r.get("error", "")]
    return GPU_BYTES / min(oom) if oom else 0.0


def _links(n_ranks: int) -> Link:
    return NVLINK_H100 if n_ranks <= GPUS_PER_NODE else IB_NDR400


def predict(model: str, comp: ComputeCost, shape: ModelShape, n_atoms: int, n_ranks: int,
            mode: str, plan_rows: list[dict], cutoff: float, skin: float,
            exchange: str = "direct") -> dict:
    a = LATTICE[model]
    k = max(1, round((n_atoms / 4) ** (1 / 3)))
    layers = max(shape.sync_points + 1, 1)
    width = (layers if mode == "halo" else 1) * cutoff + skin
    c = plan_counts_from_json(plan_rows, 4 * k ** 3, n_ranks, mode, cutoff, width, a) or \
        lattice_counts(k, a, n_ranks, mode, cutoff, skin, layers)
    if mode != "graph" and c.staged_peers is None:  # a planned row: its grid of equal boxes
        reach = np.ceil(width / (k * a / np.array(c.grid))).astype(int)
        c = replace(c, staged_peers=np.full(n_ranks, staged_messages_uniform(c.grid, reach)))
    sh = shape if mode != "halo" else replace(shape, sync_points=0)
    t = md_step(c, comp, sh, _links(n_ranks), exchange=exchange)
    return {"model": model, "mode": mode, "n_ranks": n_ranks, "n_atoms": c.n_atoms,
            "exchange": exchange, "messages_per_exchange": int(messages(c, exchange).max())
            if mode != "graph" else None,
            "atoms_per_rank": c.n_atoms / n_ranks, "grid": list(c.grid),
            "method": c.method, "step_s": t.total, "split": t.split(),
            "ghost_over_owned": float((c.ghost / np.maximum(c.owned, 1)).max()),
            "atom_steps_per_s_per_gpu": c.n_atoms / n_ranks / t.total,
            "fits_80GB": (bool(c.held.max() * BYTES_PER_HELD[model] <= GPU_BYTES)
                          if model in BYTES_PER_HELD else None)}


def plain_step(model: str, comp: ComputeCost, n_atoms: float, cutoff: float) -> float:
    """One GPU running the model on ``n_atoms`` with periodic edges (no ghosts, no
    communication): the reference of the efficiencies."""
    z = coordination(cutoff, LATTICE[model])
    return float(comp.seconds(n_atoms, n_atoms * z))


def predictions(cal: dict, plan_rows: list[dict], ranks=(8, 16, 32, 64, 128, 256, 512),
                per_rank=(250_000, 1_000_000), totals=(10_000_000, 100_000_000)) -> list[dict]:
    out = []
    for model, (comp, shape) in cal.items():
        cutoff = CUTOFF[model]
        modes = ("halo",) if model == "lj" else ("halo", "sync", "graph")
        for mode, p in itertools.product(modes, ranks):
            for n in per_rank:
                r = predict(model, comp, shape, n * p, p, mode, plan_rows, cutoff, 1.0)
                base = plain_step(model, comp, r["atoms_per_rank"], cutoff)
                r.update(scaling="weak", target_per_rank=n, one_gpu_step_s=base,
                         efficiency=base / r["step_s"])
                out.append(r)
            for n in totals:
                r = predict(model, comp, shape, n, p, mode, plan_rows, cutoff, 1.0)
                base = plain_step(model, comp, r["n_atoms"], cutoff)
                r.update(scaling="strong", target_total=n, one_gpu_step_s=base,
                         efficiency=base / (p * r["step_s"]))
                out.append(r)
    return out


def smallest_efficient(cal: dict, model: str, mode: str, n_ranks: int, target: float = 0.8,
                       plan_rows=()) -> int | None:
    """Smallest atoms per GPU (of a doubling ladder from 4,000) at which the weak-scaling
    efficiency on ``n_ranks`` GPUs is >= ``target``."""
    comp, shape = cal[model]
    cutoff = CUTOFF[model]
    n = 4000
    while n <= 4_000_000:
        r = predict(model, comp, shape, n * n_ranks, n_ranks, mode, list(plan_rows), cutoff, 1.0)
        if plain_step(model, comp, r["atoms_per_rank"], cutoff) / r["step_s"] >= target:
            return n
        n *= 2
    return None


#: published weak-scaling figures the headline is set next to
PUBLISHED = [
    {"who": "Allegro (Musaelian et al., 2023)", "gpus": 5120, "gpu": "A100",
     "atoms": 44_000_000, "atoms_per_gpu": 44_000_000 / 5120, "weak_efficiency": 0.70,
     "note": "atoms per GPU: 44M / 5,120, as issue 47 reads it",
     "url": "https://arxiv.org/abs/2304.10061"},
    {"who": "UMA-S graph parallel (Meta FAIR, 2025)", "gpus": 256, "gpu": "H200",
     "atoms_per_gpu": 4000, "weak_efficiency": 0.646,
     "url": "https://arxiv.org/abs/2506.23971"},
]


def comparisons(cal: dict, plan_rows) -> list[dict]:
    """The equivariant model's predicted weak-scaling efficiency at the published figures'
    GPU counts and atoms per GPU, and at 250k and 1M atoms per GPU on 512 GPUs."""
    if "equivariant" not in cal:
        return []
    comp, shape = cal["equivariant"]
    out = []
    for gpus, per in ((512, 1_000_000), (512, 250_000), (512, 8600), (256, 4000),
                      (512, 4000)):
        for mode in ("sync", "halo", "graph"):
            r = predict("equivariant", comp, shape, per * gpus, gpus, mode, plan_rows, 5.0, 1.0)
            base = plain_step("equivariant", comp, r["atoms_per_rank"], 5.0)
            out.append({"gpus": gpus, "atoms_per_gpu": r["atoms_per_rank"], "mode": mode,
                        "efficiency": base / r["step_s"], "split": r["split"],
                        "one_gpu_step_s": base})
    return out


def losses(cal: dict, plan_rows, gpus: int = 512) -> list[dict]:
    """Per model, mode and atoms per GPU: the time lost on ``gpus`` GPUs against one GPU,
    by cause (ghost compute, exchange, reductions, rebuild), largest first."""
    out = []
    for model, (comp, shape) in cal.items():
        cutoff = CUTOFF[model]
        for mode in (("halo",) if model == "lj" else ("halo", "sync", "graph")):
            for per in (250_000, 1_000_000):
                r = predict(model, comp, shape, per * gpus, gpus, mode, plan_rows, cutoff, 1.0)
                base = plain_step(model, comp, r["atoms_per_rank"], cutoff)
                sp = r["split"]
                causes = {"ghost compute": sp["compute"] - base, "exchange": sp["exchange"],
                          "reductions": sp["reduction"], "rebuild": sp["rebuild"]}
                ranked = sorted(causes.items(), key=lambda kv: -kv[1])
                out.append({"model": model, "mode": mode, "atoms_per_gpu": r["atoms_per_rank"],
                            "gpus": gpus, "step_s": r["step_s"], "one_gpu_step_s": base,
                            "lost_s": r["step_s"] - base, "ranked": ranked})
    return out


#: the sizes at which the staged exchange is priced against the direct one at 512 GPUs
STAGED_CASES = (("equivariant", "sync", 4000), ("equivariant", "sync", 8600),
                ("equivariant", "sync", 250_000), ("lj", "halo", 250_000))


def staged_gain(cal: dict, plan_rows, gpus: int = 512) -> list[dict]:
    """``parallel.exchange`` direct vs staged on ``gpus`` GPUs at :data:`STAGED_CASES`:
    messages per exchange, exchange time and step of the slowest rank, weak-scaling
    efficiency, and the step's gain (s and fraction)."""
    out = []
    for model, mode, per in STAGED_CASES:
        if model not in cal:
            continue
        comp, shape = cal[model]
        cutoff = CUTOFF[model]
        row = {"model": model, "mode": mode, "gpus": gpus}
        for exchange in ("direct", "staged"):
            r = predict(model, comp, shape, per * gpus, gpus, mode, plan_rows, cutoff, 1.0,
                        exchange)
            base = plain_step(model, comp, r["atoms_per_rank"], cutoff)
            row["atoms_per_gpu"] = r["atoms_per_rank"]
            row[exchange] = {"messages_per_exchange": r["messages_per_exchange"],
                             "exchange_s": r["split"]["exchange"], "step_s": r["step_s"],
                             "efficiency": base / r["step_s"]}
        row["gain_s"] = row["direct"]["step_s"] - row["staged"]["step_s"]
        row["gain_fraction"] = row["gain_s"] / row["direct"]["step_s"]
        out.append(row)
    return out


def plot(preds: list[dict], comps: list[dict], out_dir: Path) -> list[Path]:
    """``scaling_efficiency.png`` (weak-scaling efficiency vs GPUs) and
    ``scaling_split.png`` (time per step at 512 GPUs split into compute, exchange and
    reductions) under ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, per in zip(axes, (250_000, 1_000_000)):
        for (model, mode), style in {("equivariant", "sync"): "o-", ("equivariant", "halo"): "s-",
                                     ("equivariant", "graph"): "^-", ("lj", "halo"): "d--",
                                     ("mace", "sync"): "v-"}.items():
            pts = sorted((r["n_ranks"], r["efficiency"]) for r in preds
                         if r["model"] == model and r["mode"] == mode
                         and r["scaling"] == "weak" and r["target_per_rank"] == per)
            if pts:
                ax.plot(*zip(*pts), style, label=f"{model} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node)")
        ax.set_title(f"weak scaling, {per:,} atoms per GPU")
        ax.axhline(0.8, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("predicted efficiency vs one GPU")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    first = out_dir / "scaling_efficiency.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(10, 4))
    rows = [c for c in comps if c["gpus"] == 512]
    labels = [f"{c['mode']}\n{c['atoms_per_gpu'] / 1000:.0f}k/GPU" for c in rows]
    bottom = np.zeros(len(rows))
    for part, color in (("compute", "tab:blue"), ("exchange", "tab:orange"),
                        ("reduction", "tab:red")):
        v = np.array([c["split"][part] / c["split"]["total"] for c in rows])
        ax.bar(labels, v, bottom=bottom, color=color, label=part)
        bottom += v
    for i, c in enumerate(rows):
        ax.text(i, 1.01, f"{c['split']['total'] * 1e3:.0f} ms", ha="center", fontsize=7)
    ax.set_ylabel("share of the step")
    ax.set_ylim(0, 1.1)
    ax.set_title("equivariant model on 512 GPUs: time per step by part (predicted)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    second = out_dir / "scaling_split.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [first, second]


def output_cost(headline: dict | None, every: int = 100) -> dict | None:
    """The headline run (1M atoms per GPU on 512 GPUs) writing a trajectory frame every
    ``every`` steps, sharded against gathered on rank 0, priced by :class:`Output` with the
    bandwidths of ``io_scale_cpu.json`` (1 rank, 10^6 atoms, local disk: one rank's write
    bandwidth, and the gather's rate to rank 0), stated as assumptions."""
    path = RESULTS / "io_scale_cpu.json"
    if headline is None or not path.exists():
        return None
    rows = [r for r in json.loads(path.read_text())["rows"]
            if r["kind"] == "frame" and r["ranks"] == 1 and "error" not in r]
    big = max(r["n_atoms"] for r in rows)
    sh = next(r for r in rows if r["n_atoms"] == big and r["format"] == "sharded")
    ga = next(r for r in rows if r["n_atoms"] == big and r["format"] == "gathered")
    write_bw = sh["bytes_per_atom"] * big / sh["write_s"]
    gathers = [r for r in json.loads(path.read_text())["rows"]
               if r["kind"] == "frame" and r["n_atoms"] == big and r["format"] == "gathered"
               and r["ranks"] > 1]
    gather_bw = max(ga["bytes_per_atom"] * big / r["gather_s"] for r in gathers)
    owned = np.full(headline["n_ranks"], headline["n_atoms"] / headline["n_ranks"])
    out = {"every": every, "write_bandwidth": write_bw, "gather_bandwidth": gather_bw,
           "step_s": headline["step_s"], "source": path.name}
    for name, o in (("sharded", Output(sh["bytes_per_atom"], write_bw, every)),
                    ("gathered", Output(ga["bytes_per_atom"], write_bw, every, sharded=False,
                                        gather_bandwidth=gather_bw))):
        t = float(o.seconds(owned).max())
        out[name] = {"seconds_per_step": t, "fraction_of_step": t / headline["step_s"]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=str(RESULTS / "scaling_model_cpu.json"))
    p.add_argument("--components", default=None,
                   help="dd_components JSON files (comma list); default: every "
                        "benchmarks/results/dd_components_cpu*.json")
    p.add_argument("--plots", default=None, help="folder for the two figures (docs/img)")
    args = p.parse_args(argv)
    comps = ([Path(s) for s in args.components.split(",")] if args.components
             else sorted(RESULTS.glob("dd_components_cpu*.json")))
    rows, fits = [], {}
    for path in comps:
        r, f = validate_components(path)
        rows += r
        fits[path.name] = f
    rows += validate_dd_md(RESULTS / "dd_md_cpu16.json")
    rows += validate_cp(RESULTS / "cp_training_cpu16.json")
    for name in ("dd_equivariant_h200x2", "dd_equivariant_h200x4", "dd_painn_h200x4",
                 "dd_sevenn_h200x2"):
        rows += validate_dd_gpu(RESULTS / f"{name}.json")
    for r in rows:
        print(f"{r['source']:48s} P={r['ranks']:2d} N={r['n_atoms']:8d} predicted "
              f"{r['predicted_s'] * 1e3:9.2f} ms measured {r['measured_s'] * 1e3:9.2f} ms "
              f"error {100 * r['error']:+6.1f}%")
    plan = RESULTS / "ghost_plan_scale_cpu.json"
    plan_rows = json.loads(plan.read_text()).get("rows", []) if plan.exists() else []
    cal = gpu_calibrations()
    preds = predictions(cal, plan_rows)
    knee = {f"{m}/{mode}/{p}": smallest_efficient(cal, m, mode, p, plan_rows=plan_rows)
            for m in cal for mode in (("halo",) if m == "lj" else ("halo", "sync", "graph"))
            for p in (8, 64, 512)}
    headline = next((r for r in preds if r["model"] == "equivariant" and r["mode"] == "sync"
                     and r["scaling"] == "weak" and r["n_ranks"] == 512
                     and r["target_per_rank"] == 1_000_000), None)
    write_json(args.json, {
        "benchmark": "scaling_model", "validation": rows,
        "max_abs_error": max((abs(r["error"]) for r in rows), default=None),
        "fits": fits, "gpu_calibrations": {m: {"compute": vars(c), "shape": vars(s)}
                                           for m, (c, s) in cal.items()},
        "links": {"nvlink": vars(NVLINK_H100), "ib": vars(IB_NDR400)},
        "all_reduces_per_step": {m: all_reduces_per_step(m) for m in ("halo", "sync", "graph")},
        "smallest_atoms_per_gpu_for_80pct": knee, "headline_512_equivariant_1M": headline,
        "published": PUBLISHED, "comparisons": comparisons(cal, plan_rows),
        "losses_512": losses(cal, plan_rows), "mace": "mace" in cal,
        "staged_exchange_512": staged_gain(cal, plan_rows),
        "output_512": output_cost(headline),
        "predictions": preds}, device="cpu")
    if args.plots:
        plot(preds, comparisons(cal, plan_rows), Path(args.plots))
    if headline:
        print(f"equivariant, sync, 1M atoms/GPU on 512 GPUs: weak-scaling efficiency "
              f"{headline['efficiency']:.3f}; split {headline['split']}")
    print("smallest atoms/GPU with efficiency >= 80%:", knee)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
