"""HDF5 datasets for training sets larger than memory: concatenated arrays + per-structure offsets.

Layout (format ``xnn-hdf5`` version 1), ``S`` structures with ``A`` atoms in total::

    /atom_ptr   [S + 1]    int64   offsets: atoms of structure s are atom_ptr[s]:atom_ptr[s+1]
    /numbers    [A]        int64   atomic numbers
    /positions  [A, 3]     float64 Å
    /forces     [A, 3]     float64 eV/Å   (NaN rows: no force label)
    /cell       [S, 3, 3]  float64 Å, rows are lattice vectors
    /pbc        [S, 3]     bool
    /energy     [S]        float64 eV     (NaN: no energy label)
    /stress     [S, 3, 3]  float64 eV/Å³, ASE sign (NaN: no stress label)
    attrs: format="xnn-hdf5", format_version=1

Missing labels are stored as NaN, the same convention as the in-memory datasets of
:mod:`xnn.data.datasets`. :class:`HDF5Dataset` reads one structure at a time (the file is
opened lazily, once per process, so it works in forked data-loader workers);
:meth:`HDF5Dataset.read_batch` reads a batch's rows of each array in one HDF5 read (a
selection of the structures' row ranges) and builds one graph.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from xnn._files import require_file
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.data.rows import row_ranges
from xnn.errors import DataFileError

FORMAT = "xnn-hdf5"
FORMAT_VERSION = 1
_ATOM_ARRAYS = {"numbers": ((), np.int64), "positions": ((3,), np.float64),
                "forces": ((3,), np.float64)}
_SYSTEM_ARRAYS = {"cell": ((3, 3), np.float64), "pbc": ((3,), np.bool_),
                  "energy": ((), np.float64), "stress": ((3, 3), np.float64)}


def _label(graph: AtomicGraph, name: str, shape: tuple[int, ...]) -> np.ndarray:
    value = graph.get(name)
    if value is None:
        return np.full(shape, np.nan)
    return value.detach().cpu().double().numpy().reshape(shape)


def _arrays_of(graph: AtomicGraph) -> dict[str, np.ndarray]:
    """Per-structure arrays of a one-system graph, labels NaN where missing."""
    if graph.n_systems != 1:
        raise ValueError("write_hdf5 expects one graph per structure")
    n = graph.n_atoms
    stress = _label(graph, K.STRESS, (3, 3))
    if K.STRESS not in graph and K.VIRIAL in graph:
        vol = float(graph.volume()[0])
        stress = -_label(graph, K.VIRIAL, (3, 3)) / vol
    return {
        "numbers": graph.numbers.cpu().numpy().astype(np.int64),
        "positions": graph.positions.detach().cpu().double().numpy(),
        "forces": _label(graph, K.FORCES, (n, 3)),
        "cell": graph.cell.detach().cpu().double().numpy().reshape(1, 3, 3),
        "pbc": graph.pbc.cpu().numpy().reshape(1, 3),
        "energy": _label(graph, K.ENERGY, (1,)),
        "stress": stress.reshape(1, 3, 3),
    }


def write_hdf5(path: str | os.PathLike, graphs: Iterable[AtomicGraph], chunk: int = 1024) -> int:
    """Write one-structure graphs to an HDF5 file (streamed: the input may be a generator).

    Args:
        path: output file (overwritten).
        graphs: iterable of one-system :class:`AtomicGraph` with optional ``energy``,
            ``forces``, ``stress`` (or ``virial``) labels.
        chunk: structures buffered between writes.
    Returns:
        the number of structures written.
    """
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n_sys, n_atoms = 0, 0
    with h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        for name, (shape, dtype) in {**_ATOM_ARRAYS, **_SYSTEM_ARRAYS}.items():
            f.create_dataset(name, shape=(0, *shape), maxshape=(None, *shape), dtype=dtype,
                             chunks=(max(chunk, 1), *shape))
        ptr = [0]
        buffer: list[dict[str, np.ndarray]] = []

        def flush():
            nonlocal n_sys, n_atoms
            if not buffer:
                return
            for name in {**_ATOM_ARRAYS, **_SYSTEM_ARRAYS}:
                block = np.concatenate([b[name] for b in buffer])
                ds = f[name]
                old = ds.shape[0]
                ds.resize(old + block.shape[0], axis=0)
                ds[old:] = block
            n_sys += len(buffer)
            n_atoms += sum(len(b["numbers"]) for b in buffer)
            buffer.clear()

        for g in graphs:
            arrays = _arrays_of(g)
            ptr.append(ptr[-1] + len(arrays["numbers"]))
            buffer.append(arrays)
            if len(buffer) >= chunk:
                flush()
        flush()
        f.create_dataset("atom_ptr", data=np.asarray(ptr, dtype=np.int64))
    os.replace(tmp, path)
    return n_sys


class HDF5Dataset:
    """Lazily read structures from an ``xnn-hdf5`` file.

    Args:
        path: the file.
        dtype: floating dtype of the returned graphs.

    ``dataset[i]`` is a one-system :class:`AtomicGraph` with ``energy``, ``forces`` and
    ``stress`` fields (NaN where the file has no label). ``n_atoms`` is an ``[S]`` array
    available without reading the structures.
    """

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype = torch.float64):
        import h5py

        self.path = Path(path)
        self.dtype = dtype
        require_file(self.path, "HDF5 file")
        try:
            with h5py.File(self.path, "r") as f:
                if f.attrs.get("format") != FORMAT:
                    raise DataFileError(f"{str(self.path)!r} is not an xnn HDF5 dataset "
                                        f"(format attribute {f.attrs.get('format')!r})")
                self.atom_ptr = np.asarray(f["atom_ptr"][:], dtype=np.int64)  # past 2**31
        except OSError as e:
            raise DataFileError(f"cannot read HDF5 file {str(self.path)!r}: {e}") from None
        self.n_atoms = np.diff(self.atom_ptr)
        if not self.n_atoms.size or int(self.n_atoms.max()) < 2**31:
            self.n_atoms = self.n_atoms.astype(np.int32)  # 4 bytes a structure
        self._file = None
        self._pid = None
        self._sets: dict = {}

    def __len__(self) -> int:
        return len(self.n_atoms)

    def _handle(self):
        import h5py

        if self._file is None or self._pid != os.getpid():
            self._file = h5py.File(self.path, "r")
            self._pid = os.getpid()
            self._sets = {}
        return self._file

    def _set(self, name: str):
        """The file's dataset ``name``, looked up once per process (a lookup by name cost
        about as much as reading a small structure's rows)."""
        f = self._handle()
        found = self._sets.get(name)
        if found is None:
            found = self._sets[name] = f[name]
        return found

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_file"], state["_sets"] = None, {}
        return state

    def __getitem__(self, index: int) -> AtomicGraph:
        if not 0 <= index < len(self):
            raise IndexError(f"structure {index} out of range [0, {len(self)})")
        f = self._set
        a, b = int(self.atom_ptr[index]), int(self.atom_ptr[index + 1])
        dt = self.dtype
        extra = {
            K.ENERGY: torch.as_tensor(f("energy")[index : index + 1], dtype=dt),
            K.FORCES: torch.as_tensor(f("forces")[a:b], dtype=dt),
            K.STRESS: torch.as_tensor(f("stress")[index : index + 1], dtype=dt),
        }
        return AtomicGraph.from_arrays(
            f("positions")[a:b], f("numbers")[a:b], cell=f("cell")[index], pbc=f("pbc")[index],
            atom_id=np.arange(a, b), extra=extra, dtype=dt,
        )

    def _rows(self, name: str, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Rows ``starts[k] : starts[k] + counts[k]`` of array ``name`` for every ``k``, one
        after the other, in one read (the ranges increasing, apart and not empty: an HDF5
        selection is read in file order)."""
        from h5py import h5s

        ds = self._set(name)
        rest = tuple(ds.shape[1:])
        space = ds.id.get_space()
        space.select_none()
        for a, n in zip(starts.tolist(), counts.tolist()):
            space.select_hyperslab((a, *(0,) * len(rest)), (n, *rest), op=h5s.SELECT_OR)
        out = np.empty((int(counts.sum()), *rest), dtype=ds.dtype)
        ds.id.read(h5s.create_simple(out.shape), space, out)
        return out

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        """Structures ``indices`` (at least one; repeats allowed) as one batched graph, equal
        field by field (values and dtypes) to concatenating ``self[i]`` each: one read per
        array for the whole batch (its distinct structures' rows, in file order), not one per
        structure.

        Raises:
            IndexError: an index out of range.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = idx[(idx < 0) | (idx >= len(self))]
        if len(bad) or not len(idx):
            if len(bad):
                raise IndexError(f"structure {int(bad[0])} out of range [0, {len(self)})")
            raise IndexError("read_batch takes at least one structure")
        uniq, inverse = np.unique(idx, return_inverse=True)  # sorted: the file's order
        start, count = self.atom_ptr[uniq], self.atom_ptr[uniq + 1] - self.atom_ptr[uniq]
        if not count.all():
            return AtomicGraph.concat([self[int(i)] for i in idx])  # an empty structure
        read_ptr = np.concatenate([[0], np.cumsum(count)])
        rows = row_ranges(read_ptr[inverse], count[inverse])  # the batch's atoms, in order
        atoms = {name: self._rows(name, start, count)[rows] for name in _ATOM_ARRAYS}
        if atoms["numbers"].min() < 0:
            return AtomicGraph.concat([self[int(i)] for i in idx])  # masses per structure
        one = np.ones(len(uniq), dtype=np.int64)
        system = {name: self._rows(name, uniq, one)[inverse] for name in _SYSTEM_ARRAYS}
        n = count[inverse]
        dt = self.dtype
        extra = {K.ENERGY: torch.as_tensor(system["energy"], dtype=dt),
                 K.FORCES: torch.as_tensor(atoms["forces"], dtype=dt),
                 K.STRESS: torch.as_tensor(system["stress"], dtype=dt)}
        return AtomicGraph.from_arrays(
            atoms["positions"], atoms["numbers"], cell=system["cell"], pbc=system["pbc"],
            batch=np.repeat(np.arange(len(idx)), n), atom_id=row_ranges(start[inverse], n),
            extra=extra, dtype=dt)
