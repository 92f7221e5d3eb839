"""Compiled training (make_fx trace + torch.compile): the same properties and weight gradients
as eager double backward, one compiled graph for batches of any size, wrong traces refused."""

from __future__ import annotations

import pytest
import torch

from xnn.data import keys as K
from xnn.data.datasets import collate
from xnn.data.emt import write_emt
from xnn.data.sources import read_structures
from xnn.models import build
from xnn.models.base import AtomisticModel
from xnn.models.compiled_training import CompiledProperties, CompileError, verify
from xnn.models.derivatives import compute_properties
from xnn.models.heads import Heads
from xnn.neighbors.datasets import WithEdges

TINY = {
    "schnet": dict(num_features=8, num_filters=8, num_interactions=2, num_basis=8),
    "painn": dict(num_features=8, num_interactions=2, num_basis=8),
    "equivariant": dict(channels=4, l_max=2, hidden_l_max=1, num_interactions=2,
                        correlation=2, avg_num_neighbors=10.0),
}


@pytest.fixture(scope="module")
def structures(tmp_path_factory):
    path = tmp_path_factory.mktemp("emt") / "cu.xyz"
    write_emt(path, 12, ["Cu"], seed=3)
    return WithEdges(read_structures(path), 3.5)


def _loss(out):
    # energy, forces and stress all enter (stress scaled up to weigh like the others)
    return (out[K.ENERGY].square().sum() + out[K.FORCES].square().sum()
            + 1e3 * out[K.STRESS].square().sum())


def _assert_matches_eager(compiled, model, graph, params):
    """The compiled properties of ``graph`` equal eager's (1e-12) and so do the weight
    gradients of a loss on them (1e-10 relative); returns eager's properties."""
    out = compiled(graph)
    ref = compute_properties(model, graph, True, True, training=True)
    for key in (K.ENERGY, K.FORCES, K.STRESS):
        torch.testing.assert_close(out[key], ref[key], rtol=1e-12, atol=1e-12)
    g_c = torch.autograd.grad(_loss(out), params)
    g_e = torch.autograd.grad(_loss(ref), params)
    scale = max(float(g.abs().max()) for g in g_e)
    err = max(float((a - b).abs().max()) for a, b in zip(g_c, g_e)) / scale
    assert err < 1e-10 and scale > 0, err
    return ref


def _check_against_eager(name, structures):
    torch.manual_seed(0)
    model = build(name, species=[29], cutoff=3.5, **TINY[name]).double()
    compiled = CompiledProperties(model, forces=True, stress=True, backend="aot_eager")
    params = [p for p in model.parameters()]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # batches of different sizes (2, 3 and 4 structures) share one trace and one compiled
    # graph; one structure (size 1: outside the first trace's guards) gets a trace of its own
    for index in ([0, 5], [1, 2, 7], [3, 4, 8, 11], [6], [9, 10]):
        graph = collate([structures[i] for i in index]).to(dtype=torch.float64)
        _assert_matches_eager(compiled, model, graph, params)
    assert compiled.verified_rel_diff is not None and compiled.verified_rel_diff < 1e-10
    assert compiled.eager_calls == 0
    assert compiled.n_traces == 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name", ["schnet", pytest.param("painn", marks=pytest.mark.slow)])
def test_compiled_properties_match_eager_double_backward(name, structures):
    """PaiNN's sqrt (its saved output) is the case a plain make_fx trace gets wrong."""
    _check_against_eager(name, structures)


@pytest.mark.slow
def test_compiled_properties_match_eager_equivariant(structures):
    _check_against_eager("equivariant", structures)


class _TwoHeadPair(Heads, AtomisticModel):
    """Per-atom energy ``sum_j exp(-w r_ij)``, ``w`` the weight of the atom's head (two
    heads): the smallest multi-head model, cheap to trace."""

    cutoff = 3.5

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.7, 1.1], dtype=torch.float64))

    @property
    def head_names(self):
        return ("a", "b")

    def forward(self, graph):
        which = self.atom_heads(graph, graph.n_atoms)
        w = self.w[self.active_head].expand(graph.n_atoms) if which is None else self.w[which]
        r = graph.edge_vectors().norm(dim=-1)
        receiver = graph.edge_index[1]
        pair = torch.exp(-w[receiver] * r)
        return torch.zeros(graph.n_atoms, dtype=r.dtype).index_add(0, receiver, pair)


def test_compiled_multihead_matches_eager(structures):
    """Multi-head training (``finetune.heads``): each structure's ``head`` is an input of the
    trace (was dropped: every atom took the default head), so batches mixing the two heads
    give eager's properties and weight gradients (1e-12, 1e-10), in one trace for batches of
    2-4 structures; swapping the heads changes the energies (the heads differ). The seam is
    model-independent: a two-head pair model here (the equivariant model took 262 s)."""
    from helpers.training import with_heads

    model = _TwoHeadPair()
    compiled = CompiledProperties(model, forces=True, stress=True, backend="aot_eager")
    params = list(model.parameters())
    torch._dynamo.reset()
    for index in ([0, 5], [1, 2, 7], [3, 4, 8, 11]):
        items = [structures[i] for i in index]
        graph = collate(with_heads(items, [i % 2 for i in index])).to(dtype=torch.float64)
        ref = _assert_matches_eager(compiled, model, graph, params)
        swapped = collate(with_heads(items, [1 - i % 2 for i in index])).to(dtype=torch.float64)
        moved = (compiled(swapped)[K.ENERGY] - ref[K.ENERGY]).detach().abs() / graph.n_atoms
        assert float(moved.min()) > 1e-3  # eV/atom: the head of every structure matters
    assert compiled.eager_calls == 0 and compiled.n_traces == 1


class _StopGradient(AtomisticModel):
    """Pair energy whose weight enters through a detached factor: a trace (where detach is an
    alias) differentiates what eager autograd does not."""

    cutoff = 3.5

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, graph):
        r = graph.edge_vectors().norm(dim=-1)
        pair = torch.exp(-self.w * r) * torch.cos(self.w * r).detach()
        return torch.zeros(graph.n_atoms, dtype=r.dtype).index_add(0, graph.edge_index[1], pair)


def test_trace_that_differs_from_eager_is_refused(structures):
    graph = collate([structures[i] for i in (0, 1)]).to(dtype=torch.float64)
    with pytest.raises(CompileError, match="differs from eager"):
        verify(_StopGradient(), graph, True, True)
    model = build("schnet", species=[29], cutoff=3.5, **TINY["schnet"])
    assert verify(model, graph, True, True) < 1e-10


def test_compile_config_rules():
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.train import TrainConfig

    with pytest.raises(ConfigError, match="bf16_mixed"):
        load_config(TrainConfig, None, ["compile=true", "precision=bf16_mixed"])
    assert load_config(TrainConfig, None, ["compile=true"]).compile is True


@pytest.mark.slow
def test_xnn_train_compiled_matches_eager(tmp_path, structures):
    """``xnn train compile=true`` (inductor) follows the eager run's loss curve."""
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.training.checkpoint import load_checkpoint

    data = tmp_path / "cu.xyz"
    write_emt(data, 12, ["Cu"], seed=0)

    def cfg(out, compile):
        return load_config(TrainConfig, None, [
            f"data.datasets.0.path={data}", f"output_dir={tmp_path / out}", "model.cutoff=3.0",
            "model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
            "num_basis: 8}", "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=2",
            "precision=fp64", "logging.plots=false", "logging.progress_bar=false",
            "loss.stress.weight=1.0", "device=cpu", f"compile={str(compile).lower()}"])

    train(cfg("eager", False))
    train(cfg("compiled", True))
    hist = [load_checkpoint(tmp_path / f"{o}/checkpoints/last.pt")["progress"]["history"]
            for o in ("eager", "compiled")]
    assert len(hist[0]) == len(hist[1]) == 2
    for a, b in zip(*hist):
        for key in ("train_loss", "val_loss", "val_forces_mae"):
            assert b[key] == pytest.approx(a[key], rel=1e-8), key


def test_verify_copy_shares_scripted_functions():
    """The float64 reference copy of ``verify`` works when a module holds a TorchScript
    function (e3nn's ``SphericalHarmonics.sph_func`` once e3nn's scripting is on, as after
    mace-torch's compile preparation): ``copy.deepcopy`` raises on those."""
    import copy

    from xnn.models import build
    from xnn.models.compiled_training import _deepcopy

    torch.manual_seed(0)
    model = build("equivariant", species=[29], cutoff=3.5, channels=4, l_max=1)
    model.sh.sph_func = torch.jit.script(model.sh.sph_func)
    with pytest.raises(Exception, match="cannot be pickled"):
        copy.deepcopy(model)
    clone = _deepcopy(model)
    assert clone.sh.sph_func is model.sh.sph_func
    for a, b in zip(clone.parameters(), model.parameters()):
        assert a is not b and torch.equal(a, b)
