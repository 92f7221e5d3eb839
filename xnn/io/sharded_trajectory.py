"""A trajectory that the ranks of a decomposed run write in parallel, and its reader.

Each rank appends the frames of its owned atoms to its own HDF5 file
``trajectory.d/rank-RRRR.h5``; nothing is gathered. Atoms migrate between ranks, so a
frame's rows in a file are the atoms that rank owned at that step, with their global ids:

- per row (atom): ``atom_id [R]``, ``numbers [R]``, ``positions [R, 3]`` Å, ``velocities
  [R, 3]`` Å/fs, ``forces [R, 3]`` eV/Å;
- per frame: ``step [T]``, ``start [T]`` (first row of the frame), ``count [T]`` (rows),
  ``cell [T, 3, 3]`` Å, ``energy [T]`` eV (the whole system's);
- static: ``pbc [3]``; attribute ``first_frame`` (the run's frame index of the file's first
  frame: a rank added on a resume with more ranks starts there).

:func:`read_sharded_trajectory` merges the files into frames in global-id order, equal to the
gathered HDF5 trajectory of the same run (:func:`xnn.io.trajectory.read_hdf5_trajectory`
keys); :func:`sharded_frames` gives them as ASE ``Atoms`` (``xnn traj merge`` writes them as
extxyz). A resumed run truncates every file to the checkpoint's frame count, like the other
writers.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import DataFileError

SUFFIX = ".d"
ROWS = ("atom_id", "numbers", "positions", "velocities", "forces")
FRAMES = ("step", "start", "count", "cell", "energy")


def shard_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank-{rank:04d}.h5"


class ShardedTrajectoryWriter:
    """Append this rank's owned atoms of each frame to ``folder/rank-RRRR.h5``.

    Args:
        folder: ``trajectory.d`` (created).
        rank: this rank. size: ranks of the run (rank 0 truncates the files of ranks of an
            earlier run with more ranks).
        truncate_to: resume: the run's frame count at the checkpoint (``None``: new files).
    """

    suffix = SUFFIX

    def __init__(self, folder: str | os.PathLike, rank: int, size: int,
                 truncate_to: int | None = None):
        import h5py

        self.path = Path(folder)
        self.path.mkdir(parents=True, exist_ok=True)
        own = shard_file(self.path, rank)
        if truncate_to is None:
            self.file = h5py.File(own, "w")
            self.file.attrs["first_frame"] = 0
            return
        if rank == 0:
            for r in _ranks(self.path):
                if r >= size:  # a rank of a run with more ranks: cut to the checkpoint
                    with h5py.File(shard_file(self.path, r), "a") as f:
                        _truncate(f, truncate_to)
        if own.is_file():
            self.file = h5py.File(own, "a")
            _truncate(self.file, truncate_to)
        else:  # a rank the checkpoint's run did not have
            self.file = h5py.File(own, "w")
            self.file.attrs["first_frame"] = int(truncate_to)

    def _create(self, rows: dict[str, np.ndarray], frame: dict[str, np.ndarray],
                pbc: np.ndarray) -> None:
        f = self.file
        f.create_dataset("pbc", data=pbc)
        f.attrs["units"] = "positions Å, velocities Å/fs, forces eV/Å, cell Å, energy eV"
        n = max(1, min(1 << 16, len(rows["atom_id"])))  # a chunk: about a frame's rows
        for name, a in {**rows, **frame}.items():
            shape = a.shape[1:] if name in rows else a.shape
            f.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape), dtype=a.dtype,
                             chunks=(n if name in rows else 64, *shape))

    def write(self, graph: AtomicGraph, step: int, results: dict | None = None) -> None:
        """Append one frame: this rank's atoms of ``graph`` (one system) at ``step``;
        ``results``: forces (of these atoms) and the system's energy."""
        g, results = graph.detach(), results or {}
        rows = {"atom_id": g.atom_id.cpu().numpy(), "numbers": g.numbers.cpu().numpy(),
                "positions": g.positions.cpu().numpy()}
        if K.VELOCITIES in g:
            rows["velocities"] = g.velocities.cpu().numpy()
        if K.FORCES in results:
            rows["forces"] = results[K.FORCES].detach().cpu().numpy()
        f = self.file
        start = int(f["atom_id"].shape[0]) if "atom_id" in f else 0
        frame = {"step": np.asarray(step, dtype=np.int64),
                 "start": np.asarray(start, dtype=np.int64),
                 "count": np.asarray(g.n_atoms, dtype=np.int64),
                 "cell": g.cell[0].cpu().numpy()}
        if K.ENERGY in results:
            frame["energy"] = np.asarray(results[K.ENERGY].detach().cpu().numpy()).reshape(-1)[0]
        if "step" not in f:
            self._create(rows, frame, g.pbc[0].cpu().numpy())
        for name, a in rows.items():
            if name in f:
                d = f[name]
                d.resize(start + a.shape[0], axis=0)
                d[start:] = a
        for name, a in frame.items():
            if name in f:
                d = f[name]
                d.resize(d.shape[0] + 1, axis=0)
                d[-1] = a
        f.flush()

    def position(self) -> int:
        """The run's frame count (the same on every rank; stored in checkpoints)."""
        n = int(self.file["step"].shape[0]) if "step" in self.file else 0
        return int(self.file.attrs["first_frame"]) + n

    def close(self) -> None:
        self.file.close()


def _ranks(folder: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in folder.glob("rank-*.h5"))


def _truncate(f, frames: int) -> None:
    """Cut an open shard file to the run's first ``frames`` frames."""
    keep = max(0, frames - int(f.attrs["first_frame"]))
    if "step" not in f:
        return
    if f["step"].shape[0] < keep:
        raise DataFileError(f"cannot resume: trajectory {f.filename} is shorter than the "
                            "checkpoint says")
    rows = int(f["start"][keep]) if keep < f["step"].shape[0] else int(f["atom_id"].shape[0])
    for name in FRAMES:
        if name in f:
            f[name].resize(keep, axis=0)
    for name in ROWS:
        if name in f:
            f[name].resize(rows, axis=0)


def _frames_of(folder: Path):
    """Per file: ``(first_frame, frame datasets, row datasets)`` as numpy arrays."""
    import h5py

    if not folder.is_dir():
        raise DataFileError(f"sharded trajectory {folder} is not a folder (it is the "
                            "trajectory.d folder of a run with output.trajectory_format="
                            "sharded)")
    ranks = _ranks(folder)
    if not ranks:
        raise DataFileError(f"{folder} holds no trajectory shards (rank-RRRR.h5)")
    out = []
    for r in ranks:
        with h5py.File(shard_file(folder, r), "r") as f:
            if "step" not in f:
                continue
            out.append((int(f.attrs["first_frame"]), {n: f[n][()] for n in FRAMES if n in f},
                        {n: f[n][()] for n in ROWS if n in f}, f["pbc"][()]))
    return out


def read_sharded_trajectory(folder: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every frame of a sharded trajectory in global-id order, with the keys of
    :func:`~xnn.io.trajectory.read_hdf5_trajectory` (one system): ``positions [T, N, 3]``,
    ``velocities``, ``forces``, ``cell [T, 1, 3, 3]``, ``energy [T, 1]``, ``step [T]``,
    ``numbers [N]``, ``atom_id [N]``, ``batch [N]``, ``pbc [1, 3]``.

    Raises:
        DataFileError: no shards, frames whose steps or atoms disagree between the files.
    """
    folder = Path(folder)
    files = _frames_of(folder)
    if not files:
        raise DataFileError(f"{folder}: its shards hold no frames")
    n_frames = max(first + len(fr["step"]) for first, fr, _, _ in files)
    frames = [_frame(folder, files, k) for k in range(n_frames)]
    ids = frames[0]["atom_id"]
    if any(not np.array_equal(f["atom_id"], ids) for f in frames):
        raise DataFileError(f"{folder}: the frames hold different atoms")
    out = {k: np.stack([f[k] for f in frames]) for k in ("positions", "velocities", "forces")
           if k in frames[0]}
    out["cell"] = np.stack([f["cell"] for f in frames])[:, None]
    if "energy" in frames[0]:
        out["energy"] = np.asarray([f["energy"] for f in frames])[:, None]
    out["step"] = np.asarray([f["step"] for f in frames], dtype=np.int64)
    out.update(numbers=frames[0]["numbers"], atom_id=ids,
               batch=np.zeros(len(ids), dtype=np.int64), pbc=files[0][3][None])
    return out


def _frame(folder: Path, files, k: int) -> dict:
    """Frame ``k`` of the run: the rows of every file that holds it, sorted by id."""
    parts, head = [], None
    for first, fr, rows, _ in files:
        i = k - first
        if not 0 <= i < len(fr["step"]):
            continue
        a, n = int(fr["start"][i]), int(fr["count"][i])
        parts.append({name: v[a:a + n] for name, v in rows.items()})
        here = {name: fr[name][i] for name in ("step", "cell", "energy") if name in fr}
        if head is None:
            head = here
        elif here["step"] != head["step"]:
            raise DataFileError(f"{folder}: frame {k} is of step {head['step']} in one shard "
                                f"and of step {here['step']} in another")
    if head is None:
        raise DataFileError(f"{folder}: no shard holds frame {k}")
    merged = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    order = np.argsort(merged["atom_id"], kind="stable")
    return {**{name: v[order] for name, v in merged.items()}, **head}


def sharded_frames(folder: str | os.PathLike) -> list:
    """The frames of a sharded trajectory as ASE ``Atoms`` (atoms in id order; ``info``:
    step, energy; arrays: velocities, forces and ``atom_id``)."""
    from ase import Atoms, units
    from ase.calculators.singlepoint import SinglePointCalculator

    t = read_sharded_trajectory(folder)
    out = []
    for k in range(len(t["step"])):
        atoms = Atoms(numbers=t["numbers"], positions=t["positions"][k], cell=t["cell"][k, 0],
                      pbc=t["pbc"][0])
        if "velocities" in t:
            atoms.set_velocities(t["velocities"][k] / units.fs)  # Å/fs -> ASE units
        atoms.arrays["atom_id"] = t["atom_id"].copy()
        atoms.info["step"] = int(t["step"][k])
        if "forces" in t or "energy" in t:
            atoms.calc = SinglePointCalculator(
                atoms, energy=float(t["energy"][k, 0]) if "energy" in t else None,
                forces=t["forces"][k] if "forces" in t else None)
        out.append(atoms)
    return out


def merge_trajectory(folder: str | os.PathLike, out: str | os.PathLike) -> int:
    """Write a sharded trajectory's frames (id order) to ``out`` in any ASE format
    (extxyz for ``.xyz``/``.extxyz``), atomically; returns the number of frames."""
    import ase.io

    from xnn._files import atomic_write

    frames = sharded_frames(folder)
    fmt = "extxyz" if Path(out).suffix in (".xyz", ".extxyz") else None
    atomic_write(out, lambda tmp: ase.io.write(tmp, frames, format=fmt))
    return len(frames)
