"""The fused radial MLP (:mod:`xnn.models.triton_mlp`): its kernels equal the layers they
replace (forward, and the gradients in the inputs and the cutoff that forces need), e3nn's
radial networks fold into them exactly, MACE's paired interaction blocks give the per-edge
energies, forces and stress through them, the operators trace (``torch.compile``), and the
kernels compile for the H200 (sm_90).

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set per
test (not for ``gpu`` tests), read by the module when an operator is called (see
``tests/test_triton_tp.py``).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

triton = pytest.importorskip("triton")
if not hasattr(torch.library, "triton_op"):
    pytest.skip("needs torch >= 2.6 (torch.library.triton_op)", allow_module_level=True)

from helpers.kernels import SPECIES, requires_cue  # noqa: E402
from helpers.kernels import pair_equivariant as _equivariant  # noqa: E402
from helpers.kernels import paired as _paired  # noqa: E402
from helpers.kernels import tiny_mace as _tiny_mace  # noqa: E402

from xnn.data import keys as K  # noqa: E402
from xnn.models import build, triton_mlp  # noqa: E402
from xnn.models.base import pairing_edges  # noqa: E402
from xnn.models.derivatives import compute_properties  # noqa: E402
from xnn.neighbors import with_edges  # noqa: E402
from xnn.testing import random_periodic_system  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=0, atol=1e-12)}


@pytest.fixture(autouse=True)
def interpret(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of the forward and backward kernels' launches through the operators."""
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        original = getattr(triton_mlp, name)

        def counted(*args, _name=name, _f=original, **kwargs):
            if args[0].device.type == "cuda" or triton_mlp._interpreting(args[0]):
                calls[_name] += 1
            return _f(*args, **kwargs)

        monkeypatch.setattr(triton_mlp, name, counted)
    return calls


def _layers(widths, dtype, bias=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    layers = []
    for a, b in zip(widths, widths[1:]):
        w = (torch.randn(a, b, generator=g, dtype=dtype) / a**0.5).to(device)
        layers.append((w, torch.randn(b, generator=g, dtype=dtype).to(device) if bias else None))
    return layers


def _torch_mlp(x, layers, scales, s):
    """The unpacked network: SiLU times ``scales[i]`` after hidden layer ``i``."""
    h = x
    for i, (w, b) in enumerate(layers):
        h = h @ w + (0 if b is None else b)
        if i < len(layers) - 1:
            h = torch.nn.functional.silu(h) * scales[i]
    return h if s is None else h * s[:, None]


CASES = [  # (widths, bias, scale, rows): MACE's shape, odd widths and rows, one layer
    ([8, 64, 64, 64, 200], False, True, 150),
    ([5, 48, 33, 70], True, True, 37),
    ([8, 16, 24], False, False, 65),
    ([3, 20, 130], True, False, 1),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_fused_mlp_equals_layers(case, dtype, precision, kernel_calls):
    """Forward and the gradients in ``x`` and ``s`` (autograd through the operator) equal
    the torch layers with the activation scales unfolded."""
    widths, bias, scaled, rows = case
    layers = _layers(widths, dtype, bias)
    scales = [1.0 + 0.1 * i for i in range(len(layers) - 1)]
    wh, bh, wo, bo = triton_mlp.pack(layers, scales)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, widths[0], generator=g, dtype=dtype, requires_grad=True)
    s = torch.rand(rows, generator=g, dtype=dtype).requires_grad_(True) if scaled else None
    y = triton_mlp.radial_mlp(x, wh, wo, bh, bo, s, precision)
    ref = _torch_mlp(x, layers, scales, s)
    assert y.shape == (rows, widths[-1]) and ref.abs().max() > 0.1
    torch.testing.assert_close(y, ref, **TOL[dtype])
    gy = torch.randn(y.shape, generator=g, dtype=dtype)
    inputs = (x, s) if scaled else (x,)
    got, want = torch.autograd.grad(y, inputs, gy), torch.autograd.grad(ref, inputs, gy)
    for a, b in zip(got, want):
        assert b.abs().max() > 0.1
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert kernel_calls == {"forward": 1, "backward": 1}


def test_cpu_without_the_interpreter_runs_torch(kernel_calls, monkeypatch):
    """CPU tensors without ``TRITON_INTERPRET``: the operator's torch formula (forward, and
    its hand-written backward), no kernel."""
    monkeypatch.delenv("TRITON_INTERPRET")
    layers = _layers([5, 48, 33, 70], torch.float64, bias=True, seed=2)
    wh, bh, wo, bo = triton_mlp.pack(layers, [0.9, 1.2])
    x = torch.randn(30, 5, dtype=torch.float64, requires_grad=True)
    s = torch.rand(30, dtype=torch.float64, requires_grad=True)
    y = triton_mlp.radial_mlp(x, wh, wo, bh, bo, s)
    ref = _torch_mlp(x, layers, [0.9, 1.2], s)
    torch.testing.assert_close(y, ref, **TOL[torch.float64])
    gy = torch.randn(y.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(y, (x, s), gy), torch.autograd.grad(ref, (x, s), gy)):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
    assert kernel_calls == {"forward": 0, "backward": 0}


def test_backward_without_the_scale_gradient(kernel_calls):
    """``need_s`` false: the kernel skips ``dL/ds``; ``dL/dx`` is unchanged; an input that
    needs no gradient gets none."""
    layers = _layers([6, 32, 40], torch.float64)
    wh, bh, wo, bo = triton_mlp.pack(layers)
    x = torch.randn(20, 6, dtype=torch.float64)
    s = torch.rand(20, dtype=torch.float64)
    g = torch.randn(20, 40, dtype=torch.float64)
    gx, gs = triton_mlp.radial_mlp_backward(g, x, wh, bh, wo, bo, s, need_s=False)
    gx2, gs2 = triton_mlp.radial_mlp_backward(g, x, wh, bh, wo, bo, s, need_s=True)
    assert gs.numel() == 0 and gs2.shape == (20,) and gs2.abs().max() > 0
    torch.testing.assert_close(gx, gx2, rtol=0, atol=0)
    xr = x.clone().requires_grad_(True)
    (gxs,) = torch.autograd.grad(triton_mlp.radial_mlp(xr, wh, wo, s=s), xr, g)
    torch.testing.assert_close(gxs, gx, rtol=0, atol=1e-13)


def test_refuses_weights_with_gradients_and_bad_shapes():
    layers = _layers([4, 16, 8], torch.float32)
    wh, bh, wo, bo = triton_mlp.pack(layers)
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match="require gradients"):
        triton_mlp.radial_mlp(x, wh.requires_grad_(True), wo)
    wh = wh.detach()
    with pytest.raises(ValueError, match="do not fit"):
        triton_mlp.radial_mlp(torch.randn(5, 17), wh, wo)
    with pytest.raises(ValueError, match="do not fit"):
        triton_mlp.radial_mlp(x, wh[:, :12, :12].contiguous(), wo[:12])
    with pytest.raises(ValueError, match="float32 or all float64"):
        triton_mlp.radial_mlp(x.double(), wh, wo)
    with pytest.raises(ValueError, match="precision"):
        triton_mlp.radial_mlp(x, wh, wo, precision="tf32")
    with pytest.raises(ValueError, match="above"):
        triton_mlp.pack(_layers([4, 200, 8], torch.float32))


class _ReportsCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: :func:`triton_mlp.fused`'s choice of path
    without a GPU (nothing here touches the device)."""

    @property
    def is_cuda(self):
        return True


def test_fused_declines_what_the_kernels_cannot_take_or_would_not_speed(kernel_calls):
    """``fused`` returns ``None`` (the caller runs its layers) for a network without a
    hidden layer, one wider than ``MAX_WIDTH``, and float64 on CUDA (the ``ieee`` products
    measured slower than cuBLAS on an H200); float64 on CPU (the interpreter) and float32
    "on CUDA" go to the kernels."""
    x64 = torch.randn(7, 4, dtype=torch.float64)
    layers = _layers([4, 16, 8], torch.float64)
    assert triton_mlp.fused(x64, layers[-1:], [], None, "tf32x3") is None
    assert triton_mlp.fused(x64, _layers([4, 300, 8], torch.float64), [1.0], None,
                            "tf32x3") is None
    fake = torch.Tensor._make_subclass(_ReportsCuda, x64)
    assert fake.is_cuda and not x64.is_cuda
    assert triton_mlp.fused(fake, layers, [1.0], None, "tf32x3") is None
    assert kernel_calls == {"forward": 0, "backward": 0}
    y = triton_mlp.fused(x64, layers, [1.0], None, "tf32x3")
    torch.testing.assert_close(y, _torch_mlp(x64, layers, [1.0], None), **TOL[torch.float64])
    assert kernel_calls["forward"] == 1


def test_e3nn_radial_network_folds_exactly():
    """MACE's radial network (e3nn ``FullyConnectedNet``, normalised SiLU, its layers'
    variance factors) packed: the same outputs (fp64); networks it cannot fold run as
    they are."""
    from e3nn.nn import FullyConnectedNet

    from xnn.models.external._mace_pairs import fused_layers

    torch.manual_seed(0)
    for hs, var_out in (([8, 64, 64, 64, 96], 1), ([4, 16, 10], 3)):
        net = FullyConnectedNet(hs, torch.nn.functional.silu, variance_out=var_out).double()
        net.requires_grad_(False)
        x = torch.randn(30, hs[0], dtype=torch.float64)
        wh, bh, wo, bo = triton_mlp.pack(*fused_layers(net))
        assert bh is None and bo is None and wh.shape[0] == len(hs) - 2
        torch.testing.assert_close(triton_mlp.reference(x, wh, bh, wo, bo, None), net(x),
                                   rtol=0, atol=1e-12)
    assert fused_layers(FullyConnectedNet([4, 8, 8], torch.tanh).requires_grad_(False)) is None
    assert fused_layers(FullyConnectedNet([4, 8, 8], torch.nn.functional.silu)) is None  # grads
    assert fused_layers(torch.nn.Linear(4, 8)) is None
    # wider than the kernels take: no fused result, and MACE's blocks run the network itself
    from xnn.models.external import _mace_pairs

    wide = FullyConnectedNet([4, 256, 8], torch.nn.functional.silu).requires_grad_(False)
    x = torch.randn(5, 4)
    assert triton_mlp.fused(x, *fused_layers(wide), None, "ieee") is None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_mace_pairs, "RADIAL", "ieee")
        torch.testing.assert_close(_mace_pairs._radial(wide, x, None), wide(x), rtol=0, atol=0)


@requires_cue
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_mace_paired_blocks_through_the_fused_mlp(precision, kernel_calls, monkeypatch):
    """MACE's cuEquivariance copy on a paired list with ``RADIAL`` fused: each interaction's
    radial MLP and cutoff in the kernels (half the edges), and the per-edge energies,
    forces and stress (fp64)."""
    from xnn.models.external import _mace_pairs

    model = build("mace", model=_tiny_mace(), backend="cueq").eval()
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = _paired(with_edges(g.to(dtype=torch.float64), 3.0))
    ref = compute_properties(model, g)
    monkeypatch.setattr(_mace_pairs, "RADIAL", precision)
    with pairing_edges():
        out = compute_properties(model, g)
    assert kernel_calls == {"forward": 2, "backward": 2}  # two interactions
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-6
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)


@pytest.mark.parametrize("paired", [False, True])
def test_equivariant_radial_networks_through_the_fused_mlp(paired, kernel_calls, monkeypatch):
    """xnn's equivariant model with ``RADIAL_KERNEL`` fused and frozen weights (as the MD
    application leaves them): every interaction's radial MLP in the kernels, per edge or
    once per pair, and the energies, forces and stress of its torch layers (fp64); with
    weights that need gradients (training), the torch layers."""
    from xnn.models import equivariant

    model = _equivariant().eval()
    g = random_periodic_system(SPECIES, 10, volume_per_atom=11.0, min_distance=1.0, seed=4)
    g = with_edges(g.to(dtype=torch.float64), 3.5)
    g = _paired(g) if paired else g
    ref = compute_properties(model, g)
    monkeypatch.setattr(equivariant, "RADIAL_KERNEL", "tf32x3")
    with pairing_edges(paired):
        compute_properties(model, g)
    assert kernel_calls == {"forward": 0, "backward": 0}  # trainable weights: torch
    model.requires_grad_(False)
    with pairing_edges(paired):
        out = compute_properties(model, g)
    n = len(model.interactions)
    assert kernel_calls == {"forward": n, "backward": n}
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-6
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-12)


def test_operator_traces_under_compile(kernel_calls):
    """``make_fx`` (how ``md.compile`` traces energy + forces) records both operators and the
    traced graph gives the eager values, the kernels running at call time;
    ``torch.compile(fullgraph=True)`` (AOTAutograd) differentiates through the operator."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layers = _layers([8, 32, 32, 48], torch.float64, seed=3)
    wh, bh, wo, bo = triton_mlp.pack(layers, [1.3, 0.7])

    def f(x, s):
        y = triton_mlp.radial_mlp(x.sin(), wh, wo, bh, bo, s.cos())
        e = (y * y).sum()
        return e, *torch.autograd.grad(e, (x, s))

    x = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    s = torch.rand(40, dtype=torch.float64, requires_grad=True)
    gm = make_fx(f, tracing_mode="fake", _allow_non_fake_inputs=True)(x, s)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {torch.ops.xnn.radial_mlp.default,
            torch.ops.xnn.radial_mlp_backward.default} <= targets
    assert kernel_calls == {"forward": 0, "backward": 0}  # (fake tensors: no kernels)
    for got, want in zip(gm(x, s), f(x, s)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert kernel_calls == {"forward": 2, "backward": 2}
    compiled = torch.compile(lambda x, s: triton_mlp.radial_mlp(x, wh, wo, bh, bo, s),
                             fullgraph=True, backend="aot_eager")
    out = compiled(x, s)
    ref = triton_mlp.reference(x, wh, bh, wo, bo, s)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.square().sum(), (x, s)),
                    torch.autograd.grad(ref.square().sum(), (x, s))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def _sm90_compile(kernel, pointers, ints, constexprs, dtype):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**{p: f"*{dtype}" for p in pointers}, **{i: "i64" for i in ints},
           **{c: "constexpr" for c in constexprs}}
    src = ASTSource(kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


FWD_ARGS = (["x_ptr", "wh_ptr", "bh_ptr", "wo_ptr", "bo_ptr", "s_ptr", "y_ptr"],
            ["n_rows", "sx_r", "sy_r"])
BWD_ARGS = (["g_ptr", "x_ptr", "wh_ptr", "bh_ptr", "wo_ptr", "bo_ptr", "s_ptr", "gx_ptr",
             "gs_ptr"], ["n_rows", "sg_r", "sx_r", "sgx_r"])


def _compiles_for_h200(dtype, precision, bias, as_inductor_copies=False):
    """Both kernels compiled for sm_90 (MACE's shape); ``as_inductor_copies``: from the
    source that inductor generates for them in a compiled graph (the kernel and the device
    functions it calls, copied by name)."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("Triton without its NVIDIA backend")
    kernels = [triton_mlp._FWD, triton_mlp._BWD]
    if as_inductor_copies:
        import importlib.util

        wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
        copy = getattr(wrapper, "user_defined_triton_kernel_transitive_closure_source_code",
                       None)
        if copy is None:
            pytest.skip("this torch's inductor has no such source copy")
        for i, k in enumerate(kernels):
            path = tempfile.mkdtemp() + "/kernel.py"
            with open(path, "w") as f:
                f.write("import triton\nimport triton.language as tl\n@triton.jit\n" + copy(k))
            spec = importlib.util.spec_from_file_location("kernel", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            kernels[i] = getattr(mod, k.fn.__name__)
    c = dict(n_out=1792, D0=8, H=64, L=3, HAS_BIAS=bias, HAS_SCALE=True,
             BLOCK_P=triton_mlp.BLOCK_P, BLOCK_N=triton_mlp.BLOCK_N, PREC=precision)
    fwd = _sm90_compile(kernels[0], *FWD_ARGS, c, dtype)
    c.update(NEED_S=True, BLOCK_P=triton_mlp.BWD_BLOCK_P, BLOCK_N=triton_mlp.BWD_BLOCK_N)
    bwd = _sm90_compile(kernels[1], *BWD_ARGS, c, dtype)
    return fwd.asm["ptx"], bwd.asm["ptx"]


@pytest.mark.slow  # 66 s on 2 loaded cores, as the rest of the sm_90 compile family
def test_kernels_compile_for_the_h200_tf32x3(monkeypatch):
    """The kernels as the H200 gets them (sm_90; no GPU needed to compile), as inductor
    copies them into a compiled MD step: the tf32x3 products are tensor-core ``mma``
    instructions."""
    monkeypatch.delenv("TRITON_INTERPRET")  # (the copies' triton.jit: real kernels)
    for ptx in _compiles_for_h200("fp32", "tf32x3", False, as_inductor_copies=True):
        assert "mma" in ptx and ".tf32" in ptx


@pytest.mark.slow
@pytest.mark.parametrize("dtype,precision,bias", [("fp32", "ieee", False),
                                                  ("fp32", "tf32x3", True),
                                                  ("fp64", "ieee", False)])
def test_kernels_compile_for_the_h200(dtype, precision, bias):
    for ptx in _compiles_for_h200(dtype, precision, bias):
        assert ".entry" in ptx


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_fused_mlp_cuda_accuracy(precision):
    """On CUDA, MACE's radial shape: the fused fp32 kernels' errors against an fp64
    evaluation are of the order of the fp32 torch layers' own (within 4x, for y, dL/dx and
    dL/ds)."""
    layers64 = _layers([8, 64, 64, 64, 1792], torch.float64, device="cuda")
    scales = [1.68, 1.68, 1.68]
    x64 = torch.randn(20000, 8, dtype=torch.float64, device="cuda")
    s64 = torch.rand(20000, dtype=torch.float64, device="cuda")
    g64 = torch.randn(20000, 1792, dtype=torch.float64, device="cuda")

    def run(fused, dtype):
        layers = [(w.to(dtype), None) for w, _ in layers64]
        x = x64.to(dtype).requires_grad_(True)
        s = s64.to(dtype).requires_grad_(True)
        if fused:
            wh, bh, wo, bo = triton_mlp.pack(layers, scales)
            y = triton_mlp.radial_mlp(x, wh, wo, bh, bo, s, precision)
        else:
            y = _torch_mlp(x, layers, scales, s)
        gx, gs = torch.autograd.grad(y, (x, s), g64.to(dtype))
        return [t.double() for t in (y, gx, gs)]

    exact = run(False, torch.float64)
    plain = run(False, torch.float32)
    fused = run(True, torch.float32)
    assert torch.allclose(run(True, torch.float64)[0], exact[0], rtol=0, atol=1e-12)
    for f, p, e in zip(fused, plain, exact):
        err_f, err_p = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err_f <= 4 * err_p + 1e-7 * e.abs().max().item(), (err_f, err_p)


@pytest.mark.gpu
@requires_cuda
@requires_cue
@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_mace_paired_fused_mlp_cuda(precision, monkeypatch):
    """MACE's paired blocks with the fused radial MLP on CUDA give the per-edge evaluation
    (fp32)."""
    from xnn.models.external import _mace_pairs

    model = build("mace", model=_tiny_mace().float().cuda(), backend="cueq").eval()
    g = random_periodic_system(SPECIES, 40, volume_per_atom=11.0, min_distance=1.0, seed=5)
    g = _paired(with_edges(g.to(dtype=torch.float32, device="cuda"), 3.5))
    ref = compute_properties(model, g)
    monkeypatch.setattr(_mace_pairs, "RADIAL", precision)
    with pairing_edges():
        out = compute_properties(model, g)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert ref[key].abs().max() > 1e-4
        torch.testing.assert_close(out[key], ref[key], rtol=1e-5, atol=1e-5)
