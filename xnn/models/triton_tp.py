"""Fused Triton kernels for the edge tensor product's weighted batched matmul (the ``triton``
kernel backend of :class:`~xnn.models.equivariant_ops.EdgeTensorProduct`).

The reference path evaluates, per group of paths with the same ``l1``,

    ``out[e, c, k] = Σ_{p, a} w[e, c, p] x[e, c, a] m[e, p*A + a, k]``

as ``torch.bmm(Z, m)`` with ``Z = w ⊗ x`` materialised as ``[E, C, P*A]``: per edge a tiny
``[C, P*A] @ [P*A, K]`` product (``K = 9``, ``P*A <= 20`` for ``l_max = 2``), far from the
GPU's peak, plus ``Z`` itself and its reductions in backward. Here one kernel computes ``out``
with ``Z`` formed in registers, and one kernel all three gradients:

* ``t[e, c, pa] = Σ_k g[e, c, k] m[e, pa, k]``
* ``grad_w[e, c, p] = Σ_a x[e, c, a] t[e, c, pa]``
* ``grad_x[e, c, a] = Σ_p w[e, c, p] t[e, c, pa]``
* ``grad_m[e, pa, k] = Σ_c w[e, c, p] x[e, c, a] g[e, c, k]`` (a reduction over channels inside
  each program; with more than :data:`MAX_BLOCK_C` channels, per channel block, then summed).

One call may cover several groups of paths (``groups``, up to :data:`MAX_GROUPS`): the
edge tensor product passes all its groups (``l1 = 0 .. l_in``) at once, with the whole
``w [E, C, n_paths]``, ``x [E, C, (l_in+1)^2]`` and the stacked ``m``, so the kernel writes
the summed messages once and the backward kernel reads ``g`` once and writes whole
``grad_w``/``grad_x`` (no per-group outputs to add, no slices to scatter back).

A program handles ``BLOCK_E`` edges times a block of ``BLOCK_C`` channels (all of them up to
:data:`MAX_BLOCK_C`); the group sizes and ``K`` are compile-time constants (``K`` padded to
a power of two under a mask); edge offsets are 64-bit. Accumulation is in the tensors'
dtype (float32 or float64, FMA), so the result equals the reference to rounding.

Both are ``torch.library`` operators (``xnn::weighted_bmm``, ``xnn::weighted_bmm_backward``,
via :func:`torch.library.triton_op`), so ``torch.compile(fullgraph=True)``, ``make_fx`` (the
compiled MD step and compiled training) and CUDA-graph capture see them without graph breaks.
The backward operator has its own autograd formula written with the two operators (double
backward for force training, any order), so no derivative falls back to ``Z``.

Devices: CUDA tensors run the kernels. CPU tensors run the reference formula, except when
Triton's interpreter is requested (``TRITON_INTERPRET=1`` in the environment when the
operator is *called*): then the same kernels run on the CPU through
``triton.runtime.interpreter`` (slow; the tests use it to check the kernels without a GPU).
Importing this module needs the ``triton`` package (``pip install triton``; CUDA builds of
torch ship it); :func:`xnn.models.cueq.check_backend` refuses ``triton`` without it.
"""

from __future__ import annotations

import os
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

MAX_BLOCK_C = 128  # channels per program; beyond, a second grid axis over channel blocks
MAX_GROUPS = 4  # groups of paths per call (l1 = 0..3)
TILE_ELEMENTS = 4096  # BLOCK_E * BLOCK_C * K_PAD per program on a GPU (registers)
INTERPRETER_TILE_ELEMENTS = 1 << 16  # the CPU interpreter: fewer, larger programs
NUM_WARPS = 4


def _fwd_kernel(w_ptr, x_ptr, m_ptr, out_ptr, n_edges, n_channels,
                sw_e, sw_c, sw_p, sx_e, sx_c, sx_a, sm_e, sm_r, sm_k,
                P0: tl.constexpr, A0: tl.constexpr, X0: tl.constexpr,
                P1: tl.constexpr, A1: tl.constexpr, X1: tl.constexpr,
                P2: tl.constexpr, A2: tl.constexpr, X2: tl.constexpr,
                P3: tl.constexpr, A3: tl.constexpr, X3: tl.constexpr,
                K: tl.constexpr, K_PAD: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    """``out [E, C, K]`` (contiguous) ``= Σ_g Σ_{p,a} w[e,c,W_g+p] x[e,c,X_g+a]
    m[e,R_g+p*A_g+a,k]`` for the groups ``(P_g, A_g, X_g)`` (``P_g = 0``: none)."""
    e = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, K_PAD)
    mask_ec = (e < n_edges)[:, None] & (c < n_channels)[None, :]
    mask_ek = (e < n_edges)[:, None] & (k < K)[None, :]
    w_row = w_ptr + e[:, None] * sw_e + c[None, :] * sw_c
    x_row = x_ptr + e[:, None] * sx_e + c[None, :] * sx_c
    m_row = m_ptr + e[:, None] * sm_e + k[None, :] * sm_k
    acc = tl.full((BLOCK_E, BLOCK_C, K_PAD), 0.0, out_ptr.dtype.element_ty)
    PS: tl.constexpr = (P0, P1, P2, P3)
    AS: tl.constexpr = (A0, A1, A2, A3)
    XS: tl.constexpr = (X0, X1, X2, X3)
    WS: tl.constexpr = (0, P0, P0 + P1, P0 + P1 + P2)
    RS: tl.constexpr = (0, P0 * A0, P0 * A0 + P1 * A1, P0 * A0 + P1 * A1 + P2 * A2)
    for gi in tl.static_range(4):
        for p in tl.static_range(PS[gi]):
            wp = tl.load(w_row + (WS[gi] + p) * sw_p, mask=mask_ec, other=0.0)
            for a in tl.static_range(AS[gi]):
                z = wp * tl.load(x_row + (XS[gi] + a) * sx_a, mask=mask_ec, other=0.0)
                mr = tl.load(m_row + (RS[gi] + p * AS[gi] + a) * sm_r, mask=mask_ek, other=0.0)
                acc += z[:, :, None] * mr[:, None, :]
    out = out_ptr + e[:, None, None] * (n_channels * K) + c[None, :, None] * K + k[None, None, :]
    tl.store(out, acc, mask=mask_ec[:, :, None] & (k < K)[None, None, :])


def _bwd_kernel(g_ptr, w_ptr, x_ptr, m_ptr, gw_ptr, gx_ptr, gm_ptr, n_edges, n_channels,
                sg_e, sg_c, sg_k, sw_e, sw_c, sw_p, sx_e, sx_c, sx_a, sm_e, sm_r, sm_k,
                P0: tl.constexpr, A0: tl.constexpr, X0: tl.constexpr,
                P1: tl.constexpr, A1: tl.constexpr, X1: tl.constexpr,
                P2: tl.constexpr, A2: tl.constexpr, X2: tl.constexpr,
                P3: tl.constexpr, A3: tl.constexpr, X3: tl.constexpr,
                K: tl.constexpr, K_PAD: tl.constexpr, DX: tl.constexpr, DX_PAD: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                NEED_W: tl.constexpr, NEED_X: tl.constexpr, NEED_M: tl.constexpr):
    """The gradients of :func:`_fwd_kernel` for the output gradient ``g [E, C, K]``:
    ``gw [E, C, ΣP]``, ``gx [E, C, DX]`` (columns of no group: zero) and the partial
    ``gm [n_channel_blocks, E, ΣPA, K]`` of this channel block (all contiguous; each
    written only where ``NEED_*``)."""
    e = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    cb = tl.program_id(1).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, K_PAD)
    xi = tl.arange(0, DX_PAD)
    mask_e = e < n_edges
    mask_ec = mask_e[:, None] & (c < n_channels)[None, :]
    mask_ek = mask_e[:, None] & (k < K)[None, :]
    dtype = g_ptr.dtype.element_ty
    NP: tl.constexpr = P0 + P1 + P2 + P3
    R: tl.constexpr = P0 * A0 + P1 * A1 + P2 * A2 + P3 * A3
    g = tl.load(g_ptr + e[:, None, None] * sg_e + c[None, :, None] * sg_c
                + k[None, None, :] * sg_k, mask=mask_ec[:, :, None] & (k < K)[None, None, :],
                other=0.0)
    w_row = w_ptr + e[:, None] * sw_e + c[None, :] * sw_c
    x_row = x_ptr + e[:, None] * sx_e + c[None, :] * sx_c
    m_row = m_ptr + e[:, None] * sm_e + k[None, :] * sm_k
    gx_acc = tl.full((BLOCK_E, BLOCK_C, DX_PAD), 0.0, dtype)
    PS: tl.constexpr = (P0, P1, P2, P3)
    AS: tl.constexpr = (A0, A1, A2, A3)
    XS: tl.constexpr = (X0, X1, X2, X3)
    WS: tl.constexpr = (0, P0, P0 + P1, P0 + P1 + P2)
    RS: tl.constexpr = (0, P0 * A0, P0 * A0 + P1 * A1, P0 * A0 + P1 * A1 + P2 * A2)
    for gi in tl.static_range(4):
        for p in tl.static_range(PS[gi]):
            wp = tl.load(w_row + (WS[gi] + p) * sw_p, mask=mask_ec, other=0.0)
            gw_acc = tl.full((BLOCK_E, BLOCK_C), 0.0, dtype)
            for a in tl.static_range(AS[gi]):
                xa = tl.load(x_row + (XS[gi] + a) * sx_a, mask=mask_ec, other=0.0)
                if NEED_W or NEED_X:
                    mr = tl.load(m_row + (RS[gi] + p * AS[gi] + a) * sm_r, mask=mask_ek, other=0.0)
                    t = tl.reduce(g * mr[:, None, :], 2, tl.standard._sum_combine)  # [E, C]
                    if NEED_W:
                        gw_acc += xa * t
                    if NEED_X:
                        gx_acc += tl.where(xi[None, None, :] == XS[gi] + a, (wp * t)[:, :, None],
                                           0.0)
                if NEED_M:
                    # [BLOCK_E, K_PAD]: the channel reduction of this program
                    gm_pa = tl.reduce((wp * xa)[:, :, None] * g, 1, tl.standard._sum_combine)
                    gm = (gm_ptr + cb * n_edges * (R * K) + e[:, None] * (R * K)
                          + (RS[gi] + p * AS[gi] + a) * K + k[None, :])
                    tl.store(gm, gm_pa, mask=mask_ek)
            if NEED_W:
                tl.store(gw_ptr + e[:, None] * (n_channels * NP) + c[None, :] * NP + WS[gi] + p,
                         gw_acc, mask=mask_ec)
    if NEED_X:
        gx = (gx_ptr + e[:, None, None] * (n_channels * DX) + c[None, :, None] * DX
              + xi[None, None, :])
        tl.store(gx, gx_acc, mask=mask_ec[:, :, None] & (xi < DX)[None, None, :])


# n_edges changes at every neighbor-list rebuild: specialising on it (Triton's default for
# integers: divisibility by 16, == 1) recompiled the kernels during eager MD (on an H200, 10,976
# atoms: 0.31 s per step over 18 steps, against 0.042 s without specialisation)
_FWD = triton.jit(_fwd_kernel, do_not_specialize=["n_edges"])
_BWD = triton.jit(_bwd_kernel, do_not_specialize=["n_edges"])


@cache
def _interpreted(fn):
    """The CPU interpreter's version of a kernel (independent of how ``triton.jit`` was
    configured when this module was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def _interpreting(*tensors: Tensor) -> bool:
    """CPU tensors with ``TRITON_INTERPRET=1``: run the kernels in Triton's interpreter (never
    on fake tensors, whose shapes the reference formula gives)."""
    from torch._subclasses.fake_tensor import is_fake

    return (os.environ.get("TRITON_INTERPRET", "0") == "1"
            and all(t.device.type == "cpu" and not is_fake(t) for t in tensors))


def _tiling(n_edges: int, channels: int, k_pad: int, interpret: bool, block_e: int | None
            ) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_C, n_channel_blocks)``: powers of two, ``BLOCK_E * BLOCK_C * K_PAD``
    about :data:`TILE_ELEMENTS` unless ``block_e`` is given (in the interpreter, at most
    ``n_edges`` rounded up: its cost is that of the whole tile)."""
    block_c = min(triton.next_power_of_2(channels), MAX_BLOCK_C)
    if block_e is None:
        tile = INTERPRETER_TILE_ELEMENTS if interpret else TILE_ELEMENTS
        block_e = max(1, tile // (block_c * k_pad))
        block_e = 1 << (block_e.bit_length() - 1)  # floor to a power of two
        if interpret:
            block_e = min(block_e, triton.next_power_of_2(max(n_edges, 1)))
    return block_e, block_c, triton.cdiv(channels, block_c)


Groups = list[tuple[int, int, int]]


def _groups(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None) -> Groups:
    """Validated ``[(P_g, A_g, X_g)]`` from the flat list (``None``: one group, all of
    ``w`` and ``x``)."""
    (e, c, n_paths), dx, (_, rows, _) = w.shape, x.shape[2], m.shape
    if groups is None:
        out = [(n_paths, dx, 0)]
    else:
        out = [tuple(int(v) for v in groups[i : i + 3]) for i in range(0, len(groups), 3)]
    if (x.shape[:2] != (e, c) or m.shape[0] != e or not 1 <= len(out) <= MAX_GROUPS
            or len(groups or [0, 0, 0]) % 3 or sum(p for p, _, _ in out) != n_paths
            or sum(p * a for p, a, _ in out) != rows
            or any(p < 1 or a < 1 or xo < 0 or xo + a > dx for p, a, xo in out)):
        raise ValueError(f"weighted_bmm: w {tuple(w.shape)}, x {tuple(x.shape)} and m "
                         f"{tuple(m.shape)} do not fit [E, C, ΣP], [E, C, DX], [E, ΣPA, K] "
                         f"with at most {MAX_GROUPS} groups (P, A, X) {out}")
    if not (w.dtype == x.dtype == m.dtype):
        raise ValueError(f"weighted_bmm: dtypes differ ({w.dtype}, {x.dtype}, {m.dtype})")
    return out


def _offsets(groups: Groups) -> list[tuple[int, int, int, int, int]]:
    """``(P, A, X, W, R)`` per group: ``W`` its first column of ``w``, ``R`` row of ``m``."""
    out, wo, ro = [], 0, 0
    for p, a, xo in groups:
        out.append((p, a, xo, wo, ro))
        wo, ro = wo + p, ro + p * a
    return out


def _constexprs(groups: Groups) -> dict[str, int]:
    padded = list(groups) + [(0, 1, 0)] * (MAX_GROUPS - len(groups))
    return {f"{n}{i}": v for i, grp in enumerate(padded) for n, v in zip("PAX", grp)}


def reference(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None) -> Tensor:
    """``out[e, c, k] = Σ_g Σ_{p,a} w[e,c,W_g+p] x[e,c,X_g+a] m[e,R_g+p*A_g+a,k]`` with plain
    torch ops (per group the formula of :func:`~xnn.models.equivariant_ops._weighted_bmm`)."""
    e, c = x.shape[:2]
    out = None
    for p, a, xo, wo, ro in _offsets(_groups(w, x, m, groups)):
        z = (w[:, :, wo : wo + p, None] * x[:, :, None, xo : xo + a]).reshape(e, c, p * a)
        t = torch.bmm(z, m[:, ro : ro + p * a])
        out = t if out is None else out + t
    return out


def forward(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None,
            block_e: int | None = None, num_warps: int = NUM_WARPS) -> Tensor:
    """The forward kernel (no autograd; :func:`weighted_bmm` is the differentiable operator).

    Args:
        w: ``[E, C, ΣP]`` per-path weights (any strides).
        x: ``[E, C, DX]`` features (any strides).
        m: ``[E, ΣPA, K]`` per-edge coupling matrices (any strides).
        groups: flat ``[P_0, A_0, X_0, P_1, ...]``, at most :data:`MAX_GROUPS` groups:
            group ``g`` pairs the next ``P_g`` columns of ``w`` with columns
            ``X_g .. X_g + A_g - 1`` of ``x`` and the next ``P_g * A_g`` rows of ``m``;
            ``None``: one group ``(ΣP, DX, 0)``, i.e. ``_weighted_bmm(w, x, m)``.
        block_e, num_warps: tiling override (benchmarks); default about
            :data:`TILE_ELEMENTS` per program.

    Returns:
        ``[E, C, K]`` (contiguous, dtype of the inputs).
    """
    grp = _groups(w, x, m, groups)
    interpret = _interpreting(w, x, m)
    if w.device.type != "cuda" and not interpret:
        return reference(w, x, m, groups)
    (e, c), k = x.shape[:2], m.shape[2]
    out = torch.empty((e, c, k), dtype=w.dtype, device=w.device)
    k_pad = triton.next_power_of_2(k)
    block_e, block_c, n_cb = _tiling(e, c, k_pad, interpret, block_e)
    grid = (triton.cdiv(e, block_e), n_cb)  # no edges: an empty grid, no launch
    kernel = _interpreted(_fwd_kernel) if interpret else wrap_triton(_FWD)
    kernel[grid](
        w, x, m, out, e, c, *w.stride(), *x.stride(), *m.stride(), **_constexprs(grp), K=k,
        K_PAD=k_pad, BLOCK_E=block_e, BLOCK_C=block_c, num_warps=num_warps)
    return out


def backward(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None,
             need_w: bool = True, need_x: bool = True, need_m: bool = True,
             block_e: int | None = None, num_warps: int = NUM_WARPS
             ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel (no autograd; :func:`weighted_bmm_backward` is the operator).

    Args:
        g: ``[E, C, K]`` gradient of the output (any strides, e.g. expanded).
        w, x, m, groups: the inputs of :func:`forward`.
        need_w, need_x, need_m: which gradients to compute; the others come back as empty
            tensors (``[0]``).

    Returns:
        ``grad_w [E, C, ΣP]``, ``grad_x [E, C, DX]``, ``grad_m [E, ΣPA, K]`` (contiguous).
    """
    grp = _groups(w, x, m, groups)
    (e, c, n_paths), dx, (_, rows, k) = w.shape, x.shape[2], m.shape
    if g.shape != (e, c, k) or g.dtype != w.dtype:
        raise ValueError(f"weighted_bmm_backward: gradient {tuple(g.shape)} {g.dtype} for an "
                         f"output {(e, c, k)} {w.dtype}")
    interpret = _interpreting(g, w, x, m)
    if w.device.type != "cuda" and not interpret:
        return _reference_backward(g, w, x, m, grp, need_w, need_x, need_m)
    k_pad = triton.next_power_of_2(k)
    block_e, block_c, n_cb = _tiling(e, c, k_pad, interpret, block_e)
    gw = w.new_empty((e, c, n_paths) if need_w else (0,))  # outputs never alias each other
    gx = w.new_empty((e, c, dx) if need_x else (0,))
    gm = w.new_empty(((n_cb,) if n_cb > 1 else ()) + (e, rows, k) if need_m else (0,))
    if need_w or need_x or need_m:
        grid = (triton.cdiv(e, block_e), n_cb)  # no edges: an empty grid, no launch
        kernel = _interpreted(_bwd_kernel) if interpret else wrap_triton(_BWD)
        kernel[grid](
            g, w, x, m, gw, gx, gm, e, c, *g.stride(), *w.stride(), *x.stride(), *m.stride(),
            **_constexprs(grp), K=k, K_PAD=k_pad, DX=dx,
            DX_PAD=max(triton.next_power_of_2(dx), 2), BLOCK_E=block_e, BLOCK_C=block_c,
            NEED_W=need_w, NEED_X=need_x, NEED_M=need_m, num_warps=num_warps)
    if need_m and n_cb > 1:
        gm = gm.sum(0)
    return gw, gx, gm


def _reference_backward(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: Groups,
                        need_w: bool, need_x: bool, need_m: bool
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`backward` with torch ops (CPU tensors, fake tensors)."""
    e, c = x.shape[:2]
    gws, gms = [], []
    gx = torch.zeros_like(x, memory_format=torch.contiguous_format) if need_x else None
    for p, a, xo, wo, ro in _offsets(groups):
        wg, xg, mg = w[:, :, wo : wo + p], x[:, :, xo : xo + a], m[:, ro : ro + p * a]
        t = torch.bmm(g, mg.transpose(1, 2)).view(e, c, p, a)  # [E, C, P, A]
        if need_w:
            gws.append((t * xg[:, :, None, :]).sum(-1))
        if need_x:
            gx[:, :, xo : xo + a] += (t * wg[:, :, :, None]).sum(-2)
        if need_m:
            z = (wg[:, :, :, None] * xg[:, :, None, :]).reshape(e, c, p * a)
            gms.append(torch.bmm(z.transpose(1, 2), g))
    gw = torch.cat(gws, 2) if need_w else w.new_empty(0)
    gm = torch.cat(gms, 1) if need_m else w.new_empty(0)
    return gw, gx if need_x else w.new_empty(0), gm


@torch.library.triton_op("xnn::weighted_bmm", mutates_args=())
def _weighted_bmm_op(w: Tensor, x: Tensor, m: Tensor, groups: list[int]) -> Tensor:
    return forward(w, x, m, groups)


@torch.library.triton_op("xnn::weighted_bmm_backward", mutates_args=())
def _weighted_bmm_backward_op(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: list[int],
                              need_w: bool, need_x: bool, need_m: bool
                              ) -> tuple[Tensor, Tensor, Tensor]:
    return backward(g, w, x, m, groups, need_w, need_x, need_m)


def weighted_bmm(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None) -> Tensor:
    """``out[e, c, k] = Σ_{p,a} w[e,c,p] x[e,c,a] m[e,p*A+a,k]`` (the operator
    ``xnn::weighted_bmm``), differentiable to any order; with ``groups`` (see
    :func:`forward`) the sum of such products over groups of paths in one kernel.

    Shapes:
        ``w [E, C, P]``, ``x [E, C, A]``, ``m [E, P*A, K]`` -> ``[E, C, K]`` (groups:
        ``w [E, C, ΣP]``, ``x [E, C, DX]``, ``m [E, ΣPA, K]``); float32 or float64, all the
        same dtype and device.
    """
    if groups is None:
        groups = [w.shape[2], x.shape[2], 0]
    return torch.ops.xnn.weighted_bmm(w, x, m, list(groups))


def weighted_bmm_backward(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: list[int],
                          need_w: bool = True, need_x: bool = True, need_m: bool = True
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`weighted_bmm` (operator ``xnn::weighted_bmm_backward``), see
    :func:`backward`; differentiable."""
    return torch.ops.xnn.weighted_bmm_backward(g, w, x, m, list(groups), need_w, need_x,
                                               need_m)


def _setup_forward(ctx, inputs, output):
    w, x, m, groups = inputs
    ctx.save_for_backward(w, x, m)
    ctx.groups = groups


def _forward_grad(ctx, g):
    w, x, m = ctx.saved_tensors
    need_w, need_x, need_m = ctx.needs_input_grad[:3]
    if not (need_w or need_x or need_m):
        return None, None, None, None
    gw, gx, gm = weighted_bmm_backward(g, w, x, m, ctx.groups, need_w, need_x, need_m)
    return gw if need_w else None, gx if need_x else None, gm if need_m else None, None


def _setup_backward(ctx, inputs, output):
    g, w, x, m, groups, need_w, need_x, need_m = inputs
    ctx.save_for_backward(g, w, x, m)
    ctx.groups, ctx.computed = groups, (need_w, need_x, need_m)


def _used(h: Tensor | None, computed: bool) -> Tensor | None:
    return h if computed and h is not None and h.numel() > 0 else None


def _add(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


def _backward_grad(ctx, hw, hx, hm):
    """The derivative of the gradients (double backward), with both operators. For output
    gradients ``hw, hx, hm`` of ``grad_w, grad_x, grad_m``:

    * ``d g = wbmm(hw, x, m) + wbmm(w, hx, m) + wbmm(w, x, hm)``
    * ``d w = grad_w(g; w, hx, m) + grad_w(g; w, x, hm)``
    * ``d x = grad_x(g; hw, x, m) + grad_x(g; w, x, hm)``
    * ``d m = grad_m(g; hw, x, m) + grad_m(g; w, hx, m)``

    (every gradient is linear in each of ``g, w, x, m``).
    """
    g, w, x, m = ctx.saved_tensors
    groups = ctx.groups
    hw, hx, hm = (_used(h, done) for h, done in zip((hw, hx, hm), ctx.computed))
    need_g, need_w, need_x, need_m = ctx.needs_input_grad[:4]
    dg = dw = dx = dm = None
    if need_g:
        for args in ((hw, x, m), (w, hx, m), (w, x, hm)):
            if args[0] is not None and args[1] is not None and args[2] is not None:
                dg = _add(dg, weighted_bmm(*args, groups))
    if hm is not None and (need_w or need_x):  # grad_w, grad_x of (g; w, x, hm)
        gw, gx, _ = weighted_bmm_backward(g, w, x, hm, groups, need_w, need_x, False)
        dw, dx = (gw if need_w else None), (gx if need_x else None)
    if hw is not None and (need_x or need_m):  # grad_x, grad_m of (g; hw, x, m)
        _, gx, gm = weighted_bmm_backward(g, hw, x, m, groups, False, need_x, need_m)
        dx, dm = _add(dx, gx if need_x else None), gm if need_m else None
    if hx is not None and (need_w or need_m):  # grad_w, grad_m of (g; w, hx, m)
        gw, _, gm = weighted_bmm_backward(g, w, hx, m, groups, need_w, False, need_m)
        dw, dm = _add(dw, gw if need_w else None), _add(dm, gm if need_m else None)
    return dg, dw, dx, dm, None, None, None, None


_weighted_bmm_op.register_autograd(_forward_grad, setup_context=_setup_forward)
_weighted_bmm_backward_op.register_autograd(_backward_grad, setup_context=_setup_backward)
