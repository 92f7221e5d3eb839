"""Contract: the front ends give the numbers of :class:`xnn.models.Potential`.

The ASE calculator (:class:`xnn.Calculator`), the torch-sim adapter
(:class:`xnn.interop.torchsim.XnnTorchSimModel`) and the LAMMPS adapter
(:class:`xnn.interop.lammps.XnnFixExternal`) must return the energy, forces and stress (the
virial, in LAMMPS) that ``Potential(model)`` computes on the same structures, in float64.
A contract whose front end is not installed raises :class:`unittest.SkipTest` with the
reason (pytest reports it as a skip).
"""

from __future__ import annotations

import unittest
from collections.abc import Sequence

import numpy as np
import torch

from xnn.data.graph import AtomicGraph
from xnn.testing.common import as_fp64, assert_close
from xnn.testing.systems import random_molecule, random_periodic_system

F64, CPU = torch.float64, torch.device("cpu")


def default_adapter_systems(species: Sequence[int], seed: int = 0) -> list[AtomicGraph]:
    """Two triclinic periodic systems (8 and 5 atoms) and a molecule (6 atoms) of ``species``."""
    return [random_periodic_system(species, 8, 20.0, 2.0, seed=seed),
            random_periodic_system(species, 5, 25.0, 2.0, seed=seed + 1),
            random_molecule(species, 6, 20.0, 2.0, seed=seed + 2)]


def _atoms(graph: AtomicGraph):
    from xnn.data.ase_io import to_ase

    return to_ase(graph.without_edges().to(device=CPU, dtype=F64))


def _reference(model, graph: AtomicGraph) -> dict:
    from xnn.models import Potential

    out = Potential(model)(graph.without_edges())
    return {k: out[k].detach().cpu() for k in ("energy", "forces", "stress")}


def _setup(model, systems):
    model, _ = as_fp64(model)
    systems = list(systems) if systems else default_adapter_systems(list(model.species or [18]))
    return model.to(CPU), systems


def check_ase_calculator(model: torch.nn.Module, systems: Sequence[AtomicGraph] | None = None,
                         atol: float = 1e-10) -> float:
    """:class:`xnn.Calculator` gives ``Potential``'s energy, forces and stress (periodic).

    Args:
        model: any :class:`~xnn.models.base.AtomisticModel` (run in an fp64 copy on the CPU).
        systems: one-system graphs (default :func:`default_adapter_systems`).
        atol: largest absolute difference (eV, eV/Å, eV/Å³).
    Returns:
        the largest absolute difference found.
    """
    from ase.stress import voigt_6_to_full_3x3_stress

    from xnn.io.calculator import Calculator

    model, systems = _setup(model, systems)
    worst = 0.0
    for i, g in enumerate(systems):
        (atoms,) = _atoms(g)
        ref = _reference(model, AtomicGraph.concat([g]).to(dtype=F64))
        atoms.calc = Calculator(model, device="cpu", dtype=F64)
        got = {"energy": torch.tensor([atoms.get_potential_energy()], dtype=F64),
               "forces": torch.as_tensor(atoms.get_forces())}
        if bool(g.pbc.all()):
            got["stress"] = torch.as_tensor(voigt_6_to_full_3x3_stress(atoms.get_stress()))[None]
        for key, value in got.items():
            worst = max(worst, assert_close(f"ASE {key} (system {i})", value, ref[key],
                                            atol=atol, rtol=0.0))
    return worst


def check_torchsim_adapter(model: torch.nn.Module,
                           systems: Sequence[AtomicGraph] | None = None,
                           atol: float = 1e-10) -> float:
    """``XnnTorchSimModel`` on one batched torch-sim state of all ``systems`` gives
    ``Potential``'s energies, forces and stresses (periodic systems; zeros otherwise).

    Raises:
        unittest.SkipTest: torch-sim is not installed.
    """
    try:
        import torch_sim as ts
    except ImportError as err:
        raise unittest.SkipTest(f"torch-sim is not installed ({err})") from None
    from xnn.interop.torchsim import XnnTorchSimModel

    model, systems = _setup(model, systems)
    adapter = XnnTorchSimModel(model, device="cpu", dtype=F64)
    groups: dict[tuple, list[AtomicGraph]] = {}  # a torch-sim state has one pbc
    for g in systems:
        groups.setdefault(tuple(bool(p) for p in g.pbc[0]), []).append(g)
    worst = 0.0
    for pbc, graphs in groups.items():
        state = ts.io.atoms_to_state([a for g in graphs for a in _atoms(g)], CPU, F64)
        state.pbc = torch.tensor(pbc)  # per axis (atoms_to_state may collapse it to one)
        out = adapter(state)
        ref = _reference(model, AtomicGraph.concat([g.without_edges() for g in graphs]).to(
            dtype=F64))
        if not all(pbc):
            ref["stress"] = torch.zeros_like(ref["stress"])
        worst = max(worst, *(assert_close(f"torch-sim {key} (pbc {list(pbc)})",
                                          out[key].detach(), ref[key], atol=atol, rtol=0.0)
                             for key in ("energy", "forces", "stress")))
    return worst


def _require_lammps():
    from xnn.errors import InputError
    from xnn.interop.lammps import require_lammps

    try:
        lammps = require_lammps()
        lammps.lammps(cmdargs=["-log", "none", "-screen", "none"]).close()
    except (InputError, OSError) as err:  # not installed, or its library does not load
        raise unittest.SkipTest(f"LAMMPS unavailable: {err}") from None
    return lammps


def lammps_frame(atoms):
    """``atoms`` rotated (by their fractional coordinates) into LAMMPS's triclinic frame:
    ``a`` along x, ``b`` in the xy plane (a lower-triangular cell), positions wrapped."""
    from ase.geometry import cell_to_cellpar, cellpar_to_cell

    out = atoms.copy()
    out.set_cell(cellpar_to_cell(cell_to_cellpar(atoms.cell.array)), scale_atoms=True)
    out.wrap()
    return out


def _lammps_of(lammps, atoms, types: list[int]):
    """A serial LAMMPS (units metal) with ``atoms`` as ids ``1..n`` of types by element."""
    c = atoms.cell.array.tolist()  # python floats: repr gives every digit
    lmp = lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    lmp.commands_string(f"""
        units metal
        atom_modify map yes
        region box prism 0 {c[0][0]!r} 0 {c[1][1]!r} 0 {c[2][2]!r} {c[1][0]!r} {c[2][0]!r} {c[2][1]!r} units box
        create_box {len(types)} box
    """)  # noqa: E501
    masses = atoms.get_masses()
    for t, z in enumerate(types, start=1):
        lmp.command(f"mass {t} {float(masses[atoms.numbers == z][0])!r}")
    n = len(atoms)
    kinds = [types.index(int(z)) + 1 for z in atoms.numbers]
    lmp.create_atoms(n, list(range(1, n + 1)), kinds, atoms.positions.reshape(-1).tolist())
    return lmp


def check_lammps_adapter(model: torch.nn.Module, systems: Sequence[AtomicGraph] | None = None,
                         atol: float = 1e-8, virial_atol: float = 1e-10) -> float:
    """``XnnFixExternal`` in a serial LAMMPS (``run 0``) gives ``Potential``'s energy, forces
    (by atom id) and virial (LAMMPS's pressure ``-stress``) on each fully periodic system,
    rotated into LAMMPS's frame (molecules are left out: a LAMMPS box is periodic here).

    Args:
        atol: largest difference of energy (relative to max(1, |E|)) and forces (eV/Å).
        virial_atol: largest difference of the virial pressure (eV/Å³).
    Raises:
        unittest.SkipTest: LAMMPS is not installed or does not load.
    """
    from xnn.interop.lammps import VOIGT, XnnFixExternal

    lammps = _require_lammps()
    model, systems = _setup(model, systems)
    worst = 0.0
    for i, g in enumerate(g for g in systems if bool(g.pbc.all())):
        (atoms,) = _atoms(g)
        atoms = lammps_frame(atoms)
        types = sorted({int(z) for z in atoms.numbers})
        ref = _reference(model, AtomicGraph.from_arrays(atoms.positions, atoms.numbers,
                                                        atoms.cell.array, True, dtype=F64))
        lmp = _lammps_of(lammps, atoms, types)
        try:
            fix = XnnFixExternal(lmp, model, species=types)
            lmp.command("compute pvir all pressure NULL virial")  # bar, xx yy zz xy xz yz
            fix.run(0)
            n = lmp.extract_setting("nlocal")
            ids = np.asarray(lmp.numpy.extract_atom("id"))[:n]
            forces = np.asarray(lmp.numpy.extract_atom("f"))[:n][np.argsort(ids)]
            pressure = (np.asarray(lmp.numpy.extract_compute("pvir", 0, 1))
                        / lmp.extract_global("nktv2p"))
            energy = lmp.get_thermo("pe")
        finally:
            lmp.close()
        scale = max(1.0, abs(float(ref["energy"][0])))
        worst = max(worst, assert_close(f"LAMMPS energy (system {i})",
                                        torch.tensor([energy / scale], dtype=F64),
                                        ref["energy"] / scale, atol=atol, rtol=0.0))
        worst = max(worst, assert_close(f"LAMMPS forces (system {i})", torch.as_tensor(forces),
                                        ref["forces"], atol=atol, rtol=0.0))
        expected = torch.tensor([-float(ref["stress"][0, a, b]) for a, b in VOIGT], dtype=F64)
        worst = max(worst, assert_close(f"LAMMPS virial pressure (system {i})",
                                        torch.as_tensor(pressure), expected,
                                        atol=virial_atol, rtol=0.0))
    return worst


def check_adapters(model: torch.nn.Module, systems: Sequence[AtomicGraph] | None = None
                   ) -> dict[str, float | str]:
    """Every adapter contract; those whose front end is missing are reported, not run.

    Returns:
        ``{"ase" | "torchsim" | "lammps": largest difference, or "skipped: <reason>"}``.
    Raises:
        AssertionError: an installed adapter differs from ``Potential``.
    """
    out: dict[str, float | str] = {}
    for name, check in (("ase", check_ase_calculator), ("torchsim", check_torchsim_adapter),
                        ("lammps", check_lammps_adapter)):
        try:
            out[name] = check(model, systems)
        except unittest.SkipTest as skip:
            out[name] = f"skipped: {skip}"
    return out
