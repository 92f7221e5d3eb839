"""The prepared dataset: structures preprocessed into sharded flat arrays (``xnn data prepare``).

Layout (format ``xnn-prepared`` version 1) of a folder ``DIR``, ``S`` structures with ``A``
atoms in a shard::

    DIR/prepared.json               manifest: format, shards, sources, label keys, cutoff,
                                    species, isolated atoms, statistics of the whole dataset
    DIR/shard_00000/atom_ptr.npy    [S + 1]    int64   atoms of entry s: atom_ptr[s]:atom_ptr[s+1]
                    numbers.npy     [A]        int64   atomic numbers
                    positions.npy   [A, 3]     float64 Å
                    forces.npy      [A, 3]     float64 eV/Å   (NaN rows: no force label)
                    cell.npy        [S, 3, 3]  float64 Å, rows are lattice vectors
                    pbc.npy         [S, 3]     bool
                    energy.npy      [S]        float64 eV     (NaN: no energy label)
                    stress.npy      [S, 3, 3]  float64 eV/Å³, ASE sign (NaN: no stress label)
                    label_counts.npy [S, 3]    int64   labelled energies, force and stress
                                                       components (as the loss counts them)
                    force_sq.npy    [S]        float64 eV²/Å², sum of squared force labels
                    n_edges.npy     [S]        int64   neighbour pairs within the cutoff
                                                       (full list, images counted; -1: none)
                    source.npy      [S]        int32   the entry's source file (manifest)
                    source_index.npy [S]       int64   its index in that file

Why ``.npy`` files opened with ``mmap_mode='r'``: any process (a rank, a data-loader worker)
maps the arrays and reads only the pages of the entries it uses, with no file handle to
reopen after a fork, no library beyond numpy, and nothing loaded at open; a shard is a
folder, so ranks may also copy only their own shards to local disk. The per-entry arrays
(atom, label and edge counts, force sums) give the dataset's index and the statistics of
any subset of it without reading a structure (:meth:`PreparedDataset.stored_statistics`).

:func:`write_prepared` streams: structures are read one chunk at a time and appended to the
files (whose sizes follow from the input's ``n_atoms``), so memory does not grow with the
input. It writes ``DIR.tmp`` and renames it to ``DIR`` at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from xnn.data import keys as K
from xnn.data.datasets import EntryStatistics, LabelledDataset, label_counts_of, narrow
from xnn.data.graph import AtomicGraph
from xnn.data.rows import row_ranges
from xnn.errors import DataFileError, InputError

FORMAT = "xnn-prepared"
FORMAT_VERSION = 1
MANIFEST = "prepared.json"
_ATOM = {"numbers": ((), np.int64), "positions": ((3,), np.float64),
         "forces": ((3,), np.float64)}
_ENTRY = {"cell": ((3, 3), np.float64), "pbc": ((3,), np.bool_), "energy": ((), np.float64),
          "stress": ((3, 3), np.float64), "label_counts": ((3,), np.int64),
          "force_sq": ((), np.float64), "n_edges": ((), np.int64),
          "source": ((), np.int32), "source_index": ((), np.int64)}

#: ``count_edges(graph) -> [n_systems]`` neighbour pairs of each system of a batched graph
#: within the cutoff; raises for coincident atoms (``origins``: each system's file and index)
EdgeCounter = Callable[[AtomicGraph, Sequence[tuple[str, int]]], np.ndarray]


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a prepared dataset's manifest."""
    return (Path(path) / MANIFEST).is_file()


# --------------------------------------------------------------------------- writing
class _NpyAppender:
    """One ``.npy`` file of a known shape written by appending rows in order."""

    def __init__(self, path: Path, shape: tuple[int, ...], dtype):
        self.file = open(path, "wb")
        self.dtype = np.dtype(dtype)
        np.lib.format.write_array_header_1_0(self.file, {
            "descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
            "shape": shape})
        self.rows, self.expected = 0, shape[0]

    def append(self, block: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        self.file.close()
        if self.rows != self.expected:
            raise DataFileError(f"{self.file.name}: wrote {self.rows} rows, expected "
                                f"{self.expected} (the input's n_atoms disagree with its "
                                "structures)")


def shard_bounds(n_atoms: np.ndarray, shards: int) -> np.ndarray:
    """``[shards + 1]`` entry offsets cutting ``range(len(n_atoms))`` into ``shards``
    contiguous non-empty ranges holding about equal numbers of atoms."""
    n = len(n_atoms)
    if not 1 <= shards <= max(n, 1):
        raise InputError(f"--shards must be between 1 and the number of structures ({n}), "
                         f"got {shards}")
    cum = np.cumsum(np.asarray(n_atoms, dtype=np.int64))
    total = int(cum[-1]) if n else 0
    cuts = np.searchsorted(cum, [total * k / shards for k in range(1, shards)], side="left") + 1
    cuts = np.maximum(cuts, np.arange(1, shards))  # at least one entry per shard
    cuts = np.minimum(cuts, n - np.arange(shards - 1, 0, -1))
    return np.concatenate([[0], np.maximum.accumulate(cuts), [n]]).astype(np.int64)


def _entry_rows(graph: AtomicGraph, n_edges: np.ndarray, source: np.ndarray,
                source_index: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of a batched graph of normalised structures, as written."""
    f = graph.forces.detach().double()
    sq = torch.where(torch.isfinite(f), f * f, torch.zeros_like(f)).sum(-1)
    force_sq = torch.zeros(graph.n_systems, dtype=torch.float64).index_add(0, graph.batch, sq)
    return {
        "numbers": graph.numbers.cpu().numpy(),
        "positions": graph.positions.detach().cpu().double().numpy(),
        "forces": f.cpu().numpy(),
        "cell": graph.cell.detach().cpu().double().numpy(),
        "pbc": graph.pbc.cpu().numpy(),
        "energy": graph.energy.detach().cpu().double().numpy().reshape(-1),
        "stress": graph.stress.detach().cpu().double().numpy().reshape(-1, 3, 3),
        "label_counts": label_counts_of(graph),
        "force_sq": force_sq.numpy(),
        "n_edges": n_edges, "source": source, "source_index": source_index,
    }


def _write_shard(folder: Path, dataset, lo: int, hi: int, sources: dict[str, int],
                 count_edges: EdgeCounter | None, chunk: int) -> None:
    folder.mkdir()
    n_atoms = np.asarray(dataset.n_atoms[lo:hi], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(n_atoms)]).astype(np.int64)
    np.save(folder / "atom_ptr.npy", ptr)
    files = {name: _NpyAppender(folder / f"{name}.npy", (int(ptr[-1]), *shape), dt)
             for name, (shape, dt) in _ATOM.items()}
    files.update({name: _NpyAppender(folder / f"{name}.npy", (hi - lo, *shape), dt)
                  for name, (shape, dt) in _ENTRY.items()})
    for a in range(lo, hi, chunk):
        indices = range(a, min(a + chunk, hi))
        graphs = [dataset[i] for i in indices]
        origins = [dataset.origin(i) for i in indices]
        batch = AtomicGraph.concat(graphs)
        edges = (count_edges(batch, origins) if count_edges is not None
                 else np.full(len(graphs), -1, np.int64))
        source = np.asarray([sources.setdefault(f, len(sources)) for f, _ in origins], np.int32)
        rows = _entry_rows(batch, np.asarray(edges, np.int64), source,
                           np.asarray([i for _, i in origins], np.int64))
        for name, file in files.items():
            file.append(rows[name])
    for file in files.values():
        file.close()


def write_prepared(dataset, out_dir: str | os.PathLike, shards: int,
                   cutoff: float | None = None, *, count_edges: EdgeCounter | None = None,
                   label_keys: dict[str, str] | None = None, overwrite: bool = False,
                   chunk: int = 256) -> Path:
    """Write ``dataset`` (a :class:`~xnn.data.datasets.LabelledDataset`, read structure by
    structure) as a prepared dataset in ``out_dir``.

    Args:
        dataset: normalised structures with ``n_atoms``, ``origin`` and ``isolated_atoms``.
        out_dir: the folder to create (written as ``out_dir.tmp``, renamed at the end).
        shards: number of shards (contiguous ranges with about equal atom counts).
        cutoff: Å, the cutoff of the stored edge counts (``None``: no edge counts, and no
            average neighbour count among the statistics).
        count_edges: how edges are counted (needed with ``cutoff``; the neighbour lists live
            a layer above this module): ``count_edges(batch, origins)``, see
            :data:`EdgeCounter`.
        label_keys: the keys the labels were read under (recorded in the manifest).
        overwrite: replace an existing non-empty ``out_dir``.
        chunk: structures read and written at a time.
    Returns:
        the folder.
    Raises:
        InputError: ``out_dir`` exists and is not empty (without ``overwrite``), or bad
            ``shards``.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise InputError(f"{str(out)!r} exists and is not empty; choose another --out or "
                         "pass --overwrite")
    if cutoff is not None and count_edges is None:
        raise InputError("write_prepared with a cutoff needs count_edges")
    n_atoms = np.asarray(dataset.n_atoms, dtype=np.int64)
    bounds = shard_bounds(n_atoms, shards)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        _write(dataset, tmp, bounds, cutoff, count_edges, label_keys, chunk)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.replace(tmp, out)
    return out


def _write(dataset, tmp: Path, bounds: np.ndarray, cutoff: float | None,
           count_edges: EdgeCounter | None, label_keys: dict[str, str] | None,
           chunk: int) -> None:
    """The shards and the manifest of :func:`write_prepared` in the folder ``tmp``."""
    n_atoms = np.asarray(dataset.n_atoms, dtype=np.int64)
    sources: dict[str, int] = {}
    names = []
    for k in range(len(bounds) - 1):
        names.append(f"shard_{k:05d}")
        _write_shard(tmp / names[-1], dataset, int(bounds[k]), int(bounds[k + 1]), sources,
                     count_edges, chunk)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "n_structures": int(len(n_atoms)), "n_atoms": int(n_atoms.sum()),
        "cutoff": None if cutoff is None else float(cutoff),
        "label_keys": dict(label_keys or {}),
        "sources": sorted(sources, key=sources.get),
        "shards": [{"path": name, "n_structures": int(bounds[k + 1] - bounds[k]),
                    "n_atoms": int(n_atoms[bounds[k]:bounds[k + 1]].sum())}
                   for k, name in enumerate(names)],
        "isolated_atoms": [[int(i), int(z), float(e)]
                           for i, (z, e) in sorted(dataset.isolated_atoms().items())],
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    ds = PreparedDataset(tmp)
    manifest["species"] = ds.species()
    manifest["statistics"] = summary_statistics(ds)
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


# --------------------------------------------------------------------------- reading
class PreparedDataset(LabelledDataset):
    """A prepared dataset, read lazily: each shard's arrays are memory-mapped at first use
    (once per process), ``n_atoms`` and the label counts come from the per-entry arrays.

    Args:
        path: the folder written by :func:`write_prepared` (``xnn data prepare``).
        weight: the loss weight of every structure.
        dtype: floating dtype of the returned graphs.

    ``dataset[i]`` is a one-system graph with ``energy [1]``, ``forces [n, 3]``,
    ``stress [1, 3, 3]`` (NaN where the source had no label), ``weight [1]``, ``atom_id``
    (consecutive over the dataset) and ``system_id`` ``[i]``, as
    :func:`~xnn.data.sources.read_structures` gives the source file's structures.
    Pickling keeps the path only: a data-loader worker maps the arrays again.
    """

    def __init__(self, path: str | os.PathLike, weight: float = 1.0,
                 dtype: torch.dtype = torch.float64):
        self.path = Path(path)
        self.name = self.path.name
        self.source = os.fspath(path)
        self.weight = float(weight)
        self.dtype = dtype
        try:
            self.manifest = json.loads((self.path / MANIFEST).read_text())
        except (OSError, ValueError) as e:
            raise DataFileError(f"cannot read the prepared dataset {self.source!r}: {e}") \
                from None
        if self.manifest.get("format") != FORMAT:
            raise DataFileError(f"{self.source!r} is not an xnn prepared dataset (format "
                                f"{self.manifest.get('format')!r})")
        counts = [s["n_structures"] for s in self.manifest["shards"]]
        self.first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        atoms = [s["n_atoms"] for s in self.manifest["shards"]]
        self.first_atom = np.concatenate([[0], np.cumsum(atoms)]).astype(np.int64)
        self.cutoff = self.manifest.get("cutoff")
        self._maps: dict[tuple[int, str], np.ndarray] = {}
        self._pid = os.getpid()
        self._n_atoms: np.ndarray | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"], state["_n_atoms"] = {}, None
        return state

    def _array(self, shard: int, name: str) -> np.ndarray:
        if self._pid != os.getpid():
            self._maps, self._pid = {}, os.getpid()
        key = (shard, name)
        if key not in self._maps:
            path = self.path / self.manifest["shards"][shard]["path"] / f"{name}.npy"
            try:
                self._maps[key] = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                raise DataFileError(f"cannot read {str(path)!r} of the prepared dataset: "
                                    f"{e}") from None
        return self._maps[key]

    def _entries(self, name: str) -> np.ndarray:
        """A per-entry array over all shards (read into memory)."""
        parts = [np.asarray(self._array(s, name)) for s in range(len(self.first) - 1)]
        return np.concatenate(parts) if parts else np.zeros(0)

    @property
    def n_atoms(self) -> np.ndarray:
        """``[len]`` int32 atoms per structure (from the shards' offsets; int64 only if one
        reaches ``2**31``)."""
        if self._n_atoms is None:
            parts = [np.diff(self._array(s, "atom_ptr")) for s in range(len(self.first) - 1)]
            self._n_atoms = narrow(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return self._n_atoms

    @property
    def n_edges(self) -> np.ndarray | None:
        """``[len]`` int64 neighbour pairs per structure within :attr:`cutoff` (full list),
        for samplers that balance ranks by edges; ``None`` without a stored cutoff."""
        if self.cutoff is None:
            return None
        return self._entries("n_edges").astype(np.int64)

    def __len__(self) -> int:
        return int(self.first[-1])

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"structure {index} out of range [0, {len(self)})")
        s = int(np.searchsorted(self.first, index, side="right")) - 1
        return s, index - int(self.first[s])

    def __getitem__(self, index: int) -> AtomicGraph:
        s, j = self._locate(int(index))
        ptr = self._array(s, "atom_ptr")
        a, b = int(ptr[j]), int(ptr[j + 1])
        dt, off = self.dtype, int(self.first_atom[s])
        extra = {
            K.ENERGY: torch.as_tensor(np.array(self._array(s, "energy")[j : j + 1]), dtype=dt),
            K.FORCES: torch.as_tensor(np.array(self._array(s, "forces")[a:b]), dtype=dt),
            K.STRESS: torch.as_tensor(np.array(self._array(s, "stress")[j : j + 1]), dtype=dt),
            K.WEIGHT: torch.full((1,), self.weight, dtype=dt),
            K.SYSTEM_ID: torch.tensor([int(index)]),
        }
        return AtomicGraph.from_arrays(
            np.array(self._array(s, "positions")[a:b]), np.array(self._array(s, "numbers")[a:b]),
            cell=np.array(self._array(s, "cell")[j]), pbc=np.array(self._array(s, "pbc")[j]),
            atom_id=np.arange(off + a, off + b), extra=extra, dtype=dt)

    def read_batch(self, indices: Sequence[int]) -> AtomicGraph:
        """Structures ``indices`` as one batched graph, equal field by field (values and
        dtypes) to :func:`~xnn.data.datasets.collate` of ``self[i]`` each, read in one pass
        per field and shard (one gather of the atoms' rows, one of the entries' rows) and
        built as one graph: a training batch costs a dozen array reads, not a dozen per
        structure, and one graph's validation."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if len(idx) == 0 or not ((idx >= 0) & (idx < len(self))).all():
            return super().read_batch(idx)  # the per-structure path's error
        shard = np.searchsorted(self.first, idx, side="right") - 1
        local = idx - self.first[shard]
        start, count = np.zeros(len(idx), np.int64), np.zeros(len(idx), np.int64)
        for s in np.unique(shard).tolist():
            at = np.flatnonzero(shard == s)
            ptr = self._array(s, "atom_ptr")
            start[at], count[at] = ptr[local[at]], ptr[local[at] + 1] - ptr[local[at]]
        if not count.all():
            return super().read_batch(idx)  # an empty structure: kept on the simple path
        out_ptr = np.concatenate([[0], np.cumsum(count)])
        arrays = {name: np.empty((int(out_ptr[-1]), *shape), dt)
                  for name, (shape, dt) in _ATOM.items()}
        arrays["atom_id"] = np.empty(int(out_ptr[-1]), np.int64)
        arrays.update({name: np.empty((len(idx), *_ENTRY[name][0]), _ENTRY[name][1])
                       for name in ("cell", "pbc", "energy", "stress")})
        for s in np.unique(shard).tolist():
            at = np.flatnonzero(shard == s)
            src, dst = row_ranges(start[at], count[at]), row_ranges(out_ptr[at], count[at])
            for name in _ATOM:
                arrays[name][dst] = self._array(s, name)[src]
            arrays["atom_id"][dst] = src + self.first_atom[s]
            for name in ("cell", "pbc", "energy", "stress"):
                arrays[name][at] = self._array(s, name)[local[at]]
        if arrays["numbers"].min() < 0:
            return super().read_batch(idx)  # masses per structure, as from_arrays gives
        dt = self.dtype
        extra = {K.ENERGY: torch.as_tensor(arrays["energy"], dtype=dt),
                 K.FORCES: torch.as_tensor(arrays["forces"], dtype=dt),
                 K.STRESS: torch.as_tensor(arrays["stress"], dtype=dt),
                 K.WEIGHT: torch.full((len(idx),), self.weight, dtype=dt),
                 K.SYSTEM_ID: torch.as_tensor(idx)}
        return AtomicGraph.from_arrays(
            arrays["positions"], arrays["numbers"], cell=arrays["cell"], pbc=arrays["pbc"],
            batch=np.repeat(np.arange(len(idx)), count), atom_id=arrays["atom_id"],
            extra=extra, dtype=dt)

    def origin(self, index: int) -> tuple[str, int]:
        """The source file (as named to ``xnn data prepare``) and the index in it."""
        s, j = self._locate(int(index))
        return (self.manifest["sources"][int(self._array(s, "source")[j])],
                int(self._array(s, "source_index")[j]))

    def _count_labels(self) -> np.ndarray:
        return self._entries("label_counts").reshape(-1, 3).astype(np.int32)

    def isolated_atoms(self) -> dict[int, tuple[int, float]]:
        return {int(i): (int(z), float(e)) for i, z, e in self.manifest["isolated_atoms"]}

    def species(self) -> list[int]:
        if "species" in self.manifest:
            return list(self.manifest["species"])
        found: set[int] = set()
        for s in range(len(self.first) - 1):
            found |= set(np.unique(self._array(s, "numbers")).tolist())
        return sorted(found)

    def stored_statistics(self, indices: Sequence[int],
                          cutoff: float) -> EntryStatistics | None:
        """The per-entry arrays of structures ``indices`` for statistics, without reading
        them (their atomic numbers only); ``None`` when the stored edge counts are not for
        ``cutoff`` (Å, to 1e-12 relative)."""
        if self.cutoff is None or not np.isclose(float(cutoff), self.cutoff, rtol=1e-12,
                                                 atol=0.0):
            return None
        return self.entry_statistics(indices)

    def entry_statistics(self, indices: Sequence[int]) -> EntryStatistics:
        """The per-entry arrays of structures ``indices`` (``n_edges`` -1 without a
        cutoff), whatever the cutoff."""
        indices = np.asarray(indices, dtype=np.int64)
        rows = {name: np.zeros((len(indices), *shape), dt) for name, (shape, dt) in
                (("energy", ((), np.float64)), ("force_sq", ((), np.float64)),
                 ("n_edges", ((), np.int64)), ("label_counts", ((3,), np.int64)),
                 ("composition", ((119,), np.int64)))}
        shard = np.searchsorted(self.first, indices, side="right") - 1
        for s in np.unique(shard):
            at = np.flatnonzero(shard == s)
            local = indices[at] - self.first[s]
            for name in ("energy", "force_sq", "n_edges", "label_counts"):
                rows[name][at] = self._array(int(s), name)[local]
            ptr = self._array(int(s), "atom_ptr")
            starts, lens = ptr[local], ptr[local + 1] - ptr[local]
            ends = np.cumsum(lens)
            atoms = np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]))
            numbers = np.asarray(self._array(int(s), "numbers")[atoms])
            np.add.at(rows["composition"], (np.repeat(at, lens), numbers), 1)
        return EntryStatistics(
            n_atoms=rows["composition"].sum(1), n_edges=rows["n_edges"],
            energy=rows["energy"], composition=rows["composition"],
            force_sq=rows["force_sq"], force_count=rows["label_counts"][:, 1])


# --------------------------------------------------------------------------- statistics
def summary_statistics(dataset: PreparedDataset, chunk: int = 1 << 16) -> dict:
    """The statistics of the whole prepared dataset, from its per-entry arrays in chunks
    (memory bounded by ``chunk`` entries and the squared species count):

    ``e0_fit`` (``{Z: eV}``: least squares of energy on composition, from the normal
    equations, minimum norm where singular), ``e0_isolated`` (the isolated-atom entries'
    energies), ``energy_per_atom_mean``/``_std`` (eV/atom, after ``e0_fit``), ``force_rms``
    (eV/Å), ``avg_num_neighbors`` (at the cutoff; ``None`` without one), and the counts.
    """
    species = dataset.species()
    col = np.full(119, -1)
    col[species] = np.arange(len(species))
    m = len(species)
    ata, atb = np.zeros((m, m)), np.zeros(m)
    sums = {"sq": 0.0, "count": 0, "edges": 0, "atoms": 0, "energies": 0}
    for ent in _chunks(dataset, chunk):
        keep = np.isfinite(ent.energy)
        a = ent.composition[keep][:, species].astype(np.float64)
        ata += a.T @ a
        atb += a.T @ ent.energy[keep]
        sums["sq"] += float(ent.force_sq.sum())
        sums["count"] += int(ent.force_count.sum())
        sums["edges"] += int(ent.n_edges.sum())
        sums["atoms"] += int(ent.n_atoms.sum())
        sums["energies"] += int(keep.sum())
    e0 = np.linalg.lstsq(ata, atb, rcond=None)[0] if sums["energies"] else np.zeros(m)
    s1 = s2 = 0.0
    for ent in _chunks(dataset, chunk):
        keep = np.isfinite(ent.energy)
        v = (ent.energy[keep] - ent.composition[keep][:, species] @ e0) / ent.n_atoms[keep]
        s1, s2 = s1 + float(v.sum()), s2 + float((v * v).sum())
    n = max(sums["energies"], 1)
    mean = s1 / n
    edges_known = dataset.cutoff is not None
    return {
        "e0_fit": {str(z): float(e0[col[z]]) for z in species},
        "e0_isolated": {str(z): e for z, e in sorted(dataset.isolated_atoms().values())},
        "energy_per_atom_mean": mean,
        "energy_per_atom_std": float(np.sqrt(max(s2 / n - mean * mean, 0.0))),
        "force_rms": float(np.sqrt(sums["sq"] / sums["count"])) if sums["count"] else None,
        "avg_num_neighbors": (sums["edges"] / sums["atoms"]
                              if edges_known and sums["atoms"] else None),
        "n_energies": sums["energies"], "n_force_components": sums["count"],
    }


def _chunks(dataset: PreparedDataset, chunk: int):
    """The dataset's :class:`EntryStatistics` in ranges of ``chunk`` entries."""
    for a in range(0, len(dataset), chunk):
        yield dataset.entry_statistics(np.arange(a, min(a + chunk, len(dataset))))
