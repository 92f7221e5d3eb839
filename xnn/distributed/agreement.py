"""Before the first collective of a job, every rank checks that it runs the same job.

Ranks started with different configs or data (an override given to one rank, a data file
that differs between nodes) would otherwise take different paths and block in a collective
until the timeout. :func:`check_ranks_agree` all-gathers each rank's
:func:`run_fingerprint` (the resolved config, flattened to dotted keys, with every input
file replaced by its size and SHA-256) once, and every rank raises the same one-line
:class:`~xnn.errors.InputError` naming the ranks and keys that differ from rank 0.

Files are compared by content, not by path or modification time, so node-local copies of
the same data (``$TMPDIR/train.xyz`` on each node) agree. Files up to
:data:`FULL_HASH_BYTES` are hashed whole; larger ones by their size and their first and
last MiB.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping

from xnn.distributed.collectives import all_gather_object, global_rank, group_size, is_active
from xnn.errors import InputError

FULL_HASH_BYTES = 64 << 20
_EDGE_BYTES = 1 << 20
_MAX_RANKS_SHOWN = 4
_MAX_KEYS_SHOWN = 3


def file_fingerprint(path: str | os.PathLike | None) -> str:
    """``"<size> bytes, sha256 <16 hex>"`` of a file (``"none"``, ``"missing"``,
    ``"a folder"`` otherwise); files over :data:`FULL_HASH_BYTES` are hashed by their
    first and last MiB."""
    if path is None or path == "":
        return "none"
    if os.path.isdir(path):
        return "a folder"
    try:
        size = os.path.getsize(path)
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                how = "sha256"
            else:
                h.update(fh.read(_EDGE_BYTES))
                fh.seek(size - _EDGE_BYTES)
                h.update(fh.read(_EDGE_BYTES))
                how = "sha256 of the first and last MiB"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({type(e).__name__})"
    return f"{size} bytes, {how} {h.hexdigest()[:16]}"


def _flatten(value, prefix: str, out: dict[str, str]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, (list, tuple)) and value:
        for k, v in enumerate(value):
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = repr(value)


def run_fingerprint(config, files: Mapping[str, str | os.PathLike | None] = ()) -> dict[str, str]:
    """``{dotted key: value}`` of a config (a dataclass or mapping), with the keys of
    ``files`` (``{dotted key: path}``) holding the file's :func:`file_fingerprint` instead
    of its path."""
    out: dict[str, str] = {}
    _flatten(config, "", out)
    for key, path in dict(files).items():
        out[key] = f"file: {file_fingerprint(path)}"
    return out


def _short(text: str | None, limit: int = 60) -> str:
    if text is None:
        return "absent"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def disagreement(prints: list[dict[str, str]], ranks: list[int] | None = None) -> str | None:
    """The message naming the ranks whose fingerprint differs from rank 0's (``None``: all
    agree); ``ranks`` are the global ranks of the entries (default ``0..n-1``)."""
    ranks = list(range(len(prints))) if ranks is None else ranks
    ref = prints[0]
    parts = []
    differ = [r for r, p in zip(ranks, prints) if p != ref]
    if not differ:
        return None
    for r, p in zip(ranks, prints):
        if p == ref:
            continue
        keys = sorted(k for k in set(ref) | set(p) if ref.get(k) != p.get(k))
        shown = [f"{k} ({_short(ref.get(k))} on rank {ranks[0]}, {_short(p.get(k))} on "
                 f"rank {r})" for k in keys[:_MAX_KEYS_SHOWN]]
        more = f" and {len(keys) - _MAX_KEYS_SHOWN} more" if len(keys) > _MAX_KEYS_SHOWN else ""
        parts.append(f"rank {r} in {', '.join(shown)}{more}")
        if len(parts) == _MAX_RANKS_SHOWN:
            break
    more = len(differ) - len(parts)
    tail = f"; {more} more rank(s) differ" if more > 0 else ""
    return (f"the ranks were not started with the same config and data: {'; '.join(parts)}"
            f"{tail}; start every rank with the same command line, config file and data "
            "files (a torchrun or srun job does so)")


def check_ranks_agree(fingerprint: dict[str, str], group=None) -> None:
    """All-gather ``fingerprint`` (one collective); raise on every rank if any differs.

    A no-op in a single process. Call it before the first other collective of a job.

    Raises:
        InputError: the same message on every rank, naming the ranks that differ from the
            group's first rank and, for each, up to three keys with both values.
    """
    if not is_active(group):
        return
    n = group_size(group)
    prints = all_gather_object(fingerprint, group)
    message = disagreement(prints, [global_rank(group, r) for r in range(n)])
    if message is not None:
        raise InputError(message)
