"""The files of an ``xnn run`` campaign folder.

``results.csv`` (one row per system and stage, appended as they finish),
``trajectories/sys_NNNNN.xyz`` (each system's frames, every stage, with the stage in each
frame's info), ``final/sys_NNNNN.xyz`` (a system's last structure, written when it leaves
the campaign) gathered into ``final.xyz`` in id order at the end (and ``uncertain/``, the
frames at which ``safety.max_force_uncertainty`` stopped a system, into ``uncertain.xyz``),
``summary.json``, and
``checkpoint.pt``: every slot's full state, the neighbor lists, the queue position and the
sizes of the appended files, written atomically (a resumed campaign cuts the files back
to those sizes and continues bitwise).

Under torchrun each rank appends its rows to ``ranks/gGGG_results_RRRRR.csv`` and checkpoints
to ``ranks/gGGG_checkpoint_RRRRR.pt`` (:mod:`xnn.app.workflow_ranks`); ``checkpoint.pt`` is
then a manifest (the number of ranks, the generation ``GGG`` of the files, the settings),
and the rows of every rank are merged into ``results.csv`` at the end. A completed
campaign's ``results.csv`` is ordered by system id and stage, whatever the ranks.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import torch

from xnn._files import atomic_write, require_file
from xnn.dynamics import checkpoint as ckpt
from xnn.errors import DataFileError
from xnn.models.serialization import load_failure, read_as_data

FORMAT = "xnn-workflow-checkpoint"
MANIFEST = "xnn-workflow-ranks"
COLUMNS = ("id", "stage_index", "stage", "type", "status", "converged", "steps", "n_atoms",
           "energy_eV", "fmax_eV_A", "temperature_K", "volume_A3", "pressure_GPa",
           "max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV", "wall_s", "reason")
#: what a campaign writes into its folder (a previous campaign is recognised by these)
RUN_FILES = ("config.yaml", "checkpoint.pt", "results.csv", "summary.json", "final.xyz",
             "trajectories", "final", "ranks", "uncertain", "uncertain.xyz")


def system_name(system_id: int) -> str:
    return f"sys_{int(system_id):05d}.xyz"


class ResultsTable:
    """``results.csv``, one row per finished (system, stage), appended.

    Args:
        truncate_to: on resume, the size (bytes) the checkpoint recorded; ``None``: new file.
    """

    def __init__(self, path: Path, truncate_to: int | None):
        self.path = path
        if truncate_to is None:
            path.write_text(",".join(COLUMNS) + "\n")
        else:
            truncate(path, truncate_to)

    def append(self, rows: list[dict]) -> None:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for r in rows:
            w.writerow([_cell(r[c]) for c in COLUMNS])
        with open(self.path, "a") as fh:
            fh.write(buf.getvalue())

    def position(self) -> int:
        return self.path.stat().st_size


def _cell(v) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def read_results(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``results.csv`` (values as strings)."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def read_rows(path: Path, size: int | None = None) -> list[list[str]]:
    """The rows (cells as strings) of a table of :class:`ResultsTable`, of its first ``size``
    bytes if given (the size a checkpoint recorded)."""
    data = path.read_bytes()
    if size is not None:
        if len(data) < size:
            raise DataFileError(f"cannot resume: {path} is shorter than the checkpoint says")
        data = data[:size]
    reader = csv.reader(io.StringIO(data.decode("utf-8"), newline=""))
    if next(reader, None) != list(COLUMNS):
        raise DataFileError(f"{path} is not a results table of this xnn version")
    return list(reader)


def write_rows(path: Path, rows: list[list[str]]) -> Path:
    """A table of :class:`ResultsTable` holding ``rows``, written atomically."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows(rows)
    return atomic_write(path, lambda tmp: tmp.write_text(buf.getvalue()))


def merge_results(parts: list[Path], path: Path) -> Path:
    """Write the rows of ``parts`` (tables of :class:`ResultsTable`) to ``path`` atomically,
    ordered by system id and stage index (the order does not depend on slots or ranks)."""
    rows = [r for part in parts for r in read_rows(part)]
    rows.sort(key=lambda r: (int(r[0]), int(r[1])))
    return write_rows(path, rows)


def stages_done(rows: list[list[str]], n_stages: int) -> int:
    """The stages the rows account for: one each, and the stages a failed system skips."""
    stage, status = COLUMNS.index("stage_index"), COLUMNS.index("status")
    return sum(1 + (n_stages - 1 - int(r[stage]) if r[status] == "failed" else 0)
               for r in rows)


def truncate(path: Path, size: int) -> None:
    if not path.is_file() or path.stat().st_size < size:
        raise DataFileError(f"cannot resume: {path} is missing or shorter than the "
                            "checkpoint says")
    os.truncate(path, size)


def frame_text(atoms_list: list, info: list[dict]) -> list[str]:
    """extxyz text of each ASE ``Atoms`` with ``info`` added."""
    import ase.io

    out = []
    for atoms, extra in zip(atoms_list, info):
        atoms.info.update(extra)
        buf = io.StringIO()
        ase.io.write(buf, atoms, format="extxyz")
        out.append(buf.getvalue())
    return out


def append_text(path: Path, text: str, new: bool) -> None:
    with open(path, "w" if new else "a") as fh:
        fh.write(text)


def write_final(folder: Path, system_id: int, text: str, kind: str = "final") -> None:
    """A system's last frame in ``folder/kind/`` (``final``, or ``uncertain``: the frame at
    which the uncertainty guard stopped it)."""
    (folder / kind).mkdir(exist_ok=True)
    atomic_write(folder / kind / system_name(system_id), lambda tmp: tmp.write_text(text))


def gather_final(folder: Path, n_systems: int, kind: str = "final") -> Path | None:
    """``final.xyz`` (``uncertain.xyz``): the frames of ``folder/kind/`` in id order;
    ``uncertain.xyz`` only when a system was stopped."""
    parts = []
    for i in range(n_systems):
        p = folder / kind / system_name(i)
        if p.is_file():
            parts.append(p.read_text())
    if kind != "final" and not parts:
        return None
    return atomic_write(folder / f"{kind}.xyz", lambda tmp: tmp.write_text("".join(parts)))


# ----------------------------------------------------------------------------- checkpoints
def save_campaign(path: Path, pools: list, meta: dict) -> None:
    """Write every pool's state (``None`` when empty), neighbor list and ids with ``meta``."""
    payload = {"format": FORMAT, "version": 1, "meta": meta, "pools": [
        None if p.state is None else {
            "state": ckpt.state_to_payload(p.state), "ids": list(p.ids),
            "neighbors": ckpt.neighbor_payload(p.potential),
        } for p in pools]}
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The payload of a campaign checkpoint or of a manifest of ranks (read as data)."""
    path = require_file(path, "checkpoint")
    try:
        p = read_as_data(path)
    except Exception as e:
        raise DataFileError(f"{path} is not a readable xnn run checkpoint: "
                            f"{load_failure(e)}") from None
    if not isinstance(p, dict) or p.get("format") not in (FORMAT, MANIFEST):
        raise DataFileError(f"{path} is not an xnn run (workflow) checkpoint")
    return p


def checkpoint_ranks(payload: dict) -> int:
    """How many ranks wrote a campaign: 1 for a checkpoint, the manifest's count else."""
    return int(payload["world_size"]) if payload["format"] == MANIFEST else 1


def save_manifest(path: Path, world_size: int, generation: int, settings: dict) -> None:
    """``checkpoint.pt`` of a campaign run on ``world_size`` ranks (each rank's state is in
    its own checkpoint under ``ranks/``, of file generation ``generation``)."""
    payload = {"format": MANIFEST, "version": 1, "world_size": int(world_size),
               "generation": int(generation), "settings": settings}
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def load_campaign(path: str | os.PathLike, device) -> tuple[list, dict]:
    """``(pools, meta)``: per stage ``None`` or ``(state, ids, neighbor state)``."""
    p = read_checkpoint(path)
    if p["format"] != FORMAT:
        raise DataFileError(f"{path} is not the checkpoint of one process or rank")
    pools = [None if d is None else (ckpt.state_from_payload(d["state"], device), list(d["ids"]),
                                     d["neighbors"]) for d in p["pools"]]
    return pools, p["meta"]
