"""Trajectory writers for MD and relaxations: extxyz (readable by ASE/OVITO) and HDF5.

Both append one frame per call, report their size (``position()``) so that a checkpoint can
record it, and can be reopened truncated to that size on resume, so a resumed run writes
exactly the file an uninterrupted one would (a frame torn by a killed run, after the
checkpoint, is cut off). A file of one frame that is read back as a whole
(``relaxed.xyz``, ``last_good.xyz``) is written atomically by :func:`write_extxyz`.

HDF5 layout (atoms fixed during a run): ``positions [T, N, 3]`` Å, ``velocities [T, N, 3]``
Å/fs, ``forces [T, N, 3]`` eV/Å, ``cell [T, S, 3, 3]`` Å, ``energy [T, S]`` eV, ``step [T]``,
and static ``numbers [N]``, ``batch [N]``, ``atom_id [N]``, ``pbc [S, 3]``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from xnn._files import atomic_write
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import DataFileError

#: systems larger than this are written as HDF5 when the format is "auto"
HDF5_THRESHOLD = 10_000


class ExtxyzWriter:
    """Append frames (every system of the batch, with energy, forces, stress) to an extxyz file.

    Args:
        path: file to write.
        truncate_to: reopen an existing file cut to this many bytes (resume); ``None``: new file.
    """

    suffix = ".xyz"

    def __init__(self, path: str | os.PathLike, truncate_to: int | None = None):
        self.path = Path(path)
        if truncate_to is None:
            self.path.write_bytes(b"")
        else:
            _truncate(self.path, truncate_to)

    def write(self, graph: AtomicGraph, step: int, results: dict | None = None) -> None:
        """Write ``graph`` (all its systems) at ``step``; ``results`` adds energy/forces/stress."""
        with open(self.path, "a") as fh:
            fh.write(extxyz_text(graph, step, results))

    def position(self) -> int:
        """Size of the file in bytes (stored in checkpoints)."""
        return self.path.stat().st_size

    def close(self) -> None:
        pass


def extxyz_text(graph: AtomicGraph, step: int, results: dict | None = None) -> str:
    """Every system of ``graph`` at ``step`` as extxyz frames (``results``: energy, forces,
    stress)."""
    import ase.io

    from xnn.data.ase_io import to_ase

    g = graph.replace(results or {}) if results else graph
    frames = to_ase(g.detach())
    for s, atoms in enumerate(frames):
        atoms.info["step"] = int(step)
        atoms.info["system"] = s
    buf = io.StringIO()
    ase.io.write(buf, frames, format="extxyz")
    return buf.getvalue()


def write_extxyz(path: str | os.PathLike, graph: AtomicGraph, step: int,
                 results: dict | None = None) -> Path:
    """Replace ``path`` atomically by ``graph``'s frames (see :func:`extxyz_text`)."""
    text = extxyz_text(graph, step, results)
    return atomic_write(path, lambda tmp: tmp.write_text(text))


class HDF5TrajectoryWriter:
    """Append frames to an HDF5 trajectory (chunked, resizable datasets)."""

    suffix = ".h5"

    def __init__(self, path: str | os.PathLike, truncate_to: int | None = None):
        import h5py

        self.path = Path(path)
        if truncate_to is None:
            self.file = h5py.File(self.path, "w")
        else:
            if not self.path.is_file():
                raise DataFileError(f"cannot resume: trajectory {self.path} is missing")
            self.file = h5py.File(self.path, "a")
            for name in ("positions", "velocities", "forces", "cell", "energy", "step"):
                if name in self.file:
                    self.file[name].resize(truncate_to, axis=0)

    def _create(self, g: AtomicGraph, arrays: dict[str, np.ndarray]) -> None:
        f = self.file
        f.create_dataset("numbers", data=g.numbers.cpu().numpy())
        f.create_dataset("batch", data=g.batch.cpu().numpy())
        f.create_dataset("atom_id", data=g.atom_id.cpu().numpy())
        f.create_dataset("pbc", data=g.pbc.cpu().numpy())
        f.attrs["units"] = "positions Å, velocities Å/fs, forces eV/Å, cell Å, energy eV"
        for name, a in arrays.items():
            f.create_dataset(name, shape=(0, *a.shape), maxshape=(None, *a.shape),
                             dtype=a.dtype, chunks=(1, *a.shape))

    def write(self, graph: AtomicGraph, step: int, results: dict | None = None) -> None:
        """Append one frame of every system."""
        g = graph.detach()
        results = results or {}
        arrays = {
            "positions": g.positions.cpu().numpy(),
            "cell": g.cell.cpu().numpy(),
            "step": np.asarray(step, dtype=np.int64),
        }
        if K.VELOCITIES in g:
            arrays["velocities"] = g.velocities.cpu().numpy()
        for name in (K.FORCES, K.ENERGY):
            if name in results:
                arrays[name] = results[name].detach().cpu().numpy()
        if "positions" not in self.file:
            self._create(g, arrays)
        for name, a in arrays.items():
            if name not in self.file:
                continue
            d = self.file[name]
            d.resize(d.shape[0] + 1, axis=0)
            d[-1] = a
        self.file.flush()

    def position(self) -> int:
        """Number of frames written (stored in checkpoints)."""
        return int(self.file["step"].shape[0]) if "step" in self.file else 0

    def close(self) -> None:
        self.file.close()


def _truncate(path: Path, size: int) -> None:
    if not path.is_file():
        raise DataFileError(f"cannot resume: trajectory {path} is missing")
    if path.stat().st_size < size:
        raise DataFileError(f"cannot resume: trajectory {path} is shorter than the checkpoint says")
    with open(path, "r+b") as fh:
        fh.truncate(size)


def open_trajectory(
    directory: str | os.PathLike, fmt: str, n_atoms: int, truncate_to: int | None = None,
    name: str = "trajectory",
) -> ExtxyzWriter | HDF5TrajectoryWriter:
    """Open ``directory/name.xyz`` or ``.h5``; ``fmt`` is ``auto``, ``extxyz`` or ``hdf5``."""
    if fmt == "auto":
        fmt = "hdf5" if n_atoms > HDF5_THRESHOLD else "extxyz"
    cls = HDF5TrajectoryWriter if fmt == "hdf5" else ExtxyzWriter
    return cls(Path(directory) / f"{name}{cls.suffix}", truncate_to)


def read_hdf5_trajectory(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All datasets of an HDF5 trajectory as numpy arrays."""
    import h5py

    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in f}
