"""Conversion between ASE ``Atoms`` and :class:`AtomicGraph`, and extxyz reading/writing.

Velocities: ASE stores momenta in amu·Å/(ASE time unit); xnn uses Å/fs, so
``v_xnn = v_ase * ase.units.fs`` and back ``v_ase = v_xnn / ase.units.fs``.
Stress labels are accepted as Voigt-6 ``(xx, yy, zz, yz, xz, xy)`` or 3×3 (or 9 numbers)
and stored as ``[n_systems, 3, 3]`` eV/Å³ (ASE sign).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from xnn._files import require_file
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.data.label_keys import describe_keys, inventory_of
from xnn.errors import DataFileError, InputError

LABELS = ("energy", "forces", "stress", "virial")


def _to_3x3(value, what: str, index: int) -> np.ndarray:
    a = np.asarray(value, dtype=np.float64).reshape(-1)
    if a.size == 9:
        return a.reshape(3, 3)
    if a.size == 6:
        xx, yy, zz, yz, xz, xy = a
        return np.array([[xx, xy, xz], [xy, yy, yz], [xz, yz, zz]])
    raise DataFileError(f"structure {index}: {what} must have 6 (Voigt) or 9 values, got {a.size}")


def _lookup(atoms, key: str, prop: str):
    """A label from ``atoms.info`` / ``atoms.arrays`` under ``key``, or a calculator result."""
    if key in atoms.info:
        return atoms.info[key]
    if key in atoms.arrays:
        return atoms.arrays[key]
    calc = atoms.calc
    results = getattr(calc, "results", None) or {}
    if key == prop and prop in results:
        return results[prop]
    return None


def _label(atoms, key: str, prop: str, index: int):
    """Label ``prop`` of structure ``index`` as a numpy array of xnn shape, or ``None``."""
    value = _lookup(atoms, key, prop)
    if value is None:
        return None
    if prop == "energy":
        a = np.asarray(value, dtype=np.float64)
        if a.size != 1:
            raise DataFileError(f"structure {index}: energy {key!r} must be one number")
        return a.reshape(())
    if prop == "forces":
        a = np.asarray(value, dtype=np.float64)
        if a.shape != (len(atoms), 3):
            raise DataFileError(
                f"structure {index}: forces {key!r} must have shape ({len(atoms)}, 3), "
                f"got {a.shape}"
            )
        return a
    return _to_3x3(value, f"{prop} {key!r}", index)


def _faces(cell: np.ndarray) -> np.ndarray:
    """``[3, 3]``: row ``a`` is ``cell[a + 1] × cell[a + 2]`` (indices mod 3), the products
    ``np.cross`` forms, for the three axes at once (``np.cross`` of two 3-vectors costs more
    than the rest of a structure's checks)."""
    b, c = cell[[1, 2, 0]], cell[[2, 0, 1]]
    return np.stack([b[:, 1] * c[:, 2] - b[:, 2] * c[:, 1],
                     b[:, 2] * c[:, 0] - b[:, 0] * c[:, 2],
                     b[:, 0] * c[:, 1] - b[:, 1] * c[:, 0]], -1)


def _check_structure(atoms, index: int) -> None:
    if not np.isfinite(atoms.positions).all():
        raise InputError(f"structure {index}: non-finite positions")
    cell = np.asarray(atoms.cell[:], dtype=np.float64)
    if not np.isfinite(cell).all():
        raise InputError(f"structure {index}: non-finite cell")
    pbc = np.asarray(atoms.pbc, bool)
    if pbc.any():
        # heights of the completed cell along periodic axes must be non-zero
        full = np.asarray(atoms.cell.complete()[:])
        vol = abs(np.linalg.det(full))
        faces = _faces(full)
        for a in np.nonzero(pbc)[0]:
            area = np.linalg.norm(faces[a])
            if np.linalg.norm(cell[a]) < 1e-8 or area < 1e-12 or vol / area < 1e-6:
                raise InputError(f"structure {index}: singular cell along periodic axis {'xyz'[a]}")


def _atom_ids(atoms_list: Sequence) -> np.ndarray:
    ids, offset = [], 0
    for atoms in atoms_list:
        n = len(atoms)
        if "atom_id" in atoms.arrays:
            ids.append(np.asarray(atoms.arrays["atom_id"], dtype=np.int64))
        else:
            ids.append(np.arange(offset, offset + n, dtype=np.int64))
        offset += n
    return np.concatenate(ids) if ids else np.zeros(0, np.int64)


def _collect_labels(
    atoms_list, keys: dict[str, str], require: Sequence[str]
) -> dict[str, np.ndarray]:
    """Labels present in every structure, stacked; raise if a required one is missing."""
    unknown = sorted(set(require) - set(LABELS))
    if unknown:
        raise InputError(f"unknown required label(s) {unknown}; choose from {list(LABELS)}")
    out, lacking = {}, []
    for prop in LABELS:
        if keys[prop] is None:
            if prop in require:
                raise InputError(f"label {prop!r} is required but its key is None")
            continue
        values = [_label(a, keys[prop], prop, i) for i, a in enumerate(atoms_list)]
        missing = [i for i, v in enumerate(values) if v is None]
        if missing and prop in require:
            lacking.append(f"structure {missing[0]} has no {prop} under key {keys[prop]!r} "
                           f"({len(missing)} of {len(values)} structures lack it)")
        if values and not missing:
            out[prop] = np.concatenate(values) if prop == "forces" else np.stack(values)
    if lacking:
        raise DataFileError(f"{'; '.join(lacking)}; "
                            f"{describe_keys(inventory_of(atoms_list, 'the file'))}")
    return out


def from_ase(
    atoms,
    energy_key: str | None = "energy",
    forces_key: str | None = "forces",
    stress_key: str | None = "stress",
    virial_key: str | None = "virial",
    require: Sequence[str] = (),
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> AtomicGraph:
    """Convert one ``ase.Atoms`` or a list of them into a batched :class:`AtomicGraph`.

    Args:
        atoms: an ``Atoms`` or a sequence of ``Atoms``.
        energy_key, forces_key, stress_key, virial_key: where labels live in
            ``atoms.info`` / ``atoms.arrays``; a key equal to the property name also finds a
            (SinglePoint)calculator's stored result; ``None`` skips that label.
        require: label names (``"energy"``, ``"forces"``, ...) every structure must have.
        dtype: floating-point dtype of positions, cell, masses and labels.
        device: target device.
    Returns:
        A graph with positions ``[n_atoms, 3]`` Å, numbers, cell ``[n_systems, 3, 3]``, pbc,
        masses (amu), atom ids (``atoms.arrays["atom_id"]`` or consecutive over the list),
        ``system_id`` (index in the list), velocities (Å/fs) and charges when any structure
        has them, and each label only when every structure has it.
    Raises:
        InputError: non-finite positions/cell, or a singular cell along a periodic axis.
        DataFileError: a required label is missing or a label has the wrong shape.
    """
    from ase import Atoms, units

    atoms_list = [atoms] if isinstance(atoms, Atoms) else list(atoms)
    if not atoms_list:
        raise InputError("no structures to convert")
    for i, a in enumerate(atoms_list):
        _check_structure(a, i)
    keys = {"energy": energy_key, "forces": forces_key, "stress": stress_key, "virial": virial_key}
    labels = _collect_labels(atoms_list, keys, require)
    counts = [len(a) for a in atoms_list]
    extra: dict[str, object] = {
        K.SYSTEM_ID: np.arange(len(atoms_list)),
    }
    if any(a.has("momenta") for a in atoms_list):
        extra[K.VELOCITIES] = np.concatenate([a.get_velocities() for a in atoms_list]) * units.fs
    if any(a.has("initial_charges") for a in atoms_list):
        extra[K.CHARGES] = np.concatenate([a.get_initial_charges() for a in atoms_list])
    field_of = {"energy": K.ENERGY, "forces": K.FORCES, "stress": K.STRESS, "virial": K.VIRIAL}
    for prop, value in labels.items():
        extra[field_of[prop]] = value
    return AtomicGraph.from_arrays(
        positions=np.concatenate([a.positions for a in atoms_list]).reshape(-1, 3),
        numbers=np.concatenate([a.numbers for a in atoms_list]),
        cell=np.stack([np.asarray(a.cell[:], dtype=np.float64) for a in atoms_list]),
        pbc=np.stack([np.asarray(a.pbc, bool) for a in atoms_list]),
        batch=np.repeat(np.arange(len(atoms_list)), counts),
        masses=np.concatenate([a.get_masses() for a in atoms_list]),
        atom_id=_atom_ids(atoms_list),
        extra=extra,
        dtype=dtype,
        device=device,
    )


def to_ase(graph: AtomicGraph) -> list:
    """One ``ase.Atoms`` per system; labels/results go into a ``SinglePointCalculator``.

    Energy, per-atom energies, forces and stress (as Voigt-6) are attached when present;
    velocities are converted back to ASE units; atom ids go to ``arrays["atom_id"]``.
    """
    from ase import Atoms, units
    from ase.calculators.singlepoint import SinglePointCalculator
    from ase.stress import full_3x3_to_voigt_6_stress

    g = graph.detach().to(device="cpu")
    ptr = g.ptr.tolist()
    out = []
    for s in range(g.n_systems):
        lo, hi = ptr[s], ptr[s + 1]
        atoms = Atoms(
            numbers=g.numbers[lo:hi].numpy(),
            positions=g.positions[lo:hi].double().numpy(),
            cell=g.cell[s].double().numpy(),
            pbc=g.pbc[s].numpy(),
            masses=g.masses[lo:hi].double().numpy(),
        )
        if K.VELOCITIES in g:
            atoms.set_velocities(g.velocities[lo:hi].double().numpy() / units.fs)
        if K.CHARGES in g:
            atoms.set_initial_charges(g.charges[lo:hi].double().numpy())
        atoms.arrays["atom_id"] = g.atom_id[lo:hi].numpy().astype(np.int64)
        results = {}
        if K.ENERGY in g:
            results["energy"] = float(g.energy[s])
            results["free_energy"] = float(g.energy[s])
        if K.ENERGIES in g:
            results["energies"] = g.energies[lo:hi].double().numpy()
        if K.FORCES in g:
            results["forces"] = g.forces[lo:hi].double().numpy()
        if K.STRESS in g:
            results["stress"] = full_3x3_to_voigt_6_stress(g.stress[s].double().numpy())
        if K.VIRIAL in g:
            atoms.info["virial"] = g.virial[s].double().numpy()
        if results:
            atoms.calc = SinglePointCalculator(atoms, **results)
        out.append(atoms)
    return out


def read(
    path: str | os.PathLike,
    index: str | int = ":",
    energy_key: str | None = "energy",
    forces_key: str | None = "forces",
    stress_key: str | None = "stress",
    virial_key: str | None = "virial",
    require: Sequence[str] = (),
    as_graph: bool = False,
    format: str | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
):
    """Read structures with ``ase.io.read`` (extxyz and every ASE format).

    Args:
        path: file to read.
        index: ASE index string (``":"`` all, ``"-1"`` last, ``"0:10"`` ...) or an int.
        energy_key, forces_key, stress_key, virial_key: label keys (see :func:`from_ase`).
        require: labels every structure must have (e.g. ``("energy", "forces")``).
        as_graph: return one batched :class:`AtomicGraph` instead of a list of ``Atoms``.
        format: ASE format name (guessed from the file name when ``None``).
    Returns:
        ``list[Atoms]`` or an ``AtomicGraph``.
    Raises:
        DataFileError: missing, unreadable or empty file, or a required label is missing.
        InputError: ``index`` is not a frame selection (:func:`parse_index`).
    """
    import ase.io

    from xnn._files import check_path_argument

    check_path_argument(path, "xnn.data.read", "data file")
    p = require_file(path, "data file")
    index = parse_index(index)
    if isinstance(index, int) and index < -1:  # ASE wraps -N-1 around to a wrong frame
        _check_index(p, index, format)
    try:
        frames = ase.io.read(str(p), index=index, format=format)
    except Exception as e:  # ASE raises many types for malformed files
        if isinstance(index, int) and isinstance(e, (StopIteration, IndexError)):
            _check_index(p, index, format)  # past the end: say how many frames there are
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataFileError(f"cannot parse {p}: {msg}") from None
    frames = frames if isinstance(frames, list) else [frames]
    if not frames:
        if index == slice(None):
            raise DataFileError(f"no structures in {p}")
        n = _count_frames(p, format)
        raise DataFileError(f"index {_index_text(index)!r} selects no frame of {p}, which has "
                            f"{n} frame(s)" if n is not None else f"no structures in {p}")
    kw = dict(
        energy_key=energy_key,
        forces_key=forces_key,
        stress_key=stress_key,
        virial_key=virial_key,
        require=require,
    )
    try:
        if as_graph:
            return from_ase(frames, **kw, dtype=dtype, device=device)
        keys = {
            "energy": energy_key,
            "forces": forces_key,
            "stress": stress_key,
            "virial": virial_key,
        }
        _collect_labels(frames, keys, require)
        for i, a in enumerate(frames):
            _check_structure(a, i)
    except (DataFileError, InputError) as e:
        raise type(e)(f"{p}: {e}") from None
    return frames


def parse_index(index: str | int | slice) -> int | slice:
    """An ASE frame selection as an ``int`` or a ``slice``: ``"-1"`` (the last frame),
    ``"0"``, ``":"`` (every frame), ``"1:3"``, ``"::2"``, ``"-3:"``.

    Raises:
        InputError: ``index`` is neither a frame number nor a ``start:stop:step`` slice of
            integers, or its step is 0.
    """
    if isinstance(index, slice) or (isinstance(index, int) and not isinstance(index, bool)):
        parsed = index
    else:
        parts = str(index).strip().split(":")
        try:
            if len(parts) > 3 or not parts[0].strip() and len(parts) == 1:
                raise ValueError(index)
            values = [int(v) if v.strip() else None for v in parts]
        except ValueError:
            raise InputError(f"index {index!r} is not a frame selection: give a frame number "
                             "(0 the first, -1 the last) or a slice start:stop:step (':' "
                             "every frame, '1:3', '::2')") from None
        parsed = values[0] if len(values) == 1 else slice(*values)
    if isinstance(parsed, slice) and parsed.step == 0:
        raise InputError(f"index {_index_text(index)!r} has a slice step of 0; give a "
                         "non-zero step ('::2', '::-1') or leave the step out ('1:3')")
    return parsed


def _index_text(index) -> str:
    """``index`` as the user would type it (``1:3`` rather than ``slice(1, 3, None)``)."""
    if not isinstance(index, slice):
        return str(index)
    text = ":".join("" if v is None else str(v) for v in (index.start, index.stop))
    return text if index.step is None else f"{text}:{index.step}"


def _count_frames(path: Path, format: str | None) -> int | None:
    """The number of frames of ``path`` (``None`` when it cannot be read)."""
    import ase.io

    try:
        return sum(1 for _ in ase.io.iread(str(path), index=":", format=format))
    except Exception:
        return None


def _check_index(path: Path, index: int, format: str | None) -> None:
    """Raise a one-line :class:`DataFileError` when frame ``index`` is not in ``path``."""
    n = _count_frames(path, format)
    if n is not None and not -n <= index < n:
        last = f"0 to {n - 1}, or -1 for the last" if n else "it has none"
        raise DataFileError(f"{path} has {n} frame(s); index {index} is out of range "
                            f"(use {last})")


def write(path: str | os.PathLike, data, format: str | None = None, append: bool = False) -> None:
    """Write an ``AtomicGraph``, an ``Atoms`` or a list of ``Atoms`` with ``ase.io.write``.

    The file is written to a temporary file and renamed, so a failed write never leaves a
    truncated file behind (unless ``append``). Labels/results of a graph are written as
    ``energy``, ``forces``, ``stress`` (extxyz by default for ``.xyz``).
    """
    import ase.io
    from ase import Atoms

    frames = to_ase(data) if isinstance(data, AtomicGraph) else data
    if isinstance(frames, Atoms):
        frames = [frames]
    p = Path(path)
    fmt = format or ("extxyz" if p.suffix in (".xyz", ".extxyz") else None)
    if not p.parent.exists():
        raise DataFileError(f"output folder does not exist: {p.parent}")
    if append:
        ase.io.write(str(p), frames, format=fmt, append=True)
        return
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=p.suffix)
    os.close(fd)
    try:
        ase.io.write(tmp, frames, format=fmt)
        os.replace(tmp, p)
    except Exception as e:  # ASE raises many types for unwritable data
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataFileError(f"cannot write {p}: {msg}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def checked_labels(atoms, energy_key: str | None = "energy", forces_key: str | None = "forces",
                   stress_key: str | None = "stress",
                   virial_key: str | None = "virial") -> dict[str, np.ndarray]:
    """The checks :func:`from_ase` makes of one ``ase.Atoms`` and the labels it finds
    (``{"energy": [], "forces": [n, 3], "stress": [3, 3], "virial": [3, 3]}`` float64, those
    present), without building a graph (a first pass counting labels).

    Raises:
        InputError, DataFileError: as :func:`from_ase` of ``[atoms]``.
    """
    _check_structure(atoms, 0)
    keys = {"energy": energy_key, "forces": forces_key, "stress": stress_key,
            "virial": virial_key}
    return _collect_labels([atoms], keys, ())
