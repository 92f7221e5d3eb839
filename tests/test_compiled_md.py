"""The compiled MD step (xnn.dynamics.compiled, md.compile=true): no steady-state
recompiles over 200 steps with neighbor-list rebuilds, and the trajectory of the eager
velocity-Verlet step (fp64), for LJ and SchNet."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch._dynamo
from helpers.compiled import MD_SKIN as SKIN
from helpers.compiled import argon_system as _system
from helpers.compiled import md_model as _model
from helpers.compiled import md_thermo_rows as _md
from helpers.compiled import unique_graphs as _unique_graphs

from xnn.data.graph import AtomicGraph
from xnn.dynamics import nve
from xnn.dynamics.compiled import CompiledVerlet
from xnn.errors import InputError
from xnn.models import Potential
from xnn.testing import check_compiled_step


@pytest.mark.parametrize("name,steps", [("lj", 200), ("schnet", 60)])
def test_compiled_steps_follow_eager_without_recompiles(name, steps, one_thread):
    # the contract: one compile in the first step, none after it (the stepper's count and
    # dynamo's graphs), and the eager trajectory to 1e-10 Å / 1e-12 Å/fs / 1e-10 eV/Å /
    # 1e-10 eV / 1e-12 eV/Å³
    out = check_compiled_step(_model(name), _system(), steps=steps - 1, dt=2.0, skin=SKIN)
    assert out["n_compiles"] == 1
    assert out["n_rebuilds"] >= 3  # the atoms moved through the skin several times
    compiled, eager = out["compiled"], out["eager"]
    assert compiled.step == eager.step == steps
    # and it conserves energy like the eager step (a check of the integrator itself)
    assert abs(float(nve.conserved(compiled) - nve.conserved(eager))) < 1e-9


def test_capacity_overflow_grows_geometrically_then_stays(one_thread):
    """A rebuild with more edges than the capacity compiles once for a grown capacity; the
    steps after it compile nothing."""
    model = _model("lj")
    pot = Potential(model, skin=SKIN)
    stepper = CompiledVerlet(pot, backend="aot_eager", headroom=1.0, growth=1.5)
    state = stepper.step(nve.init(_system(), pot), 2.0)
    first = stepper.capacity
    smaller = int(0.9 * first)
    stepper.capacity = smaller  # pretend the last build had fewer edges than the next has
    stepper._next_disp = torch.tensor(float("inf"))  # force a rebuild before the next step
    state = stepper.step(state, 2.0)
    assert stepper.n_compiles == 2 and stepper.capacity == math.ceil(1.5 * smaller)
    graphs = _unique_graphs()
    for _ in range(20):
        state = stepper.step(state, 2.0)
    assert stepper.n_compiles == 2 and _unique_graphs() == graphs


def test_within_cutoff_keeps_the_edges_the_model_weighs_in_order():
    """The graph's filter of the Verlet list: exactly the edges shorter than the cutoff, in
    the list's order, then inert edges; a capacity too small drops edges and says so."""
    from xnn.dynamics.compiled import _inert_edges, within_cutoff
    from xnn.neighbors import VerletList

    g = _system()
    cutoff = 6.0
    listed = VerletList(cutoff, SKIN)(g)
    vec = listed.edge_vectors()
    keep = (vec * vec).sum(-1) < cutoff**2
    n = int(keep.sum())
    assert 0 < n < listed.n_edges  # the skin holds edges beyond the cutoff
    inert = _inert_edges(g, cutoff + SKIN, n + 7)
    ei, sh, count = within_cutoff(listed, cutoff, inert)
    assert int(count) == n and ei.shape == (2, n + 7) and sh.shape == (n + 7, 3)
    torch.testing.assert_close(ei[:, :n], listed.edge_index[:, keep], rtol=0, atol=0)
    torch.testing.assert_close(sh[:n], listed.shifts[keep].long(), rtol=0, atol=0)
    torch.testing.assert_close(ei[:, n:], inert[0][:, n:], rtol=0, atol=0)
    tail = listed.replace({"edge_index": ei[:, n:], "shifts": sh[n:]}).edge_vectors()
    assert bool((tail.norm(dim=-1) > cutoff + SKIN).all())  # the rest is inert
    small = tuple(t[..., : n // 2, :] if t.dim() == 2 and t.shape[1] == 3 else t[:, : n // 2]
                  for t in inert)
    ei, _, count = within_cutoff(listed, cutoff, small)
    assert int(count) == n and ei.shape[1] == n // 2  # overflow: counted, not kept
    torch.testing.assert_close(ei, listed.edge_index[:, keep][:, : n // 2], rtol=0, atol=0)


def test_active_capacity_overflow_grows_and_repeats_the_step(one_thread):
    """The model sees the edges within the cutoff at an active capacity below the list's;
    a step that finds more of them than it holds is run again at a grown capacity, and the
    trajectory stays the eager one."""
    model = _model("lj")
    eager_pot, pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    stepper = CompiledVerlet(pot, backend="aot_eager", growth=1.5)
    eager = compiled = nve.init(_system(), eager_pot)
    eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
    assert 0 < stepper.n_active <= stepper.active_capacity < stepper.capacity
    small = stepper.n_active // 2
    stepper.active_capacity = small
    stepper._grow_active(compiled.graph, 0)  # inert edges of the smaller capacity
    compiles = stepper.n_compiles
    for _ in range(10):
        eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
    # one graph for the small capacity (its step overflowed), one for the grown one
    assert stepper.n_compiles == compiles + 2
    assert stepper.n_active <= stepper.active_capacity == max(
        math.ceil(1.5 * small), math.ceil(1.1 * stepper._overflowed))
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-10)


def test_cuda_graph_refused_on_cpu():
    with pytest.raises(InputError, match="CUDA"):
        CompiledVerlet(Potential(_model("lj"), skin=SKIN), cuda_graph=True)


@pytest.mark.slow
def test_inductor_step_matches_eager(one_thread):
    """The default backend (inductor, C++ on CPU) on the same comparison, fewer steps."""
    model = _model("lj")
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    stepper = CompiledVerlet(compiled_pot)
    eager = compiled = nve.init(_system(), eager_pot)
    for _ in range(40):
        eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
    assert stepper.n_compiles == 1
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)


def test_batch_of_two_cells_follows_eager(one_thread):
    """Padding edges spread over the atoms of every system (each shifted along its own cell)
    leave a batched trajectory equal to the eager one."""
    first = _system()
    second = first.replace(cell=first.cell * 1.05, positions=first.positions * 1.05)
    graph = AtomicGraph.concat([first, second])
    model = _model("lj")
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    stepper = CompiledVerlet(compiled_pot, backend="aot_eager")
    eager = compiled = nve.init(graph, eager_pot)
    for _ in range(40):
        eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
    assert stepper.capacity > compiled_pot.neighbors._edges[0].shape[1]  # padding in use
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.stress, eager.stress, rtol=0, atol=1e-12)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-10)


def test_md_compile_runs_the_compiled_step(tmp_path, monkeypatch, one_thread):
    """``xnn md compile=true`` logs the thermo rows of the eager run (two systems)."""
    import xnn.dynamics.compiled as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    made = []
    real = compiled.CompiledVerlet.__init__
    monkeypatch.setattr(compiled.CompiledVerlet, "__init__",
                        lambda self, *a, **k: made.append(self) or real(self, *a, **k))
    eager = _md(tmp_path, "eager")
    fast = _md(tmp_path, "compiled", "compile=true")
    assert len(made) == 1 and made[0].n_compiles == 1
    assert len(fast) == len(eager) > 3
    for a, b in zip(eager[1:], fast[1:]):
        va, vb = [float(x) for x in a.split(",")], [float(x) for x in b.split(",")]
        np.testing.assert_allclose(vb, va, rtol=1e-9, atol=1e-9)


def test_md_compile_refuses_npt(tmp_path):
    with pytest.raises(InputError, match="compiles ensembles nve, langevin, csvr, nhc"):
        _md(tmp_path, "p", "compile=true", "ensemble=npt", "pressure=0")
