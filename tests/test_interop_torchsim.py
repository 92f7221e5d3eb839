"""xnn models in torch-sim (XnnTorchSimModel), torch-sim models in xnn (TorchSimPotential).

References are xnn's own results (``xnn.Calculator`` / ``Potential``) on the same structures,
fp64, to 1e-10; a torch-sim NVE run through ``torch_sim.integrate`` is compared with xnn's
velocity Verlet; torch-sim's own Lennard-Jones with xnn's ``lj``.
"""

from __future__ import annotations

import sys
from importlib.metadata import version

import numpy as np
import pytest
import torch
from ase.build import bulk, fcc111, molecule
from ase.stress import voigt_6_to_full_3x3_stress
from helpers import lj as _lj
from helpers import schnet_hccu as _schnet

import xnn
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models import Potential

ts = pytest.importorskip("torch_sim")
from torch_sim.integrators.md import calculate_momenta  # noqa: E402
from torch_sim.models.lennard_jones import LennardJonesModel  # noqa: E402
from torch_sim.units import MetalUnits  # noqa: E402

from xnn.interop.torchsim import TorchSimPotential, XnnTorchSimModel  # noqa: E402

CPU, F64 = torch.device("cpu"), torch.float64
LJ = dict(sigma=2.3, epsilon=0.4, cutoff=5.0)
TOL = 1e-10


def cu_triclinic(seed=1):
    """8 Cu atoms, primitive (triclinic) fcc cell, strained, rattled."""
    at = bulk("Cu", "fcc", a=3.6).repeat((2, 2, 2))
    strain = np.eye(3) + 0.03 * np.random.default_rng(seed).standard_normal((3, 3))
    at.set_cell(at.cell.array @ strain, scale_atoms=True)
    at.rattle(0.08, seed=seed)
    return at


def cu_cubic():
    at = bulk("Cu", "fcc", a=3.62, cubic=True)
    at.rattle(0.05, seed=3)
    return at


def cu_one_atom():
    """1 atom in a cell far smaller than the cutoff (many periodic images)."""
    at = bulk("Cu", "fcc", a=3.55)
    at.set_cell(at.cell.array @ np.array([[1, 0.02, 0], [0, 1, -0.03], [0.01, 0, 1]]),
                scale_atoms=True)
    return at


def cu_slab():
    at = fcc111("Cu", size=(2, 2, 3), vacuum=5.0)
    at.rattle(0.05, seed=4)
    return at  # pbc [True, True, False]


def ch4():
    at = molecule("CH4")
    at.rattle(0.02, seed=5)
    return at


def xnn_reference(model, atoms):
    """energy, forces, full 3x3 stress (zeros when not 3D periodic) from xnn.Calculator."""
    at = atoms.copy()
    at.calc = xnn.Calculator(model, device="cpu", dtype=F64)
    stress = (voigt_6_to_full_3x3_stress(at.get_stress()) if at.pbc.all()
              else np.zeros((3, 3)))
    return at.get_potential_energy(), at.get_forces(), stress


def slab_state(atoms):
    """A SimState with per-axis pbc (torch-sim 0.3's atoms_to_state collapses it to one bool)."""
    st = ts.io.atoms_to_state([atoms], CPU, F64)
    st.pbc = torch.tensor(atoms.pbc)
    return st


def check_against_xnn(model, atoms_list, out):
    start = 0
    for s, atoms in enumerate(atoms_list):
        e, f, sig = xnn_reference(model, atoms)
        n = len(atoms)
        assert abs(float(out["energy"][s]) - e) <= TOL * max(1.0, abs(e))
        np.testing.assert_allclose(out["forces"][start:start + n].numpy(), f, rtol=0, atol=TOL)
        np.testing.assert_allclose(out["stress"][s].numpy(), sig, rtol=0, atol=TOL)
        start += n


# ------------------------------------------------------------------ xnn model in torch-sim
@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_batched_state_matches_xnn_calculator(make_model):
    model = make_model()
    systems = [cu_triclinic(), cu_cubic(), cu_one_atom()]
    adapter = XnnTorchSimModel(model, device="cpu", dtype=F64)
    out = adapter(ts.io.atoms_to_state(systems, CPU, F64))
    assert out["energy"].shape == (3,) and out["stress"].shape == (3, 3, 3)
    check_against_xnn(model, systems, out)
    # the cell convention matters: a transposed (row-major) cell gives other results
    assert float(out["stress"][0].abs().max()) > 1e-3


@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_slab_and_molecule_match_xnn_calculator(make_model):
    model = make_model()
    adapter = XnnTorchSimModel(model, device="cpu", dtype=F64)
    slab = cu_slab()
    check_against_xnn(model, [slab], adapter(slab_state(slab)))
    mol = ch4() if make_model is _schnet else ch4()[[0, 1, 2]]
    out = adapter(ts.io.atoms_to_state([mol], CPU, F64))
    check_against_xnn(model, [mol], out)


def test_model_file_and_torch_sim_validator(tmp_path):
    path = xnn.save_model(_lj(), tmp_path / "lj.pt")
    adapter = XnnTorchSimModel(str(path), device="cpu", dtype=F64)
    assert isinstance(adapter, ts.models.interface.ModelInterface)
    assert adapter.cutoff == LJ["cutoff"]
    ts.models.interface.validate_model_outputs(adapter, CPU, F64)
    systems = [cu_triclinic(), cu_cubic()]
    check_against_xnn(_lj(), systems, adapter(ts.io.atoms_to_state(systems, CPU, F64)))


def test_unknown_species_and_bad_inputs():
    schnet = XnnTorchSimModel(_schnet(), device="cpu", dtype=F64)
    with pytest.raises(InputError):
        schnet(ts.io.atoms_to_state([bulk("Fe", "bcc", a=2.87)], CPU, F64))
    with pytest.raises(InputError, match="xnn model"):
        XnnTorchSimModel(torch.nn.Linear(3, 3), device="cpu")


def test_coincident_atoms_are_refused_as_xnn_calculator_refuses_them():
    """Was: evaluated (LJ: an energy of 8.6e24 eV from two atoms 0.02 Å apart) where
    ``xnn.Calculator`` refuses the structure; ``min_distance=0`` evaluates it, as there."""
    close = cu_cubic()
    close.positions[3] = close.positions[1] + [0.02, 0.0, 0.0]
    state = ts.io.atoms_to_state([cu_triclinic(), close], CPU, F64)
    with pytest.raises(InputError) as err:
        XnnTorchSimModel(_lj(), device="cpu", dtype=F64)(state)
    msg = str(err.value)
    assert msg.startswith("system 1: atoms 1 and 3 are 0.02 Å apart, closer than "
                          "min_distance=0.1 Å") and "\n" not in msg, msg
    assert "pass min_distance=0 to XnnTorchSimModel" in msg
    out = XnnTorchSimModel(_lj(), device="cpu", dtype=F64, min_distance=0.0)(state)
    ref = close.copy()
    ref.calc = xnn.Calculator(_lj(), device="cpu", min_distance=0.0)
    assert float(out["energy"][1]) == pytest.approx(ref.get_potential_energy(), rel=TOL)


def test_dtype_and_min_distance_are_checked():
    """Was: torch's TypeError for an integer dtype, a negative min_distance accepted."""
    with pytest.raises(InputError, match=r"XnnTorchSimModel: dtype=torch.int32 is not "
                       r"supported; use torch.float64 or torch.float32"):
        XnnTorchSimModel(_lj(), device="cpu", dtype=torch.int32)
    for bad in (-0.5, float("nan")):
        with pytest.raises(InputError, match=r"XnnTorchSimModel: min_distance=.* must be a "
                           "finite distance >= 0"):
            XnnTorchSimModel(_lj(), device="cpu", min_distance=bad)


def test_missing_torch_sim_gives_pip_command(monkeypatch):
    from xnn.interop import torchsim as mod

    monkeypatch.setitem(sys.modules, "torch_sim", None)  # import torch_sim -> ImportError
    monkeypatch.setattr(mod, "_CLASSES", {})
    with pytest.raises(InputError, match="pip install torch-sim-atomistic"):
        mod.XnnTorchSimModel  # noqa: B018
    with pytest.raises(InputError, match="pip install torch-sim-atomistic"):
        TorchSimPotential(None)


# ------------------------------------------------------------------ torch-sim dynamics
def test_torch_sim_nve_run_matches_xnn_velocity_verlet():
    from xnn.dynamics import nve

    atoms, dt_fs, n_steps, seed = cu_triclinic(seed=2), 2.0, 20, 7
    state = ts.io.atoms_to_state([atoms], CPU, F64)
    kT = torch.tensor(600.0 * MetalUnits.temperature, dtype=F64)
    momenta = calculate_momenta(state.positions, state.masses, state.system_idx, kT, seed)
    final = ts.integrate(state, XnnTorchSimModel(_lj(), device="cpu", dtype=F64),
                         integrator=ts.integrators.nve, n_steps=n_steps, temperature=600.0,
                         timestep=dt_fs * 1e-3, seed=seed)  # timestep in ps

    fs = MetalUnits.time * 1e-3  # one fs in torch-sim's time unit sqrt(amu Å²/eV)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                masses=atoms.get_masses())
    g = g.replace(velocities=momenta / state.masses[:, None] * fs)  # Å/fs
    pot = Potential(_lj())
    s = nve.init(g, pot)
    for _ in range(n_steps):
        s = nve.step(s, pot, dt_fs)
    moved = (s.positions - g.positions).norm(dim=-1).max()
    assert moved > 0.05  # the atoms moved: the comparison is not trivial
    cell = torch.as_tensor(atoms.cell.array)
    d_frac = (final.positions - s.positions) @ torch.linalg.inv(cell)
    d = (d_frac - torch.round(d_frac)) @ cell  # torch-sim wraps positions, xnn does not
    assert float(d.abs().max()) <= 1e-8
    v_ts = final.momenta / final.masses[:, None] * fs
    assert float((v_ts - s.velocities).abs().max()) <= 1e-8
    assert abs(float(final.energy[0] - s.energy[0])) <= 1e-8


def test_torch_sim_lennard_jones_matches_xnn_lj():
    """Same parameters; torch-sim's LJ is not shifted at the cutoff, xnn's is: energies differ
    by ``u(r_c)`` per pair, forces agree. Forces are taken from torch-sim's energy by autograd;
    its analytic forces and stress are pinned for 0.3.0 (twice xnn's, see below).

    Orthorhombic cells only: torch-sim 0.3.0's LennardJonesModel hands its row-vector cell
    to ``transforms.get_pair_displacements``, which expects columns, so its results are
    wrong for cells whose matrix is not symmetric (triclinic)."""
    ortho = cu_cubic().repeat((2, 2, 1))
    ortho.set_cell(ortho.cell.array @ np.diag([1.02, 0.97, 1.05]), scale_atoms=True)
    systems = [ortho, cu_cubic().repeat((2, 1, 1))]
    state = ts.io.atoms_to_state(systems, CPU, F64)
    ts_lj = LennardJonesModel(**LJ, dtype=F64, compute_stress=True)
    xnn_out = XnnTorchSimModel(_lj(), device="cpu", dtype=F64)(state)

    pos = state.positions.clone().requires_grad_(True)
    raw = ts_lj(ts.SimState(positions=pos, masses=state.masses, cell=state.cell, pbc=True,
                            atomic_numbers=state.atomic_numbers, system_idx=state.system_idx))
    (g_pos,) = torch.autograd.grad(raw["energy"].sum(), [pos])

    graph = Potential(_lj()).neighbors(AtomicGraph.from_arrays(
        state.positions, state.atomic_numbers, state.cell.mT, torch.ones(2, 3, dtype=bool),
        state.system_idx, state.masses))
    r = graph.edge_vectors().norm(dim=-1)
    n_pairs = torch.zeros(2, dtype=F64).index_add(
        0, graph.batch[graph.edge_index[1]], (r < LJ["cutoff"]).to(F64)) / 2
    sr6 = (LJ["sigma"] / LJ["cutoff"]) ** 6
    u_rc = 4 * LJ["epsilon"] * (sr6 * sr6 - sr6)
    torch.testing.assert_close(raw["energy"].detach(), xnn_out["energy"] + n_pairs * u_rc,
                               rtol=0, atol=TOL)
    torch.testing.assert_close(-g_pos, xnn_out["forces"], rtol=0, atol=TOL)
    if version("torch-sim-atomistic") == "0.3.0":
        # torch-sim 0.3.0's analytic LJ forces and stress count each pair of its full
        # neighbor list twice (energy is halved, forces are not): exactly 2x
        torch.testing.assert_close(raw["forces"], 2 * xnn_out["forces"], rtol=0, atol=1e-9)
        torch.testing.assert_close(raw["stress"], 2 * xnn_out["stress"], rtol=0, atol=1e-9)


# ------------------------------------------------------------------ torch-sim model in xnn
def test_torch_sim_potential_round_trip_and_xnn_md():
    from xnn.dynamics import nve

    systems = [cu_triclinic(), cu_cubic(), cu_one_atom()]
    graph = AtomicGraph.concat([
        AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc) for a in systems])
    reverse = TorchSimPotential(XnnTorchSimModel(_lj(), device="cpu", dtype=F64))
    ref = Potential(_lj())(graph)
    got = reverse(graph)
    for key in (K.ENERGY, K.ENERGIES, K.FORCES, K.STRESS, K.VIRIAL):
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=TOL)

    g = graph.replace(velocities=0.01 * torch.randn(graph.n_atoms, 3, dtype=F64,
                                                    generator=torch.Generator().manual_seed(1)))
    pot = Potential(_lj())
    a, b = nve.init(g, pot), nve.init(g, reverse)
    for _ in range(10):
        a, b = nve.step(a, pot, 2.0), nve.step(b, reverse, 2.0)
    torch.testing.assert_close(b.positions, a.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(b.stress, a.stress, rtol=0, atol=TOL)


def test_torch_sim_potential_refusals():
    slab = cu_slab()
    graph = AtomicGraph.from_arrays(slab.positions, slab.numbers, slab.cell.array, slab.pbc)
    reverse = TorchSimPotential(XnnTorchSimModel(_lj(), device="cpu", dtype=F64))
    with pytest.raises(InputError, match="pbc"):
        reverse(graph)
    with pytest.raises(InputError, match="inference"):
        reverse(graph, training=True)
    no_stress = TorchSimPotential(LennardJonesModel(**LJ, dtype=F64, compute_stress=False))
    bulk_graph = AtomicGraph.from_arrays(*(lambda a: (a.positions, a.numbers, a.cell.array,
                                                      a.pbc))(cu_cubic()))
    with pytest.raises(InputError, match="compute_stress=True"):
        no_stress(bulk_graph)
    assert no_stress(bulk_graph, stress=False)[K.FORCES].shape == (4, 3)
