"""Built-in reference data: structures labelled with ASE's EMT calculator.

``generate_emt(n=200, elements=("Cu",), seed=0)`` returns a list of ``ase.Atoms`` with energy
(eV), forces (eV/Å) and stress (eV/Å³, ASE sign) attached by a ``SinglePointCalculator``. The
structures cycle over six kinds:

* ``strained``: fcc bulk under a random strain (isotropic ±4 %, shear ±2 %);
* ``rattled``: strained bulk with Gaussian displacements (σ = 0.02–0.15 Å);
* ``vacancy``: rattled bulk with one or two atoms removed;
* ``surface``: (111)/(100) slabs with 6 Å of vacuum each side (still 3-D periodic, so the
  stress is well defined), rattled;
* ``md``: snapshots of velocity-Verlet MD from a Maxwell-Boltzmann start at 300, 800 or 1500 K.

With several elements, each bulk/slab site is drawn at random among them (a random alloy).
Everything is drawn from one ``numpy.random.Generator(seed)``, so the output is identical for
a given ``(n, elements, seed)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from xnn._files import check_output_file
from xnn.errors import InputError

KINDS = ("strained", "rattled", "vacancy", "surface", "md")
EMT_ELEMENTS = ("Al", "Cu", "Ag", "Au", "Ni", "Pd", "Pt")
MD_TEMPERATURES_K = (300.0, 800.0, 1500.0)


def _check_elements(elements: Sequence[str]) -> list[str]:
    els = [e.strip() for e in elements if e.strip()]
    if not els:
        raise InputError("at least one element is required for EMT data")
    bad = [e for e in els if e not in EMT_ELEMENTS]
    if bad:
        raise InputError(f"EMT has no parameters for {bad}; choose among {list(EMT_ELEMENTS)}")
    return els


def _lattice_constant(elements: Sequence[str]) -> float:
    from ase.data import atomic_numbers, reference_states

    return float(np.mean([reference_states[atomic_numbers[e]]["a"] for e in elements]))


def _decorate(atoms, elements: Sequence[str], rng: np.random.Generator):
    if len(elements) > 1:
        atoms.set_chemical_symbols([str(e) for e in rng.choice(elements, size=len(atoms))])
    else:
        atoms.set_chemical_symbols([elements[0]] * len(atoms))
    return atoms


def _strain(atoms, rng: np.random.Generator):
    eps = np.eye(3) * rng.uniform(-0.04, 0.04)
    shear = rng.uniform(-0.02, 0.02, size=(3, 3))
    eps = eps + 0.5 * (shear + shear.T)
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
    return atoms


def _bulk(elements, rng):
    from ase.build import bulk

    atoms = bulk("X", "fcc", a=_lattice_constant(elements), cubic=True).repeat((2, 2, 2))
    return _strain(_decorate(atoms, elements, rng), rng)


def _rattle(atoms, rng, low=0.02, high=0.15):
    atoms.positions += rng.normal(0.0, rng.uniform(low, high), size=atoms.positions.shape)
    return atoms


def _vacancy(elements, rng):
    atoms = _rattle(_bulk(elements, rng), rng, 0.02, 0.08)
    remove = rng.choice(len(atoms), size=int(rng.integers(1, 3)), replace=False)
    del atoms[sorted(int(i) for i in remove)]
    return atoms


def _surface(elements, rng):
    from ase.build import fcc100, fcc111

    a = _lattice_constant(elements)
    make = fcc111 if rng.random() < 0.5 else fcc100
    atoms = make("X", size=(2, 2, 4), a=a, vacuum=6.0, periodic=True)
    atoms = _decorate(atoms, elements, rng)
    return _rattle(atoms, rng, 0.01, 0.08)


def _md(elements, rng, calc_factory):
    from ase import units
    from ase.md import velocitydistribution as vd
    from ase.md.verlet import VelocityVerlet

    atoms = _bulk(elements, rng)
    temperature = float(rng.choice(MD_TEMPERATURES_K))
    thermalize = getattr(vd, "thermalize_momenta", None) or vd.MaxwellBoltzmannDistribution
    thermalize(atoms, temperature_K=2.0 * temperature, rng=rng)
    atoms.calc = calc_factory()
    VelocityVerlet(atoms, timestep=2.0 * units.fs).run(int(rng.integers(10, 30)))
    atoms.info["temperature_K"] = temperature
    return atoms


def _label(atoms, calc_factory, kind: str):
    from ase.calculators.singlepoint import SinglePointCalculator

    atoms.calc = calc_factory()
    energy = atoms.get_potential_energy()
    forces = atoms.get_forces()
    stress = atoms.get_stress(voigt=False)
    atoms.set_velocities(np.zeros((len(atoms), 3)))
    atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
    atoms.info = {"config_type": kind, **{k: v for k, v in atoms.info.items()
                                          if k == "temperature_K"}}
    return atoms


def generate_emt(n: int = 200, elements: Sequence[str] = ("Cu",), seed: int = 0) -> list:
    """Generate ``n`` EMT-labelled structures (see the module docstring).

    Args:
        n: number of structures (>= 1).
        elements: chemical symbols, e.g. ``["Cu", "Au"]``.
        seed: seed of the one random generator used for everything.
    Returns:
        list of ``ase.Atoms`` with ``energy`` (eV), ``forces`` ``[n_atoms, 3]`` (eV/Å) and
        ``stress`` ``[3, 3]`` (eV/Å³) on a ``SinglePointCalculator`` and ``info["config_type"]``.
    """
    from ase.calculators.emt import EMT

    if n < 1:
        raise InputError(f"the number of structures must be >= 1, got {n}")
    els = _check_elements(elements)
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        kind = KINDS[k % len(KINDS)]
        if kind == "strained":
            atoms = _bulk(els, rng)
        elif kind == "rattled":
            atoms = _rattle(_bulk(els, rng), rng, 0.02, 0.1)
        elif kind == "vacancy":
            atoms = _vacancy(els, rng)
        elif kind == "surface":
            atoms = _surface(els, rng)
        else:
            atoms = _md(els, rng, EMT)
        atoms.wrap()
        out.append(_label(atoms, EMT, kind))
    return out


#: the suffixes of the data files ``write_emt`` writes (extxyz, xnn HDF5): the ones xnn
#: reads back as such
EXTXYZ_SUFFIXES = (".xyz", ".extxyz")
DATA_SUFFIXES = (*EXTXYZ_SUFFIXES, ".h5", ".hdf5")


def check_suffix(path, what: str, suffixes: Sequence[str] = DATA_SUFFIXES) -> None:
    """Refuse an output file whose suffix is not one of ``suffixes`` (a file named
    ``data.txt`` would hold extxyz that neither xnn nor ASE reads back by its name).

    Raises:
        InputError: one line naming ``what``, the file and the accepted suffixes.
    """
    if Path(path).suffix not in suffixes:
        raise InputError(f"{what} {str(path)!r} must end in {', '.join(suffixes)} (the file "
                         "is read back by its suffix), e.g. "
                         f"{str(Path(path).with_suffix(suffixes[0]))!r}")


def write_emt(path, n: int = 200, elements: Sequence[str] = ("Cu",), seed: int = 0) -> int:
    """Generate EMT data and write it to ``path`` (extxyz for ``.xyz``/``.extxyz``, HDF5 for
    ``.h5``/``.hdf5``).

    Returns:
        the number of structures written.
    Raises:
        InputError: another suffix (before anything is generated), a bad ``n`` or element.
    """
    path = check_output_file(path, "output file")
    check_suffix(path, "output file")
    atoms = generate_emt(n, elements, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix in (".h5", ".hdf5"):
        from xnn.data.ase_io import from_ase
        from xnn.data.hdf5 import write_hdf5

        write_hdf5(path, (from_ase([a]) for a in atoms))
    else:
        import ase.io

        ase.io.write(str(path), atoms, format="extxyz")
    return len(atoms)
