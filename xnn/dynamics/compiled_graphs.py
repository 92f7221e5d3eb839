"""CUDA-graph replay of a compiled MD step (``md.cuda_graph=true``).

:class:`CudaGraphStep` wraps the compiled step function (fixed shapes: the edge capacity
holds while the neighbor list is rebuilt). Its first ``warmup`` calls run the function
itself (inductor compiles and tunes its kernels, the allocator settles); the next call
copies the inputs into static buffers and captures one call into a CUDA graph; every call
after that copies into those buffers only the inputs that are not the very tensors copied
last time (positions, velocities, forces, the step counter, thermostat variables; the
edges and the reference positions after a rebuild; the species, cell, masses and ids of a
run are copied once), replays the graph and returns copies of its outputs (the next replay
writes into the same buffers, and MD states are never modified in place). A new capacity
compiles a new function and so makes a new capture. The model's weights are read in place
(the captured kernels hold their addresses): do not replace them during a run.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class CudaGraphStep:  # pragma: no cover - needs CUDA
    """``fn(*args)`` (tensors in nested tuples/dicts) replayed as one CUDA graph.

    Args:
        fn: the compiled step (same input shapes at every call).
        warmup: calls run directly before the capture (>= 1: the first one compiles).
    Attributes:
        n_captures: graphs captured so far (1 in a steady run).
    """

    def __init__(self, fn, warmup: int = 2):
        self.fn = fn
        self.warmup = int(warmup)
        self.n_calls = 0
        self.n_captures = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._spec = None
        self._static: list[torch.Tensor] = []
        self._last: list[torch.Tensor] = []
        self._out: tuple = ()

    def __call__(self, *args):
        self.n_calls += 1
        flat, spec = tree_flatten(args)
        if self._graph is None and self.n_calls <= self.warmup:
            return self.fn(*args)
        if self._graph is None or spec != self._spec or not self._fits(flat):
            self._capture(flat, spec)
        else:
            for i, t in enumerate(flat):
                if t is not self._last[i]:
                    self._static[i].copy_(t)
            self._last = flat
        self._graph.replay()
        return tuple(t.clone() for t in self._out)

    def _fits(self, flat: list) -> bool:
        return len(flat) == len(self._static) and all(
            a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            for a, b in zip(flat, self._static))

    def _capture(self, flat: list, spec) -> None:
        self._static = [t.clone() for t in flat]
        self._last, self._spec = flat, spec
        static_args = tree_unflatten(self._static, spec)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one more run on a side stream, as capture wants
                self.fn(*static_args)
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._out = tuple(self.fn(*static_args))
        except Exception as err:
            self._graph = None
            raise RuntimeError(f"the CUDA-graph capture of the compiled MD step failed "
                               f"({type(err).__name__}: {str(err).splitlines()[0]}): set "
                               f"md.cuda_graph: false (md.compile: true still compiles the "
                               f"step)") from err
        self.n_captures += 1
