"""The ``triton`` kernel backend (:mod:`xnn.models.triton_tp`): the fused weighted batched
matmul of the edge tensor product and its gradients equal the reference ``_weighted_bmm``
(fp32 to 1e-5 relative, fp64 to 1e-10), to second order, and a whole equivariant model with
``backend="triton"`` is the reference model (energies, forces, stress, force-training
gradients).

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set by
the autouse fixture below, per test (``monkeypatch``), and only for the tests not marked
``gpu``. :mod:`xnn.models.triton_tp` reads it when an operator is *called* (it builds the
interpreted kernels itself), so it need not be set before ``triton`` is imported, and it
never stays set for other test modules (inductor decorates its own kernels with
``triton.jit``, which under ``TRITON_INTERPRET=1`` would make them interpreted too). The
interpreter is slow (~0.1 ms per operation of a kernel's body): sizes stay small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not hasattr(torch.library, "triton_op"):
    pytest.skip("needs torch >= 2.6 (torch.library.triton_op)", allow_module_level=True)

from helpers.kernels import (  # noqa: E402
    assert_same_force_loss_grads,
    assert_same_properties,
    small_model,
)
from helpers.kernels import kernel_system as _system  # noqa: E402
from helpers.kernels import props as _props  # noqa: E402

from xnn.data import keys as K  # noqa: E402
from xnn.models import triton_tp  # noqa: E402
from xnn.models.equivariant_ops import EdgeTensorProduct, _weighted_bmm  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def interpret(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _group_shapes(l_in: int, l_sh: int = 2, l_out: int = 2) -> list[tuple[int, int, int]]:
    """``(P, A, K)`` of each group of :class:`EdgeTensorProduct` (what ``forward`` passes)."""
    tp = EdgeTensorProduct(l_in, l_sh, l_out)
    return [(p1 - p0, 2 * l1 + 1, tp.d_out) for l1, p0, p1 in tp.groups]


# the default equivariant model: l_in 0 (first interaction) and 1 (hidden_l_max), l_max 2;
# hidden_l_max = 2 adds (4, 5, 9); then odd sizes
SHAPES = sorted({*_group_shapes(1), *_group_shapes(2), (2, 3, 5), (1, 2, 3)})
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10)}


def _inputs(e, c, p, a, k, dtype, device="cpu", seed=0):
    """``w, x, m`` as the model passes them: ``w`` a slice of the last axis of all paths'
    weights, ``x`` one degree's block of the features (both non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(e, c, p + 3, generator=gen, dtype=torch.float64)[:, :, 1 : 1 + p]
    x = torch.randn(e, c, a + 4, generator=gen, dtype=torch.float64)[:, :, 4:]
    m = torch.randn(e, p * a, k, generator=gen, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (w, x, m)]


def _assert_close(a, b, dtype, scale=None):
    """Relative to the largest entry of ``b`` (``scale``)."""
    scale = float(b.detach().abs().max()) if scale is None else scale
    assert scale > 0
    torch.testing.assert_close(a, b, rtol=0, atol=TOL[dtype]["atol"] * scale)


def _check_op(e, c, shape, dtype, device="cpu"):
    w, x, m = _inputs(e, c, *shape, dtype, device)
    _check_values_and_grads(triton_tp.weighted_bmm(w, x, m), _weighted_bmm(w, x, m),
                            (w, x, m), dtype)


def _check_values_and_grads(out, ref, inputs, dtype):
    """``out`` equals ``ref``, and so do their gradients with respect to ``inputs`` for one
    random output gradient; returns the gradients of ``out``."""
    _assert_close(out, ref, dtype)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, inputs, g)
    grads_ref = torch.autograd.grad(ref, inputs, g)
    for got, want in zip(grads, grads_ref):
        _assert_close(got, want, dtype)
    return grads


def _second_derivatives(out, inputs, g, squared):
    """The gradients with respect to ``inputs`` and the output gradient ``g`` of a random
    function of the first gradients (linear in each, except the ``squared``-th: its square),
    as force training takes them."""
    grads = torch.autograd.grad(out, inputs, g, create_graph=True)
    torch.manual_seed(2)
    s = sum(((t.square() if i == squared else t) * torch.randn_like(t)).sum()
            for i, t in enumerate(grads))
    return torch.autograd.grad(s, (*inputs, g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels", [8, 16, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_op_and_gradients_equal_reference(shape, channels, dtype):
    """Forward and the three gradients, every group shape of the model and odd ones."""
    _check_op(97, channels, shape, dtype)


def _grouped_inputs(e, c, groups, k, dtype, device="cpu", seed=0):
    """``w [E, C, ΣP]`` (strided), ``x [E, C, DX]``, ``m [E, ΣPA, K]`` for flat ``groups``."""
    grp = [groups[i : i + 3] for i in range(0, len(groups), 3)]
    n_paths, rows = sum(q[0] for q in grp), sum(q[0] * q[1] for q in grp)
    dx = max(q[1] + q[2] for q in grp) + 1  # one column of no group: its gradient is zero
    return _inputs(e, c, n_paths, dx, k, dtype, device, seed)[:2] + [
        torch.randn(e, rows, k, dtype=torch.float64, generator=torch.Generator().manual_seed(
            seed + 1)).to(device=device, dtype=dtype).requires_grad_()]


def _per_group_reference(w, x, m, groups):
    """The sum over groups of ``_weighted_bmm`` on each group's slices (what the reference
    path of :class:`EdgeTensorProduct` computes)."""
    out, wo, ro = None, 0, 0
    for i in range(0, len(groups), 3):
        p, a, xo = groups[i : i + 3]
        t = _weighted_bmm(w[:, :, wo : wo + p], x[:, :, xo : xo + a], m[:, ro : ro + p * a])
        out, wo, ro = (t if out is None else out + t), wo + p, ro + p * a
    return out


# the model's groups (l1 = 0..l_in at x columns l1^2), then overlapping x columns
GROUPS = [[3, 1, 0, 4, 3, 1], [3, 1, 0, 4, 3, 1, 4, 5, 4], [2, 2, 1, 3, 2, 0, 1, 1, 2, 2, 3, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels", [8, 64])
@pytest.mark.parametrize("groups", GROUPS)
def test_grouped_op_and_gradients_equal_per_group_reference(groups, channels, dtype):
    """Several groups of paths in one kernel (how the model calls it): output and gradients
    equal the per-group reference summed (``grad_x`` of columns shared by groups summed,
    of columns of no group zero)."""
    k = 9 if len(groups) < 12 else 5
    w, x, m = _grouped_inputs(83, channels, groups, k, dtype)
    grads = _check_values_and_grads(triton_tp.weighted_bmm(w, x, m, groups),
                                    _per_group_reference(w, x, m, groups), (w, x, m), dtype)
    assert float(grads[1][:, :, -1].abs().max()) == 0.0


def test_grouped_double_backward_equals_reference():
    groups, dtype = GROUPS[0], torch.float64
    results = []
    for fn in (lambda *t: triton_tp.weighted_bmm(*t, groups),
               lambda *t: _per_group_reference(*t, groups)):
        w, x, m = _grouped_inputs(29, 8, groups, 9, dtype)
        g = torch.randn(29, 8, 9, dtype=dtype, generator=torch.Generator().manual_seed(1))
        g.requires_grad_()
        results.append(_second_derivatives(fn(w, x, m), (w, x, m), g, squared=1))
    for got, want in zip(*results):
        _assert_close(got, want, dtype)


def test_groups_that_do_not_fit_are_refused():
    w, x, m = (t.detach() for t in _grouped_inputs(5, 4, GROUPS[0], 9, torch.float64))
    for bad in ([3, 1, 0, 4, 3, 4], [3, 1, 0, 3, 3, 1], [3, 1, 0, 4, 3]):
        with pytest.raises(ValueError, match="do not fit"):
            triton_tp.forward(w, x, m, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernels_with_small_edge_blocks_and_channel_blocks(dtype):
    """The kernels themselves with many programs (``block_e=4``; 37 edges: a partial last
    block) and with 130 channels (two channel blocks whose ``grad_m`` parts are summed)."""
    for e, c, block_e in ((37, 16, 4), (9, 130, 2)):
        w, x, m = (t.detach() for t in _inputs(e, c, 4, 3, 9, dtype))
        g = torch.randn(e, c, 9, dtype=dtype).expand(e, c, 9)  # any strides
        ref = _weighted_bmm(w, x, m)
        _assert_close(triton_tp.forward(w, x, m, block_e=block_e), ref, dtype)
        got = triton_tp.backward(g, w, x, m, block_e=block_e)
        want = triton_tp._reference_backward(g, w, x, m, [(4, 3, 0)], True, True, True)
        for a, b in zip(got, want):
            _assert_close(a, b, dtype)


def test_no_edges():
    w, x, m = _inputs(0, 8, 4, 3, 9, torch.float64)
    out = triton_tp.weighted_bmm(w, x, m)
    assert out.shape == (0, 8, 9)
    grads = torch.autograd.grad(out.sum(), (w, x, m))
    assert [t.shape for t in grads] == [(0, 8, 4), (0, 8, 3), (0, 12, 9)]


def test_gradients_only_where_needed():
    """Only the inputs that need a gradient get one (the kernel skips the others)."""
    w, x, m = _inputs(23, 8, 3, 3, 9, torch.float64)
    for needs in ((True, False, False), (False, True, False), (False, False, True)):
        ins = [t.detach().requires_grad_(n) for t, n in zip((w, x, m), needs)]
        out = triton_tp.weighted_bmm(*ins)
        out.square().sum().backward()
        ref_ins = [t.detach().requires_grad_(n) for t, n in zip((w, x, m), needs)]
        _weighted_bmm(*ref_ins).square().sum().backward()
        for t, r, n in zip(ins, ref_ins, needs):
            assert (t.grad is not None) == n
            if n:
                _assert_close(t.grad, r.grad, torch.float64)
    gw, gx, gm = triton_tp.backward(torch.ones(23, 8, 9, dtype=torch.float64), w.detach(),
                                    x.detach(), m.detach(), need_w=False, need_m=False)
    assert gw.numel() == gm.numel() == 0 and gx.shape == (23, 8, 3)


@pytest.mark.parametrize("shape", [(3, 1, 9), (4, 3, 9)])
def test_double_backward_equals_reference(shape):
    """Second derivatives (force training: the gradient of a function of the gradients) with
    respect to ``w, x, m`` and the output gradient, against autograd through the reference."""
    dtype = torch.float64
    results = []
    for fn in (triton_tp.weighted_bmm, _weighted_bmm):
        w, x, m = _inputs(41, 8, *shape, dtype)
        g = torch.randn(41, 8, shape[2], dtype=dtype, generator=torch.Generator().manual_seed(1))
        g.requires_grad_()
        results.append(_second_derivatives(fn(w, x, m), (w, x, m), g, squared=2))
    for got, want in zip(*results):
        _assert_close(got, want, dtype)


def test_gradcheck_to_second_order():
    """``torch.autograd.gradcheck``/``gradgradcheck`` (finite differences, fp64; fast mode:
    random projections of the Jacobians) of both operators on a tiny case."""
    w, x, m = _inputs(3, 2, 2, 3, 3, torch.float64)
    assert torch.autograd.gradcheck(triton_tp.weighted_bmm, (w, x, m), fast_mode=True)
    g = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda *t: triton_tp.weighted_bmm_backward(*t, [2, 3, 0]), (g, w, x, m),
        fast_mode=True)
    assert torch.autograd.gradgradcheck(triton_tp.weighted_bmm, (w, x, m), fast_mode=True)


def _conv_inputs(e, n, c, groups, dtype, seed=0):
    """``w, h [n, C, DX], m`` and random ``sender``/``receiver`` (receivers sorted, as a
    neighbour list gives them; some nodes receive nothing) for :func:`triton_tp.tp_conv`."""
    w, _, m = _grouped_inputs(e, c, groups, 9, dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 5)
    dx = max(groups[i + 1] + groups[i + 2] for i in range(0, len(groups), 3)) + 1
    h = torch.randn(n, c, dx + 2, generator=gen, dtype=torch.float64)[:, :, 2:]
    h = h.to(dtype).requires_grad_()
    sender = torch.randint(0, n, (e,), generator=gen)
    receiver = torch.randint(0, n - 2, (e,), generator=gen).sort().values
    return w, h, m, sender, receiver


def _conv_reference(w, h, m, sender, receiver, n, groups):
    out = _per_group_reference(w, h.index_select(0, sender), m, groups)
    return out.new_zeros((n, *out.shape[1:])).index_add(0, receiver, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("groups", GROUPS[:2] + [[4, 3, 0]])
def test_fused_conv_and_gradients_equal_gather_product_scatter(groups, dtype):
    """``tp_conv`` (the gather of senders' features and the scatter into receivers inside the
    kernels) equals ``index_select``, the per-group product and ``index_add``: output and the
    gradients of ``w``, the node features ``h`` and ``m``."""
    n = 19
    w, h, m, snd, rcv = _conv_inputs(71, n, 16, groups, dtype)
    out = triton_tp.tp_conv(w, h, m, snd, rcv, n, groups)
    assert out.shape == (n, 16, 9)
    _check_values_and_grads(out, _conv_reference(w, h, m, snd, rcv, n, groups), (w, h, m),
                            dtype)


def test_fused_conv_small_blocks_and_dropped_receivers():
    """The kernels with several programs per channel block and per edge block; receivers
    outside ``0 .. n-1`` contribute nothing (forward) and get no gradient (backward)."""
    groups, n, dtype = GROUPS[0], 7, torch.float64
    w, h, m, snd, rcv = (t.detach() for t in _conv_inputs(37, n, 130, groups, dtype))
    rcv = rcv.clone()
    rcv[:3] = -1
    rcv[-2:] = n
    keep = (rcv >= 0) & (rcv < n)
    out = triton_tp.forward(w, h, m, groups, x_index=snd, out_index=rcv, n_out=n, block_e=4)
    want = _conv_reference(w[keep], h, m[keep], snd[keep], rcv[keep], n, groups)
    _assert_close(out, want, dtype)
    g = torch.randn(n, 130, 9, dtype=dtype)
    gw, gh, gm = triton_tp.backward(g, w, h, m, groups, x_index=snd, g_index=rcv, block_e=2)
    ref = triton_tp._reference_backward(g, w, h, m, [tuple(groups[i : i + 3]) for i in (0, 3)],
                                        True, True, True, snd, rcv)
    for got, want_ in zip((gw, gh, gm), ref):
        _assert_close(got, want_, dtype)
    assert float(gw[~keep].abs().max()) == 0.0 and float(gm[~keep].abs().max()) == 0.0


def test_fused_conv_double_backward_equals_reference():
    """Second derivatives through ``tp_conv`` (force training) equal autograd through the
    gather, the reference product and the scatter, including the output gradient's."""
    groups, n, dtype = GROUPS[0], 11, torch.float64
    results = []
    for fn in (lambda *t: triton_tp.tp_conv(*t, n, groups),
               lambda *t: _conv_reference(*t, n, groups)):
        w, h, m, snd, rcv = _conv_inputs(31, n, 8, groups, dtype)
        g = torch.randn(n, 8, 9, dtype=dtype, generator=torch.Generator().manual_seed(1))
        g.requires_grad_()
        results.append(_second_derivatives(fn(w, h, m, snd, rcv), (w, h, m), g, squared=1))
    for got, want in zip(*results):
        _assert_close(got, want, dtype)


def test_fused_conv_gradcheck():
    groups = [2, 3, 0]
    w, _, m = _inputs(5, 2, 2, 3, 3, torch.float64)
    h = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    snd, rcv = torch.tensor([0, 2, 1, 1, 0]), torch.tensor([0, 0, 1, 2, 2])
    assert torch.autograd.gradcheck(lambda *t: triton_tp.tp_conv(*t, snd, rcv, 3, groups),
                                    (w, h, m), fast_mode=True)
    assert torch.autograd.gradgradcheck(lambda *t: triton_tp.tp_conv(*t, snd, rcv, 3, groups),
                                        (w, h, m), fast_mode=True)


def test_symbolic_trace_on_cuda_keeps_the_edge_count_symbolic():
    """Under a dynamic-shape trace (compiled training: ``torch.compile(dynamic=True)``) of
    fake CUDA tensors, the kernels' launches specialize the channel and output widths (the
    model's constants) and leave the edge and atom counts symbolic. Reading the tiling off
    the symbols instead built guards of nested bit operations that sympy took minutes to
    simplify (the CUDA compiled-training test ran past its limit on an H200)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import (
        DimDynamic,
        ShapeEnv,
        StatelessSymbolicContext,
    )

    groups, (e, n, c, k) = [3, 3, 0], (50, 10, 16, 5)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def fake(*shape, dtype=torch.float32):
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
        t = mode.from_tensor(torch.empty(shape, dtype=dtype, device="meta"),
                             symbolic_context=ctx)
        t.fake_device = torch.device("cuda", 0)  # the kernel path, without a GPU
        return t

    w, h, m, g = fake(e, c, 3), fake(n, c, 3), fake(e, 9, k), fake(n, c, k)
    snd, rcv = fake(e, dtype=torch.int64), fake(e, dtype=torch.int64)

    def fn(w, h, m, g, snd, rcv):
        out = triton_tp.tp_conv(w, h, m, snd, rcv, h.shape[0], groups)
        grads = triton_tp.tp_conv_backward(g, w, h, m, snd, rcv, groups)
        return out, *grads, triton_tp.weighted_bmm(w, h.index_select(0, snd), m, groups)

    with mode:
        gm = make_fx(fn)(w, h, m, g, snd, rcv)
        assert any(node.target is torch.ops.xnn.tp_conv.default for node in gm.graph.nodes)
        outs = fn(w, h, m, g, snd, rcv)
    guards = [str(guard.expr) for guard in env.guards]
    assert not any("Bitwise" in x for x in guards), guards
    # a size's expression after the trace's replacements: a number once a guard fixed it
    assert w.shape[1].node.expr == c and m.shape[2].node.expr == k  # widths: specialized
    for size in (w.shape[0], h.shape[0], *(o.shape[0] for o in outs)):  # E and N: symbolic
        assert not size.node.expr.is_number, guards


def test_cpu_without_interpreter_runs_the_reference_formula(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    w, x, m = _inputs(11, 4, 3, 3, 9, torch.float64)
    assert not triton_tp._interpreting(w, x, m)
    torch.testing.assert_close(triton_tp.weighted_bmm(w, x, m), _weighted_bmm(w, x, m),
                               rtol=0, atol=1e-13)


@pytest.mark.parametrize("lean", [False, True])
def test_model_triton_equals_reference_fp64(lean):
    """The equivariant model through the kernels: energies, forces, stress and the weight
    gradients of a force loss (double backward), also with edge chunks (2 of 70 edges) under
    activation checkpointing (``lean``; one interaction, the interpreter is slow); the same
    parameter names."""
    hp = dict(edge_chunk_size=35, activation_checkpointing=True, num_interactions=1) if lean \
        else {}
    ref, tri = small_model("reference", **hp), small_model("triton", **hp)
    assert list(tri.state_dict()) == list(ref.state_dict())
    assert tri.interactions[0].tp._fused_groups == [3, 1, 0]  # one group, l1 = 0
    if not lean:
        assert tri.interactions[1].tp._fused_groups == [3, 1, 0, 4, 3, 1]  # l1 = 0, 1
    assert tri.interactions[0].product._cue is None
    tri.load_state_dict(ref.state_dict())
    g = _system()
    assert_same_properties(tri, ref, g)
    assert_same_force_loss_grads([ref.train(), tri.train()], g)


def test_traced_forces_keep_the_operators():
    """``make_fx`` (how ``md.compile`` and compiled training trace energy + forces) records
    the two operators, not the reference formula, and the traced graph gives the eager
    forces; ``torch.compile(fullgraph=True)`` (AOTAutograd) differentiates through them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    w, x, m = _inputs(29, 8, 4, 3, 9, torch.float64)

    def energy_and_grads(w, x, m):
        e = triton_tp.weighted_bmm(w, x, m).square().sum()
        return e, *torch.autograd.grad(e, (w, x, m), create_graph=True)

    gm = make_fx(energy_and_grads, tracing_mode="fake")(w, x, m)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.xnn.weighted_bmm.default in targets
    assert torch.ops.xnn.weighted_bmm_backward.default in targets
    for got, want in zip(gm(w, x, m), energy_and_grads(w, x, m)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * float(want.detach().abs().max()))

    compiled = torch.compile(triton_tp.weighted_bmm, fullgraph=True, backend="aot_eager")
    out = compiled(w, x, m)
    grads = torch.autograd.grad(out.square().sum(), (w, x, m))
    ref = _weighted_bmm(w, x, m)
    grads_ref = torch.autograd.grad(ref.square().sum(), (w, x, m))
    _assert_close(out, ref, torch.float64)
    for a, b in zip(grads, grads_ref):
        _assert_close(a, b, torch.float64)


def test_saved_model_switches_between_triton_and_reference(tmp_path):
    from xnn.models.serialization import load_model, save_model

    tri = small_model("triton")
    loaded = load_model(save_model(tri, tmp_path / "tri.pt"))
    assert loaded.hparams["backend"] == "triton" and loaded.interactions[0].tp._fused
    g = _system()
    f_tri = _props(loaded, g)[K.FORCES]
    loaded.set_backend("reference")
    assert loaded.interactions[0].tp._fused is None
    torch.testing.assert_close(_props(loaded, g)[K.FORCES], f_tri, atol=1e-10, rtol=0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_conv_equals_reference_cuda(dtype):
    """``tp_conv`` on the GPU (atomics in both directions) against the gather, reference
    product and scatter, with many programs and two channel blocks, for the model's largest
    grouping (three groups, K = 9).

    One grouping and one channel count only: each (grouping, channel block, dtype) is a Triton
    compilation of the fully unrolled backward kernel, tens of seconds each on an H100 with a
    cold cache (two groupings x two channel counts took 266 s for both dtypes and stalled the
    GPU suite); every grouping is checked against the reference in the interpreter tests."""
    n = 997
    groups, channels = GROUPS[1], 130
    ins = _conv_inputs(5003, n, channels, groups, dtype)
    w, h, m = (t.detach().cuda().requires_grad_() for t in ins[:3])
    snd, rcv = ins[3].cuda(), ins[4].cuda()
    _check_values_and_grads(triton_tp.tp_conv(w, h, m, snd, rcv, n, groups),
                            _conv_reference(w, h, m, snd, rcv, n, groups), (w, h, m), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_equals_reference_cuda(dtype):
    """The compiled kernels on the GPU at sizes with many programs: the smallest and the
    largest group shape (one and two channel blocks) and the odd overlapping groups (K = 5).

    A subset, as in :func:`test_fused_conv_equals_reference_cuda`: each shape x channel block x
    dtype compiles its own kernels (the 5 shapes x 3 channel counts and 3 groupings this test
    took before did not finish in 7 minutes on an H100); every shape and grouping is checked in
    the interpreter tests (:func:`test_op_and_gradients_equal_reference`,
    :func:`test_grouped_op_and_gradients_equal_per_group_reference`)."""
    for shape, channels in (((1, 2, 3), 16), ((4, 5, 9), 130)):
        _check_op(5003, channels, shape, dtype, "cuda")
    for groups in GROUPS[2:]:
        w, x, m = _grouped_inputs(5003, 64, groups, 9 if len(groups) < 12 else 5, dtype,
                                  "cuda")
        out, ref = triton_tp.weighted_bmm(w, x, m, groups), _per_group_reference(w, x, m,
                                                                                  groups)
        _assert_close(out, ref, dtype)
        g = torch.randn_like(ref)
        for got, want in zip(torch.autograd.grad(out, (w, x, m), g),
                             torch.autograd.grad(ref, (w, x, m), g)):
            _assert_close(got, want, dtype)


@pytest.mark.gpu
@requires_cuda
def test_op_with_more_than_2_31_output_entries_cuda():
    """64-bit offsets: ``E * C * K > 2^31`` (fp32, 3.8M edges x 64 x 9); the last edges
    checked against the reference."""
    e, c, (p, a, k) = 3_800_000, 64, (4, 3, 9)
    assert e * c * k > 2**31
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(e, c, p, device="cuda", generator=gen)
    x = torch.randn(e, c, a, device="cuda", generator=gen)
    m = torch.randn(e, p * a, k, device="cuda", generator=gen)
    out = triton_tp.forward(w, x, m)
    tail = slice(e - 1000, e)
    _assert_close(out[tail], _weighted_bmm(w[tail], x[tail], m[tail]), torch.float32)
    g = torch.randn(e, c, k, device="cuda", generator=gen)
    got = triton_tp.backward(g, w, x, m)
    want = triton_tp._reference_backward(g[tail], w[tail], x[tail], m[tail], [(p, a, 0)],
                                         True, True, True)
    for a_, b_ in zip(got, want):
        _assert_close(a_[tail], b_, torch.float32)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_model_triton_equals_reference_cuda(dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=0)
    ref = small_model("reference").to(device="cuda", dtype=dtype)
    tri = small_model("triton").to(device="cuda", dtype=dtype)
    tri.load_state_dict(ref.state_dict())
    g = _system(dtype, "cuda")
    o_ref, o_tri = _props(ref, g), _props(tri, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(o_tri[key], o_ref[key], **tol)
    grads = []
    for model in (ref.train(), tri.train()):
        model.zero_grad()
        _props(model, g, training=True)[K.FORCES].square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **tol)


@pytest.mark.gpu
@requires_cuda
def test_compiled_model_triton_equals_reference_cuda():
    """``model.compile`` (:meth:`compile_for_inference`: ``torch.compile(dynamic=True)`` of the
    edge messages, symbolic sizes through the kernels) on the GPU, fp32."""
    ref = small_model("reference").to(device="cuda", dtype=torch.float32)
    tri = small_model("triton").to(device="cuda", dtype=torch.float32)
    tri.load_state_dict(ref.state_dict())
    tri.compile_for_inference()
    g = _system(torch.float32, "cuda")
    for _ in range(2):  # compile, then run compiled
        o_ref, o_tri = _props(ref, g), _props(tri, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(o_tri[key], o_ref[key], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@requires_cuda
def test_inductor_fullgraph_cuda():
    """``torch.compile(fullgraph=True)`` with inductor: the user kernels inside the graph, no
    graph break, forward and backward equal to eager."""
    import torch._dynamo

    torch._dynamo.utils.counters.clear()
    w, x, m = _inputs(4001, 64, 4, 3, 9, torch.float32, "cuda")

    def f(w, x, m):
        return (triton_tp.weighted_bmm(w, x, m) * 2.0).sin()

    out = torch.compile(f, fullgraph=True)(w, x, m)
    grads = torch.autograd.grad(out.sum(), (w, x, m))
    ref = (_weighted_bmm(w, x, m) * 2.0).sin()
    grads_ref = torch.autograd.grad(ref.sum(), (w, x, m))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    _assert_close(out, ref, torch.float32, scale=1.0)
    for a, b in zip(grads, grads_ref):
        _assert_close(a, b, torch.float32)


@pytest.mark.gpu
@requires_cuda
def test_cuda_graph_replay_of_a_triton_model_follows_eager():
    """``model.backend=triton`` under ``md.cuda_graph=true`` (fp32, the default equivariant
    model on 108 Cu atoms): the replayed compiled step follows the eager reference step over
    30 steps with a rebuild, compiling and capturing once."""
    from helpers.compiled import replay_follows_eager

    from xnn.models import build

    torch.manual_seed(0)
    model = build("equivariant", species=[29], cutoff=4.5).to(device="cuda", dtype=torch.float32)
    tri = build("equivariant", species=[29], cutoff=4.5, backend="triton")
    tri.load_state_dict(model.state_dict())
    replay_follows_eager(model, tri.to(device="cuda", dtype=torch.float32))


def _compiled_training_follows_eager(tmp_path, device: str) -> None:
    """Compiled training of a triton-backend model against eager double backward (fp64)."""
    from xnn.data.datasets import collate
    from xnn.data.emt import write_emt
    from xnn.data.sources import read_structures
    from xnn.models import build
    from xnn.models.compiled_training import CompiledProperties
    from xnn.models.derivatives import compute_properties
    from xnn.neighbors.datasets import WithEdges

    write_emt(tmp_path / "cu.xyz", 4, ["Cu"], seed=3)
    structures = WithEdges(read_structures(tmp_path / "cu.xyz"), 3.5)
    torch.manual_seed(0)
    model = build("equivariant", species=[29], cutoff=3.5, channels=4, l_max=2,
                  hidden_l_max=1, correlation=2, avg_num_neighbors=10.0,
                  backend="triton").to(device=device, dtype=torch.float64)
    compiled = CompiledProperties(model, forces=True, stress=True, backend="aot_eager")
    graph = collate([structures[0], structures[3]]).to(device=device, dtype=torch.float64)
    out, ref = compiled(graph), compute_properties(model, graph, True, True, training=True)
    gm = compiled._variants[0][0].gm
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch.ops.xnn.tp_conv.default, torch.ops.xnn.tp_conv_backward.default} <= targets
    params = list(model.parameters())
    g_c = torch.autograd.grad(out[K.FORCES].square().sum() + out[K.ENERGY].sum(), params)
    g_e = torch.autograd.grad(ref[K.FORCES].square().sum() + ref[K.ENERGY].sum(), params)
    scale = max(float(g.abs().max()) for g in g_e)
    assert scale > 0
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10 * scale)


@pytest.mark.slow
def test_compiled_training_keeps_the_operators(tmp_path):
    """Compiled training (a symbolic ``make_fx`` trace, AOTAutograd's derivative of it: the
    backward operator's own autograd formula) runs the fused convolution (its atom count a
    symbol of the trace, not the traced batch's) and gives eager double backward's weight
    gradients on a batch of another size than the trace's (~120 s on a CPU)."""
    _compiled_training_follows_eager(tmp_path, "cpu")


@pytest.mark.gpu
@requires_cuda
def test_compiled_training_keeps_the_operators_cuda(tmp_path):
    """The same on CUDA (the kernels, not the interpreter)."""
    _compiled_training_follows_eager(tmp_path, "cuda")


def test_exported_artefact_runs_the_reference_kernels():
    """An artefact of a triton-backend model holds no ``xnn::`` operators (torch alone loads
    it) and gives the model's forces."""
    from xnn.models.export import ForceField, example_inputs, trace_forcefield

    tri = small_model("triton")
    gm = trace_forcefield(tri)
    assert tri.interactions[0].tp._fused is not None  # the model itself is unchanged
    assert not [n for n in gm.graph.nodes if "xnn" in str(n.target)]
    inputs = example_inputs(tri)
    for got, want in zip(gm(*inputs), ForceField(tri)(*inputs)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
