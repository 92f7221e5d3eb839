"""extxyz files read lazily through an index of frame offsets.

Opening makes one pass over the file that looks only at line breaks and the atom-count
line of each frame (numpy over 64 MiB blocks of a memory map; the rest of a frame is
skipped, not parsed) and keeps ``[frames + 1]`` byte offsets (int32 in a file below 2 GiB,
else int64) and ``[frames]`` int32 atom counts in memory (8 or 12 bytes a frame), stored on
disk with the label counts after the first pass (:mod:`xnn.data.sources.index`). ``ds[i]``
reads the bytes of frame ``i`` and parses them with ASE's extxyz reader, so a structure
equals the same frame of
``ase.io.read(path, ":")``.
"""

from __future__ import annotations

import io
import mmap
import os
from array import array

import numpy as np

from xnn.data.datasets import narrow
from xnn.data.sources.frames import AtomsSource
from xnn.errors import DataFileError

_BLOCK = 1 << 26


def _header(text: bytes, path: str, line: int, frame: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataFileError(f"cannot parse {path}: line {line + 1} should hold the atom count "
                            f"of frame {frame}, found {text[:40].decode(errors='replace')!r}"
                            ) from None


def frame_index(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets [frames + 1], n_atoms [frames])`` of an extxyz file: frame ``i`` is bytes
    ``offsets[i]:offsets[i + 1]``; blank lines after the last frame are ignored.

    Raises:
        DataFileError: an atom-count line is not an integer, or the last frame is cut short.
    """
    source = os.fspath(path)
    size = os.path.getsize(source)
    starts = array("q")  # 8 bytes a frame while scanning (a list of ints took ~40)
    counts = array("q")
    if size == 0:
        return np.zeros(1, np.int64), np.zeros(0, np.int64)
    with open(source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        header, lines_before, prev_break, end = 0, 0, -1, None
        for block_start in range(0, size, _BLOCK):
            block = np.frombuffer(mm[block_start:block_start + _BLOCK], np.uint8)
            breaks = np.flatnonzero(block == 10) + block_start
            while end is None and header < lines_before + len(breaks):
                k = header - lines_before
                start = prev_break + 1 if k == 0 else int(breaks[k - 1]) + 1
                text = mm[start:int(breaks[k])]
                if not text.strip():  # blank lines after the last frame
                    end = start
                    break
                starts.append(start)
                counts.append(_header(text, source, header, len(starts) - 1))
                header += counts[-1] + 2
            lines_before += len(breaks)
            prev_break = int(breaks[-1]) if len(breaks) else prev_break
            if end is not None:
                break
        if end is not None:
            if mm[end:].strip():
                raise DataFileError(f"cannot parse {source}: a blank line where frame "
                                    f"{len(starts)} should start (line {header + 1})")
        else:
            end = size
            tail = mm[prev_break + 1:].strip()
            if header == lines_before and tail:
                raise DataFileError(f"cannot parse {source}: frame {len(starts)} has only "
                                    "its atom-count line")
            if header > lines_before + (1 if tail else 0):
                raise DataFileError(f"cannot parse {source}: frame {len(starts) - 1} is cut "
                                    f"short (it should have {counts[-1]} atom lines)")
    starts.append(end)
    return narrow(np.frombuffer(starts, np.int64)), narrow(np.frombuffer(counts, np.int64))


class ExtxyzSource(AtomsSource):
    """The frames of an extxyz file (``.xyz``/``.extxyz``), read one at a time through
    :func:`frame_index`."""

    FORMAT = "extxyz"

    def __init__(self, path: str | os.PathLike, weight: float, keys: dict[str, str],
                 workers: int | None = None):
        super().__init__(path, weight, keys, workers)
        self._open_index()

    def _scan(self) -> None:
        self.offsets, self.n_atoms = frame_index(self.source)

    def _index_arrays(self) -> dict[str, np.ndarray]:
        return {"offsets": self.offsets, "n_atoms": self.n_atoms}

    def _use(self, arrays: dict[str, np.ndarray]) -> None:
        self.offsets = narrow(arrays["offsets"])  # byte offsets: int64 from 2 GiB files
        self.n_atoms = narrow(arrays["n_atoms"])

    def _connect(self):
        return open(self.source, "rb")  # noqa: SIM115 (held for the process, see _handle)

    def _atoms(self, index: int):
        import ase.io

        f = self._handle()
        f.seek(int(self.offsets[index]))
        text = f.read(int(self.offsets[index + 1] - self.offsets[index])).decode()
        try:
            return ase.io.read(io.StringIO(text), index=0, format="extxyz")
        except Exception as e:  # ASE raises many types for a malformed frame
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataFileError(f"cannot parse {self.source}: structure {index}: {msg}"
                                ) from None
