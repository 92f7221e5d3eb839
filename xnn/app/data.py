"""The application behind ``xnn data``: reference structures (EMT-labelled, bulk crystals),
format conversion to xnn HDF5, prepared sharded datasets and the label keys a file holds.
Each function checks its output path before any work and raises one-line errors."""

from __future__ import annotations

from pathlib import Path

from xnn.errors import InputError

PROPERTIES = ("energy", "forces", "stress", "virial")


def write_emt_file(out: str, n: int, elements: list[str], seed: int) -> int:
    """``n`` EMT-labelled structures of ``elements`` to ``out``; returns how many."""
    from xnn.data.emt import check_output_file, check_suffix, write_emt

    check_output_file(out, "--out")
    check_suffix(out, "--out")
    return write_emt(out, n, elements, seed)


def write_bulk_file(out: str, element: str, repeat: int, a: float | None, rattle: float,
                    seed: int) -> tuple[Path, int]:
    """A ``repeat``³ cubic crystal of ``element`` (extxyz); returns the path and atom count."""
    from xnn.data.ase_io import write
    from xnn.data.crystals import bulk_crystal
    from xnn.data.emt import EXTXYZ_SUFFIXES, check_output_file, check_suffix

    path = check_output_file(out, "--out", example="big.xyz")
    check_suffix(path, "--out", EXTXYZ_SUFFIXES)
    atoms = bulk_crystal(element, repeat, a, rattle, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    write(path, atoms, format="extxyz")
    return path, len(atoms)


def convert_file(source: str, output: str, keys: dict[str, str]) -> tuple[int, int]:
    """``source`` (any format, labels by ``keys``: energy, forces, stress, virial) as xnn
    HDF5 ``output``; returns the structure and atom counts."""
    from xnn.data.emt import check_output_file
    from xnn.data.hdf5 import write_hdf5
    from xnn.data.sources import read_structures

    check_output_file(output, "output", example="data.h5")
    if Path(output).suffix not in (".h5", ".hdf5"):
        raise InputError(f"output {output!r} must end in .h5 or .hdf5")
    ds = read_structures(source, 1.0, *(keys[p] for p in PROPERTIES))
    n = write_hdf5(output, (ds[i] for i in range(len(ds))))
    return n, int(ds.n_atoms.sum())


def inspect_file(path: str, limit: int | None, keys: dict[str, str]) -> str:
    """The report of the keys ``path`` holds and where the labels of ``keys`` are found."""
    from xnn.data.inventory import inventory
    from xnn.data.label_keys import report

    if limit is not None and limit < 1:
        raise InputError(f"--limit must be >= 1, got {limit}")
    return report(inventory(path, limit=limit), keys)


def edge_counter(cutoff: float):
    """``count_edges(batch, origins)`` for :func:`xnn.data.prepared.write_prepared`: the
    neighbour pairs of each system within ``cutoff`` (Å; full list, images counted, as the
    training's neighbor lists), refusing a system with coincident atoms (named by
    ``origins``) as training does."""
    import numpy as np

    from xnn.neighbors import with_edges
    from xnn.neighbors.coincident import MIN_DISTANCE, find_close_pair, first_close_edge
    from xnn.neighbors.datasets import coincident_error

    def count(batch, origins):
        g = with_edges(batch, float(cutoff))
        if cutoff < MIN_DISTANCE:
            pair = find_close_pair(batch)
        else:  # every closer pair is an edge: one batched length check, then the lists
            pair = first_close_edge(g) if _shortest_edge(g) < MIN_DISTANCE else None
        if pair is not None:
            raise coincident_error(*origins[pair.system], pair)
        receivers = g.batch[g.edge_index[1]].cpu().numpy()
        return np.bincount(receivers, minlength=g.n_systems).astype(np.int64)

    return count


def _shortest_edge(g) -> float:
    """The shortest edge of a batched graph (Å; ``inf`` without edges), in one pass:
    ``r_ij = pos[j] - pos[i] + s @ cell[batch[i]]``."""
    import torch

    send, recv = g.edge_index
    if send.numel() == 0:
        return float("inf")
    shift = torch.einsum("ea,eab->eb", g.shifts.to(g.dtype), g.cell[g.batch[recv]])
    return float((g.positions[send] - g.positions[recv] + shift).norm(dim=-1).min())


def prepare_files(inputs: list[str], out: str, shards: int, cutoff: float | None,
                  keys: dict[str, str], overwrite: bool = False) -> dict:
    """``inputs`` (any format :func:`~xnn.data.sources.read_structures` opens, labels by
    ``keys``: energy, forces, stress, virial) as one prepared dataset in the folder ``out``
    (:func:`xnn.data.prepared.write_prepared`); returns its manifest."""
    from xnn.data.datasets import ConcatDataset
    from xnn.data.prepared import PreparedDataset, write_prepared
    from xnn.data.sources import read_structures

    if not inputs:
        raise InputError("name at least one input file")
    if cutoff is not None and cutoff <= 0:
        raise InputError(f"--cutoff must be > 0 Å, got {cutoff}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise InputError(f"--out {out!r} exists and is not empty; choose another folder or "
                         "pass --overwrite")
    parts = [read_structures(p, 1.0, *(keys[k] for k in PROPERTIES)) for p in inputs]
    data = parts[0] if len(parts) == 1 else ConcatDataset(parts)
    write_prepared(data, out, shards, cutoff,
                   count_edges=None if cutoff is None else edge_counter(cutoff),
                   label_keys={f"{k}_key": keys[k] for k in PROPERTIES}, overwrite=overwrite)
    return PreparedDataset(out).manifest
