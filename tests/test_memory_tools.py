"""Memory tools: activation checkpointing, CPU offload of saved tensors, CUDA memory profile.

Checkpointing and offload must not change a force-training step: the loss and every
parameter gradient of an energy + force + stress loss equal the plain step's (fp64, 1e-12).
"""

from __future__ import annotations

import pickle

import pytest
import torch

from xnn.config.loader import ConfigError, load_config
from xnn.config.train import TrainConfig
from xnn.data import keys as K
from xnn.data.emt import write_emt
from xnn.errors import InputError
from xnn.io.memory_profile import MemoryProfile
from xnn.models import build
from xnn.models.derivatives import compute_properties
from xnn.neighbors import with_edges
from xnn.testing.systems import random_periodic_system
from xnn.training.memory import MemoryTools, set_activation_checkpointing

SPECIES = [29, 79]
HP = {
    "schnet": dict(num_features=8, num_filters=8, num_basis=6, num_interactions=3),
    "painn": dict(num_features=8, num_basis=6, num_interactions=3),
    "equivariant": dict(channels=4, radial_mlp=[8], num_interactions=3, correlation=2),
}


def _model(name, checkpointing=False, **extra):
    torch.manual_seed(0)
    m = build(name, species=SPECIES, cutoff=3.5, activation_checkpointing=checkpointing,
              **HP[name], **extra).double()
    m.set_statistics(e0={29: -1.0, 79: -2.0}, scale=1.3, shift=0.2)
    return m.train()


def _graph(seed=1, n_atoms=10):
    g = random_periodic_system(SPECIES, n_atoms=n_atoms, volume_per_atom=14.0,
                               min_distance=1.9, seed=seed)
    return with_edges(g, 3.5)


def _step(model, graph, memory=None):
    """Loss and parameter gradients of an energy + force + stress loss (force training)."""
    model.zero_grad(set_to_none=True)
    ctx = memory.context() if memory is not None else torch.enable_grad()
    with ctx:
        p = compute_properties(model, graph, forces=True, stress=True, training=True)
        loss = (p[K.ENERGY] ** 2).sum() + (p[K.FORCES] ** 2).sum() + (p[K.STRESS] ** 2).sum()
        loss.backward()
    return loss.detach(), [q.grad.clone() for q in model.parameters()]


def _assert_same(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.allclose(la, lb, rtol=1e-12, atol=0)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12 * float(y.abs().max()))


def _saved_bytes(model, graph) -> int:
    """Bytes autograd keeps after the first derivative of force training (what the second
    backward needs), parameters excluded, each storage once."""
    params = {q.data_ptr() for q in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        compute_properties(model, graph, forces=True, stress=False, training=True)
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(HP))
def test_checkpointing_gives_the_same_gradients_and_keeps_less(name):
    g = _graph()
    plain, ckpt = _model(name), _model(name, True)
    _assert_same(_step(ckpt, g), _step(plain, g))
    assert ckpt.hparams["activation_checkpointing"] is True
    # it is active: far fewer bytes kept for the second backward (fails without it)
    big = _graph(seed=2, n_atoms=40)
    assert _saved_bytes(ckpt, big) < 0.75 * _saved_bytes(plain, big)
    # evaluation and no-grad: a plain call (nothing recomputed, the same numbers)
    ckpt.eval()
    plain.eval()
    with torch.no_grad():
        assert torch.equal(ckpt(g), plain(g))
    assert _saved_bytes(ckpt, big) == _saved_bytes(plain, big)


class _LiveSaved:
    """Live bytes of the tensors saved for backward (each storage once), and their peak."""

    def __init__(self, params):
        self.params = {q.data_ptr() for q in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        return t if t.data_ptr() in self.params else _Saved(self, t)

    @staticmethod
    def unpack(h):
        return h.tensor if isinstance(h, _Saved) else h

    def count(self, t, sign: int) -> None:
        key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        refs = self.refs.get(key, 0) + sign
        if refs:
            self.refs[key] = refs
        else:
            del self.refs[key]
        if (sign, refs) in ((1, 1), (-1, 0)):
            self.live += sign * n
        self.peak = max(self.peak, self.live)


class _Saved:
    def __init__(self, counter: _LiveSaved, t: torch.Tensor):
        self.counter, self.tensor = counter, t
        counter.count(t, 1)

    def __del__(self):
        self.counter.count(self.tensor, -1)


def _peak_saved(model, graph) -> int:
    """Peak of the live bytes saved for backward over a whole force-training step (both
    backward passes and their recomputations), parameters excluded."""
    counter = _LiveSaved(model.parameters())
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        _step(model, graph)
    return counter.peak


def test_equivariant_checkpointing_recomputes_one_edge_chunk_at_a_time(monkeypatch):
    """The peak of saved bytes is the kept node-sized tensors plus one edge chunk's pieces
    (with the whole layer as one checkpointed block, as before: 2.3x here, the
    recomputation of a whole layer inside the second backward)."""
    import xnn.models.equivariant as eq

    g = _graph(seed=2, n_atoms=40)
    monkeypatch.setattr(eq, "CKPT_MIN_EDGES", 1)  # pieces of 4 edges per atom: 474 -> 3
    plain, ckpt = _model("equivariant"), _model("equivariant", True)
    assert len(ckpt.edge_features(g).chunks) == 3
    _assert_same(_step(ckpt, g), _step(plain, g))
    assert _peak_saved(plain, g) > 4.0 * _peak_saved(ckpt, g)


def test_equivariant_layer_checkpointing_with_edge_chunks():
    g = _graph()
    ref = _step(_model("equivariant", edge_chunk_size=None), g)
    _assert_same(_step(_model("equivariant", True, edge_chunk_size=40), g), ref)


@pytest.mark.parametrize("name", ["schnet", "equivariant"])
def test_offload_alone_and_with_checkpointing_gives_the_same_gradients(name, monkeypatch):
    g = _graph()
    ref = _step(_model(name), g)
    packed = []
    real = torch.autograd.graph.save_on_cpu.__init__

    def counting(self, pin_memory=False, device_type="cuda"):
        real(self, pin_memory, device_type)
        pack = self.pack_hook
        self.pack_hook = lambda t: packed.append(1) or pack(t)

    monkeypatch.setattr(torch.autograd.graph.save_on_cpu, "__init__", counting)
    memory = MemoryTools(offload_activations=True)
    _assert_same(_step(_model(name), g, memory), ref)
    assert packed  # the offload hooks saw the saved tensors
    _assert_same(_step(_model(name, True), g, memory), ref)


def test_model_file_with_checkpointing_loads_and_evaluates_identically(tmp_path):
    from xnn.models.serialization import load_model, save_model

    model = _model("painn", True)
    save_model(model, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt").double()
    assert loaded.activation_checkpointing and loaded.hparams == model.hparams
    g = _graph()
    for m in (model, loaded):
        m.eval()
    a = compute_properties(model, g)
    b = compute_properties(loaded, g)
    for k in (K.ENERGY, K.FORCES, K.STRESS):
        assert torch.equal(a[k], b[k])
    # an older file without the key rebuilds the same model, without checkpointing
    hp = dict(model.hparams)
    del hp["activation_checkpointing"]
    from xnn.models.registry import rebuild

    assert rebuild("painn", hp).activation_checkpointing is False


def test_unsupported_models_are_refused():
    lj = build("lj", sigma=2.3, epsilon=0.4, cutoff=5.0)
    set_activation_checkpointing(lj, False, "lj")  # off: nothing to do
    with pytest.raises(InputError, match="no activation checkpointing"):
        set_activation_checkpointing(lj, True, "lj")
    with pytest.raises(InputError, match="compile=true"):
        set_activation_checkpointing(_model("schnet"), True, "schnet", compile=True)


def test_profile_on_cpu_is_a_clear_message():
    with pytest.raises(InputError, match="memory.profile_prefix needs a CUDA device"):
        MemoryProfile("prof", 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("emt")
    write_emt(d / "cu.xyz", 8, ["Cu"], seed=0)
    return d / "cu.xyz"


def _cfg(out, data, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", "model.cutoff=3.0",
        "model.name=schnet", "model.hyperparameters={num_features: 8, num_filters: 8, "
        "num_interactions: 2, num_basis: 6}", "data.batch_size=2", "data.val_fraction=0.25",
        "max_epochs=1", "logging.plots=false", "logging.progress_bar=false",
        "precision=fp64", *extra])


def test_training_run_with_memory_options(tmp_path, data):
    from xnn.app.train import train
    from xnn.training.checkpoint import load_checkpoint

    with pytest.raises(InputError, match="needs a CUDA device"):
        train(_cfg(tmp_path / "p", data, "device=cpu", f"memory.profile_prefix={tmp_path}/x"))
    assert not (tmp_path / "p").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="set model.activation_checkpointing, not "
                                          "model.hyperparameters"):
        train(_cfg(tmp_path / "h", data, "model.hyperparameters.activation_checkpointing=true"))
    train(_cfg(tmp_path / "a", data, "device=cpu"))
    train(_cfg(tmp_path / "b", data, "device=cpu", "model.activation_checkpointing=true",
               "memory.offload_activations=true"))
    ref = load_checkpoint(tmp_path / "a" / "checkpoints" / "last.pt")
    saved = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")
    assert saved["model"]["hparams"]["activation_checkpointing"] is True
    for k, w in ref["model"]["state_dict"].items():  # 3 optimizer steps: the same weights
        torch.testing.assert_close(saved["model"]["state_dict"][k], w, rtol=1e-10, atol=1e-12)
    # resuming with checkpointing switched off is allowed (not an architecture change)
    train(_cfg(tmp_path / "b", data, "device=cpu", "max_epochs=2", "resume=auto"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile_files_appear_and_load(tmp_path, data):
    from xnn.app.train import train

    prefix = tmp_path / "prof" / "mem"
    train(_cfg(tmp_path / "run", data, "device=cuda", "max_steps=3", "max_epochs=5",
               f"memory.profile_prefix={prefix}", "memory.profile_steps=3",
               "model.activation_checkpointing=true", "memory.offload_activations=true"))
    path = tmp_path / "prof" / "mem_rank0.pickle"
    assert path.is_file()
    with open(path, "rb") as f:
        snap = pickle.load(f)
    assert snap["segments"] and any(t for t in snap["device_traces"])
