"""Helpers shared by neighbor-list backends: input checks, cell heights, image ranges."""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch
from torch import Tensor

from xnn.errors import InputError


def cell_heights(cell: Tensor) -> Tensor:
    """``[n_systems, 3]`` perpendicular heights h_a = V / |b × c| of each cell (0 if degenerate)."""
    a, b, c = cell[:, 0], cell[:, 1], cell[:, 2]
    vol = torch.linalg.det(cell).abs()
    cross = torch.stack(
        [torch.linalg.cross(b, c), torch.linalg.cross(c, a), torch.linalg.cross(a, b)], dim=1
    ).norm(dim=-1)
    return torch.where(
        cross > 0, vol.unsqueeze(-1) / cross.clamp_min(1e-300), torch.zeros_like(cross)
    )


def image_ranges(cell: Tensor, pbc: Tensor, cutoff: float) -> Tensor:
    """``[n_systems, 3]`` number of periodic images needed on each side along each axis.

    Positions are not assumed wrapped: callers wrap first (or pass wrapped positions).
    """
    h = cell_heights(cell)
    n = torch.ceil(cutoff / h.clamp_min(1e-300))
    n = torch.where(pbc, n, torch.zeros_like(n))
    return n.to(torch.long)


def check_inputs(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None):
    """Validate and normalise neighbor-list inputs; returns (positions, cell, pbc, batch)."""
    return validate_inputs(positions, cell, pbc, cutoff, batch)[:4]


def validate_inputs(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, bool]:
    """Validate and normalise neighbor-list inputs with one host sync; returns
    ``(positions, cell, pbc, batch, has_zero_vectors)``."""
    positions, cell, pbc, batch, has_zero = validate_lazy(positions, cell, pbc, cutoff, batch)
    if batch is None:
        batch = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
    return positions, cell, pbc, batch, has_zero


def validate_lazy(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
    """:func:`validate_inputs`, with ``batch`` left ``None`` for one system without one (no
    zeros allocated when the backend does not need them).

    The host values of the cell, pbc and batch are remembered per tensor on devices where
    reading costs a host sync (:data:`REMEMBER_ON`): a later call with the very same tensor,
    not modified in place since (same ``_version``, data pointer, shape, strides, dtype),
    reads only the sum of the positions (one small kernel and one read: NaN/inf positions
    must never reach a backend's kernels). Writes that bypass the version counter
    (``tensor.data``, numpy views of a CPU tensor, custom kernels) are not seen.
    """
    return checked(positions, cell, pbc, cutoff, batch)[:5]


def checked(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None):
    """:func:`validate_lazy` plus, for one system, its ``cell [3, 3]`` and ``pbc [3]`` as
    views (or ``None``): ``(positions, cell, pbc, batch, has_zero_vectors, views)``.

    A repeated call with the very cell, pbc and batch tensors of an earlier call (unchanged
    since, as in :func:`validate_lazy`), positions of the same dtype and device and no grad
    on the cell returns that call's normalised tensors and verdict at once (one entry per
    cell: :data:`_FAST`), after reading only the positions' sum.
    """
    if not isinstance(cutoff, (int, float)) or not math.isfinite(cutoff) or cutoff <= 0:
        raise InputError(f"cutoff must be a positive finite number, got {cutoff!r}")
    if positions.ndim != 2 or positions.shape[-1] != 3:
        raise InputError(f"positions must have shape [n_atoms, 3], got {tuple(positions.shape)}")
    entry = _FAST.get(id(cell))
    if entry is not None and _fast_match(entry, positions, cell, pbc, batch):
        _check_finite(positions, positions.sum().item())
        norm_cell, norm_pbc, has_zero, views = entry[-1]
        return positions, norm_cell, norm_pbc, batch, has_zero, views
    out = _validate_full(positions, cell, pbc, batch)
    if positions.device.type in REMEMBER_ON:
        return _fast_store(positions, cell, pbc, batch, out)
    return (*out, None)


def _check_finite(positions: Tensor, pos_sum: float) -> None:
    """Raise for non-finite positions, given their sum read on the host (a finite sum needs
    no element check; an infinite one may be an overflow of finite values)."""
    if not math.isfinite(pos_sum) and not bool(torch.isfinite(positions).all()):
        raise InputError("non-finite positions")


def _validate_full(positions, cell, pbc, batch):
    """:func:`checked` without the whole-call entry (per-tensor host values only), after
    its cutoff and positions-shape checks."""
    cell_src = cell
    if cell.ndim == 2:
        cell = cell.unsqueeze(0)
    if cell.shape[1:] != (3, 3):
        raise InputError(f"cell must have shape [n_systems, 3, 3], got {tuple(cell.shape)}")
    n_sys = cell.shape[0]
    (pbc, pbc_src), pbc_h = _pbc(pbc, positions.device, n_sys)
    remember_pbc = pbc_h is None  # a device tensor: its values cost a read
    if batch is None:
        if n_sys != 1:
            raise InputError("batch is required when more than one cell is given")
    else:
        if batch.shape != (positions.shape[0],):
            raise InputError(
                f"batch must have shape [{positions.shape[0]}], got {tuple(batch.shape)}")
        if batch.dtype.is_floating_point and batch.numel():
            raise InputError(f"batch must be non-decreasing integers in [0, {n_sys})")
    if cell.dtype != positions.dtype:
        cell = cell.to(positions.dtype)
    check_batch = batch is not None and batch.numel() > 0
    remember = positions.device.type in REMEMBER_ON
    cell_h = _remembered(cell_src, positions.dtype) if remember else None
    if remember_pbc and remember:
        pbc_h = _remembered(pbc_src, n_sys)
    batch_h = _remembered(batch, n_sys > 1) if check_batch and remember else None
    if cell_h is None or pbc_h is None or (check_batch and batch_h is None):
        host = _read_once(positions, cell, pbc, batch if check_batch else None).numpy()
        pos_sum = host[0]
        cell_h = host[1 : 1 + 9 * n_sys].reshape(n_sys, 3, 3)
        pbc_h = host[1 + 9 * n_sys : 1 + 12 * n_sys].reshape(n_sys, 3) != 0
        batch_h = (*host[1 + 12 * n_sys :].tolist(), 0.0)[:3] if check_batch else None
        if remember:
            _remember(cell_src, positions.dtype, cell_h)
            if remember_pbc:
                _remember(pbc_src, n_sys, pbc_h)
            if check_batch:
                _remember(batch, n_sys > 1, batch_h)
    else:  # the cell, pbc and batch as last read: only the positions are new
        pos_sum = positions.sum().item()
    _check_finite(positions, pos_sum)
    # the cell checks on the host copy, in numpy: µs for a few 3x3 matrices
    if not np.isfinite(cell_h).all():
        raise InputError("non-finite cell")
    if check_batch:
        b_min, b_max, unsorted = batch_h
        if b_min < 0 or b_max >= n_sys or unsorted:
            raise InputError(f"batch must be non-decreasing integers in [0, {n_sys})")
    has_zero, bad = _cell_verdict(cell_h, pbc_h)
    if bad >= 0:
        raise InputError(f"system {bad}: singular cell along a periodic axis")
    return positions, cell, pbc, batch, has_zero


def _pbc(pbc, device: torch.device, n_sys: int) -> tuple[tuple[Tensor, Tensor], np.ndarray | None]:
    """``((pbc [n_systems, 3] bool on device, the tensor its values are remembered by),
    host values [n_systems, 3] or None)``: host values are known without a device read when
    ``pbc`` is not a tensor, or a CPU tensor for another device."""
    src = pbc
    host = None
    if not isinstance(pbc, Tensor) or (pbc.device.type == "cpu" and device.type != "cpu"):
        cpu = torch.as_tensor(pbc, dtype=torch.bool)
        pbc = cpu if device.type == "cpu" else cpu.to(device)
        host = cpu
    elif pbc.dtype != torch.bool or pbc.device != device:
        pbc = pbc.to(device=device, dtype=torch.bool)
    if pbc.ndim > 2 or (pbc.ndim >= 1 and pbc.shape[-1] != 3):
        raise InputError(f"pbc must have shape [n_systems, 3] or [3], got {tuple(pbc.shape)}")
    if pbc.ndim < 2:
        pbc = pbc.expand(n_sys, 3)
    if tuple(pbc.shape) != (n_sys, 3):
        raise InputError(f"pbc must have shape [n_systems, 3], got {tuple(pbc.shape)}")
    if host is not None:
        host = np.broadcast_to(host.numpy(), (n_sys, 3))
    return (pbc, src), host


#: device types on which the host values of cell, pbc and batch are remembered per tensor
REMEMBER_ON = {"cuda"}
_HOST_VALUES: dict[int, tuple] = {}
#: id(cell) -> the checked result of a whole call with that cell, pbc and batch (see
#: :func:`checked`): (cell ref, cell meta, pbc ref, pbc meta, batch ref, batch meta,
#: positions (dtype, device, n_atoms), device type, result)
_FAST: dict[int, tuple] = {}


def _fast_match(entry: tuple, positions: Tensor, cell: Tensor, pbc, batch) -> bool:
    """Whether ``entry`` of :data:`_FAST` applies: the same tensor objects, each unchanged
    (as :func:`_meta`), positions of the same dtype, device and (with a batch) count."""
    ref_c, meta_c, ref_p, meta_p, ref_b, meta_b, pos_key, dev_type, _ = entry
    if ref_c() is not cell or ref_p() is not pbc or dev_type not in REMEMBER_ON:
        return False
    if cell.requires_grad:  # switched on since: the stored cell has none
        return False
    if _meta(cell) != meta_c or _meta(pbc) != meta_p:
        return False
    if batch is None:
        if ref_b is not None:
            return False
    elif ref_b is None or ref_b() is not batch or _meta(batch) != meta_b:
        return False
    return (positions.dtype, positions.device,
            positions.shape[0] if batch is not None else -1) == pos_key


def _fast_store(positions: Tensor, cell: Tensor, pbc, batch: Tensor | None, out: tuple):
    """Store the whole-call entry of :func:`checked` for ``out`` (checks passed) where
    allowed: tensors with version counters (not inference), no grad on the cell, a pbc
    tensor (lists and tuples have no identity to trust); returns ``(*out, views)``."""
    _, norm_cell, norm_pbc, _, has_zero = out
    views = (norm_cell[0], norm_pbc[0]) if norm_cell.shape[0] == 1 else None
    tensors = (cell, pbc) if batch is None else (cell, pbc, batch)
    if (not isinstance(pbc, Tensor) or cell.requires_grad
            or any(t.is_inference() for t in tensors)):
        return (*out, views)
    if len(_FAST) >= 16:
        _FAST.clear()
    pos_key = (positions.dtype, positions.device,
               positions.shape[0] if batch is not None else -1)
    _FAST[id(cell)] = (weakref.ref(cell), _meta(cell), weakref.ref(pbc), _meta(pbc),
                       None if batch is None else weakref.ref(batch),
                       None if batch is None else _meta(batch), pos_key,
                       positions.device.type, (norm_cell, norm_pbc, has_zero, views))
    return (*out, views)


def _meta(t: Tensor) -> tuple:
    return (t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _remembered(t: Tensor, extra):
    """The host values stored for ``t`` (this very object, unchanged since) and ``extra``;
    never for inference tensors (no version counter: in-place edits would go unseen)."""
    if t.is_inference():
        return None
    entry = _HOST_VALUES.get(id(t))
    if entry is None or entry[0]() is not t or entry[1] != (_meta(t), extra):
        return None
    return entry[2]


def _remember(t: Tensor, extra, value) -> None:
    if t.is_inference():
        return
    if len(_HOST_VALUES) >= 64:
        _HOST_VALUES.clear()
    _HOST_VALUES[id(t)] = (weakref.ref(t), (_meta(t), extra), value)


_VERDICTS: dict[bytes, tuple[bool, int]] = {}


def _cell_verdict(cell: np.ndarray, pbc: np.ndarray) -> tuple[bool, int]:
    """``(has zero vectors, first system singular along a periodic axis or -1)`` of a host
    cell ``[S, 3, 3]`` and pbc ``[S, 3]``; remembered for the last few cells (an MD run
    asks for the same cell at every rebuild)."""
    key = cell.tobytes() + pbc.tobytes()
    verdict = _VERDICTS.get(key)
    if verdict is None:
        zero = np.linalg.norm(cell, axis=-1) < 1e-12  # [S, 3] vectors to complete
        has_zero = bool(zero.any())
        if has_zero:  # slabs, wires, clusters
            from xnn.data.graph import complete_cell

            cell = complete_cell(torch.from_numpy(cell.copy())).numpy()
        bad = (pbc & (zero | (_heights(cell) < 1e-8))).any(-1)  # a zero vector is flat
        verdict = (has_zero, int(np.flatnonzero(bad)[0]) if bad.any() else -1)
        if len(_VERDICTS) >= 16:
            _VERDICTS.clear()
        _VERDICTS[key] = verdict
    return verdict


def _heights(cell: np.ndarray) -> np.ndarray:
    """``[n_systems, 3]`` :func:`cell_heights` of a host cell ``[n_systems, 3, 3]``."""
    a, b, c = cell[:, 0], cell[:, 1], cell[:, 2]
    vol = np.abs(np.linalg.det(cell))
    cross = np.linalg.norm(np.stack([np.cross(b, c), np.cross(c, a), np.cross(a, b)], 1), axis=-1)
    return np.where(cross > 0, vol[:, None] / np.maximum(cross, 1e-300), 0.0)


def _read_once(positions: Tensor, cell: Tensor, pbc: Tensor, batch: Tensor | None) -> Tensor:
    """Everything the checks read, in one float64 CPU tensor from one device read (the one
    host sync of a build; a few kernels on CUDA): ``[sum of positions, cell [9 S], pbc [3 S],
    (batch min, batch max, 1 if batch decreases anywhere)]``. The cell checks then run on
    this host copy, not as dozens of small device kernels.

    On the CPU the reads are numpy's (one thread): a torch reduction over more than
    ``torch``'s grain size (~11k atoms) wakes its OpenMP workers, which then spin for
    milliseconds on the cores vesin's own threads are about to use (benchmarks/results/
    README.md, Neighbor lists: vesin right after a torch reduction)."""
    if positions.device.type == "cpu" and positions.dtype in NUMPY_FLOATS:
        return _read_once_numpy(positions, cell, pbc, batch)
    parts = [positions.sum().reshape(1).double(), cell.reshape(-1).double(),
             pbc.reshape(-1).double()]
    if batch is not None:
        lo, hi = torch.aminmax(batch)
        parts.append(torch.stack([lo, hi]).double())
        if cell.shape[0] > 1:  # one system: in [0, 1) means all zero, so sorted
            parts.append((batch[1:] < batch[:-1]).any().reshape(1).double())
    return torch.cat(parts).cpu()


def _read_once_numpy(positions: Tensor, cell: Tensor, pbc: Tensor, batch: Tensor | None):
    """:func:`_read_once` of CPU tensors, by numpy (see there)."""
    pos = numpy_view(positions)
    parts = [np.add.reduce(pos, axis=None, dtype=np.float64).reshape(1),
             numpy_view(cell).reshape(-1).astype(np.float64),
             numpy_view(pbc).reshape(-1).astype(np.float64)]
    if batch is not None:
        b = numpy_view(batch)
        parts.append(np.array([b.min(), b.max()], dtype=np.float64))
        if cell.shape[0] > 1:
            parts.append(np.array([float(bool((b[1:] < b[:-1]).any()))]))
    return torch.from_numpy(np.concatenate(parts))


#: float dtypes numpy reads: CPU positions of these go through numpy (others, e.g. bfloat16,
#: through torch)
NUMPY_FLOATS = (torch.float64, torch.float32, torch.float16)


def numpy_view(t: Tensor) -> np.ndarray:
    """A numpy view of CPU tensor ``t`` (its data, without grad; a copy only for views
    numpy cannot express: negated or conjugated ones)."""
    return t.detach().resolve_neg().resolve_conj().numpy()


def spectral_norm_3x3(m: Tensor) -> Tensor:
    """``[...]`` largest singular value of ``m [..., 3, 3]`` in closed form (the largest
    eigenvalue of ``mᵀ m`` by the trigonometric method): elementwise kernels only, so no
    LAPACK call and no host sync on CUDA, unlike ``torch.linalg.matrix_norm(ord=2)``."""
    a = m.transpose(-1, -2) @ m
    diag = a.diagonal(dim1=-2, dim2=-1)
    q = diag.sum(-1) / 3
    off = a[..., 0, 1] ** 2 + a[..., 0, 2] ** 2 + a[..., 1, 2] ** 2
    p = torch.sqrt((((diag - q.unsqueeze(-1)) ** 2).sum(-1) + 2 * off) / 6)
    eye = torch.eye(3, dtype=m.dtype, device=m.device)
    b = (a - q[..., None, None] * eye) / p.clamp_min(1e-300)[..., None, None]
    det = (b[..., 0, 0] * (b[..., 1, 1] * b[..., 2, 2] - b[..., 1, 2] * b[..., 2, 1])
           - b[..., 0, 1] * (b[..., 1, 0] * b[..., 2, 2] - b[..., 1, 2] * b[..., 2, 0])
           + b[..., 0, 2] * (b[..., 1, 0] * b[..., 2, 1] - b[..., 1, 1] * b[..., 2, 0]))
    phi = torch.acos((det / 2).clamp(-1.0, 1.0)) / 3
    top = torch.where(p > 0, q + 2 * p * torch.cos(phi), q)
    return torch.sqrt(top.clamp_min(0.0))
