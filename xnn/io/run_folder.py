"""Output folders of ``xnn train``, ``xnn md`` and ``xnn relax`` that never lose a previous run.

A run first checks everything it can (config, data, model, resume file) without writing;
only then is its folder created (:meth:`RunFolder.create`). A run asked to replace a
previous one (``overwrite=true``) is written to the staging folder ``OUT/.xnn-new-run``
while the previous run's files stay where they are; when it completes, :meth:`RunFolder.
commit` swaps them: the previous files are moved into ``OUT/.xnn-old-run``, the new ones
into ``OUT``, and only then is ``.xnn-old-run`` deleted. Every move is a rename within
``OUT``, and a failure or a kill at any point leaves the previous run complete (in place, or
in ``.xnn-old-run`` during the swap). Files of ``OUT`` that are not run files (a data file,
a job script) are never touched.

An interrupted replacing run can be resumed from its staging folder
(``resume=OUT/.xnn-new-run/...`` with ``overwrite=true``); a new ``overwrite=true`` run
without resume discards it, after it has been validated itself.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from xnn.errors import InputError

STAGING = ".xnn-new-run"
REPLACED = ".xnn-old-run"


def staging_dir(out: str | os.PathLike) -> Path:
    """The folder where a run that replaces the run in ``out`` is written until it completes."""
    return Path(out) / STAGING


def _inside(path: str | os.PathLike, folder: Path) -> bool:
    try:
        Path(path).resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class RunFolder:
    """Where a run writes (``work``) and where its files end up (``final``).

    Attributes:
        final: the configured output folder.
        work: ``final``, or its staging folder when the run replaces a previous one.
        run_files: names of the files and folders a run writes (those a commit replaces).
        discard: ``work`` is the staging folder of an interrupted run, to delete on create.
    """

    final: Path
    work: Path
    run_files: tuple[str, ...]
    discard: bool = False

    @property
    def staged(self) -> bool:
        """The run is written to the staging folder and replaces the previous run on commit."""
        return self.work != self.final

    def create(self) -> None:
        """Create the folder the run writes to (call after the run has been validated)."""
        try:
            if self.discard:
                shutil.rmtree(self.work)
            self.work.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"cannot create the output folder {self.work}: "
                             f"{e.strerror or e}") from None
        if not os.access(self.work, os.W_OK | os.X_OK):
            raise InputError(f"the output folder {self.work} is not writable; choose another")

    def commit(self) -> None:
        """Replace the previous run's files in ``final`` by the new run's (staged runs only)."""
        if not self.staged:
            return
        old = self.final / REPLACED
        old.mkdir()
        new_names = {p.name for p in self.work.iterdir()}
        for name in sorted(set(self.run_files) | new_names):
            src = self.final / name
            if src.exists() or src.is_symlink():
                os.replace(src, old / name)
        for name in sorted(new_names):
            os.replace(self.work / name, self.final / name)
        self.work.rmdir()
        _fsync_dir(self.final)
        shutil.rmtree(old)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_location(out: Path, key: str) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"{key}={str(out)!r} is a file, not a folder; choose another {key}")
    blocking = next((p for p in out.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise InputError(f"{key}={str(out)!r}: {str(blocking)!r} is a file, not a folder")
    if (out / REPLACED).exists():
        raise InputError(f"{out / REPLACED} holds the run that an interrupted overwrite was "
                         f"replacing; move its files back into {out} (or delete it), then "
                         "run again")


def plan_run_folder(
    out: str | os.PathLike, run_files: tuple[str, ...], *, resume: str | None,
    overwrite: bool, keep: bool = False, key: str = "output_dir",
    overwrite_key: str = "overwrite", resume_hint: str = "resume=auto",
) -> RunFolder:
    """Decide where a run writes, without writing anything.

    Args:
        out: the configured output folder.
        run_files: names a run writes into it (a previous run is recognised by them).
        resume: the checkpoint the run continues from, if any (it writes where that run
            wrote: ``out``, or the staging folder of an interrupted replacing run).
        overwrite: the user allows replacing a previous run.
        keep: write next to a previous run without replacing it (validation-only runs).
        key, overwrite_key, resume_hint: option names for the messages.
    Raises:
        InputError: ``out`` is a file (or lies under one), holds a previous run and
            ``overwrite`` is false, or holds the remains of an interrupted swap.
    """
    out = Path(out)
    _check_location(out, key)
    staging = staging_dir(out)
    if resume and _inside(resume, staging):
        if not overwrite:
            raise InputError(f"resume={resume} continues a run that replaces the run in "
                             f"{out}: add {overwrite_key}=true")
        return RunFolder(out, staging, run_files)
    previous = [name for name in run_files if (out / name).exists()]
    if not previous or resume or keep:
        return RunFolder(out, out, run_files)
    if not overwrite:
        raise InputError(f"{key} {str(out)!r} holds a previous run ({previous[0]}); set "
                         f"{overwrite_key}=true (it is kept until the new run completes), "
                         f"{resume_hint}, or another {key}")
    return RunFolder(out, staging, run_files, discard=staging.exists())
