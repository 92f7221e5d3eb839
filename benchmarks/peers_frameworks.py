"""The frameworks of ``benchmarks/peers.py``: the shared random-weight models, the systems
and their starting velocities, and one runner per framework (xnn, torch-sim, nvalchemi),
each returning ``(forces of the start, advance(n_steps))``. Peers are imported inside
their runners: a missing one fails its rows only.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch

try:
    from benchmarks.common import fcc_cu
except ImportError:  # imported from benchmarks/peers.py run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.common import fcc_cu

DT_FS, T_K, FRICTION, SKIN = 1.0, 300.0, 0.01, 1.0  # fs, K, 1/fs, Å
FS_PER_INTERNAL = 10.180505710759414  # fs per sqrt(amu Å² / eV) (torch-sim, nvalchemi, ASE)
KB_EV = 8.617333262e-5
LANGEVIN = "Langevin BAOAB"
XNN = ("xnn", "xnn_compiled", "xnn_step_compiled", "xnn_step_graph")


# --------------------------------------------------------------------------- models
def base_model(name: str, small: bool = False) -> torch.nn.Module:
    """The random-weight model of ``name`` (float64 master copy; every framework gets a
    deep copy cast to the run's dtype): mace-torch's module or xnn's equivariant model.
    ``small``: 8-channel models of the same kinds (tests, smoke runs)."""
    torch.manual_seed(0)
    if name == "mace":
        from xnn.models.external._optional import import_extra

        (mod,) = import_extra("mace", "mace.modules")  # e3nn set up, env vars kept
        if not small:
            from benchmarks.models import build_mace

            return build_mace(avg_num_neighbors=40.0).double().eval()
        import numpy as np
        from e3nn import o3

        block = mod.interaction_classes["RealAgnosticResidualInteractionBlock"]
        return mod.ScaleShiftMACE(
            r_max=4.0, num_bessel=6, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
            interaction_cls_first=block, num_interactions=2, num_elements=1,
            hidden_irreps=o3.Irreps("8x0e+8x1o"), MLP_irreps=o3.Irreps("8x0e"),
            atomic_energies=np.array([-3.0]), avg_num_neighbors=20.0, atomic_numbers=[29],
            correlation=2, gate=torch.nn.functional.silu, atomic_inter_scale=1.0,
            atomic_inter_shift=0.0).double().eval()
    if small:
        from xnn.models import build

        return build("equivariant", species=[29], cutoff=4.0, channels=8, l_max=1,
                     hidden_l_max=1, num_interactions=2, correlation=2).double().eval()
    from benchmarks.bench_equivariant import xnn_model

    return xnn_model(channels=128, hidden_l_max=1, cutoff=6.0).double().eval()


def systems(n_atoms: int, n_systems: int) -> list:
    """``n_systems`` rattled FCC Cu cells of about ``n_atoms`` atoms (ase.Atoms)."""
    return [fcc_cu(n_atoms, rattle=0.05, seed=k) for k in range(n_systems)]


def start_velocities(atoms_list, dtype) -> torch.Tensor:
    """Maxwell–Boltzmann velocities at 300 K (Å/fs) ``[n_atoms, 3]``, the same for all."""
    from xnn.data import AtomicGraph
    from xnn.dynamics import maxwell_boltzmann

    gs = [AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc) for a in atoms_list]
    g = AtomicGraph.concat(gs) if len(gs) > 1 else gs[0]
    return maxwell_boltzmann(g, T_K, seed=0).velocities.to(dtype)


# --------------------------------------------------------------------------- frameworks
def run_xnn(module, kind, atoms_list, v, device, dtype, variant, cueq):
    """xnn: Langevin, eager (``xnn``), with the model compiled (``xnn_compiled``), as the
    compiled MD step (``xnn_step_compiled``) or its CUDA-graph replay (``xnn_step_graph``)."""
    from xnn.data import AtomicGraph
    from xnn.dynamics import langevin
    from xnn.models import Potential, build

    backend = "cueq" if cueq else "reference"
    if kind == "mace":
        model = build("mace", model=module, backend=backend)
    else:
        model = module
        model.set_backend(backend)
    model = model.to(device=device, dtype=dtype).eval()
    pot = Potential(model, skin=SKIN, compile=variant == "xnn_compiled")
    gs = [AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc, dtype=dtype,
                                  device=device) for a in atoms_list]
    g = (AtomicGraph.concat(gs) if len(gs) > 1 else gs[0]).replace(velocities=v.to(device))
    if variant not in ("xnn_step_compiled", "xnn_step_graph"):
        state = [langevin.init(g, pot, T_K, friction=FRICTION, seed=0)
                 .replace(compute_stress=False)]
        return state[0].forces.detach(), _advance(state, lambda s: langevin.step(
            s, pot, DT_FS)), {"ensemble": LANGEVIN}
    from xnn.dynamics.compiled_thermo import CompiledIntegrator

    integ = CompiledIntegrator("langevin", pot, cuda_graph=variant == "xnn_step_graph")
    state = [langevin.init(g, pot, T_K, friction=FRICTION, seed=0)
             .replace(compute_stress=False)]  # eager forces
    # the compiled graph's own forces at the start: a step from rest at 0 K without forces
    # moves nothing (it compiles here; the run then reuses the graph and the neighbor list)
    s0 = state[0]
    rest = s0.replace(graph=s0.graph.replace(velocities=torch.zeros_like(s0.graph.velocities)),
                      forces=torch.zeros_like(s0.forces),
                      vars={**s0.vars, "temperature": torch.zeros_like(s0.vars["temperature"])})
    forces = integ.step(rest, pot, DT_FS).forces.detach()
    how = "the compiled MD step" + (", replayed as a CUDA graph" if variant == "xnn_step_graph"
                                    else "")
    return forces, _advance(state, lambda s: integ.step(s, pot, DT_FS)), {
        "ensemble": f"{LANGEVIN} ({how})"}


def _advance(state: list, one):
    """``advance(n)``: ``n`` steps of ``one`` applied to ``state[0]`` in place."""
    def advance(n):
        for _ in range(n):
            state[0] = one(state[0])
    return advance


def run_torch_sim(module, atoms_list, v, device, dtype, compiled, cueq):
    """torch-sim 0.6: ``MaceModel`` (mace-torch's ``MaceTorchSimModel``) + BAOAB Langevin."""
    from xnn.models.external._optional import preserved_environ

    with preserved_environ():  # mace sets env vars on import
        # torch-sim's MaceModel is this class; torch-sim hides its import error behind a stub
        import mace.calculators.mace_torchsim  # noqa: F401
        import torch_sim as ts
        from torch_sim.models.mace import MaceModel
        from torch_sim.units import MetalUnits

    nl_fn, nl_name = None, "torchsim_nl (default)"
    try:  # the default picks nvalchemiops' O(N^2) list first: give it the cell list
        from torch_sim.neighbors import ALCHEMIOPS_AVAILABLE, alchemiops_nl_cell_list

        if ALCHEMIOPS_AVAILABLE:
            nl_fn, nl_name = alchemiops_nl_cell_list, "alchemiops_nl_cell_list"
    except ImportError:
        pass
    with _default_dtype():  # mace's cueq conversion sets it
        model = MaceModel(model=module, device=device, dtype=dtype, compute_forces=True,
                          compute_stress=False, neighbor_list_fn=nl_fn, enable_cueq=cueq,
                          compile_mode="default" if compiled else None)
    state = ts.io.atoms_to_state(atoms_list, device=device, dtype=dtype)
    state.momenta = state.masses[:, None] * v.to(device) * FS_PER_INTERNAL
    kt = T_K * float(MetalUnits.temperature)
    dt = DT_FS * 1e-3 * float(MetalUnits.time)  # ps -> internal
    gamma = FRICTION * FS_PER_INTERNAL
    st = [ts.nvt_langevin_init(state, model, kT=kt)]

    def advance(n):
        for _ in range(n):
            st[0] = ts.nvt_langevin_step(st[0], model, dt=dt, kT=kt, gamma=gamma)
    return st[0].forces.detach(), advance, {"ensemble": LANGEVIN, "neighbor_list": nl_name}


def run_nvalchemi(module, atoms_list, v, device, dtype, compiled, cueq):
    """nvalchemi-toolkit 0.2: ``MACEWrapper`` + ``NVTLangevin`` + ``NeighborListHook``."""
    from xnn.models.external._optional import preserved_environ

    with preserved_environ():
        from nvalchemi.data import AtomicData, Batch
        from nvalchemi.dynamics import NVTLangevin
        from nvalchemi.dynamics.base import DynamicsStage
        from nvalchemi.hooks import NeighborListHook
        from nvalchemi.models.mace import MACEWrapper, _patch_e3nn_irrep_len_for_compile

    module = module.to(device=device, dtype=dtype).eval()
    if cueq:  # what MACEWrapper.from_checkpoint(enable_cueq=True) does
        from mace.cli.convert_e3nn_cueq import run as convert

        with _default_dtype(), preserved_environ():
            module = convert(module, return_model=True, device=device.type)
        module = module.to(device=device, dtype=dtype).eval()
    if compiled:  # what MACEWrapper.from_checkpoint(compile_model=True) does
        _patch_e3nn_irrep_len_for_compile()
        for p in module.parameters():
            p.requires_grad = False
        module = torch.compile(module)
    model = MACEWrapper(module)
    data, start = [], 0
    for a in atoms_list:
        a = a.copy()
        a.arrays["forces"] = 0.0 * a.positions  # the batch then holds forces and energy
        a.info["energy"] = 0.0
        d = AtomicData.from_atoms(a, device=device, dtype=dtype)
        d.velocities = (v[start:start + len(a)] * FS_PER_INTERNAL).to(device)
        data.append(d)
        start += len(a)
    batch = Batch.from_data_list(data)
    dyn = NVTLangevin(model, dt=DT_FS, temperature=T_K, friction=FRICTION, random_seed=0)
    dyn.register_hook(NeighborListHook(model.model_config.neighbor_config, skin=SKIN,
                                       stage=DynamicsStage.BEFORE_COMPUTE))
    dyn._call_hooks(DynamicsStage.BEFORE_COMPUTE, batch)  # starting forces (run() has none)
    forces = dyn.compute(batch)["forces"].clone()
    held = [batch]

    def advance(n):
        for _ in range(n):
            held[0], _ = dyn.step(held[0])
    return forces, advance, {"ensemble": LANGEVIN, "neighbor_list": f"NeighborListHook skin {SKIN}"}


@contextlib.contextmanager
def _default_dtype():
    """Restore torch's default dtype on exit."""
    saved = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def start(framework, kind, base, atoms_list, v, device, dtype, cueq=False):
    """``(forces0 [n_atoms, 3], advance(n_steps), info)`` of ``framework`` on a fresh copy
    of ``base`` (``cueq``: each framework's cuEquivariance path)."""
    module = copy.deepcopy(base)
    if framework in XNN:
        return run_xnn(module, kind, atoms_list, v, device, dtype, framework, cueq)
    run = run_torch_sim if framework.startswith("torch_sim") else run_nvalchemi
    return run(module, atoms_list, v, device, dtype, framework.endswith("compiled"), cueq)
