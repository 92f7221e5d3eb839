"""Moving per-atom rows between ranks: named tensors packed into one byte buffer per message.

Migration, the ghost push, the start-up scatter and the output gather all send rows of many
per-atom fields (positions, ids, velocities, user fields...) of mixed dtypes. A
:class:`Layout` names the fields with their dtype and per-row shape; :func:`pack` views each
field's rows as bytes and concatenates them, so one message per peer carries every field;
:func:`unpack` copies each field's bytes out to storage aligned for its dtype, so any mix of
dtypes and per-row shapes (bool masks, int32, float32, float64...) arrives intact at any row
count, one row included.
Each message is preceded by its row count and the layout's checksum, so both sides know
every size (no deadlock) and a rank holding other fields fails with a clear error instead of
misreading bytes.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from xnn.distributed import collectives as C
from xnn.errors import InputError


@dataclass(frozen=True)
class Layout:
    """Fields of a packed row: ``(name, dtype, per-row shape)`` in a canonical (sorted) order."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    @property
    def row_bytes(self) -> int:
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.entries)

    @property
    def checksum(self) -> int:
        text = repr([(n, str(d), s) for n, d, s in self.entries])
        return zlib.crc32(text.encode())

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.entries]


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def layout_of(fields: Mapping[str, Tensor]) -> Layout:
    """The layout of per-atom ``fields`` (each ``[n, ...]``), sorted by name."""
    return Layout(tuple((k, fields[k].dtype, tuple(fields[k].shape[1:])) for k in sorted(fields)))


def pack(fields: Mapping[str, Tensor], layout: Layout, rows: Tensor | None = None) -> Tensor:
    """``[n, row_bytes]`` uint8: the (selected) rows of every field of ``layout``, as bytes."""
    parts = []
    for name, _, _ in layout.entries:
        t = fields[name].detach()
        if rows is not None:
            t = t.index_select(0, rows)
        t = t.reshape(t.shape[0], math.prod(t.shape[1:])).contiguous()
        parts.append(t.view(torch.uint8) if t.dtype != torch.uint8 else t)
    if not parts:
        n = 0 if rows is None else int(rows.numel())
        return torch.zeros(n, 0, dtype=torch.uint8)
    return torch.cat(parts, dim=1)


def unpack(buf: Tensor, layout: Layout) -> dict[str, Tensor]:
    """The fields of a packed ``buf [n, row_bytes]`` (inverse of :func:`pack`).

    Each field's bytes are copied into storage of its own before they are viewed as its
    dtype: a field's columns start at any byte of a row (a 1-byte mask before a float64,
    float32 positions before an int64), and a view in place would need its start and the
    row length to be multiples of the dtype's size, which one-row buffers do not give.
    """
    out, offset, n = {}, 0, buf.shape[0]
    for name, dtype, shape in layout.entries:
        nb = _nbytes(dtype, shape)
        column = torch.empty((n, nb), dtype=torch.uint8, device=buf.device)
        column.copy_(buf[:, offset:offset + nb])
        out[name] = column.view(dtype).reshape(n, *shape)
        offset += nb
    return out


def _check(layout: Layout, heads: Sequence[tuple[int, Tensor]], group, what: str) -> None:
    """All ranks agree that every received header carries this rank's layout checksum."""
    error = None
    for peer, head in heads:
        if int(head[1]) != layout.checksum:
            error = InputError(f"{what}: rank {peer} sends other per-atom fields than this rank "
                               f"holds ({layout.names}); every rank's graph must carry the same "
                               "fields")
            break
    C.agree(group, what, error)


def exchange_packed(peers: Sequence[int], payloads: Sequence[Tensor], layout: Layout, group,
                    what: str = "atom exchange") -> list[Tensor]:
    """Send ``payloads[i] [n_i, row_bytes]`` to ``peers[i]`` and receive one buffer from each.

    Collective over ``group`` (every rank calls it; the peer relation must be symmetric).
    Returns the received buffers in ``peers`` order.
    """
    device = payloads[0].device if payloads else torch.device("cpu")
    heads = [torch.tensor([p.shape[0], layout.checksum], device=device) for p in payloads]
    got = [torch.empty(2, dtype=torch.long, device=device) for _ in peers]
    C.exchange(list(zip(peers, heads)), list(zip(peers, got)), group)
    _check(layout, list(zip(peers, got)), group, what)
    bufs = [torch.empty(int(h[0]), layout.row_bytes, dtype=torch.uint8, device=device)
            for h in got]
    C.exchange(list(zip(peers, payloads)), list(zip(peers, bufs)), group)
    return bufs


def gather_packed(payload: Tensor, layout: Layout, group, dst: int = 0) -> list[Tensor] | None:
    """Every rank's ``payload`` on group rank ``dst`` (in rank order), ``None`` elsewhere."""
    size, me = C.group_size(group), C.group_rank(group)
    if size == 1:
        return [payload]
    head = torch.tensor([payload.shape[0], layout.checksum], device=payload.device)
    heads = C.all_gather_tensor(head, group)
    _check(layout, list(enumerate(heads)), group, "gather to rank 0")
    if me != dst:
        C.exchange([(dst, payload)], [], group)
        return None
    bufs = [payload if q == me else
            torch.empty(int(heads[q, 0]), layout.row_bytes, dtype=torch.uint8,
                        device=payload.device) for q in range(size)]
    C.exchange([], [(q, bufs[q]) for q in range(size) if q != me], group)
    return bufs
