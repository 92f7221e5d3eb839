"""Energy, forces and stress for *training* through compiled kernels.

Force training differentiates the forces (first derivatives of the energy) with respect to
the weights: a double backward. ``torch.compile`` cannot differentiate a compiled backward
again, so the usual ``torch.compile(model)`` serves inference only. Here, instead (as NequIP
does), the whole function "graph -> energy, forces, stress" is first traced by
:func:`torch.fx.experimental.proxy_tensor.make_fx` with symbolic sizes: the autograd call that
gives forces and stress becomes ordinary operations of one graph. ``torch.compile`` then
compiles that graph (dynamic shapes), and AOTAutograd derives its single backward for the
loss. A training step thus runs a few dozen fused kernels instead of about a thousand eager
operations, which matters most where the host, not the GPU, bounds the step.

Three things make the traced graph exactly the eager computation:

* The tracer records the output that an operation such as ``sqrt`` or ``tanh`` saves for its
  backward as ``detach(output)``; left in place, that detach would cut the second derivative
  through it (wrong weight gradients, right forces). Every ``detach`` of the traced graph is
  therefore an alias of its input. A model must not rely on ``detach`` as a stop-gradient.
* Models see :func:`~xnn.models.base.graph_tracing` as true while traced and avoid
  data-dependent shapes (e.g. the equivariant model keeps all edges, whose envelope is zero
  beyond the cutoff).
* The trace must not specialise on the sizes of one batch: it is taken on the batch
  doubled (no size 0 or 1) with duck sizing off (no two sizes assumed equal), and every
  later batch is checked against the guards the tracer recorded (every size at least 2,
  and the like). A batch that fails them, e.g. a single structure, gets a trace of its own
  (at most :data:`MAX_VARIANTS`; beyond, such batches are evaluated eagerly).

Before first use, the traced graph is checked against eager double backward in float64 on
the first batch (weight gradients of a random projection of energy, forces and stress): a
model whose graph differs raises :class:`CompileError` instead of training wrongly.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.fx.experimental import _config as fx_config

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import XnnError
from xnn.models.base import tracing_graph
from xnn.models.derivatives import compute_properties

#: traces per :class:`CompiledProperties` (the first, and ones for batches outside its guards)
MAX_VARIANTS = 4

#: graph fields the traced function takes (labels and per-run extras are not inputs); the
#: ``head`` of a multi-head batch (:mod:`xnn.models.heads`) is an input where present
INPUT_FIELDS = (K.POSITIONS, K.NUMBERS, K.CELL, K.PBC, K.BATCH, K.MASSES, K.ATOM_ID,
                K.EDGE_INDEX, K.SHIFTS, K.HEAD)


class CompileError(XnnError):
    """The model cannot be traced for compiled training, or its trace is not exact."""


class _Properties(nn.Module):
    """``fields -> compute_properties(model, graph, training=True)`` (what is traced)."""

    def __init__(self, model: nn.Module, forces: bool, stress: bool):
        super().__init__()
        self.model = model
        self.forces = forces
        self.stress = stress

    def forward(self, fields: dict[str, Tensor]) -> dict[str, Tensor]:
        graph = AtomicGraph(fields, validate=False)
        return compute_properties(self.model, graph, self.forces, self.stress, training=True)


def _state(module: nn.Module) -> dict[str, Tensor]:
    state = dict(module.named_parameters())
    state.update(module.named_buffers())
    return state


def _inputs(graph: AtomicGraph) -> dict[str, Tensor]:
    missing = [k for k in (K.EDGE_INDEX, K.SHIFTS) if k not in graph]
    if missing:
        raise CompileError(f"compiled training needs graphs with edges (missing {missing})")
    if K.N_UPDATE in graph:
        raise CompileError("compiled training does not take graphs with n_update")
    return {k: graph[k] for k in INPUT_FIELDS if k in graph}


class Traced:
    """A traced graph module ``(state, fields) -> properties`` and the conditions on sizes
    under which it is exact (:meth:`holds`)."""

    def __init__(self, gm, guards: str | None, shape_env):
        self.gm = gm
        self.guards = guards
        self._env = shape_env

    def holds(self, state: dict[str, Tensor], fields: dict[str, Tensor]) -> bool:
        """Whether the sizes of these inputs satisfy every guard the tracer recorded (e.g.
        equal atom counts across fields; a batch with a size the trace specialised fails)."""
        if not self.guards:
            return True
        flat = torch.utils._pytree.tree_leaves([state, fields])
        return bool(self._env.evaluate_guards_expression(self.guards, flat))


def trace(model: nn.Module, example: AtomicGraph, forces: bool, stress: bool,
          double: bool = True) -> Traced:
    """Trace ``model``'s properties for training (see the module docstring), with every
    ``detach`` an alias; on ``example`` concatenated with itself unless ``double=False``
    (then sizes of 0 or 1 in ``example`` are fixed in the trace).

    Raises:
        CompileError: the model has data-dependent shapes (or fails under the tracer).
    """
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx

    wrapper = _Properties(model, forces, stress)
    fields = _inputs(AtomicGraph.concat([example, example]) if double else example)
    state = {k: v.detach() for k, v in _state(wrapper).items()}

    def fn(state, fields):
        return functional_call(wrapper, state, (fields,))

    try:
        with tracing_graph(), fx_config.patch(use_duck_shape=False):
            gm = make_fx(fn, tracing_mode="symbolic")(state, fields)
    except Exception as e:  # data-dependent shapes and the like
        raise CompileError(f"{type(model).__name__} cannot be traced for compiled training: "
                           f"{type(e).__name__}: {str(e).splitlines()[0]}") from e
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    fakes = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    env = next((s.node.shape_env for v in fakes if isinstance(v, Tensor) for s in v.shape
                if isinstance(s, torch.SymInt)), None)
    guards = env.produce_guards_expression(fakes) if env is not None else None
    return Traced(gm, guards, env)


def _projection_loss(out: dict[str, Tensor], weights: dict[str, Tensor]) -> Tensor:
    return sum((out[k] * w).sum() for k, w in weights.items())


def _deepcopy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` sharing the TorchScript functions that modules hold as
    attributes (compiled code, immutable, and not copyable: e3nn's ``SphericalHarmonics``
    keeps a scripted ``sph_func`` once something has enabled e3nn's scripting)."""
    memo = {id(v): v for m in model.modules() for v in vars(m).values()
            if isinstance(v, torch.jit.ScriptFunction)}
    return copy.deepcopy(model, memo)


def verify(model: nn.Module, example: AtomicGraph, forces: bool, stress: bool,
           rtol: float = 1e-8) -> float:
    """Relative difference (in the max norm over all weight gradients) between the traced
    graph and eager autograd, in float64, of the weight gradient of a random projection of
    energy, forces and stress on ``example`` with rattled positions.

    Raises:
        CompileError: the difference exceeds ``rtol``.
    """
    ref_model = _deepcopy(model).to(torch.float64)
    graph = example.to(dtype=torch.float64)
    # rattled: in a symmetric crystal vector features vanish, and with them some terms
    gen = torch.Generator().manual_seed(0)
    noise = 0.05 * torch.randn(graph.positions.shape, generator=gen, dtype=torch.float64)
    graph = graph.replace({K.POSITIONS: graph.positions + noise.to(graph.device)})
    gm = trace(ref_model, graph, forces, stress).gm
    wrapper = _Properties(ref_model, forces, stress)
    params = [p for p in ref_model.parameters() if p.requires_grad]
    eager = wrapper(_inputs(graph))
    keys = [k for k in (K.ENERGY, K.FORCES, K.STRESS) if k in eager]
    weights = {k: torch.randn(eager[k].shape, generator=gen, dtype=torch.float64)
               .to(eager[k].device) for k in keys}
    g_eager = torch.autograd.grad(_projection_loss(eager, weights), params, allow_unused=True)
    traced = gm(_state(wrapper), _inputs(graph))
    g_traced = torch.autograd.grad(_projection_loss(traced, weights), params,
                                   allow_unused=True)
    scale, diff = 0.0, 0.0
    for a, b in zip(g_traced, g_eager):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is None:
            continue
        scale = max(scale, float(b.abs().max()))
        diff = max(diff, float((a - b).abs().max()))
    rel = diff / max(scale, 1e-300)
    if not rel <= rtol:
        raise CompileError(f"the traced training graph of {type(model).__name__} differs from "
                           f"eager autograd (relative difference {rel:.2e} of the weight "
                           "gradients); train without compile")
    return rel


class CompiledProperties:
    """``compute_properties(model, graph, forces, stress, training=True)`` through compiled
    kernels (see the module docstring). Differentiable with respect to ``model``'s weights.

    The graph is traced on the first call (and again if the dtype, device or the fields of
    the batches change), checked against eager autograd unless ``verify=False``, and
    compiled by ``torch.compile(dynamic=True)``: the first steps take tens of seconds.

    Args:
        model: a per-atom-energy model (its weights are read at every call).
        forces, stress: what to derive (as for :func:`compute_properties`).
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` for tests).
        verify: compare the trace with eager autograd once (float64) before use.
    """

    def __init__(self, model: nn.Module, forces: bool = True, stress: bool = True,
                 backend: str = "inductor", verify: bool = True):
        self.model = model
        self.forces = bool(forces)
        self.stress = bool(stress)
        self.backend = backend
        self.verify = verify
        self.verified_rel_diff: float | None = None
        self._key = None
        self._variants: list[tuple[Traced, object]] = []  # (trace, its compiled function)
        self.eager_calls = 0  # batches outside every trace's guards, evaluated eagerly
        self._wrapper = _Properties(model, self.forces, self.stress)

    @property
    def n_traces(self) -> int:
        """Traces made for the current dtype, device and fields."""
        return len(self._variants)

    def _compile(self, graph: AtomicGraph, double: bool):
        if self.verify and self.verified_rel_diff is None:
            self.verified_rel_diff = verify(self.model, graph, self.forces, self.stress)
        traced = trace(self.model, graph, self.forces, self.stress, double=double)
        options = None
        if self.backend == "inductor" and graph.device.type == "cpu":
            # torch 2.13's vectorised C++ code generation asserts on the scatter of a
            # weight-gradient; scalar C++ kernels are right
            options = {"cpp.simdlen": 0}
        fn = torch.compile(traced.gm, dynamic=True, backend=self.backend, options=options)
        self._variants.append((traced, fn))
        return traced, fn

    def _function(self, graph: AtomicGraph, state, fields):
        """The compiled function whose trace holds for these inputs (traced now if needed;
        ``None``: evaluate eagerly)."""
        key = (graph.dtype, graph.device, tuple(fields), self.model.training)
        if key != self._key:
            self._variants, self._key = [], key
        for traced, fn in self._variants:
            if traced.holds(state, fields):
                return fn
        if len(self._variants) >= MAX_VARIANTS:
            return None
        # the first trace generalises from the doubled batch; later ones (a batch the first
        # trace does not cover, e.g. one structure) fix the batch's sizes of 0 or 1
        traced, fn = self._compile(graph, double=not self._variants)
        return fn if traced.holds(state, fields) else None

    def __call__(self, graph: AtomicGraph) -> dict[str, Tensor]:
        fields = _inputs(graph)
        state = _state(self._wrapper)
        fn = self._function(graph, state, fields)
        if fn is None:
            self.eager_calls += 1
            return self._wrapper(fields)
        with fx_config.patch(use_duck_shape=False):  # a batch of 3 systems: cell [3, 3, 3]
            return fn(state, fields)
