"""Host-side helpers of :class:`xnn.interop.lammps.XnnFixExternal` for LAMMPS's per-atom
arrays: image flags as unwrapping offsets, views of LAMMPS's box, per-atom rows and per-atom
virial flag kept between steps, a model's results brought to the host in LAMMPS's order."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from xnn.data import keys as K

VOIGT = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))  # LAMMPS: xx, yy, zz, xy, xz, yz
#: VOIGT as indices of a row-major [3, 3] flattened to [9]
VOIGT_FLAT = np.array([3 * a + b for a, b in VOIGT])


def cell_of_box(lo, hi, xy: float, yz: float, xz: float, periodicity
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``origin [3]`` Å, ``cell [3, 3]`` Å (rows ``(lx, 0, 0)``, ``(xy, ly, 0)``,
    ``(xz, yz, lz)``) and ``pbc [3]`` of LAMMPS's box parameters (``extract_box``'s)."""
    lo, hi = np.array(lo, dtype=float), np.asarray(hi, dtype=float)
    lx, ly, lz = hi - lo
    cell = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]])
    return lo, cell, np.asarray(periodicity, dtype=bool)


def kept(a) -> np.ndarray:
    """``a`` as float64 to keep for later comparison: itself where it is read-only (the
    arrays of :meth:`LammpsArrays.box`, then compared by identity), else a copy."""
    a = np.asarray(a, dtype=np.float64)
    return a if not a.flags.writeable else a.copy()


class LammpsArrays:
    """LAMMPS's box, per-atom arrays and per-atom virial flag, read without the Python
    wrapper's per-call work (ctypes types, lists, a ``domain->init()``): the box and the flag
    through pointers taken once (members of LAMMPS's ``Domain`` and ``Update``, which live as
    long as the instance), a per-atom array as a numpy view remade only when LAMMPS
    reallocated it or the row count changed (one library call a read). Views are valid until
    LAMMPS next reallocates: inside one callback."""

    def __init__(self, lmp):
        from lammps.constants import (
            LAMMPS_DOUBLE,
            LAMMPS_DOUBLE_2D,
            LAMMPS_INT64,
            LAMMPS_INT64_2D,
            LAMMPS_INT_2D,
        )

        self.lmp = lmp
        self._global = lmp.lib["lammps_extract_global"]  # private copies: own result types
        self._global.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._global.restype = ctypes.c_void_p
        self._atom = lmp.lib["lammps_extract_atom"]
        self._atom.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self._atom.restype = ctypes.c_void_p
        self._two_d = (LAMMPS_INT_2D, LAMMPS_DOUBLE_2D, LAMMPS_INT64_2D)
        self._int64 = (LAMMPS_INT64, LAMMPS_INT64_2D)
        self._double = (LAMMPS_DOUBLE, LAMMPS_DOUBLE_2D)
        self._box_fields = [self._view(k, ctypes.c_double, 3) for k in ("boxlo", "boxhi")] \
            + [self._view(k, ctypes.c_double, 1) for k in ("xy", "yz", "xz")] \
            + [self._view("periodicity", ctypes.c_int, 3)]
        self._box: tuple[list, tuple] | None = None  # (LAMMPS's values, box()) last read
        self._vflag_atom = (self._view("vflag_atom", ctypes.c_int64, 1)
                            if lmp.extract_global_datatype("vflag_atom") == LAMMPS_INT64
                            else None)
        self._kinds: dict[str, tuple[type, int]] = {}  # name: (numpy dtype, columns)
        self._rows: dict[str, tuple[int, int, np.ndarray]] = {}  # name: (address, n, view)

    def _view(self, name: str, ctype, k: int):
        """A ctypes array over LAMMPS's global ``name`` (``None``: LAMMPS has no such field)."""
        address = self._global(self.lmp.lmp, name.encode())
        return None if not address else (ctype * k).from_address(address)

    def box(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:func:`xnn.interop.lammps.lammps_cell`: ``origin [3]``, ``cell [3, 3]`` (Å),
        ``pbc [3]``, read-only arrays, the same objects while LAMMPS's box is unchanged."""
        values = [field[:] for field in self._box_fields]  # Python floats and ints
        if self._box is None or self._box[0] != values:
            lo, hi, (xy,), (yz,), (xz,), periodicity = values
            arrays = cell_of_box(lo, hi, xy, yz, xz, periodicity)
            for a in arrays:
                a.flags.writeable = False
            self._box = (values, arrays)
        return self._box[1]

    def vflag_atom(self) -> int | None:
        """LAMMPS's ``update->vflag_atom`` (``None``: a LAMMPS without the field)."""
        return None if self._vflag_atom is None else int(self._vflag_atom[0])

    def rows(self, name: str, n: int) -> np.ndarray:
        """The first ``n`` rows of LAMMPS's per-atom array ``name`` (``[n]`` or ``[n, cols]``,
        LAMMPS's own dtype), a view of LAMMPS's memory."""
        kind = self._kinds.get(name)
        if kind is None:
            from lammps.constants import LMP_SIZE_COLS

            code = self.lmp.extract_atom_datatype(name)
            cols = (int(self.lmp.extract_atom_size(name, LMP_SIZE_COLS))
                    if code in self._two_d else 0)
            dtype = np.float64 if code in self._double else (
                np.int64 if code in self._int64 else np.int32)
            kind = self._kinds[name] = (dtype, cols)
        dtype, cols = kind
        if n == 0:
            return np.zeros((0, cols) if cols else (0,), dtype=dtype)
        address = self._atom(self.lmp.lmp, name.encode())
        if address and cols:  # a 2-D array: its rows are one block from row 0's pointer
            address = ctypes.c_void_p.from_address(address).value
        if not address:
            raise RuntimeError(f"LAMMPS has no per-atom array {name!r}")
        cached = self._rows.get(name)
        if cached is None or cached[0] != address or cached[1] != n:
            ctype = np.ctypeslib.as_ctypes_type(dtype)
            view = np.ctypeslib.as_array((ctype * (n * max(cols, 1))).from_address(address))
            cached = self._rows[name] = (address, n, view.reshape((n, cols) if cols else (n,)))
        return cached[2]


def unask_peratom_virial(lmp) -> None:
    """Make LAMMPS's ``update->vflag_atom`` (the last step at which a compute asked for
    per-atom virials) say "never" while it equals the current step without a run behind it.

    LAMMPS starts it at 0, so at the setup of a first run from step 0 it reads "asked" when
    nothing asked, and ``XnnFixExternal.wants_peratom_virial`` could not tell. It is set
    to -1 (LAMMPS's own "never" of ``update->vflag_global``) through the pointer LAMMPS's
    library hands out; LAMMPS sets it to the step again whenever a compute asks."""
    from lammps.constants import LAMMPS_INT64

    extract = lmp.lib["lammps_extract_global"]  # a private copy: its own result type
    extract.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    extract.restype = ctypes.POINTER(ctypes.c_int64)  # bigint, as extract_global_datatype says
    value = extract(lmp.lmp, b"vflag_atom")
    step = lmp.extract_global("ntimestep")
    if value and step is not None and lmp.extract_global_datatype("vflag_atom") == LAMMPS_INT64 \
            and value[0] == int(step):
        value[0] = -1


class Images:
    """LAMMPS's image flags as Cartesian offsets: ``x + (n - n_0) @ cell`` (``n`` the image
    counts of the atoms' periodic jumps) is continuous where LAMMPS wraps atoms into its box.

    ``n_0`` are the counts at the last :meth:`rebase` (a new atom order, where xnn's list is
    rebuilt anyway), or where an atom has jumped twice along an axis since: positions then
    stay within about a box of LAMMPS's own (float32 keeps its precision in a long,
    diffusive run) at the price of one list rebuild. The offsets are kept while flags, cell
    and origin are unchanged (LAMMPS changes the flags only where it re-neighbours; one
    comparison of ``[n_atoms]`` integers a step). Any offsets give the same periodic system:
    they matter only for how long xnn's Verlet list stays valid."""

    def __init__(self, lmp, arrays: LammpsArrays | None = None):
        self.lmp = lmp
        self.arrays = LammpsArrays(lmp) if arrays is None else arrays
        self.mask, self.bits, self.bits2, self.max = (
            int(lmp.extract_setting(k)) for k in ("IMGMASK", "IMGBITS", "IMG2BITS", "IMGMAX"))
        self._flags: np.ndarray | None = None
        self._frame: tuple[np.ndarray, np.ndarray] | None = None  # cell, origin of the offsets
        self._offsets: np.ndarray | None = None
        self._base: np.ndarray | None = None  # [n, 3] image counts n_0

    def rebase(self) -> None:
        """Unwrap from the next call's image counts (``n_0 = n``)."""
        self._base = self._flags = None

    def unwrap(self, x: np.ndarray, origin: np.ndarray, cell: np.ndarray,
               dtype=np.float64) -> np.ndarray:
        """``[n, 3]`` Å: the first ``n = len(x)`` local atoms' positions relative to
        ``boxlo``, unwrapped by their image flags (a new array), computed in float64 and
        rounded once to ``dtype``."""
        n = x.shape[0]
        if n == 0:
            return (np.asarray(x, dtype=np.float64) - origin).astype(dtype)
        flags = self.arrays.rows("image", n)
        if not (self._flags is not None and np.array_equal(flags, self._flags)
                and self._same_frame(cell, origin)):
            counts = np.stack([flags & self.mask, (flags >> self.bits) & self.mask,
                               flags >> self.bits2], axis=1).astype(np.int64)
            if (self._base is None or self._base.shape != counts.shape
                    or int(np.abs(counts - self._base).max()) >= 2):
                self._base = counts
            self._flags = flags.copy()
            self._frame = (kept(cell), kept(origin))
            self._offsets = ((counts - self._base).astype(np.float64)
                             @ np.asarray(cell, np.float64) - origin)
        return np.add(x, self._offsets, out=np.empty(x.shape, dtype))

    def _same_frame(self, cell: np.ndarray, origin: np.ndarray) -> bool:
        """Whether the offsets were made for this cell and origin (the very read-only arrays
        of :meth:`LammpsArrays.box` while LAMMPS's box is unchanged: no comparison)."""
        if self._frame is None:
            return False
        if cell is self._frame[0] and origin is self._frame[1]:
            return True
        return bool(np.array_equal(cell, self._frame[0])
                    and np.array_equal(origin, self._frame[1]))


def unpack(out: dict, n: int
            ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Energy (eV), forces ``[n, 3]``, LAMMPS virial ``[6]``, per-atom energies ``[n]`` and
    (where the results hold them) per-atom virials ``[n, 6]`` (eV, LAMMPS's order) of a
    potential's results on the host.

    From a device: one copy in the model's dtype (one sync); on the CPU: views of the results.
    Forces and per-atom energies keep the model's dtype (float32 widens exactly where LAMMPS's
    arrays take them); virials are float64."""
    parts = [out[K.ENERGY].detach().sum().reshape(1), out[K.VIRIAL].detach().reshape(9),
             out[K.FORCES].detach().reshape(-1), out[K.ENERGIES].detach().reshape(-1)]
    if K.VIRIALS in out:
        parts.append(out[K.VIRIALS].detach().reshape(-1))
    if any(p.device.type != "cpu" for p in parts):
        parts = torch.cat(parts).cpu().split([p.numel() for p in parts])
    host = [p.numpy() for p in parts]
    virial = host[1][VOIGT_FLAT].astype(np.float64)
    virials = None
    if K.VIRIALS in out:
        virials = host[4].reshape(n, 9)[:, VOIGT_FLAT].astype(np.float64)
    return float(host[0][0]), host[2].reshape(n, 3), virial, host[3], virials
