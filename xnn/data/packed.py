"""A graph's fields packed into one byte buffer, to cross between processes as one tensor.

A DataLoader worker hands its batch to the training process through shared memory: every
tensor is a shared-memory file whose descriptor goes over a socket, and the training process
maps each (the receive cost is measured in ``docs/prepared-data.md``, "Throughput").
:func:`pack` copies the fields
into one ``uint8`` tensor (each at a 64-byte aligned offset) and :meth:`Packed.unpack`
views them apart again: one shared-memory file a batch, the same bits, dtypes and shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import Tensor

#: bytes between the starts of two fields in the buffer (a cache line; any dtype's size)
ALIGN = 64


class Packed(NamedTuple):
    """Fields packed by :func:`pack`.

    Attributes:
        buffer: ``[n_bytes]`` uint8: every field's bytes, each from a multiple of
            :data:`ALIGN`.
        layout: ``(name, dtype, shape, offset)`` of each field, in the order given.
    """

    buffer: Tensor
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]

    def unpack(self) -> dict[str, Tensor]:
        """The fields as tensors viewing :attr:`buffer` (contiguous; no copy)."""
        out = {}
        for name, dtype, shape, offset in self.layout:
            size = _nbytes(dtype, shape)
            out[name] = self.buffer[offset:offset + size].view(dtype).view(shape)
        return out


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def pack(fields: Mapping[str, Tensor]) -> Packed:
    """Copy CPU ``fields`` (any dtypes, shapes and strides) into one buffer.

    Raises:
        ValueError: a field on another device than the CPU.
    """
    layout, offset = [], 0
    for name, t in fields.items():
        if t.device.type != "cpu":
            raise ValueError(f"pack takes CPU tensors; field {name!r} is on {t.device}")
        layout.append((name, t.dtype, tuple(t.shape), offset))
        offset += -(-_nbytes(t.dtype, tuple(t.shape)) // ALIGN) * ALIGN
    packed = Packed(torch.empty(offset, dtype=torch.uint8), tuple(layout))
    for t, view in zip(fields.values(), packed.unpack().values()):
        try:  # numpy copies in this thread: torch's copy into the fresh buffer spreads
            # over intra-op threads, which on a loaded CPU cost far more than the copy
            view.numpy()[...] = t.detach().numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16)
            view.copy_(t.detach())
    return packed


__all__ = ["ALIGN", "Packed", "pack"]
