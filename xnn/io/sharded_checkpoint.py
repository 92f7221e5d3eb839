"""Sharded checkpoints of ``xnn md`` / ``xnn relax``: each rank writes its own atoms, no rank
holds the whole system.

Layout of ``checkpoint.pt.d/`` (the checkpoint ``NAME`` becomes the folder ``NAME.d``)::

    index.pt                    written last, atomically: the checkpoint
    GENERATION/rank-RRRR.pt     one shard per writing rank

A shard holds the owned atoms of one rank: every atom-scope field of its graph (atom ids,
positions, velocities, masses, numbers, any per-atom state such as a hook's fields), their
forces and the per-atom entries of the run layer's meta (the ghost plan's reference
positions of a decomposed run). The index holds everything that is not per atom: the
step, energies, stress, integrator variables (thermostat and barostat scalars), the RNG
state, the run's meta (ensemble, output file sizes, model fingerprint, the decomposition's
grid and counters), the system fields (cell, pbc) and, per shard, its atom count and id
range.

A new checkpoint's shards go to a new generation folder; the index that names it replaces
the previous index atomically, and only then is the previous generation removed. A killed
write therefore leaves the previous checkpoint whole: a checkpoint without its index is not
a checkpoint.

:func:`load_sharded` assembles the global state by atom id, with the meta a gathered
checkpoint of the same run holds (each atom's rank, reference positions), so a resume from
either format continues identically. :func:`read_shards` reads only some shards (a rank of a
resumed run with as many ranks reads its own).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from xnn._files import atomic_write
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.checkpoint import FORMAT
from xnn.dynamics.state import MDState
from xnn.errors import DataFileError
from xnn.models.serialization import read_as_data

SUFFIX = ".d"
INDEX = "index.pt"
SHARD_FORMAT = "xnn-md-checkpoint-shard"
#: per-atom entries of a decomposed run's checkpoint meta, stored in the shards
PER_ATOM_META = ("ref_positions", "migrated")


def sharded_path(path: str | os.PathLike) -> Path:
    """The folder of the sharded form of checkpoint ``path`` (``checkpoint.pt.d``)."""
    path = Path(path)
    return path if path.name.endswith(".pt" + SUFFIX) else path.with_name(path.name + SUFFIX)


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a sharded checkpoint: its folder (``*.pt.d``, or any folder
    holding an index), or ``checkpoint.pt`` whose file is absent while the folder
    ``checkpoint.pt.d`` exists. Any other folder is not (a directory given as a file)."""
    path = Path(path)
    if path.is_dir():
        return path.name.endswith(".pt" + SUFFIX) or (path / INDEX).is_file()
    return not path.exists() and sharded_path(path).is_dir()


def new_generation(step: int) -> str:
    """A fresh generation folder name (rank 0 draws it and broadcasts it)."""
    return f"step-{step:012d}-{uuid.uuid4().hex[:8]}"


def shard_name(rank: int) -> str:
    return f"rank-{rank:04d}.pt"


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in storage of its own (``torch.save`` writes a view's whole
    storage)."""
    t = t.detach().cpu()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def shard_payload(state: MDState, per_atom: dict[str, torch.Tensor]) -> dict:
    """One rank's shard: the atom-scope fields of ``state``'s owned atoms, their forces and
    ``per_atom`` meta entries (``[n_owned, ...]``), as CPU tensors."""
    graph = state.graph.without_edges()
    atoms = {k: _own(v) for k, v in graph.fields.items() if K.scope_of(k) == K.ATOM}
    return {"format": SHARD_FORMAT, "atoms": atoms, "forces": _own(state.forces),
            "per_atom": {k: _own(v) for k, v in per_atom.items()}}


def empty_shard(payload: dict) -> dict:
    """A shard of no atoms with the fields, dtypes and shapes of ``payload``."""
    return {"format": SHARD_FORMAT,
            "atoms": {k: _own(v[:0]) for k, v in payload["atoms"].items()},
            "forces": _own(payload["forces"][:0]),
            "per_atom": {k: _own(v[:0]) for k, v in payload["per_atom"].items()}}


def write_shard(path: str | os.PathLike, generation: str, rank: int, payload: dict) -> int:
    """Write one rank's shard (fsynced); returns its size in bytes."""
    folder = sharded_path(path) / generation
    folder.mkdir(parents=True, exist_ok=True)
    target = atomic_write(folder / shard_name(rank), lambda tmp: torch.save(payload, tmp))
    return target.stat().st_size


def index_payload(state: MDState, meta: dict, generation: str, counts: list[list[int]],
                  neighbors: dict | None = None, template: dict | None = None) -> dict:
    """The index of a sharded checkpoint.

    Args:
        state: any rank's state (its global entries: step, energy, stress, variables, RNG,
            system fields).
        meta: the run's meta (without per-atom entries).
        generation: the folder of the shards.
        counts: per shard ``[n_atoms, min id, max id]`` (ids ``-1`` for an empty shard).
        neighbors: the one-process potential's Verlet cache (shard 0's atoms are all atoms).
        template: a shard of no atoms (:func:`shard_payload` of none): the fields, dtypes
            and shapes a rank that reads no shard starts from.
    """
    system = {k: v.detach().cpu() for k, v in state.graph.fields.items()
              if K.scope_of(k) == K.SYSTEM}
    return {
        "format": FORMAT, "version": 1, "sharded": True, "meta": meta,
        "generation": generation,
        "shards": [{"file": shard_name(r), "n_atoms": int(n), "id_min": int(lo),
                    "id_max": int(hi)} for r, (n, lo, hi) in enumerate(counts)],
        "n_atoms": int(sum(c[0] for c in counts)), "system": system,
        "step": state.step, "energy": state.energy.cpu(), "stress": state.stress.cpu(),
        "vars": {k: v.cpu() for k, v in state.vars.items()},
        "rng": None if state.rng is None else state.rng.cpu(),
        "compute_stress": state.compute_stress, "neighbors": neighbors,
        "template": template,
    }


def write_index(path: str | os.PathLike, index: dict) -> Path:
    """Land ``index`` atomically (the checkpoint now exists), then remove the generations
    it does not name (rank 0, after every shard is written)."""
    folder = sharded_path(path)
    atomic_write(folder / INDEX, lambda tmp: torch.save(index, tmp))
    for old in folder.iterdir():
        if old.is_dir() and old.name != index["generation"]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def read_index(path: str | os.PathLike, what: str = "xnn md/relax checkpoint") -> dict:
    """The index of the sharded checkpoint at ``path`` (its folder, or ``checkpoint.pt``).

    Raises:
        DataFileError: no index (an interrupted first write), or not an xnn checkpoint.
    """
    folder = sharded_path(path)
    if not (folder / INDEX).is_file():
        raise DataFileError(f"{folder} is not an {what}: it has no {INDEX} (a checkpoint "
                            "whose write was interrupted before its index landed)")
    try:
        index = read_as_data(folder / INDEX)
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line
        raise DataFileError(f"{folder / INDEX} is not a readable {what} "
                            f"({type(e).__name__})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or not index.get("sharded"):
        raise DataFileError(f"{folder} is not an {what}")
    return index


def read_shards(path: str | os.PathLike, index: dict, ranks) -> list[dict]:
    """The shards ``ranks`` of the checkpoint ``index`` (read as data)."""
    folder = sharded_path(path) / index["generation"]
    out = []
    for r in ranks:
        entry = index["shards"][r]
        try:
            shard = read_as_data(folder / entry["file"])
        except Exception as e:  # noqa: BLE001 - a missing or torn shard: one line
            raise DataFileError(f"checkpoint {sharded_path(path)}: shard {entry['file']} of "
                                f"{index['generation']} is unreadable ({type(e).__name__})"
                                ) from None
        n = shard["forces"].shape[0] if isinstance(shard, dict) else -1
        if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT \
                or n != entry["n_atoms"]:
            raise DataFileError(f"checkpoint {sharded_path(path)}: shard {entry['file']} does "
                                f"not hold the {entry['n_atoms']} atoms its index says")
        out.append(shard)
    return out


def merge_shards(shards: list[dict], ranks=None) -> tuple[dict, torch.Tensor]:
    """The shards' atoms concatenated and sorted by atom id: ``(fields, owner)``, with
    ``fields`` holding the atom fields, ``"forces"`` and the per-atom meta entries, and
    ``owner [n]`` each atom's shard (``ranks[i]`` for ``shards[i]``; default: position)."""
    ranks = list(range(len(shards))) if ranks is None else list(ranks)
    keys = shards[0]["atoms"].keys()
    fields = {k: torch.cat([s["atoms"][k] for s in shards]) for k in keys}
    fields["forces"] = torch.cat([s["forces"] for s in shards])
    extra = [k for k in PER_ATOM_META if k in shards[0]["per_atom"]]
    fields.update({k: torch.cat([s["per_atom"][k] for s in shards]) for k in extra})
    owner = torch.cat([torch.full((s["forces"].shape[0],), r, dtype=torch.int64)
                       for r, s in zip(ranks, shards)])
    order = torch.argsort(fields[K.ATOM_ID])
    return {k: v.index_select(0, order) for k, v in fields.items()}, owner[order]


def state_of(index: dict, fields: dict, device=None) -> MDState:
    """The :class:`MDState` of ``fields`` (of :func:`merge_shards`) with the index's global
    entries, on ``device``."""
    atoms = {k: v.to(device) for k, v in fields.items()
             if k != "forces" and k not in PER_ATOM_META}
    atoms.update({k: v.to(device) for k, v in index["system"].items()})
    return MDState(AtomicGraph(atoms, validate=False), fields["forces"].to(device),
                   index["energy"].to(device), index["stress"].to(device), int(index["step"]),
                   {k: v.to(device) for k, v in index["vars"].items()}, index["rng"],
                   bool(index["compute_stress"]))


def read_state(path: str | os.PathLike, index: dict, ranks, device=None):
    """The atoms of shards ``ranks`` only (a rank's part of a resume over several ranks):
    ``(state, per_atom, owner)``: the :class:`MDState` of those atoms sorted by id with the
    index's global entries, their per-atom meta entries and the shard each came from. No
    shard: no atoms (the index's template)."""
    ranks = list(ranks)
    got = read_shards(path, index, ranks) if ranks else [index["template"]]
    fields, owner = merge_shards(got, ranks or [0])
    per_atom = {k: fields[k].to(device) for k in PER_ATOM_META if k in fields}
    return state_of(index, fields, device), per_atom, owner


def load_sharded(path: str | os.PathLike, device=None) -> tuple[MDState, dict, dict | None]:
    """The global state of a sharded checkpoint (atoms by id, every shard read), its meta
    (as a gathered checkpoint of the same run holds it: each atom's rank and the reference
    positions under ``meta["domain"]``) and the Verlet cache (``None``: none stored)."""
    index = read_index(path)
    shards = read_shards(path, index, range(len(index["shards"])))
    fields, owner = merge_shards(shards)
    meta = dict(index["meta"])
    dom = meta.get("domain")
    if dom:  # the per-atom entries a gathered checkpoint keeps in its meta
        dom = {**dom, "owner": owner}
        dom.update({k: fields[k] for k in PER_ATOM_META if k in fields})
        meta["domain"] = dom
    return state_of(index, fields, device), meta, index.get("neighbors")
