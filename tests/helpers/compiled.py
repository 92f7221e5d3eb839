"""Systems and models of the compiled-MD tests (one process and decomposed)."""

from __future__ import annotations

import functools

import torch

from xnn.data.graph import AtomicGraph
from xnn.testing.compiled import unique_graphs  # noqa: F401 - re-exported

from .models import lj
from .structures import fcc, hot, primitive, rattled_argon

#: Verlet skin (Å) of the one-process compiled-step tests
MD_SKIN = 0.4
#: the compiled decomposed tests' hot crystal: skin (Å), time step (fs), warm-up steps
DOMAIN_SKIN, DOMAIN_DT, DOMAIN_WARMUP = 0.5, 1.0, 100
DOMAIN_REPS = (4, 4, 4)  # 64 atoms of a hot (2000 K) primitive FCC crystal

#: ``xnn md`` arguments of an LJ argon NVE run logged every 5 steps
MD_ARGS = ["md", "model.device=cpu", "model.name=lj",
           "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
           "model.cutoff=6.0", "model.skin=0.3",
           "output.progress=false", "output.plot=false", "ensemble=nve", "steps=30",
           "timestep=5.0", "initial_temperature=300", "output.log_every=5",
           "output.trajectory_every=0", "output.checkpoint_every=0", "seed=7"]


def md_model(name: str):
    """fp64 argon LJ (``"lj"``) or a default SchNet for argon."""
    from xnn.models import build

    if name == "lj":
        return build("lj", sigma=3.4, epsilon=0.0104, cutoff=6.0).double()
    torch.manual_seed(0)
    return build("schnet", species=[18], cutoff=5.0).double()


@functools.cache
def argon_system(temperature: float = 600.0) -> AtomicGraph:
    """32 argon atoms after 60 eager LJ steps from a rattled FCC lattice at ``temperature``:
    past the first steps, in which the pair count within the cutoff rises by half (the
    capacity's warm-up), so that the runs below exercise rebuilds, not growth."""
    from xnn.dynamics import maxwell_boltzmann, nve
    from xnn.models import Potential

    atoms = rattled_argon(rep=2)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True)
    pot = Potential(md_model("lj"), skin=MD_SKIN)
    state = nve.init(maxwell_boltzmann(g, temperature, seed=3), pot)
    for _ in range(60):
        state = nve.step(state, pot, 2.0)
    return state.graph


@functools.cache
def hot_crystal():
    """The hot crystal after ``DOMAIN_WARMUP`` one-process steps: past the first steps, in
    which the pair count within the cutoff rises (the capacities' warm-up), so that the runs
    below exercise rebuilds and migrations, not growth."""
    from xnn.dynamics import nve
    from xnn.models import Potential

    pot = Potential(lj(), skin=DOMAIN_SKIN)
    state = nve.init(hot(primitive(DOMAIN_REPS), 2000.0), pot)
    for _ in range(DOMAIN_WARMUP):
        state = nve.step(state, pot, DOMAIN_DT)
    return state.graph.without_edges()


def md_thermo_rows(tmp_path, out, *extra):
    """``xnn md`` (30 NVE steps of two argon structures, logged every 10): thermo.csv rows."""
    import ase.io

    from xnn.app.md import run_md
    from xnn.config.loader import load_config
    from xnn.config.md import MDConfig

    path = tmp_path / "ar.xyz"
    if not path.exists():
        ase.io.write(path, [rattled_argon(seed=0), rattled_argon(seed=1)])
    cfg = load_config(MDConfig, None, [
        f"structure={path}", "index=:", f"output.dir={tmp_path / out}", "model.name=lj",
        "model.hyperparameters.sigma=3.405", "model.hyperparameters.epsilon=0.0104",
        "model.cutoff=6.5",
        "output.progress=false", "output.plot=false", "ensemble=nve", "steps=30",
        "output.log_every=10", "initial_temperature=300", *extra])
    run_md(cfg)
    return (tmp_path / out / "thermo.csv").read_text().splitlines()


def replay_follows_eager(eager_model, model) -> None:
    """The CUDA-graph replay of the compiled NVE step with ``model`` follows the eager step
    with ``eager_model`` (fp32, 108 Cu atoms at 600 K) over 30 steps with a forced rebuild,
    compiling and capturing once (tests/test_compiled_cuda.py, tests/test_triton_tp.py)."""
    from xnn.dynamics import maxwell_boltzmann, nve
    from xnn.dynamics.compiled_thermo import CompiledIntegrator
    from xnn.models import Potential

    dev = torch.device("cuda")
    atoms = fcc((3, 3, 3), a=3.61, rattle=0.05, seed=0)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True,
                                dtype=torch.float32, device=dev)
    g = maxwell_boltzmann(g, 600.0, seed=3)
    eager_pot, compiled_pot = Potential(eager_model, skin=0.5), Potential(model, skin=0.5)
    integ = CompiledIntegrator("nve", compiled_pot, backend="inductor", cuda_graph=True)
    stepper = integ.stepper
    eager = compiled = nve.init(g, eager_pot)
    for i in range(30):
        if i == 15:
            stepper._next_disp = torch.tensor(float("inf"), device=dev)
        eager, compiled = nve.step(eager, eager_pot, 2.0), integ.step(compiled, compiled_pot, 2.0)
    assert stepper.n_compiles == 1 and stepper._replay.n_captures == 1
    assert stepper.n_rebuilds >= 2
    scale = float(eager.forces.abs().max())
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-4)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-4 * scale)


def count_app_domain_steps() -> list[str]:
    """Set the one-process compiled backend to ``aot_eager`` (no C++ compile, as the app's
    compiled runs of these tests) and count the compiled decomposed steps the app then takes:
    the list grows by one class name per ``CompiledDomainVerlet.step`` call, in this process.
    """
    import xnn.distributed.domain.compiled as compiled
    import xnn.dynamics.compiled as one_process

    one_process.DEFAULT_BACKEND = "aot_eager"
    made, step = [], compiled.CompiledDomainVerlet.step

    def counted(self, state, dt):
        made.append(type(self).__name__)
        return step(self, state, dt)

    compiled.CompiledDomainVerlet.step = counted
    return made


def count_routed() -> dict[str, int]:
    """Count the staged routing's exchanges (``parallel.exchange=staged``) in this process:
    the dict's ``forward`` and ``reverse`` grow by one per
    :meth:`~xnn.distributed.domain.staged.StagedRouting.forward` /
    :meth:`~xnn.distributed.domain.staged.StagedRouting.reverse` call (a direct exchange
    counts nothing)."""
    from xnn.distributed.domain import staged

    calls = {"forward": 0, "reverse": 0}
    for name in calls:
        method = getattr(staged.StagedRouting, name)

        def counted(self, rows, _name=name, _method=method):
            calls[_name] += 1
            return _method(self, rows)

        setattr(staged.StagedRouting, name, counted)
    return calls
