"""Kernel backends of the equivariant model: ``backend="cueq"`` (cuEquivariance) is the same
model as the reference einsum path, with the same parameters (fp64 CPU to 1e-10; fp32 CUDA
to 1e-5, skipped without a GPU)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers.kernels import (
    SPECIES,
    assert_same_force_loss_grads,
    assert_same_properties,
    requires_cue,
    small_model,
)
from helpers.kernels import kernel_system as _system
from helpers.kernels import props as _props
from helpers.kernels import tiny_mace as _tiny_mace

from xnn.data import keys as K
from xnn.errors import InputError
from xnn.models import build
from xnn.models.equivariant_ops import EdgeTensorProduct, IrrepsLinear, ProductBasis
from xnn.neighbors import with_edges


@requires_cue
def test_edge_tensor_product_cueq_equals_reference():
    torch.manual_seed(1)
    tp = EdgeTensorProduct(1, 3, 2)
    x, y = torch.randn(9, 5, 4, dtype=torch.float64), torch.randn(9, 16, dtype=torch.float64)
    w = torch.randn(9, 5, tp.num_paths, dtype=torch.float64, requires_grad=True)
    ref = tp(x, y, w)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), w)
    tp.set_backend("cueq")
    out = tp(x, y, w)
    (g_out,) = torch.autograd.grad(out.square().sum(), w)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_out, g_ref, atol=1e-11, rtol=0)


@pytest.mark.parametrize("recompute", [False, True])
@requires_cue
def test_symmetric_contraction_cueq_equals_reference(recompute):
    torch.manual_seed(2)
    pb = ProductBasis(3, 5, 2, 1, 3).double()
    a = torch.randn(11, 5, 9, dtype=torch.float64, requires_grad=True)
    species = torch.tensor([0, 2, 1, 1, 0, 2, 2, 0, 1, 0, 2])
    ref = pb(a, species, recompute=False)
    (g_ref,) = torch.autograd.grad(ref.pow(3).sum(), a)
    pb.set_backend("cueq")
    out = pb(a, species, recompute=recompute)
    (g_out,) = torch.autograd.grad(out.pow(3).sum(), a)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(g_out, g_ref, atol=1e-10, rtol=0)


@requires_cue
def test_linear_cueq_equals_reference():
    torch.manual_seed(3)
    lin = IrrepsLinear(5, 3, 2, bias=True).double()
    lin.bias.data.normal_()
    x = torch.randn(7, 5, 9, dtype=torch.float64)
    ref = lin(x)
    lin.set_backend("cueq")
    torch.testing.assert_close(lin(x), ref, atol=1e-13, rtol=0)


@requires_cue
def test_model_cueq_equals_reference_fp64():
    ref, cq = small_model("reference"), small_model("cueq")
    assert list(cq.state_dict()) == list(ref.state_dict())
    cq.load_state_dict(ref.state_dict())
    assert_same_properties(cq, ref, _system())


@pytest.mark.parametrize("lean", [False, True])
@requires_cue
def test_force_training_gradients_equal(lean):
    """Double backward (force loss -> parameters) is the same through both backends, also
    with edge chunks under activation checkpointing (``lean``)."""
    hp = dict(edge_chunk_size=7, activation_checkpointing=True) if lean else {}
    model, g = small_model("reference", **hp).train(), _system()
    assert_same_force_loss_grads([model, model], g, ["reference", "cueq"])


@requires_cue
def test_saved_model_switches_backend(tmp_path):
    """A model file saved with one backend loads with it (hparams), and its parameters (the
    same names) run with the other."""
    from xnn.models.serialization import load_model, save_model

    cq = small_model("cueq")
    assert cq.hparams["backend"] == "cueq"
    path = save_model(cq, tmp_path / "cq.pt")
    loaded = load_model(path)
    assert loaded.hparams["backend"] == "cueq" and loaded.interactions[0].product._cue
    ref = small_model("reference", seed=1)
    ref.load_state_dict(loaded.state_dict())  # strict: the same names
    g = _system()
    torch.testing.assert_close(_props(ref, g)[K.ENERGY], _props(cq, g)[K.ENERGY],
                               atol=1e-10, rtol=0)
    loaded.set_backend("reference")
    assert loaded.hparams["backend"] == "reference"
    torch.testing.assert_close(_props(loaded, g)[K.FORCES], _props(cq, g)[K.FORCES],
                               atol=1e-10, rtol=0)


def test_unknown_backend_refused():
    with pytest.raises(InputError, match="model.kernel_backend must be one of.*triton"):
        small_model("warp")


def test_cueq_without_package_refused(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cuequivariance_torch", None)  # import raises
    with pytest.raises(InputError, match="pip install cuequivariance-torch"):
        small_model("cueq")


def test_triton_without_package_refused(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "triton", None)  # import raises
    with pytest.raises(InputError, match="pip install triton"):
        small_model("triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@requires_cue
def test_model_cueq_equals_reference_cuda_fp32():
    ref = small_model("reference").float().cuda()
    cq = small_model("cueq").float().cuda()
    cq.load_state_dict(ref.state_dict())
    g = _system(torch.float32, "cuda")
    o_ref, o_cq = _props(ref, g), _props(cq, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(o_cq[key], o_ref[key], atol=1e-5, rtol=1e-5)


@requires_cue
def test_mace_wrapper_cueq_equals_reference():
    """mace-torch's own cuEq conversion behind the same switch: the same energies, forces and
    stress on CPU, the same wrapper parameters, and the backend kept in the saved payload."""
    from xnn.models.external.mace import MACEWrapper

    module = _tiny_mace()
    ref = build("mace", model=module).eval()
    cq = build("mace", model=module, backend="cueq").eval()  # the cueq copy serves eval
    assert list(cq.state_dict()) == list(ref.state_dict())
    g = _system()
    dtype = torch.get_default_dtype()
    o_ref, o_cq = _props(ref, g), _props(cq, g)
    assert torch.get_default_dtype() == dtype  # the conversion's set_default_dtype undone
    assert getattr(cq, "_cueq", None) is not None and getattr(ref, "_cueq", None) is None
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        assert o_ref[key].abs().max() > 1e-6
        # mace's conversion re-expresses the correlation-3 weights in cue's basis (a
        # projection): ~1e-10 eV/Å apart in fp64
        torch.testing.assert_close(o_cq[key], o_ref[key], atol=1e-9, rtol=0)
    again = MACEWrapper.from_payload(cq.to_payload())
    assert again.backend == "cueq"
    torch.testing.assert_close(_props(again.eval(), g)[K.ENERGY], o_ref[K.ENERGY], atol=1e-9,
                               rtol=0)


@requires_cue
def test_set_kernel_backend_from_config():
    """``model.kernel_backend`` reaches the equivariant model (hparams too) and is refused for a
    model without kernel backends and as a hyperparameter."""
    from xnn.config.loader import ConfigError
    from xnn.config.model import ModelConfig
    from xnn.models.cueq import set_kernel_backend

    model = small_model("reference")
    set_kernel_backend(model, "cueq", "equivariant")
    assert model.hparams["backend"] == "cueq" and model.interactions[0].tp.backend == "cueq"
    schnet = build("schnet", species=SPECIES, cutoff=3.0)
    set_kernel_backend(schnet, "reference")
    with pytest.raises(InputError, match="model.kernel_backend=reference"):
        set_kernel_backend(schnet, "cueq", "schnet")
    assert ModelConfig(kernel_backend="cueq").kernel_backend == "cueq"
    with pytest.raises(ConfigError, match="model.kernel_backend"):
        ModelConfig(name="schnet", cutoff=5.0, hyperparameters={"backend": "cueq"}).check_train()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@requires_cue
def test_mace_wrapper_cueq_equals_reference_cuda_fp32():
    module = _tiny_mace().float().cuda()
    ref = build("mace", model=module).eval()
    cq = build("mace", model=module, backend="cueq").eval()
    g = _system(torch.float32, "cuda")
    o_ref, o_cq = _props(ref, g), _props(cq, g)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(o_cq[key], o_ref[key], atol=1e-5, rtol=1e-5)


@requires_cue
def test_train_with_model_backend_cueq(tmp_path):
    """``xnn train model.kernel_backend=cueq`` trains the equivariant model through cuEquivariance
    and saves the backend in the model file; the file runs with the reference backend."""
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.data.emt import write_emt
    from xnn.models.serialization import load_model

    write_emt(tmp_path / "cu.xyz", 6, ["Cu"], seed=0)
    hp = ("model.hyperparameters={channels: 4, l_max: 1, hidden_l_max: 1, correlation: 2, "
          "num_bessel: 4, radial_mlp: [8], num_interactions: 1, readout_hidden: 0}")
    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={tmp_path / 'cu.xyz'}", f"output_dir={tmp_path / 'run'}",
        "data.batch_size=3", "logging.plots=false", "logging.progress_bar=false", "device=cpu",
        "model.name=equivariant", "model.cutoff=3.0", hp, "model.kernel_backend=cueq",
        "max_steps=2"])
    train(cfg)
    model = load_model(tmp_path / "run" / "model.pt")
    assert model.hparams["backend"] == "cueq" and model.interactions[0].tp._cue is not None
    g = with_edges(_system().without_edges(), 3.0)
    g = g.replace(numbers=torch.full_like(g.numbers, 29))
    e_cq = _props(model.double(), g)[K.ENERGY]
    model.set_backend("reference")
    torch.testing.assert_close(_props(model, g)[K.ENERGY], e_cq, atol=1e-10, rtol=0)


def test_md_model_kernel_backend_switches_the_loaded_model():
    """``xnn md model.kernel_backend=...`` sets the kernels of the model it loads (saved:
    as built; a model without kernel backends is refused with what to set)."""
    from xnn.app.md_setup import load_potential
    from xnn.config.loader import load_config
    from xnn.config.md import MDConfig

    def model_of(*extra):
        cfg = load_config(MDConfig, None, ["model.name=equivariant", "model.species=[29]",
                                           *extra])
        model = load_potential(cfg.model, torch.device("cpu"), torch.float64).model
        ops = {m.backend for m in model.modules() if isinstance(m, EdgeTensorProduct)}
        assert ops == {model.hparams["backend"]}  # the kernels, not only the record
        return model

    assert model_of().hparams["backend"] == "reference"
    assert model_of("model.kernel_backend=reference").hparams["backend"] == "reference"
    if importlib.util.find_spec("cuequivariance_torch") is not None:
        assert model_of("model.kernel_backend=cueq").hparams["backend"] == "cueq"
    with pytest.raises(InputError, match="set model.kernel_backend: saved"):
        lj_cfg = load_config(MDConfig, None, [
            "model.name=lj", "model.hyperparameters.sigma=2.3",
            "model.hyperparameters.epsilon=0.4", "model.cutoff=5.0",
            "model.kernel_backend=reference"])
        load_potential(lj_cfg.model, torch.device("cpu"), torch.float64)
