"""Compiled MD of a committee (``md.compile=true``, one process): each compiled step equals
the eager committee step (mean forces, energy, stress and the members' spread), the thermo
log of ``xnn md compile=true`` has the eager uncertainty columns, and the uncertainty guard
stops a compiled run at the eager step."""

from __future__ import annotations

import ase.io
import numpy as np
import pytest
import torch
from helpers.compiled import MD_SKIN, argon_system
from helpers.models import SMALL
from helpers.uncertainty import committee, compressed_cu, first_record, md_args

from xnn.app.md import run_md
from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.data import keys as K
from xnn.dynamics import langevin, nve
from xnn.dynamics.compiled_thermo import CompiledIntegrator
from xnn.dynamics.safety import SimulationError
from xnn.errors import InputError
from xnn.io.thermo import read_log
from xnn.models import Potential
from xnn.models.committee import Committee
from xnn.models.serialization import save_model

pytestmark = pytest.mark.usefixtures("one_thread")

MODULES = {"nve": (nve, {}), "langevin": (langevin, dict(temperature=500.0, friction=0.05,
                                                          seed=7))}


def argon_committee() -> Committee:
    """Three small SchNet members for argon (fp64)."""
    return Committee({"name": "schnet", "species": [18], "cutoff": 5.0, "num_interactions": 2,
                      **SMALL["schnet"]}, size=3, seeds=[4, 5, 6]).double()


# langevin is slow: nve covers the compiled committee step, tests/test_compiled_thermo.py the
# compiled Langevin step of one model
@pytest.mark.parametrize("name", ["nve", pytest.param("langevin", marks=pytest.mark.slow)])
def test_compiled_committee_step_equals_the_eager_step(name):
    mod, args = MODULES[name]
    model = argon_committee()
    eager_pot, compiled_pot = Potential(model, skin=MD_SKIN), Potential(model, skin=MD_SKIN)
    integ = CompiledIntegrator(name, compiled_pot, backend="aot_eager")
    eager = compiled = mod.init(argon_system(), eager_pot, **args)
    spreads = []
    for _ in range(25):
        eager = mod.step(eager, eager_pot, 2.0)
        compiled = integ.step(compiled, compiled_pot, 2.0)
        spreads.append(float(compiled.graph[K.FORCES_STD].max()))
    assert integ.stepper.n_compiles == 1 and compiled.step == eager.step == 25
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.velocities, eager.velocities, rtol=0, atol=1e-12)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.stress, eager.stress, rtol=0, atol=1e-12)
    for key in (K.FORCES_STD, K.ENERGY_STD):  # the spread the eager step set on its graph
        assert compiled.graph[key].shape == eager.graph[key].shape
        torch.testing.assert_close(compiled.graph[key], eager.graph[key], rtol=0, atol=1e-10)
    assert float(compiled.graph[K.FORCES_STD].min()) > 0 and np.ptp(spreads) > 0
    # the mean forces are those of the members' mean, not of one member
    out = eager_pot(compiled.graph.without_edges())
    torch.testing.assert_close(compiled.forces, out[K.FORCES], rtol=0, atol=1e-10)
    assert not torch.allclose(out[K.FORCES_MEMBERS][0], out[K.FORCES], atol=1e-6)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An eager and a compiled ``xnn md`` of the committee (unguarded; the compiled runs of
    this module with the aot_eager backend)."""
    import xnn.dynamics.compiled as compiled

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
        yield _runs(tmp_path_factory.mktemp("uqc"))


def _runs(tmp):
    model = save_model(committee(), tmp / "committee.pt")
    compressed_cu(tmp / "cu.xyz")
    eager = run_md(load_config(MDConfig, None, md_args(tmp / "cu.xyz", model, tmp / "eager")))
    fast = run_md(load_config(MDConfig, None, md_args(tmp / "cu.xyz", model, tmp / "fast",
                                                      "compile=true")))
    return tmp, model, read_log(eager / "thermo.csv"), read_log(fast / "thermo.csv")


def test_compiled_thermo_has_the_eager_uncertainty_columns(runs):
    _, _, eager, fast = runs
    assert set(fast) == set(eager)
    for col in ("max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV"):
        assert len(fast[col]) == len(eager[col]) > 10
        np.testing.assert_allclose(fast[col], eager[col], rtol=1e-9, atol=1e-12, err_msg=col)
    np.testing.assert_allclose(fast["conserved_eV"], eager["conserved_eV"], rtol=1e-9)
    assert np.ptp(fast["max_force_std_eV_A"]) > 0


def test_guard_stops_a_compiled_run_at_the_eager_step(runs):
    tmp, model, eager, _ = runs
    k, threshold = first_record(eager["max_force_std_eV_A"])
    out = tmp / "stop"
    with pytest.raises(SimulationError) as err:
        run_md(load_config(MDConfig, None, md_args(
            tmp / "cu.xyz", model, out, "compile=true",
            f"safety.max_force_uncertainty={threshold!r}")))
    assert err.value.step == k and str(err.value).startswith(f"step {k}: force uncertainty")
    assert ase.io.read(out / "uncertain.xyz").info["step"] == k
    assert read_log(out / "thermo.csv")["step"][-1] == k


def test_compiled_committee_accepted_on_several_ranks():
    """compile=true takes a committee on one and on several ranks (the compiled decomposed
    step runs it: tests/test_compiled_domain_committee.py); what several ranks cannot compile
    is still refused, without naming the committee."""
    from xnn.app.md_setup import check_compile

    cfg = load_config(MDConfig, None, ["compile=true"])
    for several in (False, True):
        check_compile(cfg, committee(), torch.device("cpu"), several_ranks=several)
    cfg = load_config(MDConfig, None, ["compile=true", "parallel.mode=graph"])
    with pytest.raises(InputError, match="parallel.mode=graph") as err:
        check_compile(cfg, committee(), torch.device("cpu"), several_ranks=True)
    assert "committee" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nve", "langevin"])
def test_cuda_graph_committee_step_follows_eager(name):
    """``md.cuda_graph=true`` with a committee: the compiled step (inductor) replayed as one
    CUDA graph follows the eager committee step over 30 steps with a forced rebuild, mean
    forces and the members' spread included, capturing once."""
    dev = torch.device("cuda")
    mod, args = MODULES[name]
    model = argon_committee().to(dev)
    eager_pot, compiled_pot = Potential(model, skin=MD_SKIN), Potential(model, skin=MD_SKIN)
    integ = CompiledIntegrator(name, compiled_pot, backend="inductor", cuda_graph=True)
    stepper = integ.stepper
    eager = compiled = mod.init(argon_system().to(dev), eager_pot, **args)
    for i in range(30):
        if i == 15:  # one rebuild for sure: new edges copied into the captured buffers
            stepper._next_disp = torch.tensor(float("inf"), device=dev)
        eager = mod.step(eager, eager_pot, 2.0)
        compiled = integ.step(compiled, compiled_pot, 2.0)
    assert stepper.n_compiles == 1 and stepper._replay.n_captures == 1
    assert stepper.n_rebuilds >= 1 and compiled.step == eager.step == 30
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-9)
    for key in (K.FORCES_STD, K.ENERGY_STD):
        torch.testing.assert_close(compiled.graph[key], eager.graph[key], rtol=0, atol=1e-9)
    assert float(compiled.graph[K.FORCES_STD].min()) > 0
