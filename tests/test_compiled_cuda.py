"""``md.cuda_graph=true``: on a GPU (skipped without CUDA) the compiled step (inductor)
replayed as a CUDA graph follows the eager step over 50 steps with rebuilds, captures once
and compiles nothing after its first step (NVE, Langevin and CSVR, fp64, LJ: the
noise hash compiled by Triton gives the eager bits); on the CPU, the
replay's bookkeeping (static buffers, inputs copied only when they changed, edges after a
rebuild) through a stand-in for the CUDA graph that runs the captured call again."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from helpers.compiled import MD_SKIN as SKIN
from helpers.compiled import argon_system as _system
from helpers.compiled import md_model as _model
from helpers.compiled import replay_follows_eager
from helpers.compiled import unique_graphs as _unique_graphs

from xnn.dynamics import csvr, langevin, nve
from xnn.dynamics.compiled_thermo import CompiledIntegrator
from xnn.models import Potential

ARGS = {"nve": {}, "langevin": dict(temperature=500.0, friction=0.05, seed=7),
        "csvr": dict(temperature=500.0, tau=20.0, seed=7)}
MODULES = {"nve": nve, "langevin": langevin, "csvr": csvr}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nve", "langevin", "csvr"])
def test_cuda_graph_replay_follows_eager(name):
    torch._dynamo.utils.counters.clear()
    dev = torch.device("cuda")
    mod, model = MODULES[name], _model("lj").to(dev)
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    integ = CompiledIntegrator(name, compiled_pot, backend="inductor", cuda_graph=True)
    stepper = integ.stepper
    eager = compiled = mod.init(_system().to(dev), eager_pot, **ARGS[name])
    for _ in range(4):  # compile, warm-up runs, capture
        eager, compiled = mod.step(eager, eager_pot, 2.0), integ.step(compiled, compiled_pot, 2.0)
    graphs, rebuilds = _unique_graphs(), stepper.n_rebuilds
    assert stepper.n_compiles == 1 and stepper._replay.n_captures == 1
    for i in range(46):
        if i == 20:  # one rebuild for sure: new edges, same capacity, copied in place
            stepper._next_disp = torch.tensor(float("inf"), device=dev)
        eager, compiled = mod.step(eager, eager_pot, 2.0), integ.step(compiled, compiled_pot, 2.0)
    assert stepper.n_rebuilds > rebuilds
    assert stepper.n_compiles == 1 and _unique_graphs() == graphs  # replays compile nothing
    assert stepper._replay.n_captures == 1  # and capture nothing either
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0
    assert compiled.step == eager.step == 50
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled.velocities, eager.velocities, rtol=0, atol=1e-11)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-9)
    for k, v in eager.vars.items():
        torch.testing.assert_close(compiled.vars[k], v, rtol=0, atol=1e-9)


class _FakeGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: ``replay`` runs the captured call on the
    captured (static) inputs again and writes into the captured outputs, as a replay does."""

    capturing: _FakeGraph | None = None

    def __init__(self):
        self.call = None

    def replay(self):
        fn, args, outs = self.call
        for o, n in zip(outs, fn(*args)):
            o.copy_(n)


class _Stream:
    def wait_stream(self, other):
        pass


@contextlib.contextmanager
def _capture(graph):
    _FakeGraph.capturing = graph
    try:
        yield
    finally:
        _FakeGraph.capturing = None


def _recording(fn):
    def call(*args):
        out = fn(*args)
        if _FakeGraph.capturing is not None:
            _FakeGraph.capturing.call = (fn, args, out)
        return out
    return call


def _fake_cuda_graphs(monkeypatch):
    for name, value in [("CUDAGraph", _FakeGraph), ("graph", _capture), ("Stream", _Stream),
                        ("current_stream", _Stream),
                        ("stream", lambda s: contextlib.nullcontext())]:
        monkeypatch.setattr(torch.cuda, name, value)


def test_failed_capture_says_what_to_set(monkeypatch):
    """A step that cannot be captured (as a cueq model's once could not) fails with one line
    that names ``md.cuda_graph: false``, and the next call tries the capture again."""
    from xnn.dynamics.compiled_graphs import CudaGraphStep

    _fake_cuda_graphs(monkeypatch)

    def fn(x):
        if _FakeGraph.capturing is not None:
            raise NotImplementedError("Attempt to trace generator\nmore")
        return (x + 1,)

    step = CudaGraphStep(fn, warmup=1)
    x = torch.zeros(3)
    assert torch.equal(step(x)[0], x + 1)  # the warm-up call runs fn itself
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"NotImplementedError: Attempt to trace "
                           r"generator\): set md.cuda_graph: false"):
            step(x)
    assert step.n_captures == 0


def test_replay_bookkeeping_follows_eager(monkeypatch, one_thread):
    from xnn.dynamics.compiled_graphs import CudaGraphStep

    _fake_cuda_graphs(monkeypatch)
    real_init = CudaGraphStep.__init__
    monkeypatch.setattr(CudaGraphStep, "__init__",
                        lambda self, fn, warmup=2: real_init(self, _recording(fn), warmup))
    model = _model("lj")
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    integ = CompiledIntegrator("langevin", compiled_pot, backend="aot_eager")
    stepper = integ.stepper
    stepper.cuda_graph = True  # the CPU refuses it at construction
    eager = compiled = langevin.init(_system(), eager_pot, **ARGS["langevin"])
    for _ in range(60):
        eager = langevin.step(eager, eager_pot, 2.0)
        compiled = integ.step(compiled, compiled_pot, 2.0)
    assert stepper.n_rebuilds >= 2 and stepper._replay.n_captures == 1
    assert stepper.n_compiles == 1
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.velocities, eager.velocities, rtol=0, atol=1e-12)
    torch.testing.assert_close(compiled.vars["heat"], eager.vars["heat"], rtol=0, atol=1e-10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(importlib.util.find_spec("cuequivariance_torch") is None,
                    reason="needs cuEquivariance (pip install cuequivariance-torch)")
def test_cuda_graph_replay_of_a_cueq_model_follows_eager():
    """``model.backend=cueq`` under ``md.cuda_graph=true`` (fp32, equivariant model on 108
    Cu atoms): the replayed step follows the eager cueq step over 30 steps with a rebuild,
    capturing once."""
    from xnn.models import build

    torch.manual_seed(0)
    model = build("equivariant", species=[29], cutoff=4.5).to(device="cuda", dtype=torch.float32)
    model.set_backend("cueq")
    replay_follows_eager(model, model)
