"""Link classes of the step-cost model: latency and bandwidth of point-to-point messages and
small/large all-reduces, per class of connection (issue 47).

A message of ``b`` bytes costs ``latency + b / bandwidth`` (Hockney's model). A collective
over ``P`` ranks costs, for NCCL/gloo's ring and tree algorithms (nccl-tests'
``doc/PERFORMANCE.md`` defines the bus bandwidth this uses:
https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

* all-reduce of ``b`` bytes: ``allreduce_latency(P) + 2 (P-1)/P * b / bus_bandwidth``,
  with a latency growing as ``log2 P`` (tree) from the 2-rank figure;
* all-gather (or reduce-scatter) of ``P`` parts of ``b`` bytes each: ``(P-1) *
  latency_ring_step + (P-1) * b / bus_bandwidth``.

Each parameter below cites where it comes from. The gloo class is fitted from this
project's measurements (:func:`fit_link`, ``benchmarks/scaling_model.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Link:
    """One class of connection between two ranks.

    Attributes:
        name: e.g. ``"nvlink-h100"``.
        latency_s: per point-to-point message (s).
        bandwidth: point-to-point bytes/s of one rank's link (each direction).
        allreduce_latency_s: a small all-reduce on 2 ranks (s); grows as ``log2 P``.
        bus_bandwidth: the collectives' bus bandwidth (bytes/s, nccl-tests ``busbw``).
        source: where the figures come from (a URL or a measurement file).
        reduce_scatter: the backend has a reduce-scatter (NCCL); gloo has none, and mode
            graph's backward all-reduces the whole gathered tensor instead.
    """

    name: str
    latency_s: float
    bandwidth: float
    allreduce_latency_s: float
    bus_bandwidth: float
    source: str
    reduce_scatter: bool = True

    def message(self, nbytes) -> np.ndarray:
        """Seconds of one point-to-point message of ``nbytes`` (array or scalar)."""
        return self.latency_s + np.asarray(nbytes, dtype=float) / self.bandwidth

    def exchange(self, messages, send_bytes, recv_bytes) -> np.ndarray:
        """Seconds of one batched exchange with ``messages`` peers, posted at once: the
        latencies add (messages posted one after the other), the bytes share the link."""
        b = np.maximum(np.asarray(send_bytes, float), np.asarray(recv_bytes, float))
        m = np.asarray(messages, float)
        return np.where(m > 0, m * self.latency_s + b / self.bandwidth, 0.0)

    def allreduce(self, nbytes: float, n_ranks: int) -> float:
        """Seconds of one all-reduce of ``nbytes`` over ``n_ranks``."""
        if n_ranks <= 1:
            return 0.0
        lat = self.allreduce_latency_s * max(1.0, math.log2(n_ranks))
        return lat + 2.0 * (n_ranks - 1) / n_ranks * nbytes / self.bus_bandwidth

    def allgather(self, part_bytes, n_ranks: int) -> float:
        """Seconds of one all-gather (or reduce-scatter) of ``n_ranks`` parts of
        ``part_bytes`` each (ring)."""
        if n_ranks <= 1:
            return 0.0
        return (n_ranks - 1) * (self.latency_s + float(part_bytes) / self.bus_bandwidth)


GB = 1e9

#: NVLink 4 within one HGX H100/H200 node (NVSwitch). Bus bandwidth: nccl-tests
#: all_reduce_perf on 8 H100 SXM5 reaches 460-480 GB/s busbw
#: (https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); we take 450 GB/s, the
#: NVLink-4 unidirectional figure quoted there. Point-to-point: 900 GB/s bidirectional per
#: GPU, of which one peer pair sees the same 450 GB/s per direction minus protocol losses
#: (~360 GB/s assumed, 80%). Latencies: NCCL's small-message cost within a node is
#: ~10 us per operation (nccl-tests PERFORMANCE.md explains that time at small sizes is
#: the latency; 8-64 kB all-reduces within an NVSwitch node take ~10-20 us in the curves
#: published at https://github.com/stas00/ml-engineering/tree/master/network/benchmarks),
#: assumed 10 us per all-reduce and 8 us per message.
NVLINK_H100 = Link("nvlink-h100", latency_s=8e-6, bandwidth=360 * GB,
                   allreduce_latency_s=10e-6, bus_bandwidth=450 * GB,
                   source="https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests; "
                          "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md")

#: InfiniBand NDR 400 Gb/s, one NIC per GPU (HGX H100/H200 nodes with 8 ConnectX-7):
#: 400 Gb/s = 50 GB/s per direction per GPU, of which NCCL point-to-point reaches ~90%
#: (45 GB/s assumed). The bus bandwidth of an all-reduce over several 8-GPU nodes is set by
#: the NICs: stas00's all_reduce_bench on 4 H100 nodes shows ~92 GB/s busbw at >= 1 GiB and
#: 0.92 GB/s busbw (0.48 GB/s algbw, i.e. ~68 us) at 32 KiB
#: (https://github.com/stas00/ml-engineering/tree/master/network/benchmarks); 2 H200 NVL
#: nodes on 4 RoCE NICs reach ~35 GB/s (https://kubernetes.recipes/recipes/ai/
#: nccl-all-reduce-perf-benchmark-multi-node/). We take 90 GB/s bus bandwidth and 30 us for
#: a small all-reduce between 2 ranks on different nodes (68 us at 32 ranks is
#: 30 us x log2(32)/2.2: the tree's log2 P growth), and 12 us per point-to-point message
#: (GPUDirect RDMA send/recv across one switch hop; assumed, no published figure found).
IB_NDR400 = Link("ib-ndr400", latency_s=12e-6, bandwidth=45 * GB,
                 allreduce_latency_s=30e-6, bus_bandwidth=90 * GB,
                 source="https://github.com/stas00/ml-engineering/tree/master/network/"
                        "benchmarks; https://kubernetes.recipes/recipes/ai/"
                        "nccl-all-reduce-perf-benchmark-multi-node/")

#: gloo over loopback TCP on one CPU host: fitted from dd_components' measured exchanges
#: (benchmarks/scaling_model.py replaces these by the fit of the file it reads).
GLOO_HOST = Link("gloo-host", latency_s=60e-6, bandwidth=1.0 * GB, allreduce_latency_s=80e-6,
                 bus_bandwidth=1.0 * GB, source="fitted: benchmarks/results/dd_components_*.json",
                 reduce_scatter=False)

LINKS = {link.name: link for link in (NVLINK_H100, IB_NDR400, GLOO_HOST)}


def fit_link(base: Link, p2p: list[tuple[int, int, float]],
             allreduce: list[tuple[int, int, float]], name: str | None = None,
             source: str = "fitted") -> Link:
    """``base`` with latency and bandwidth fitted (least squares, non-negative) to measured
    exchanges ``(messages, bytes, seconds)`` and all-reduces ``(n_ranks, bytes, seconds)``
    (fields without measurements keep ``base``'s value)."""
    out = base
    if p2p:
        a = np.array([[m, b] for m, b, _ in p2p], float)
        t = np.array([s for *_, s in p2p], float)
        lat, inv_bw = _nnls(a, t)
        out = replace(out, latency_s=lat if lat > 0 else out.latency_s,
                      bandwidth=1 / inv_bw if inv_bw > 0 else out.bandwidth)
    if allreduce:
        per = [s / max(1.0, math.log2(p)) for p, _, s in allreduce if p > 1]
        if per:
            out = replace(out, allreduce_latency_s=float(np.median(per)))
    return replace(out, name=name or out.name, source=source)


def _nnls(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares ``a x ≈ t`` with ``x >= 0`` (two unknowns: tries the active sets)."""
    best, err = np.zeros(a.shape[1]), float(np.sum(t ** 2))
    for cols in ([0, 1], [0], [1]):
        x, *_ = np.linalg.lstsq(a[:, cols], t, rcond=None)
        if (x < 0).any():
            continue
        full = np.zeros(a.shape[1])
        full[cols] = x
        e = float(np.sum((a @ full - t) ** 2))
        if e < err:
            best, err = full, e
    return best
