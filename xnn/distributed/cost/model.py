"""The step-cost model of a decomposed run: what one MD step (or one context-parallel
training step) costs on ``P`` ranks, from per-rank counts and measured unit costs (issue 47).

For one MD force evaluation per step, on rank ``r`` with ``owned_r``, ``ghost_r`` atoms and
``edges_r`` local edges (:class:`~.counts.RankCounts`)::

    compute_r  = fixed + per_atom * (owned_r + ghost_r) + per_owned * owned_r
                 + per_edge * edges_r
    exchange_r = sum over the exchanges of one step of
                 peers_r * latency + max(send_r, recv_r) * width * dtype_bytes / bandwidth
                 (staged exchange: the stages' messages ``staged_peers_r`` instead of
                 ``peers_r``; the stages move the same shell of rows)
    rebuild_r  = rebuild_per_atom * held_r / rebuild_interval
    reduction  = all_reduces * allreduce(bytes, P)
    step       = max_r (compute_r + exchange_r + rebuild_r) + reduction

The exchanges of one eager decomposed step (:class:`~xnn.distributed.DecomposedPotential`
under ``nve.step``) are, counted by instrumenting real gloo runs
(:class:`~.tally.CollectiveTally`, ``benchmarks/dd_components.py``) and read in the code:

* mode ``halo``: the local positions' exchange (3 numbers per row) and its adjoint in the
  backward pass (the forces on ghosts returned to their owners): 2 exchanges;
* mode ``sync``: those 2, plus per sync point the features' exchange (``width`` numbers per
  row) and its adjoint: ``2 + 2 S``;
* mode ``graph``: all-gathers instead (positions, then per sync point the features, each
  of the largest rank's ``N / P`` rows, padded) and in the backward pass their
  reduce-scatters (NCCL) or all-reduces of the whole gathered tensor (gloo);
* :data:`ALL_REDUCES_PER_STEP` = 3 blocking all-reduces per step of NVE when no rebuild
  or migration happens (:data:`ALL_REDUCE_BYTES` per mode; the fused step of
  ``docs/distributed.md``, "Collectives per step"): before the force call one maximum of
  the rebuild check with the migration criteria of the same positions (10 float64,
  ``DecomposedPotential.update``; mode graph, which never migrates, 2), the energy with the
  evaluation's agreement flag (2 values, ``collectives.agree_sum``) and the virial (9
  values, ``derivatives.derive``): 168 bytes in fp64. Thermostats add their fused sums
  (Langevin 2, Nosé–Hoover 2, NPT 6 more per step); a rebuild adds its own (species
  check, ghost selection, local neighbor list agreements), counted in its measured cost.

Context-parallel training (:func:`training_step`): forward and double backward cost
``train_factor`` times the MD compute; every exchange runs 4 times (forward, its adjoint in
the first backward, and both again in the backward of the backward) and there are 4
scalar all-reduces (:data:`TRAIN_ALL_REDUCE_BYTES`: the MD step's 3 and the energy's
adjoint), both counted on real ranks in ``tests/test_cost_model.py``; the gradients
(``n_params`` numbers) are all-reduced over the ``dp × dd`` mesh.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from xnn.distributed.cost.counts import RankCounts
from xnn.distributed.cost.links import Link

#: blocking all-reduces of one eager decomposed NVE step without a rebuild (module docstring)
ALL_REDUCES_PER_STEP = 3
#: their bytes per mode in fp64: the rebuild check (with the migration criteria in the
#: spatial modes: 10 x 8; graph: 2 x 8), energy and agreement flag 2 x 8, virial 9 x 8
ALL_REDUCE_BYTES = {"halo": (80, 16, 72), "sync": (80, 16, 72), "graph": (16, 16, 72)}
#: a context-parallel training evaluation's: the MD step's and the energy's adjoint
TRAIN_ALL_REDUCE_BYTES = (80, 16, 72, 16)
#: exchanges per step and sync point: a forward exchange and its adjoint
EXCHANGES_PER_POINT = 2
#: numbers per row of the positions' exchange
POSITION_WIDTH = 3


@dataclass(frozen=True)
class ComputeCost:
    """Measured cost of the model's forward + backward (forces and virial) on one device.

    Attributes:
        per_atom: s per held atom (owned + ghost).
        per_edge: s per local edge.
        fixed: s per evaluation (launches, Python).
        source: the measurements it was fitted to.
        per_owned: s per owned atom (the work that follows the atoms whose energy a rank
            sums, not its ghosts). One-rank rows of one system cannot tell it from
            ``per_atom`` (their ghost/owned ratio is fixed); 1-rank rows of several sizes
            (whose periodic-image ghosts are a different share of each) can.
    """

    per_atom: float
    per_edge: float
    fixed: float = 0.0
    source: str = ""
    per_owned: float = 0.0

    def seconds(self, held, edges, owned=None) -> np.ndarray:
        """Seconds of one evaluation on ``held`` atoms (``owned`` of them owned: default
        all) and ``edges`` edges (arrays)."""
        held = np.asarray(held, float)
        owned = held if owned is None else np.asarray(owned, float)
        return (self.fixed + self.per_atom * held + self.per_owned * owned
                + self.per_edge * np.asarray(edges, float))

    @classmethod
    def fit(cls, held, edges, seconds, fixed: bool = True, source: str = "",
            owned=None) -> ComputeCost:
        """Non-negative least squares on 1-rank measurements (relative residuals, so that
        small and large systems weigh the same): every subset of the terms (held atoms,
        edges, the fixed cost, and owned atoms when ``owned`` is given) is fitted and the
        best non-negative one kept. Terms that the points cannot tell apart are dropped in
        favour of the first of them: with one edges-per-atom ratio the cost goes on the
        edges (``per_atom = 0``), which predicts any count of that ratio exactly; with one
        owned-per-held ratio the atom cost stays on the held atoms (``per_owned = 0``); with
        one size (the same atoms and edges in every row, e.g. lattice scales whose edges
        within the cutoff are equal) there is no fixed cost (``fixed = 0``): a rank holding
        half the edges is priced at half the time, not at all of it."""
        h, e, t = (np.asarray(x, float) for x in (held, edges, seconds))
        cols = {"held": h / t, "edges": e / t}
        if fixed:
            cols["fixed"] = 1.0 / t
        if owned is not None:
            o = np.asarray(owned, float)
            if np.ptp(o / np.maximum(h, 1)) >= 0.02 * np.mean(o / np.maximum(h, 1)):
                cols["owned"] = o / t
        if np.ptp(e / np.maximum(h, 1)) < 0.02 * np.mean(e / np.maximum(h, 1)):
            del cols["held"]  # one ratio: atoms and edges collinear
        if fixed and np.ptp(e) < 0.02 * np.mean(e) and np.ptp(h) < 0.02 * np.mean(h):
            del cols["fixed"]  # one size: a fixed cost and the edges' collinear
        names = list(cols)
        best, err = None, np.inf
        for k in range(len(names), 0, -1):
            for c in itertools.combinations(names, k):
                a = np.stack([cols[n] for n in c], axis=1)
                x, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
                if (x < 0).any():
                    continue
                r = float(np.sum((a @ x - 1.0) ** 2))
                if r < err - 1e-12:
                    best, err = dict(zip(c, (float(v) for v in x))), r
        if best is None:
            raise ValueError("no non-negative fit of the compute cost")
        return cls(best.get("held", 0.0), best.get("edges", 0.0), best.get("fixed", 0.0),
                   source, per_owned=best.get("owned", 0.0))


@dataclass(frozen=True)
class ModelShape:
    """What the model exchanges: sync points per evaluation (0 in mode halo), numbers per
    row at a sync point, bytes per number, and trainable parameters (training)."""

    sync_points: int
    feature_width: int
    dtype_bytes: int
    n_params: int = 0


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step: per-rank arrays and the step's total.

    Attributes:
        compute, exchange, rebuild: ``[n_ranks]`` seconds per rank.
        reduction: seconds of the step's all-reduces (every rank waits for them).
        total: ``max_r(compute + exchange + rebuild) + reduction``.
        slowest: the rank that sets the total.
    """

    compute: np.ndarray
    exchange: np.ndarray
    rebuild: np.ndarray
    reduction: float
    output: np.ndarray | float = 0.0

    def _per_rank(self) -> np.ndarray:
        return self.compute + self.exchange + self.rebuild + self.output

    @property
    def slowest(self) -> int:
        return int(np.argmax(self._per_rank()))

    @property
    def total(self) -> float:
        return float(self._per_rank().max() + self.reduction)

    def split(self) -> dict[str, float]:
        """The slowest rank's step in parts (s): compute, exchange, rebuild, reduction,
        output."""
        r = self.slowest
        out = np.broadcast_to(np.asarray(self.output, float), self.compute.shape)
        return {"compute": float(self.compute[r]), "exchange": float(self.exchange[r]),
                "rebuild": float(self.rebuild[r]), "reduction": self.reduction,
                "output": float(out[r]), "total": self.total}


@dataclass(frozen=True)
class Rebuild:
    """Ghost-plan rebuild and migration: s per held atom, once every ``interval`` steps."""

    per_atom: float = 0.0
    interval: float = 20.0

    def seconds(self, held) -> np.ndarray:
        return self.per_atom * np.asarray(held, float) / max(self.interval, 1.0)


@dataclass(frozen=True)
class Output:
    """Trajectory frames and checkpoints, amortised per step (``docs/distributed.md``,
    "Output at scale"; measured by ``benchmarks/io_scale.py``).

    Attributes:
        bytes_per_atom: bytes written per atom per output (fp64: 104 for a checkpoint,
            92-96 for a frame with velocities and forces).
        write_bandwidth: bytes/s one rank writes to the file system.
        every: steps between outputs.
        sharded: every rank writes its owned atoms (``output.*_format=sharded``), or rank 0
            gathers all ``N`` atoms (gather at ``gather_bandwidth``) and writes them alone
            while the others wait.
        gather_bandwidth: bytes/s of gathering to rank 0 (gathered only).
    """

    bytes_per_atom: float
    write_bandwidth: float
    every: float
    sharded: bool = True
    gather_bandwidth: float = 1e9

    def seconds(self, owned: np.ndarray) -> np.ndarray:
        """``[n_ranks]`` seconds per step of each rank's share of the output."""
        owned = np.asarray(owned, float)
        if self.sharded:
            t = owned * self.bytes_per_atom / self.write_bandwidth
        else:  # the others wait for rank 0's gather and write: every rank pays it
            total = owned.sum() * self.bytes_per_atom
            t = np.full(owned.shape, total / self.gather_bandwidth
                        + total / self.write_bandwidth)
        return t / max(self.every, 1.0)


def exchanges_per_step(mode: str, shape: ModelShape) -> list[int]:
    """Numbers per row of each exchange of one MD step in a spatial ``mode`` (forward
    exchanges and their adjoints), or of each forward all-gather in mode ``graph``."""
    points = [POSITION_WIDTH] + ([shape.feature_width] * shape.sync_points
                                 if mode in ("sync", "graph") else [])
    if mode == "graph":
        return points
    return [w for w in points for _ in range(EXCHANGES_PER_POINT)]


def all_reduces_per_step(mode: str) -> int:
    """Blocking scalar all-reduces of a quiet NVE step (the same number in every mode: graph
    has no migration criteria, but its rebuild check stays)."""
    return len(ALL_REDUCE_BYTES[mode])


def messages(counts: RankCounts, exchange: str = "direct") -> np.ndarray:
    """``[n_ranks]`` messages per exchange: ``counts.peers`` (``direct``) or
    ``counts.staged_peers`` (``staged``: the stages' sends, x then y then z)."""
    if exchange == "direct":
        return counts.peers
    if exchange != "staged":
        raise ValueError(f"exchange is 'direct' or 'staged', got {exchange!r}")
    if counts.staged_peers is None:
        raise ValueError("these counts have no staged_peers: count them with "
                         "xnn.distributed.cost.counts.staged_messages")
    return counts.staged_peers


def exchange_bytes(counts: RankCounts, shape: ModelShape,
                   exchange: str = "direct") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per rank and quiet MD step in a spatial mode: (messages, bytes sent, bytes received)
    of its point-to-point exchanges (``exchange``: ``direct`` or ``staged``)."""
    widths = exchanges_per_step(counts.mode, shape)
    rows_w = float(sum(widths)) * shape.dtype_bytes
    return (messages(counts, exchange) * len(widths), counts.send_rows * rows_w,
            counts.recv_rows * rows_w)


def gather_bytes(counts: RankCounts, shape: ModelShape) -> list[tuple[float, float]]:
    """Mode graph, per forward all-gather of one MD step: (bytes of one rank's part, bytes
    of the whole gathered tensor). Parts are padded to the largest rank's rows; the backward
    of each gather is a reduce-scatter of the whole tensor (an all-reduce of it on gloo)."""
    part = float(counts.owned.max()) * shape.dtype_bytes
    return [(part * w, part * w * counts.n_ranks)
            for w in exchanges_per_step("graph", shape)]


def md_step(counts: RankCounts, compute: ComputeCost, shape: ModelShape, link: Link,
            reduce_link: Link | None = None, rebuild: Rebuild | None = None,
            all_reduces: int | None = None,
            all_reduce_bytes: float | None = None,
            output: Output | None = None, exchange: str = "direct") -> StepTime:
    """Predicted time of one eager decomposed MD step (see the module docstring).

    Args:
        counts: per-rank counts of the decomposition (``counts.mode`` halo, sync or graph).
        compute: the model's measured cost on the device.
        shape: what the model exchanges.
        link: the link of the exchanges (the slowest link a rank's peers use).
        reduce_link: the link class of the all-reduces (default ``link``).
        rebuild: rebuild and migration cost, amortised over its interval.
        all_reduces: blocking all-reduces per step (default
            :func:`all_reduces_per_step`).
        all_reduce_bytes: bytes of each (default: the fp64 sizes of
            :data:`ALL_REDUCE_BYTES` of the mode, averaged).
        output: trajectory frames or checkpoints, amortised per step (default none).
        exchange: ``parallel.exchange`` of the spatial modes: ``direct`` (``counts.peers``
            messages per exchange) or ``staged`` (``counts.staged_peers``).
    """
    reduce_link = reduce_link or link
    rebuild = rebuild or Rebuild()
    held = counts.held
    comp = compute.seconds(held, counts.edges, counts.owned)
    if counts.mode == "graph":
        p, t = counts.n_ranks, 0.0
        for part, whole in gather_bytes(counts, shape):
            t += reduce_link.allgather(part, p)  # forward
            t += (reduce_link.allgather(part, p) if reduce_link.reduce_scatter
                  else reduce_link.allreduce(whole, p))  # backward
        exch = np.full(p, t)
    else:
        exch = np.zeros(counts.n_ranks)
        sends = messages(counts, exchange)
        for w in exchanges_per_step(counts.mode, shape):
            row = w * shape.dtype_bytes
            exch = exch + link.exchange(sends, counts.send_rows * row, counts.recv_rows * row)
    nbytes = (np.mean(ALL_REDUCE_BYTES[counts.mode]) if all_reduce_bytes is None
              else all_reduce_bytes)
    if all_reduces is None:
        all_reduces = all_reduces_per_step(counts.mode)
    red = all_reduces * reduce_link.allreduce(nbytes, counts.n_ranks)
    out = output.seconds(counts.owned) if output is not None else 0.0
    return StepTime(comp, exch, rebuild.seconds(held), red, out)


def training_step(counts: RankCounts, compute: ComputeCost, shape: ModelShape, link: Link,
                  dp: int, reduce_link: Link | None = None, train_factor: float = 3.0,
                  grad_bytes: int = 4, exchange: str = "direct") -> StepTime:
    """Predicted time of one context-parallel training step of one structure per dd group
    (``counts`` is the dd decomposition), on a ``dp × counts.n_ranks`` mesh.

    ``train_factor``: forward + double backward over forward + backward (measure it: 1-rank
    training step over 1-rank MD evaluation; 3 by default, an assumption). Every exchange
    runs twice as often as in MD (4 per point), with the 4 scalar all-reduces of
    :data:`TRAIN_ALL_REDUCE_BYTES`; the ``n_params`` gradients (``grad_bytes``
    each) are all-reduced over the whole mesh. ``exchange``: as :func:`md_step`.
    """
    md = md_step(counts, compute, shape, link, reduce_link,
                 all_reduces=len(TRAIN_ALL_REDUCE_BYTES),
                 all_reduce_bytes=float(np.mean(TRAIN_ALL_REDUCE_BYTES)), exchange=exchange)
    reduce_link = reduce_link or link
    world = dp * counts.n_ranks
    grads = reduce_link.allreduce(float(shape.n_params) * grad_bytes, world)
    return StepTime(md.compute * train_factor, md.exchange * 2.0, md.rebuild,
                    md.reduction + grads)


def efficiency(step: StepTime, reference: StepTime, scale: float = 1.0) -> float:
    """Parallel efficiency: ``scale * reference.total / step.total``, e.g. weak scaling
    with ``reference`` the one-device step of the same atoms per device (``scale = 1``),
    strong scaling with ``reference`` the one-device step of the whole system and ``scale =
    1 / P``."""
    return scale * reference.total / step.total
