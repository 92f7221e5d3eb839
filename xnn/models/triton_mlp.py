"""Fused Triton kernels for radial MLPs: ``y = s * (silu(... silu(x A_1 + b_1) ...) A_o + b_o)``.

A radial network maps a few basis values of each edge's length (``x [P, D0]``, ``D0`` about
8) through hidden layers of width 64 to the weights of the edge's tensor product
(``y [P, N]``, ``N`` in the thousands for MACE), then (MACE) multiplies them by the smooth
cutoff ``s [P]``. Through cuBLAS and torch that is four GEMMs, a pointwise product and, in
the backward, a product with a reduction: the ``[P, N]`` weights and their gradient cross
memory five or six times per evaluation, and the GEMMs run in fp32 on the CUDA cores (a
fraction of the tensor cores' TF32 rate).

Here one kernel computes a tile of rows through every layer in registers and writes ``y``
once; one backward kernel reads ``dL/dy`` once, computes ``t = dL/dy A_o^T`` (the only product
with the output layer: ``dL/ds = Σ_k h_k t_k``), recomputes the hidden layers (64 wide:
cheap), and returns ``dL/dx [P, D0]`` and ``dL/ds [P]`` (the forces need both: the basis and
the cutoff are functions of the edge length). The matrix products use ``tl.dot`` with the
input precision given:

* ``"ieee"``: fp32 products (exact fp32 arithmetic, as cuBLAS's fp32 GEMM);
* ``"tf32x3"``: three TF32 tensor-core products per product (each operand split into a
  TF32 head and a TF32 tail, the tail-tail term dropped): errors of the order of fp32
  rounding (about ``2^-21`` relative per product term against ``2^-24``), at the tensor
  cores' rate.

float64 inputs always use ``"ieee"``.

There are no gradients for the weights (the kernels serve inference: MD, relaxation,
evaluation; training keeps the torch path). :func:`radial_mlp` refuses weights that require
gradients, and the backward operator has no derivative of its own (no double backward).

The operators (``xnn::radial_mlp``, ``xnn::radial_mlp_backward``) are
:func:`torch.library.triton_op`\\ s: ``torch.compile(fullgraph=True)``, ``make_fx`` and
CUDA-graph capture see them. CPU tensors run the same formula with torch ops, or the kernels
in Triton's interpreter when ``TRITON_INTERPRET=1`` is set at the call (tests).
"""

from __future__ import annotations

import types
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from xnn.models.triton_tp import _interpreting

PRECISIONS = ("ieee", "tf32x3")
#: rows per program, output columns per inner step, warps and software-pipeline stages
#: (GPU; the interpreter takes whole small inputs): set from ``benchmarks/triton_mlp.py``
#: sweeps in 3xTF32 on MACE's N = 1280 network: the fastest forward tiling
#: (benchmarks/results/README.md, Kernels) and the fastest backward one (its sweep log:
#: triton_mlp_sweep_backward_h200_s23.txt at commit a742891; no change in the MD step)
BLOCK_P, BLOCK_N, NUM_WARPS, NUM_STAGES = 128, 32, 4, 3
BWD_BLOCK_P, BWD_BLOCK_N, BWD_NUM_WARPS, BWD_NUM_STAGES = 128, 64, 8, 3
INTERPRETER_BLOCK_P = 64
MAX_WIDTH = 128  # hidden widths (and D0) padded to a power of two up to this


@triton.jit
def _hidden(x_ptr, wh_ptr, bh_ptr, rows, rmask, hc, sx_r, D0: tl.constexpr, H: tl.constexpr,
            N_LAYERS: tl.constexpr, HAS_BIAS: tl.constexpr, PREC: tl.constexpr):
    """The input rows (zero-padded to ``H`` columns) through the first ``N_LAYERS`` hidden
    layers."""
    h = tl.load(x_ptr + rows[:, None] * sx_r + hc[None, :],
                mask=rmask[:, None] & (hc[None, :] < D0), other=0.0)
    for i in tl.static_range(N_LAYERS):
        w = tl.load(wh_ptr + i * H * H + hc[:, None] * H + hc[None, :])
        z = tl.dot(h, w, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(bh_ptr + i * H + hc)[None, :]
        h = z / (1.0 + tl.exp(-z))
    return h


def _fwd_kernel(x_ptr, wh_ptr, bh_ptr, wo_ptr, bo_ptr, s_ptr, y_ptr, n_rows, sx_r, sy_r,
                n_out: tl.constexpr, D0: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask = rows < n_rows
    hc = tl.arange(0, H)
    h = _hidden(x_ptr, wh_ptr, bh_ptr, rows, rmask, hc, sx_r, D0, H, L, HAS_BIAS, PREC)
    if HAS_SCALE:
        s = tl.load(s_ptr + rows, mask=rmask, other=0.0)
    for n0 in range(0, n_out, BLOCK_N):
        nc = n0 + tl.arange(0, BLOCK_N)
        nmask = nc < n_out
        w = tl.load(wo_ptr + hc[:, None] * n_out + nc[None, :], mask=nmask[None, :], other=0.0)
        y = tl.dot(h, w, input_precision=PREC)
        if HAS_BIAS:
            y += tl.load(bo_ptr + nc, mask=nmask, other=0.0)[None, :]
        if HAS_SCALE:
            y = y * s[:, None]
        tl.store(y_ptr + rows[:, None] * sy_r + nc[None, :], y,
                 mask=rmask[:, None] & nmask[None, :])


def _bwd_kernel(g_ptr, x_ptr, wh_ptr, bh_ptr, wo_ptr, bo_ptr, s_ptr, gx_ptr, gs_ptr, n_rows,
                sg_r, sx_r, sgx_r, n_out: tl.constexpr,
                D0: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, NEED_S: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask = rows < n_rows
    hc = tl.arange(0, H)
    # t = g @ A_o^T; then dL/ds = Σ_n g (h @ A_o + b_o) = Σ_k h t + Σ_n g b_o, dL/dh = s t
    t = tl.full((BLOCK_P, H), 0.0, x_ptr.dtype.element_ty)
    gb = tl.full((BLOCK_P,), 0.0, x_ptr.dtype.element_ty)
    for n0 in range(0, n_out, BLOCK_N):
        nc = n0 + tl.arange(0, BLOCK_N)
        nmask = nc < n_out
        g = tl.load(g_ptr + rows[:, None] * sg_r + nc[None, :],
                    mask=rmask[:, None] & nmask[None, :], other=0.0)
        wt = tl.load(wo_ptr + hc[None, :] * n_out + nc[:, None], mask=nmask[:, None],
                     other=0.0)  # [BLOCK_N, H]: the output layer transposed
        t += tl.dot(g, wt, input_precision=PREC)
        if NEED_S and HAS_BIAS:  # (tl.sum is not in the interpreter's reach)
            gb += tl.reduce(g * tl.load(bo_ptr + nc, mask=nmask, other=0.0)[None, :], 1,
                            tl.standard._sum_combine)
    for j in tl.static_range(L):  # back through the hidden layers, last first
        hi = _hidden(x_ptr, wh_ptr, bh_ptr, rows, rmask, hc, sx_r, D0, H, L - 1 - j, HAS_BIAS,
                     PREC)
        w = tl.load(wh_ptr + (L - 1 - j) * H * H + hc[:, None] * H + hc[None, :])
        z = tl.dot(hi, w, input_precision=PREC)
        if HAS_BIAS:
            z += tl.load(bh_ptr + (L - 1 - j) * H + hc)[None, :]
        sg = 1.0 / (1.0 + tl.exp(-z))
        if j == 0:  # z * sg is the last hidden layer h
            if NEED_S:
                gs = tl.reduce(z * sg * t, 1, tl.standard._sum_combine) + gb
                tl.store(gs_ptr + rows, gs, mask=rmask)
            gh = t
            if HAS_SCALE:
                gh = t * tl.load(s_ptr + rows, mask=rmask, other=0.0)[:, None]
        gz = gh * (sg * (1.0 + z * (1.0 - sg)))
        gh = tl.dot(gz, tl.trans(w), input_precision=PREC)
    tl.store(gx_ptr + rows[:, None] * sgx_r + hc[None, :], gh,
             mask=rmask[:, None] & (hc[None, :] < D0))


# (the device function's global name is its def's: inductor copies its source by that name)
_FWD = triton.jit(_fwd_kernel, do_not_specialize=["n_rows"])
_BWD = triton.jit(_bwd_kernel, do_not_specialize=["n_rows"])


@cache
def _interpreted_kernel(fn):
    """The CPU interpreter's version of a kernel, its device function ``_hidden``
    interpreted too (a ``triton.jit`` function cannot be called from interpreted code)."""
    from triton.runtime.interpreter import InterpretedFunction

    scope = dict(fn.__globals__, _hidden=InterpretedFunction(_hidden.fn))
    return InterpretedFunction(types.FunctionType(fn.__code__, scope, fn.__name__))


# ---- plain torch: CPU tensors, fake tensors under tracing, and the tests' reference

def reference(x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor, bo: Tensor | None,
              s: Tensor | None, d0: int | None = None) -> Tensor:
    """The packed MLP with torch ops (``x [P, D0]``; see :func:`pack`)."""
    d0 = x.shape[1] if d0 is None else d0
    h = x
    for i in range(wh.shape[0]):
        z = h @ (wh[i, :d0] if i == 0 else wh[i])
        if bh is not None:
            z = z + bh[i]
        h = torch.nn.functional.silu(z)
    y = h @ wo
    if bo is not None:
        y = y + bo
    return y if s is None else y * s[:, None]


def _reference_backward(g, x, wh, bh, wo, bo, s, need_s):
    """:func:`backward` with torch ops, by hand (an operator's body runs below autograd)."""
    d0, zs, h = x.shape[1], [], x
    for i in range(wh.shape[0]):
        zs.append(h @ (wh[i, :d0] if i == 0 else wh[i]) + (0 if bh is None else bh[i]))
        h = torch.nn.functional.silu(zs[-1])
    gs = x.new_empty(0)
    if need_s:
        gs = (g * (h @ wo + (0 if bo is None else bo))).sum(1)
    gh = (g if s is None else g * s[:, None]) @ wo.T
    for i in reversed(range(wh.shape[0])):
        sg = torch.sigmoid(zs[i])
        gh = (gh * sg * (1 + zs[i] * (1 - sg))) @ (wh[i, :d0] if i == 0 else wh[i]).T
    return gh, gs


# ---- the operators

def _check(x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor, bo: Tensor | None,
           s: Tensor | None, precision: str) -> None:
    n_layers, width = int(wh.shape[0]), int(wh.shape[1])
    ok = (x.dim() == 2 and wh.dim() == 3 and n_layers >= 1 and wh.shape[2] == width
          and width == triton.next_power_of_2(width) and 16 <= width <= MAX_WIDTH
          and x.shape[1] <= width and wo.dim() == 2 and wo.shape[0] == width
          and (bh is None or bh.shape == (n_layers, width))
          and (bo is None or bo.shape == (wo.shape[1],))
          and (s is None or s.shape == (x.shape[0],)))
    if not ok:
        raise ValueError(
            f"radial_mlp: x {tuple(x.shape)}, hidden weights {tuple(wh.shape)}, output "
            f"weights {tuple(wo.shape)} (biases {None if bh is None else tuple(bh.shape)}, "
            f"{None if bo is None else tuple(bo.shape)}; scale "
            f"{None if s is None else tuple(s.shape)}) do not fit x [P, D0], [L, H, H], "
            f"[H, N] with H a power of two in 16..{MAX_WIDTH} and D0 <= H")
    tensors = [t for t in (x, wh, bh, wo, bo, s) if t is not None]
    if len({t.dtype for t in tensors}) != 1 or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"radial_mlp: tensors must all be float32 or all float64, got "
                         f"{[t.dtype for t in tensors]}")
    if precision not in PRECISIONS:
        raise ValueError(f"radial_mlp: precision must be one of {PRECISIONS}, got "
                         f"{precision!r}")


def _prec(x: Tensor, precision: str) -> str:
    return "ieee" if x.dtype == torch.float64 else precision


def _c(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def forward(x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor, bo: Tensor | None,
            s: Tensor | None, precision: str = "ieee") -> Tensor:
    """The forward kernel (no autograd; :func:`radial_mlp` is the differentiable operator)."""
    _check(x, wh, bh, wo, bo, s, precision)
    interpret = _interpreting(x, wh, wo)
    if x.device.type != "cuda" and not interpret:
        return reference(x, wh, bh, wo, bo, s)
    x, wh, bh, wo, bo, s = (_c(t) for t in (x, wh, bh, wo, bo, s))
    p, n, width = x.shape[0], int(wo.shape[1]), int(wh.shape[1])
    y = x.new_empty((p, n))
    block_p = INTERPRETER_BLOCK_P if interpret else BLOCK_P
    kernel = _interpreted_kernel(_fwd_kernel) if interpret else wrap_triton(_FWD)
    kernel[(triton.cdiv(p, block_p),)](
        x, wh, wh if bh is None else bh, wo, wo if bo is None else bo, x if s is None else s,
        y, p, x.stride(0), y.stride(0), n_out=n, D0=int(x.shape[1]), H=width, L=int(wh.shape[0]),
        HAS_BIAS=bh is not None, HAS_SCALE=s is not None, BLOCK_P=block_p, BLOCK_N=BLOCK_N,
        PREC=_prec(x, precision), num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y


def backward(g: Tensor, x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor,
             bo: Tensor | None, s: Tensor | None, precision: str = "ieee",
             need_s: bool = True) -> tuple[Tensor, Tensor]:
    """``(dL/dx [P, D0], dL/ds [P])`` for ``g = dL/dy [P, N]`` (``dL/ds`` empty without a
    scale or when ``need_s`` is false); no autograd."""
    _check(x, wh, bh, wo, bo, s, precision)
    need_s = need_s and s is not None
    if g.shape != (x.shape[0], wo.shape[1]) or g.dtype != x.dtype:
        raise ValueError(f"radial_mlp_backward: gradient {tuple(g.shape)} {g.dtype} for an "
                         f"output {(x.shape[0], wo.shape[1])} {x.dtype}")
    interpret = _interpreting(g, x, wh, wo)
    if x.device.type != "cuda" and not interpret:
        return _reference_backward(g, x, wh, bh, wo, bo, s, need_s)
    g, x, wh, bh, wo, bo, s = (_c(t) for t in (g, x, wh, bh, wo, bo, s))
    p, n, width = x.shape[0], int(wo.shape[1]), int(wh.shape[1])
    gx = x.new_empty(x.shape)
    gs = x.new_empty((p,) if need_s else (0,))
    block_p = INTERPRETER_BLOCK_P if interpret else BWD_BLOCK_P
    kernel = _interpreted_kernel(_bwd_kernel) if interpret else wrap_triton(_BWD)
    kernel[(triton.cdiv(p, block_p),)](
        g, x, wh, wh if bh is None else bh, wo, wo if bo is None else bo,
        x if s is None else s, gx, gs, p, g.stride(0), x.stride(0), gx.stride(0), n_out=n,
        D0=int(x.shape[1]), H=width, L=int(wh.shape[0]), HAS_BIAS=bh is not None,
        HAS_SCALE=s is not None, NEED_S=need_s, BLOCK_P=block_p, BLOCK_N=BWD_BLOCK_N,
        PREC=_prec(x, precision), num_warps=BWD_NUM_WARPS, num_stages=BWD_NUM_STAGES)
    return gx, gs


@torch.library.triton_op("xnn::radial_mlp", mutates_args=())
def _radial_mlp_op(x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor, bo: Tensor | None,
                   s: Tensor | None, precision: str) -> Tensor:
    return forward(x, wh, bh, wo, bo, s, precision)


@torch.library.triton_op("xnn::radial_mlp_backward", mutates_args=())
def _radial_mlp_backward_op(g: Tensor, x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor,
                            bo: Tensor | None, s: Tensor | None, precision: str,
                            need_s: bool) -> tuple[Tensor, Tensor]:
    return backward(g, x, wh, bh, wo, bo, s, precision, need_s)


def _setup(ctx, inputs, output):
    x, wh, bh, wo, bo, s, precision = inputs
    ctx.save_for_backward(x, wh, bh, wo, bo, s)
    ctx.precision = precision


def _grad(ctx, g):
    x, wh, bh, wo, bo, s = ctx.saved_tensors
    need_x, need_wh, need_bh, need_wo, need_bo, need_s = ctx.needs_input_grad[:6]
    if need_wh or need_bh or need_wo or need_bo:
        raise RuntimeError("radial_mlp: the fused radial MLP has no weight gradients "
                           "(inference only; train through the torch layers)")
    if not (need_x or need_s):
        return (None,) * 7
    gx, gs = radial_mlp_backward(g, x, wh, bh, wo, bo, s, ctx.precision, need_s)
    return (gx if need_x else None, None, None, None, None, gs if need_s else None, None)


_radial_mlp_op.register_autograd(_grad, setup_context=_setup)


def radial_mlp(x: Tensor, wh: Tensor, wo: Tensor, bh: Tensor | None = None,
               bo: Tensor | None = None, s: Tensor | None = None,
               precision: str = "ieee") -> Tensor:
    """``y = s[:, None] * (silu(... silu(x @ A_1 + b_1) ... @ A_L + b_L) @ A_o + b_o)``
    (operator ``xnn::radial_mlp``), differentiable once in ``x`` and ``s``.

    Args:
        x: ``[P, D0]`` inputs (``D0 <= H``).
        wh: ``[L, H, H]`` hidden layers' matrices (``L >= 1``; layer ``i`` maps row vectors,
            ``h @ wh[i]``; the first layer reads rows ``0 .. D0 - 1`` of ``wh[0]``, the
            rest must be zero; padded columns must be zero too: see :func:`pack`).
        wo: ``[H, N]`` output layer.
        bh, bo: optional biases ``[L, H]``, ``[N]``.
        s: optional ``[P]`` factor per row (a cutoff).
        precision: ``"ieee"`` or ``"tf32x3"`` (module docstring); float64 runs ``"ieee"``.

    Raises:
        ValueError: weights that require gradients (no weight gradients here), or shapes
            and dtypes that do not fit.
    """
    if any(t is not None and t.requires_grad for t in (wh, wo, bh, bo)):
        raise ValueError("radial_mlp: weights that require gradients (the fused radial MLP "
                         "is for inference; train through the torch layers)")
    return torch.ops.xnn.radial_mlp(x, wh, bh, wo, bo, s, precision)


def radial_mlp_backward(g: Tensor, x: Tensor, wh: Tensor, bh: Tensor | None, wo: Tensor,
                        bo: Tensor | None, s: Tensor | None, precision: str = "ieee",
                        need_s: bool = True) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`radial_mlp` in ``x`` and ``s`` (operator
    ``xnn::radial_mlp_backward``; not differentiable)."""
    return torch.ops.xnn.radial_mlp_backward(g, x, wh, bh, wo, bo, s, precision, need_s)


# ---- packing the layers of a network

def fused(x: Tensor, layers: list[tuple[Tensor, Tensor | None]], post_scales: list[float],
          s: Tensor | None, precision: str) -> Tensor | None:
    """:func:`radial_mlp` of the network ``layers`` (see :func:`pack`), or ``None`` when the
    kernels cannot take it (no hidden layer, or one wider than :data:`MAX_WIDTH`) or would
    not gain (float64 on CUDA: it runs the ``"ieee"`` products, slower than cuBLAS even in
    fp32, benchmarks/results/README.md, Kernels): the caller then runs its own layers."""
    widths = [a.shape[0] for a, _ in layers]  # inputs of every layer: D0 and hidden widths
    if len(layers) < 2 or max(widths) > MAX_WIDTH or (x.is_cuda and x.dtype == torch.float64):
        return None
    wh, bh, wo, bo = pack(layers, post_scales)
    return radial_mlp(x, wh, wo, bh, bo, s, precision)


def pack(layers: list[tuple[Tensor, Tensor | None]], post_scales: list[float] | None = None
         ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """``(wh, bh, wo, bo)`` for :func:`radial_mlp` from ``[(A_i [d_in, d_out], b_i), ...]``
    (the last one the output layer; row-vector convention ``h @ A``), SiLU between them.

    ``post_scales[i]``: a constant the hidden layer ``i``'s activation is multiplied by
    (e3nn's normalised SiLU): folded into the next layer's matrix. Widths are padded with
    zeros to one power of two ``H >= 16`` (``silu(0) = 0``: padded units stay zero).
    """
    *hidden, (a_out, b_out) = layers
    if not hidden:
        raise ValueError("radial_mlp: needs at least one hidden layer")
    scales = post_scales or [1.0] * len(hidden)
    widths = [hidden[0][0].shape[0]] + [a.shape[1] for a, _ in hidden]
    width = max(16, triton.next_power_of_2(max(widths)))
    if width > MAX_WIDTH:
        raise ValueError(f"radial_mlp: hidden width {max(widths)} above {MAX_WIDTH}")
    ref = a_out
    wh = ref.new_zeros((len(hidden), width, width))
    with_bias = any(b is not None for _, b in layers)
    bh = ref.new_zeros((len(hidden), width)) if with_bias else None
    for i, (a, b) in enumerate(hidden):
        scale = scales[i - 1] if i else 1.0
        wh[i, : a.shape[0], : a.shape[1]] = a * scale
        if b is not None:
            bh[i, : b.shape[0]] = b
    wo = ref.new_zeros((width, a_out.shape[1]))
    wo[: a_out.shape[0]] = a_out * scales[-1]
    bo = None
    if with_bias:
        bo = b_out if b_out is not None else ref.new_zeros(a_out.shape[1])
    return wh, bh, wo, bo
