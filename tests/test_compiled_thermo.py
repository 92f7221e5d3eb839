"""Compiled thermostatted MD steps (xnn.dynamics.compiled_thermo, md.compile=true with
ensemble langevin / csvr / nhc): the eager trajectory and thermostat state (fp64, LJ and
SchNet), no steady-state recompiles over 200 steps with rebuilds, the noise hashed in the
graph equal to the eager noise, and the app's thermo log equal to the eager run's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.compiled import MD_SKIN as SKIN
from helpers.compiled import argon_system as _system
from helpers.compiled import md_model as _model
from helpers.compiled import md_thermo_rows as _md
from helpers.compiled import unique_graphs as _unique_graphs

from xnn.dynamics import csvr, langevin, nhc
from xnn.dynamics.compiled_random import csvr_draws, normal_keyed, stream_key_of
from xnn.dynamics.compiled_thermo import CompiledIntegrator, LangevinScheme
from xnn.dynamics.state import RNG_KEY, RNG_STEP0, new_rng
from xnn.errors import InputError
from xnn.models import Potential

MODULES = {"langevin": langevin, "csvr": csvr, "nhc": nhc}
ARGS = {"langevin": dict(temperature=500.0, friction=0.05, seed=7),
        "csvr": dict(temperature=500.0, tau=20.0, seed=7),
        "nhc": dict(temperature=500.0, tau=20.0)}


def _pair(name: str, model_name: str = "lj", graph=None):
    """Eager and compiled (aot_eager) integrators of ``name`` from one start."""
    model = _model(model_name)
    eager_pot, compiled_pot = Potential(model, skin=SKIN), Potential(model, skin=SKIN)
    integ = CompiledIntegrator(name, compiled_pot, backend="aot_eager")
    start = MODULES[name].init(_system() if graph is None else graph, eager_pot, **ARGS[name])
    return MODULES[name], eager_pot, integ, start


def _advance(mod, pot, integ, eager, compiled, n: int):
    """``n`` steps of the eager module and of the compiled integrator, side by side."""
    for _ in range(n):
        eager = mod.step(eager, pot, 2.0)
        compiled = integ.step(compiled, integ.stepper.potential, 2.0)
    return eager, compiled


def _assert_same(mod, eager, compiled):
    assert compiled.step == eager.step
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.velocities, eager.velocities, rtol=0, atol=1e-12)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.stress, eager.stress, rtol=0, atol=1e-12)
    assert set(compiled.vars) == set(eager.vars)
    for k, v in eager.vars.items():  # thermostat state: heat, eta, v_eta, targets
        torch.testing.assert_close(compiled.vars[k], v, rtol=0, atol=1e-10)
    torch.testing.assert_close(mod.conserved(compiled), mod.conserved(eager), rtol=0, atol=1e-9)


@pytest.mark.parametrize("name,steps", [("langevin", 200), ("csvr", 200), ("nhc", 120)])
def test_compiled_thermostat_follows_eager_without_recompiles(name, steps, one_thread):
    mod, pot, integ, eager = _pair(name)
    compiled = eager
    eager, compiled = mod.step(eager, pot, 2.0), integ.step(compiled, integ.stepper.potential, 2.0)
    graphs, stepper = _unique_graphs(), integ.stepper
    assert stepper.n_compiles == 1
    eager, compiled = _advance(mod, pot, integ, eager, compiled, steps - 1)
    assert stepper.n_rebuilds >= 3  # atoms crossed the skin several times
    assert stepper.n_compiles == 1 and _unique_graphs() == graphs  # 0 recompiles
    _assert_same(mod, eager, compiled)
    if name != "nhc":
        assert float(compiled.vars["heat"].abs().max()) > 1e-3  # the thermostat acted


# SchNet with langevin in the fast set; csvr and nhc (each thermostat's compiled step is
# checked fast with LJ above) under -m slow
@pytest.mark.parametrize("name", ["langevin", pytest.param("csvr", marks=pytest.mark.slow),
                                  pytest.param("nhc", marks=pytest.mark.slow)])
def test_compiled_thermostat_with_schnet(name, one_thread):
    mod, pot, integ, eager = _pair(name, "schnet")
    compiled = eager
    eager, compiled = _advance(mod, pot, integ, eager, compiled, 25)
    assert integ.stepper.n_compiles == 1
    _assert_same(mod, eager, compiled)


# csvr under -m slow: its draws keyed by step are checked fast below
# (test_graph_csvr_draws_are_the_eager_draws), the resumed compiled step with langevin
@pytest.mark.parametrize("name", ["langevin", pytest.param("csvr", marks=pytest.mark.slow)])
def test_compiled_steps_continue_a_resumed_state(name, one_thread):
    """Started from a state at step 7 (a resumed run) and then handed an earlier one, the
    compiled step keys its random numbers by each state's step, as the eager step does,
    and builds a list for the state it is handed."""
    mod, pot, integ, eager = _pair(name)
    for _ in range(7):
        eager = mod.step(eager, pot, 2.0)
    other = eager
    compiled = eager
    eager, compiled = _advance(mod, pot, integ, eager, compiled, 8)
    _assert_same(mod, eager, compiled)
    rebuilds = integ.stepper.n_rebuilds
    other_eager = mod.step(other, pot, 2.0)
    other_compiled = integ.step(other, integ.stepper.potential, 2.0)
    assert integ.stepper.n_rebuilds == rebuilds + 1
    _assert_same(mod, other_eager, other_compiled)
    assert integ.stepper.n_compiles == 1


def test_graph_noise_is_the_eager_noise():
    """The hash on a step tensor (the key the graph computes) gives langevin.noise's bits,
    with system indices and with per-system keys (slots)."""
    mod, pot, integ, state = _pair("langevin")
    scheme = LangevinScheme()
    scheme.key(state)
    for step in (0, 5, 2**40):
        s = state.replace(step=step)
        got = scheme.noise(s, torch.tensor(step))
        assert torch.equal(got, langevin.noise(s))
    keyed = state.replace(vars={RNG_KEY: torch.tensor([11]), RNG_STEP0: torch.tensor([3])})
    assert torch.equal(scheme.noise(keyed.replace(step=9), torch.tensor(9)),
                       langevin.noise(keyed.replace(step=9)))
    k1, k2 = stream_key_of(7, 2, torch.tensor(4))
    ids = torch.arange(5)
    assert not torch.equal(normal_keyed(k1, k2, ids), normal_keyed(k2, k1, ids))


@pytest.mark.parametrize("nf", [[1.0, 2.0, 95.0], [3.0, 400.0, 3.0]])
def test_graph_csvr_draws_are_the_eager_draws(nf):
    """R and S (a Gamma variate: small and large shapes) at a step tensor equal
    csvr.draws, with system indices and with per-system keys."""
    nf = torch.tensor(nf, dtype=torch.float64)
    keyed = {RNG_KEY: torch.tensor([4, 9, 2]), RNG_STEP0: torch.tensor([0, -3, 5])}
    for vars_ in ({}, keyed):
        for step, stage in ((0, 0), (13, 1), (2**35, 0)):
            want = csvr.draws(new_rng(21), step, stage, nf, vars_)
            got = csvr_draws(21, torch.tensor(step), stage, nf, vars_)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_langevin_with_fixed_atoms_and_slot_keys(one_thread):
    """Fixed atoms (no COM removal, zero velocity) and per-system rng keys compile to the
    eager result too."""
    fixed = torch.zeros(_system().n_atoms, dtype=torch.bool)
    fixed[:4] = True
    mod, pot, integ, eager = _pair("langevin", graph=_system().replace(fixed=fixed))
    eager = eager.replace(vars={RNG_KEY: torch.tensor([5]), RNG_STEP0: torch.tensor([-2])})
    compiled = eager
    eager, compiled = _advance(mod, pot, integ, eager, compiled, 30)
    assert bool((compiled.velocities[:4] == 0).all())
    _assert_same(mod, eager, compiled)


def test_compiled_integrator_refuses_npt():
    with pytest.raises(InputError, match="nve, langevin, csvr, nhc"):
        CompiledIntegrator("npt", Potential(_model("lj"), skin=SKIN))


# the app's compiled path with langevin fast; csvr (its compiled step is checked fast with
# LJ above) under -m slow
@pytest.mark.parametrize("ensemble", ["langevin", pytest.param("csvr", marks=pytest.mark.slow)])
def test_md_compile_thermostat_logs_the_eager_thermo(ensemble, tmp_path, monkeypatch,
                                                     one_thread):
    """``xnn md compile=true ensemble=langevin`` (two systems) writes the eager thermo rows,
    conserved quantity included."""
    import xnn.dynamics.compiled as compiled
    from xnn.dynamics.compiled_thermo import SCHEMES

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    made = []
    real = compiled.CompiledVerlet.run
    monkeypatch.setattr(compiled.CompiledVerlet, "run",
                        lambda self, state, key, *a: made.append((self, key))
                        or real(self, state, key, *a))
    extra = (f"ensemble={ensemble}", "temperature=400", "thermostat.tau=20")
    eager = _md(tmp_path, "eager", *extra)
    assert not made
    fast = _md(tmp_path, "compiled", "compile=true", *extra)
    # every step ran the ensemble's scheme through the compiled graph, compiled once
    assert len(made) == 30 and {key[0] for _, key in made} == {SCHEMES[ensemble]}
    made = [stepper for stepper, _ in made]
    assert made[0].n_compiles == 1 and made[0].hashed_rng
    assert made[0].n_rebuilds < 10  # the loop hands back the states it gets: no rebuild each step
    assert len(fast) == len(eager) > 3
    for a, b in zip(eager[1:], fast[1:]):
        va, vb = [float(x) for x in a.split(",")], [float(x) for x in b.split(",")]
        np.testing.assert_allclose(vb, va, rtol=1e-9, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["langevin", "csvr", "nhc"])
def test_inductor_thermostat_matches_eager(name):
    """The default backend (inductor's C++) compiles the int64 hash of the noise and of the
    CSVR draws to the same bits: the trajectory is the eager one. With two threads, as a user
    runs it: inductor then writes per-system sums as parallel scatters, and its code
    generation failed on one into a single row (the degrees of freedom of one system)."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        mod, pot, integ, eager = _pair(name)
        integ = CompiledIntegrator(name, integ.stepper.potential, backend="inductor")
        compiled = eager
        eager, compiled = _advance(mod, pot, integ, eager, compiled, 30)
    finally:
        torch.set_num_threads(n)
    assert integ.stepper.n_compiles == 1
    _assert_same(mod, eager, compiled)


def test_hashed_schemes_declare_it_and_inductor_drops_index_propagation():
    """The schemes that hash random numbers in the graph say so (a class attribute, not the
    presence of a seed), and only their inductor graphs run without constant and index
    propagation (Triton refuses the 64-bit constants it folds into int32 indices)."""
    from xnn.dynamics.compiled import compile_options
    from xnn.dynamics.compiled_thermo import SCHEMES

    hashed = {name for name, cls in SCHEMES.items() if cls.uses_hashed_rng}
    assert hashed == {"langevin", "csvr"}
    off = {"constant_and_index_propagation": False}
    for name in SCHEMES:
        integ = CompiledIntegrator(name, Potential(_model("lj"), skin=SKIN), backend="inductor")
        assert integ.stepper.hashed_rng == (name in hashed)
        assert compile_options("inductor", integ.stepper.hashed_rng) == (
            off if name in hashed else None)
        assert compile_options("aot_eager", integ.stepper.hashed_rng) is None
    assert compile_options("inductor", False) is None
