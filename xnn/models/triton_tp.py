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

A program handles a tile of edges times channels (all channels up to :data:`MAX_BLOCK_C`).
The forward accumulates ``[BLOCK_E, BLOCK_C, K_PAD]`` (``K`` padded to a power of two under
a mask; each row of ``m`` is one vector load per edge); the backward holds the ``K`` columns
of ``g`` as ``K`` separate ``[BLOCK_E, BLOCK_C]`` tiles (no padding; ``m`` read as one value
per edge). The group sizes and ``K`` are
compile-time constants; edge offsets are 64-bit. Accumulation is in the tensors' dtype
(float32 or float64, FMA), so the result equals the reference to rounding.

The fused convolution :func:`tp_conv` (``xnn::tp_conv``) runs the same kernels with the
gather of the senders' features (``x = h[sender]``) and the scatter of the messages into the
receivers inside them: rows are read through the index, the messages are added into the
receivers with atomics, and in backward ``g`` is read by receiver and ``grad_h`` is added by
sender. Neither ``h[sender]`` nor the per-edge messages or their gradients exist.

All are ``torch.library`` operators (``xnn::weighted_bmm``, ``xnn::weighted_bmm_backward``,
``xnn::tp_conv``, ``xnn::tp_conv_backward``, via :func:`torch.library.triton_op`), so
``torch.compile(fullgraph=True)``, ``make_fx`` (the
compiled MD step and compiled training) and CUDA-graph capture see them without graph breaks.
The backward operators have their own autograd formulas written with the edge operators
(double backward for force training, any order), so no derivative falls back to ``Z``.

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
# Elements per program on a GPU and warps per program: forward BLOCK_E * BLOCK_C * K_PAD (its
# accumulator; the fastest of a sweep at C = 64, triton_tp_h200.json), backward BLOCK_E * BLOCK_C.
# The backward holds the K columns of g and reduces grad_m over channels: one warp per
# program keeps those reductions within a warp (Triton places a program's warps along the
# channels, and more warps would add a shared-memory round trip with barriers per reduction).
FWD_TILE, FWD_WARPS = 2048, 4
BWD_TILE, BWD_WARPS = 128, 1
INTERPRETER_TILE_ELEMENTS = 1 << 12  # the CPU interpreter: fewer, larger programs


def _fwd_kernel(w_ptr, x_ptr, m_ptr, out_ptr, xi_ptr, oi_ptr, n_edges, n_channels, n_out,
                sw_e, sw_c, sw_p, sx_e, sx_c, sx_a, sm_e, sm_r, sm_k, so_e, so_c, so_k,
                P0: tl.constexpr, A0: tl.constexpr, X0: tl.constexpr,
                P1: tl.constexpr, A1: tl.constexpr, X1: tl.constexpr,
                P2: tl.constexpr, A2: tl.constexpr, X2: tl.constexpr,
                P3: tl.constexpr, A3: tl.constexpr, X3: tl.constexpr,
                K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_C: tl.constexpr, GATHER_X: tl.constexpr, SCATTER: tl.constexpr):
    """``out[o(e), c, k] (+)= Σ_g Σ_{p,a} w[e,c,W_g+p] x[s(e),c,X_g+a] m[e,R_g+p*A_g+a,k]``
    for the groups ``(P_g, A_g, X_g)`` (``P_g = 0``: none); ``s(e) = xi[e]`` with
    ``GATHER_X`` (else ``e``), ``o(e) = oi[e]`` and an atomic add with ``SCATTER`` (else ``e``
    and a store). The accumulator is a ``[BLOCK_E, BLOCK_C, K_PAD]`` tile (``K`` padded to a
    power of two under a mask): each row of ``m`` is one vector load per edge, and each
    product ``z = w x`` one broadcast multiply-add over ``K``."""
    e = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    k = tl.arange(0, K_PAD)
    mask_e = e < n_edges
    xr = tl.load(xi_ptr + e, mask=mask_e, other=0).to(tl.int64) if GATHER_X else e
    if SCATTER:
        orow = tl.load(oi_ptr + e, mask=mask_e, other=0).to(tl.int64)
        mask_o = mask_e & (orow >= 0) & (orow < n_out)
    else:
        orow, mask_o = e, mask_e
    mask_ec = mask_e[:, None] & (c < n_channels)[None, :]
    mask_ek = mask_e[:, None] & (k < K)[None, :]
    w_row = w_ptr + e[:, None] * sw_e + c[None, :] * sw_c
    x_row = x_ptr + xr[:, None] * sx_e + c[None, :] * sx_c
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
    out = (out_ptr + orow[:, None, None] * so_e + c[None, :, None] * so_c
           + k[None, None, :] * so_k)
    mask = ((mask_o[:, None] & (c < n_channels)[None, :])[:, :, None]
            & (k < K)[None, None, :])
    if SCATTER:
        tl.atomic_add(out, acc, mask=mask, sem="relaxed")
    else:
        tl.store(out, acc, mask=mask)


def _bwd_kernel(g_ptr, w_ptr, x_ptr, m_ptr, gw_ptr, gx_ptr, gm_ptr, xi_ptr, gi_ptr,
                n_edges, n_channels, n_g,
                sg_e, sg_c, sg_k, sw_e, sw_c, sw_p, sx_e, sx_c, sx_a, sm_e, sm_r, sm_k,
                sgx_e, sgx_c, sgx_a,
                P0: tl.constexpr, A0: tl.constexpr, X0: tl.constexpr,
                P1: tl.constexpr, A1: tl.constexpr, X1: tl.constexpr,
                P2: tl.constexpr, A2: tl.constexpr, X2: tl.constexpr,
                P3: tl.constexpr, A3: tl.constexpr, X3: tl.constexpr,
                K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,
                GATHER_X: tl.constexpr, GATHER_G: tl.constexpr, GX_ADD: tl.constexpr,
                NEED_W: tl.constexpr, NEED_X: tl.constexpr, NEED_M: tl.constexpr):
    """The gradients of :func:`_fwd_kernel` for the output gradient ``g`` (rows ``o(e) =
    gi[e]`` with ``GATHER_G``, else ``e``): ``gw [E, C, ΣP]`` (contiguous), ``gx`` (rows
    ``s(e)``, strides ``sgx_*``; an atomic add with ``GX_ADD``, else a store) and the partial
    ``gm [n_channel_blocks, E, ΣPA, K]`` of this channel block (contiguous); each written only
    where ``NEED_*``. ``g``'s ``K`` columns are held as separate tiles (a tuple)."""
    e = (tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    cb = tl.program_id(1).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_e = e < n_edges
    xr = tl.load(xi_ptr + e, mask=mask_e, other=0).to(tl.int64) if GATHER_X else e
    if GATHER_G:
        grow = tl.load(gi_ptr + e, mask=mask_e, other=0).to(tl.int64)
        mask_g = mask_e & (grow >= 0) & (grow < n_g)  # edges without a receiver: g = 0
    else:
        grow, mask_g = e, mask_e
    mask_ec = mask_e[:, None] & (c < n_channels)[None, :]
    mask_gc = mask_g[:, None] & (c < n_channels)[None, :]
    NP: tl.constexpr = P0 + P1 + P2 + P3
    R: tl.constexpr = P0 * A0 + P1 * A1 + P2 * A2 + P3 * A3
    g_row = g_ptr + grow[:, None] * sg_e + c[None, :] * sg_c
    gs = ()
    for k in tl.static_range(K):
        gs = gs + (tl.load(g_row + k * sg_k, mask=mask_gc, other=0.0),)
    w_row = w_ptr + e[:, None] * sw_e + c[None, :] * sw_c
    x_row = x_ptr + xr[:, None] * sx_e + c[None, :] * sx_c
    m_row = m_ptr + e * sm_e
    gm_row = gm_ptr + cb * n_edges * (R * K) + e * (R * K)
    dtype = g_ptr.dtype.element_ty
    PS: tl.constexpr = (P0, P1, P2, P3)
    AS: tl.constexpr = (A0, A1, A2, A3)
    XS: tl.constexpr = (X0, X1, X2, X3)
    WS: tl.constexpr = (0, P0, P0 + P1, P0 + P1 + P2)
    RS: tl.constexpr = (0, P0 * A0, P0 * A0 + P1 * A1, P0 * A0 + P1 * A1 + P2 * A2)
    for gi in tl.static_range(4):
        xs = ()
        gxs = ()
        for a in tl.static_range(AS[gi] if PS[gi] > 0 else 0):
            xs = xs + (tl.load(x_row + (XS[gi] + a) * sx_a, mask=mask_ec, other=0.0),)
            gxs = gxs + (tl.full((BLOCK_E, BLOCK_C), 0.0, dtype),)
        for p in tl.static_range(PS[gi]):
            wp = tl.load(w_row + (WS[gi] + p) * sw_p, mask=mask_ec, other=0.0)
            gw_acc = tl.full((BLOCK_E, BLOCK_C), 0.0, dtype)
            upd = ()
            for a in tl.static_range(AS[gi]):
                r = RS[gi] + p * AS[gi] + a
                if NEED_W or NEED_X:
                    t = tl.full((BLOCK_E, BLOCK_C), 0.0, dtype)
                    for k in tl.static_range(K):
                        mk = tl.load(m_row + r * sm_r + k * sm_k, mask=mask_e, other=0.0)
                        t += gs[k] * mk[:, None]
                    if NEED_W:
                        gw_acc += xs[a] * t
                    if NEED_X:
                        upd = upd + (gxs[a] + wp * t,)
                if NEED_M:
                    z = wp * xs[a]
                    for k in tl.static_range(K):
                        gm_k = tl.reduce(z * gs[k], 1, tl.standard._sum_combine)
                        tl.store(gm_row + r * K + k, gm_k, mask=mask_e)
            if NEED_X:
                gxs = upd
            if NEED_W:
                tl.store(gw_ptr + e[:, None] * (n_channels * NP) + c[None, :] * NP + WS[gi] + p,
                         gw_acc, mask=mask_ec)
        if NEED_X:
            gx_row = gx_ptr + xr[:, None] * sgx_e + c[None, :] * sgx_c
            for a in tl.static_range(AS[gi] if PS[gi] > 0 else 0):
                if GX_ADD:
                    tl.atomic_add(gx_row + (XS[gi] + a) * sgx_a, gxs[a], mask=mask_ec,
                                  sem="relaxed")
                else:
                    tl.store(gx_row + (XS[gi] + a) * sgx_a, gxs[a], mask=mask_ec)


# n_edges changes at every neighbor-list rebuild: specialising on it (Triton's default for
# integers: divisibility by 16, == 1) recompiled the kernels during eager MD, several times
# slower per step (md_compiled_triton_pergroup_specialised_h200.json at commit 2a45317)
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


def _tiling(n_edges: int, channels: int, interpret: bool, block_e: int | None, tile: int
            ) -> tuple[int, int, int]:
    """``(BLOCK_E, BLOCK_C, n_channel_blocks)``: powers of two, ``BLOCK_E * BLOCK_C`` about
    ``tile`` unless ``block_e`` is given (in the interpreter, at most ``n_edges`` rounded up:
    its cost is that of the whole tile)."""
    block_c = min(triton.next_power_of_2(channels), MAX_BLOCK_C)
    if block_e is None:
        tile = INTERPRETER_TILE_ELEMENTS if interpret else tile
        block_e = max(1, tile // block_c)
        block_e = 1 << (block_e.bit_length() - 1)  # floor to a power of two
        if interpret:
            block_e = min(block_e, triton.next_power_of_2(max(n_edges, 1)))
    return block_e, block_c, triton.cdiv(channels, block_c)


Groups = list[tuple[int, int, int]]


def _groups(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None,
            gathered: bool = False) -> Groups:
    """Validated ``[(P_g, A_g, X_g)]`` from the flat list (``None``: one group, all of
    ``w`` and ``x``). ``gathered``: ``x`` holds rows of nodes (any number), not of edges."""
    (e, c, n_paths), dx, (_, rows, _) = w.shape, x.shape[2], m.shape
    if groups is None:
        out = [(n_paths, dx, 0)]
    else:
        out = [tuple(int(v) for v in groups[i : i + 3]) for i in range(0, len(groups), 3)]
    if (x.shape[1] != c or (not gathered and x.shape[0] != e) or m.shape[0] != e
            or not 1 <= len(out) <= MAX_GROUPS
            or len(groups or [0, 0, 0]) % 3 or sum(p for p, _, _ in out) != n_paths
            or sum(p * a for p, a, _ in out) != rows
            or any(p < 1 or a < 1 or xo < 0 or xo + a > dx for p, a, xo in out)):
        raise ValueError(f"weighted_bmm: w {tuple(w.shape)}, x {tuple(x.shape)} and m "
                         f"{tuple(m.shape)} do not fit [E, C, ΣP], [E, C, DX], [E, ΣPA, K] "
                         f"with at most {MAX_GROUPS} groups (P, A, X) {out}")
    if not (w.dtype == x.dtype == m.dtype):
        raise ValueError(f"weighted_bmm: dtypes differ ({w.dtype}, {x.dtype}, {m.dtype})")
    return out


def _check_index(index: Tensor, n_edges: int, what: str) -> None:
    if index.dim() != 1 or index.shape[0] != n_edges or index.dtype not in (torch.int32,
                                                                            torch.int64):
        raise ValueError(f"tp_conv: {what} must be an integer [{n_edges}] tensor, got "
                         f"{index.dtype} {tuple(index.shape)}")


def _offsets(groups: Groups) -> list[tuple[int, int, int, int, int]]:
    """``(P, A, X, W, R)`` per group: ``W`` its first column of ``w``, ``R`` row of ``m``."""
    out, wo, ro = [], 0, 0
    for p, a, xo in groups:
        out.append((p, a, xo, wo, ro))
        wo, ro = wo + p, ro + p * a
    return out


def _constexprs(groups: Groups) -> dict[str, int]:
    padded = list(groups) + [(0, 0, 0)] * (MAX_GROUPS - len(groups))
    return {f"{n}{i}": v for i, grp in enumerate(padded) for n, v in zip("PAX", grp)}


def _tiles_x(groups: Groups, dx: int) -> bool:
    """Whether the groups' columns of ``x`` are disjoint and cover all ``dx`` of them (then
    the backward kernel stores ``grad_x`` instead of adding into zeros)."""
    cols = sorted(c for _, a, xo in groups for c in range(xo, xo + a))
    return cols == list(range(dx))


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


def _dummy_index(t: Tensor) -> Tensor:
    return torch.empty(0, dtype=torch.int64, device=t.device)


def forward(w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None,
            x_index: Tensor | None = None, out_index: Tensor | None = None, n_out: int = 0,
            block_e: int | None = None, num_warps: int = FWD_WARPS) -> Tensor:
    """The forward kernel (no autograd; :func:`weighted_bmm` and :func:`tp_conv` are the
    differentiable operators).

    Args:
        w: ``[E, C, ΣP]`` per-path weights (any strides).
        x: ``[E, C, DX]`` features (any strides); with ``x_index``, ``[N, C, DX]`` node
            features of which edge ``e`` reads row ``x_index[e]`` (the gather is fused).
        m: ``[E, ΣPA, K]`` per-edge coupling matrices (any strides).
        groups: flat ``[P_0, A_0, X_0, P_1, ...]``, at most :data:`MAX_GROUPS` groups:
            group ``g`` pairs the next ``P_g`` columns of ``w`` with columns
            ``X_g .. X_g + A_g - 1`` of ``x`` and the next ``P_g * A_g`` rows of ``m``;
            ``None``: one group ``(ΣP, DX, 0)``, i.e. ``_weighted_bmm(w, x, m)``.
        out_index, n_out: with ``out_index`` (``[E]``), edge ``e``'s output is added into row
            ``out_index[e]`` of ``[n_out, C, K]`` zeros (the scatter is fused; indices
            outside ``0 .. n_out - 1`` are dropped).
        block_e, num_warps: tiling override (benchmarks); default about :data:`FWD_TILE`
            elements per program.

    Returns:
        ``[E, C, K]`` or ``[n_out, C, K]`` (contiguous, dtype of the inputs).
    """
    grp = _groups(w, x, m, groups, gathered=x_index is not None)
    # the channel and output widths are the model's constants: concrete under a dynamic-shape
    # trace (compiled training), where the tiling's bit arithmetic on symbols blows up sympy
    e, c, k = w.shape[0], int(w.shape[1]), int(m.shape[2])
    for index, what in ((x_index, "x_index"), (out_index, "out_index")):
        if index is not None:
            _check_index(index, e, what)
    interpret = _interpreting(w, x, m)
    if w.device.type != "cuda" and not interpret:
        xe = x if x_index is None else x.index_select(0, x_index)
        out = reference(w, xe, m, groups)
        return out if out_index is None else _sum_rows(out, out_index, n_out)
    if out_index is None:
        out = torch.empty((e, c, k), dtype=w.dtype, device=w.device)
    else:
        out = torch.zeros((n_out, c, k), dtype=w.dtype, device=w.device)
    block_e, block_c, n_cb = _tiling(e, c, interpret, block_e,
                                     FWD_TILE // triton.next_power_of_2(k))
    grid = (triton.cdiv(e, block_e), n_cb)  # no edges: an empty grid, no launch
    kernel = _interpreted(_fwd_kernel) if interpret else wrap_triton(_FWD)
    kernel[grid](
        w, x, m, out, _dummy_index(w) if x_index is None else x_index,
        _dummy_index(w) if out_index is None else out_index, e, c, n_out, *w.stride(),
        *x.stride(), *m.stride(), *out.stride(), **_constexprs(grp), K=k, BLOCK_E=block_e,
        K_PAD=triton.next_power_of_2(k), BLOCK_C=block_c, GATHER_X=x_index is not None,
        SCATTER=out_index is not None, num_warps=num_warps)
    return out


def backward(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: list[int] | None = None,
             need_w: bool = True, need_x: bool = True, need_m: bool = True,
             x_index: Tensor | None = None, g_index: Tensor | None = None,
             block_e: int | None = None, num_warps: int = BWD_WARPS
             ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward kernel (no autograd; :func:`weighted_bmm_backward` and
    :func:`tp_conv_backward` are the operators).

    Args:
        g: ``[E, C, K]`` gradient of the output (any strides, e.g. expanded); with
            ``g_index``, ``[n_out, C, K]`` of which edge ``e`` reads row ``g_index[e]``
            (zero outside ``0 .. n_out - 1``).
        w, x, m, groups, x_index: the inputs of :func:`forward` (with ``x_index``,
            ``grad_x`` is the node gradient ``[N, C, DX]``: the scatter is fused).
        need_w, need_x, need_m: which gradients to compute; the others come back as empty
            tensors (``[0]``).
        block_e, num_warps: tiling override (benchmarks); default about :data:`BWD_TILE`
            elements per program.

    Returns:
        ``grad_w [E, C, ΣP]``, ``grad_x`` (the shape of ``x``), ``grad_m [E, ΣPA, K]``
        (contiguous).
    """
    grp = _groups(w, x, m, groups, gathered=x_index is not None)
    (e, c, n_paths), (nx, _, dx), (_, rows, k) = w.shape, x.shape, m.shape
    c, k, dx = int(c), int(k), int(dx)  # the model's constants (see forward)
    n_g = g.shape[0] if g_index is not None else e
    if g.shape != (n_g, c, k) or g.dtype != w.dtype:
        raise ValueError(f"weighted_bmm_backward: gradient {tuple(g.shape)} {g.dtype} for an "
                         f"output {(n_g, c, k)} {w.dtype}")
    for index, what in ((x_index, "x_index"), (g_index, "g_index")):
        if index is not None:
            _check_index(index, e, what)
    interpret = _interpreting(g, w, x, m)
    if w.device.type != "cuda" and not interpret:
        return _reference_backward(g, w, x, m, grp, need_w, need_x, need_m, x_index, g_index)
    block_e, block_c, n_cb = _tiling(e, c, interpret, block_e, BWD_TILE)
    gx_add = x_index is not None or not _tiles_x(grp, dx)
    gw = w.new_empty((e, c, n_paths) if need_w else (0,))  # outputs never alias each other
    gx = ((w.new_zeros if gx_add else w.new_empty)((nx, c, dx)) if need_x
          else w.new_empty((0, 0, 0)))
    gm = w.new_empty(((n_cb,) if n_cb > 1 else ()) + (e, rows, k) if need_m else (0,))
    if need_w or need_x or need_m:
        grid = (triton.cdiv(e, block_e), n_cb)  # no edges: an empty grid, no launch
        kernel = _interpreted(_bwd_kernel) if interpret else wrap_triton(_BWD)
        kernel[grid](
            g, w, x, m, gw, gx, gm, _dummy_index(w) if x_index is None else x_index,
            _dummy_index(w) if g_index is None else g_index, e, c, n_g, *g.stride(),
            *w.stride(), *x.stride(), *m.stride(), *gx.stride(), **_constexprs(grp), K=k,
            BLOCK_E=block_e, BLOCK_C=block_c, GATHER_X=x_index is not None,
            GATHER_G=g_index is not None, GX_ADD=gx_add, NEED_W=need_w, NEED_X=need_x,
            NEED_M=need_m, num_warps=num_warps)
    if need_m and n_cb > 1:
        gm = gm.sum(0)
    return gw, gx if need_x else w.new_empty(0), gm


def _reference_backward(g: Tensor, w: Tensor, x: Tensor, m: Tensor, groups: Groups,
                        need_w: bool, need_x: bool, need_m: bool,
                        x_index: Tensor | None = None, g_index: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`backward` with torch ops (CPU tensors, fake tensors)."""
    if g_index is not None:
        g = _rows(g, g_index)
    xe = x if x_index is None else x.index_select(0, x_index)
    e, c = xe.shape[:2]
    gws, gms = [], []
    gx = torch.zeros_like(xe, memory_format=torch.contiguous_format) if need_x else None
    for p, a, xo, wo, ro in _offsets(groups):
        wg, xg, mg = w[:, :, wo : wo + p], xe[:, :, xo : xo + a], m[:, ro : ro + p * a]
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
    if need_x and x_index is not None:
        gx = x.new_zeros(x.shape).index_add(0, x_index, gx)
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
    """The derivative of the gradients (double backward): :func:`_edge_double_backward`."""
    g, w, x, m = ctx.saved_tensors
    hw, hx, hm = (_used(h, done) for h, done in zip((hw, hx, hm), ctx.computed))
    dg, dw, dx, dm = _edge_double_backward(g, w, x, m, ctx.groups, hw, hx, hm,
                                           *ctx.needs_input_grad[:4])
    return dg, dw, dx, dm, None, None, None, None


def _edge_double_backward(g, w, x, m, groups, hw, hx, hm, need_g, need_w, need_x, need_m):
    """For output gradients ``hw, hx, hm`` of ``grad_w, grad_x, grad_m`` (``None``: zero),
    with both operators (differentiable again):

    * ``d g = wbmm(hw, x, m) + wbmm(w, hx, m) + wbmm(w, x, hm)``
    * ``d w = grad_w(g; w, hx, m) + grad_w(g; w, x, hm)``
    * ``d x = grad_x(g; hw, x, m) + grad_x(g; w, x, hm)``
    * ``d m = grad_m(g; hw, x, m) + grad_m(g; w, hx, m)``

    (every gradient is linear in each of ``g, w, x, m``).
    """
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
    return dg, dw, dx, dm


_weighted_bmm_op.register_autograd(_forward_grad, setup_context=_setup_forward)
_weighted_bmm_backward_op.register_autograd(_backward_grad, setup_context=_setup_backward)


# ---- the fused convolution: gather of the senders' features, product, scatter to receivers

@torch.library.triton_op("xnn::tp_conv", mutates_args=())
def _tp_conv_op(w: Tensor, h: Tensor, m: Tensor, sender: Tensor, receiver: Tensor, n_out: int,
                groups: list[int]) -> Tensor:
    return forward(w, h, m, groups, x_index=sender, out_index=receiver, n_out=n_out)


@torch.library.triton_op("xnn::tp_conv_backward", mutates_args=())
def _tp_conv_backward_op(g: Tensor, w: Tensor, h: Tensor, m: Tensor, sender: Tensor,
                         receiver: Tensor, groups: list[int], need_w: bool, need_h: bool,
                         need_m: bool) -> tuple[Tensor, Tensor, Tensor]:
    return backward(g, w, h, m, groups, need_w, need_h, need_m, x_index=sender,
                    g_index=receiver)


def tp_conv(w: Tensor, h: Tensor, m: Tensor, sender: Tensor, receiver: Tensor, n_out: int,
            groups: list[int] | None = None) -> Tensor:
    """``out[r, c, k] = Σ_{e: receiver[e] = r} Σ_g Σ_{p,a} w[e,c,W_g+p] h[sender[e],c,X_g+a]
    m[e,R_g+p*A_g+a,k]`` (operator ``xnn::tp_conv``): :func:`weighted_bmm` of the senders'
    features summed into the receivers, with the gather and the scatter inside the kernels
    (neither ``h[sender]`` nor the per-edge messages exist, forward or backward).
    Differentiable to any order (beyond the first through the edge operators).

    Shapes:
        ``w [E, C, ΣP]``, ``h [N, C, DX]``, ``m [E, ΣPA, K]``, ``sender, receiver [E]``
        (receivers outside ``0 .. n_out - 1`` contribute nothing) -> ``[n_out, C, K]``.

    The scatter adds with atomics, as ``index_add`` does on CUDA: the order of the sum, and so
    the last bits in float32, may change from run to run.
    """
    if groups is None:
        groups = [w.shape[2], h.shape[2], 0]
    return torch.ops.xnn.tp_conv(w, h, m, sender, receiver, n_out, list(groups))


def tp_conv_backward(g: Tensor, w: Tensor, h: Tensor, m: Tensor, sender: Tensor,
                     receiver: Tensor, groups: list[int], need_w: bool = True,
                     need_h: bool = True, need_m: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`tp_conv` (operator ``xnn::tp_conv_backward``): ``grad_w
    [E, C, ΣP]``, ``grad_h [N, C, DX]``, ``grad_m [E, ΣPA, K]``; differentiable."""
    return torch.ops.xnn.tp_conv_backward(g, w, h, m, sender, receiver, list(groups), need_w,
                                          need_h, need_m)


def _setup_conv(ctx, inputs, output):
    w, h, m, sender, receiver, n_out, groups = inputs
    ctx.save_for_backward(w, h, m, sender, receiver)
    ctx.groups = groups


def _conv_grad(ctx, g):
    w, h, m, sender, receiver = ctx.saved_tensors
    need_w, need_h, need_m = ctx.needs_input_grad[:3]
    if not (need_w or need_h or need_m):
        return (None,) * 7
    gw, gh, gm = tp_conv_backward(g, w, h, m, sender, receiver, ctx.groups, need_w, need_h,
                                  need_m)
    return (gw if need_w else None, gh if need_h else None, gm if need_m else None,
            None, None, None, None)


def _setup_conv_backward(ctx, inputs, output):
    g, w, h, m, sender, receiver, groups, need_w, need_h, need_m = inputs
    ctx.save_for_backward(g, w, h, m, sender, receiver)
    ctx.groups, ctx.computed = groups, (need_w, need_h, need_m)


def _in_rows(index: Tensor, n: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """``index`` clamped into ``0 .. n-1`` and the 0/1 factor (shaped to multiply rows of
    ``like``) that is zero where it was outside."""
    keep = ((index >= 0) & (index < n)).to(like.dtype).view(-1, *[1] * (like.dim() - 1))
    return index.clamp(0, max(n - 1, 0)), keep


def _rows(t: Tensor, index: Tensor) -> Tensor:
    """``t[index]``, zero where ``index`` is outside ``t``'s rows (differentiable)."""
    rows, keep = _in_rows(index, t.shape[0], t)
    return t.index_select(0, rows) * keep


def _sum_rows(t: Tensor, index: Tensor, n: int) -> Tensor:
    """The adjoint of :func:`_rows`: ``out[index[e]] += t[e]`` into ``n`` zero rows."""
    rows, keep = _in_rows(index, n, t)
    return t.new_zeros((n, *t.shape[1:])).index_add(0, rows, t * keep)


def _conv_backward_grad(ctx, hw, hh, hm):
    """Double backward of the fused convolution, on edges: gather ``g`` by receiver and
    ``h``, ``hh`` by sender, :func:`_edge_double_backward`, then sum the edge results of
    ``g`` and ``h`` back into their rows."""
    g, w, h, m, sender, receiver = ctx.saved_tensors
    hw, hh, hm = (_used(t, done) for t, done in zip((hw, hh, hm), ctx.computed))
    need_g, need_w, need_h, need_m = ctx.needs_input_grad[:4]
    g_e, x_e = _rows(g, receiver), h.index_select(0, sender)
    hx = None if hh is None else hh.index_select(0, sender)
    dg, dw, dx, dm = _edge_double_backward(g_e, w, x_e, m, ctx.groups, hw, hx, hm, need_g,
                                           need_w, need_h, need_m)
    dg = None if dg is None else _sum_rows(dg, receiver, g.shape[0])
    dh = None if dx is None else h.new_zeros(h.shape).index_add(0, sender, dx)
    return dg, dw, dh, dm, None, None, None, None, None, None


_tp_conv_op.register_autograd(_conv_grad, setup_context=_setup_conv)
_tp_conv_backward_op.register_autograd(_conv_backward_grad, setup_context=_setup_conv_backward)
