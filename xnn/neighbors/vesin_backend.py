"""Neighbor lists from vesin (https://github.com/Luthaf/vesin), one system at a time.

``vesin`` (the C library's Python package) takes torch tensors directly on CPU; CUDA tensors
go to ``vesin.torch`` (package ``vesin-torch``) when it is importable, otherwise through
``vesin`` itself (which reads CUDA torch tensors when its library was built with CUDA), and
as a last resort through the CPU. vesin ≥ 0.6 supports mixed periodicity, non-periodic
systems and cells thinner than the cutoff; its ``(i, j, S)`` follow ASE
(``r = pos[j] - pos[i] + S @ cell``), i.e. ``i`` is our receiver and ``j`` our sender. A
system that the installed vesin refuses (older versions reject mixed periodicity or
degenerate boxes) is computed by the torch cell list instead.

Overhead against calling vesin directly (``benchmarks/neighbors.py``): one
``NeighborList`` per thread, device and cutoff is kept and reused (its output buffers are
not reallocated, and on CUDA not freed with a device sync, on every build); results are
read with ``copy=False`` and written once into the returned tensors (``edge_index`` the
transpose of the ``[E, 2]`` pairs, one copy; ``shifts`` negated, in vesin's int32, 12 B per
edge as in vesin's own output; by numpy on CPU, which copies these several times faster than torch,
in chunks over ``torch.get_num_threads()`` threads for large lists: numpy releases the GIL),
which replaces vesin's own copy. No dtype conversion of positions beyond what vesin itself
needs. On the CPU no torch operator runs around vesin's call (numpy views in and out, the
input checks by numpy too): a torch kernel over a large tensor wakes torch's OpenMP
workers, which then spin for milliseconds on the cores vesin's threads need. On CUDA the
tensors stay on the device: besides vesin's own read of the pair count, one host sync of
xnn's checks (:func:`xnn.neighbors.common.validate_lazy`: the positions' sum only, when
the cell, pbc and batch tensors are those of an earlier call). For one system such a
repeated call goes straight to :func:`one_system` with the remembered ``[3, 3]`` cell and
``[3]`` pbc views (``xnn.neighbors.api``); host time of the wrapper around a stubbed
vesin: ``benchmarks/neighbors.py --host-overhead 2000``.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from xnn.neighbors.common import NUMPY_FLOATS, numpy_view

try:
    import vesin as _vesin
except ImportError:  # pragma: no cover - depends on the environment
    _vesin = None

try:
    import vesin_torch as _vesin_torch  # vesin >= 0.6 deprecates the alias vesin.torch
except (ImportError, OSError, RuntimeError):  # pragma: no cover - absent or ABI mismatch
    try:
        import vesin.torch as _vesin_torch
    except (ImportError, OSError, RuntimeError):
        _vesin_torch = None

# Errors vesin raises for inputs it cannot handle; we fall back to the torch cell list.
_VESIN_ERRORS = (ValueError, RuntimeError, TypeError)
_CACHE = threading.local()
_CACHE_SIZE = 8


def vesin_available() -> bool:
    """True when the ``vesin`` package is importable."""
    return _vesin is not None


def vesin_torch_available() -> bool:
    """True when ``vesin.torch`` (package ``vesin-torch``) is importable."""
    return _vesin_torch is not None


def _calculator(module, device: torch.device, cutoff: float):
    """This thread's reusable ``module.NeighborList`` for ``(device, cutoff)``."""
    cache = getattr(_CACHE, "lists", None)
    if cache is None:
        cache = _CACHE.lists = {}
    key = (module.__name__, device, cutoff)
    nl = cache.get(key)
    if nl is None:
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        nl = cache[key] = module.NeighborList(cutoff=cutoff, full_list=True)
    return nl


def vesin_neighbor_list(
    positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor
) -> tuple[Tensor, Tensor]:
    """Full neighbor list by vesin, looping over systems and offsetting atom indices.

    Args:
        positions: ``[n_atoms, 3]`` Å; need not be wrapped (vesin's shifts account for it).
        cell: ``[n_systems, 3, 3]`` completed (invertible) cell, rows lattice vectors.
        pbc: ``[n_systems, 3]`` bool.
        cutoff: Å, > 0.
        batch: ``[n_atoms]`` non-decreasing system index.
    Returns:
        ``edge_index [2, E]`` long (row 0 sender j, row 1 receiver i) and ``shifts [E, 3]``
        int32 (vesin's dtype; int64 where a system fell back to the torch cell list).
    """
    if _vesin is None and _vesin_torch is None:
        raise ImportError("the 'vesin' backend needs the vesin package: pip install vesin")
    device = positions.device
    n_sys = cell.shape[0]
    if n_sys == 1:
        return one_system(positions, cell[0], pbc[0], cutoff)
    if positions.is_cpu and _vesin is not None and positions.dtype in NUMPY_FLOATS:
        return _batched_numpy(positions, cell, pbc, cutoff, batch)
    counts = torch.bincount(batch, minlength=n_sys).tolist()
    edges, shifts = [], []
    start = 0
    for s, n in enumerate(counts):
        if n > 0:
            ei, sh = one_system(positions[start : start + n], cell[s], pbc[s], cutoff)
            edges.append(ei + start)
            shifts.append(sh)
        start += n
    if not edges:
        z = torch.zeros(0, dtype=torch.long, device=device)
        return torch.stack([z, z]), torch.zeros(0, 3, dtype=torch.int32, device=device)
    return torch.cat(edges, dim=1), torch.cat(shifts)


def one_system(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float) -> tuple[Tensor, Tensor]:
    """``edge_index [2, E]`` long and ``shifts [E, 3]`` int32 (on ``pos.device``) of one
    system (int64 shifts from the torch cell list where vesin refused the system), from
    ``pos [n_atoms, 3]`` (need not be wrapped), ``cell [3, 3]`` (complete) and ``pbc [3]``
    bool on ``pos``'s device."""
    try:
        if not pos.is_cpu and _vesin_torch is not None:
            return _with_vesin_torch(pos, cell, pbc, cutoff)
        if _vesin is not None:
            return _with_vesin_numpy(pos, cell, pbc, cutoff)
        return _with_vesin_torch(pos, cell, pbc, cutoff)
    except _VESIN_ERRORS as err:
        if isinstance(err, torch.OutOfMemoryError):
            raise
        return _torch_fallback(pos, cell, pbc, cutoff)


def _torch_fallback(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    """The torch cell list's list of one system vesin refused (int64 shifts)."""
    from xnn.neighbors.api import neighbor_list  # wraps positions for the torch backend

    return neighbor_list(pos, cell, pbc, cutoff, backend="torch")


def _batched_numpy(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float,
                   batch: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`vesin_neighbor_list` of several systems on the CPU without a torch operator:
    vesin reads numpy views of each system, each list is copied once out of vesin's
    buffers with its atom offset added in the same pass, and the lists are joined once.
    (Per system, torch's offset add and the final ``torch.cat`` made the build of many
    small systems slower than a loop over vesin; a torch op on large tensors also wakes torch's
    OpenMP workers, which spin on the cores vesin's threads use:
    ``xnn.neighbors.common._read_once``.)"""
    pos = numpy_view(positions)
    if cell.dtype != positions.dtype:
        cell = cell.to(positions.dtype)
    box, periodic = numpy_view(cell), numpy_view(pbc.to(torch.bool))
    counts = np.bincount(numpy_view(batch), minlength=cell.shape[0]).tolist()
    nl = _calculator(_vesin, positions.device, cutoff)
    edges, shifts = [], []
    start = 0
    for s, n in enumerate(counts):
        if n > 0:
            try:
                p, sh = nl.compute(pos[start : start + n], box[s], periodic[s], "PS", copy=False)
            except _VESIN_ERRORS as err:
                if isinstance(err, torch.OutOfMemoryError):
                    raise
                ei, sh = _torch_fallback(positions[start : start + n], cell[s], pbc[s], cutoff)
                ei, sh = ei.numpy() + start, sh.numpy()
            else:
                ei, sh = _copies(p, sh, start)
            edges.append(ei)
            shifts.append(sh)
        start += n
    if not edges:
        return torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, 3, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(edges, axis=1)), torch.from_numpy(np.concatenate(shifts))



def _outputs(pairs: Tensor, shifts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """Our ``edge_index [2, E]`` and ``shifts [E, 3]`` int32 from vesin's ``pairs [E, 2]``
    (i, j) and ``shifts [E, 3]`` int32 (views are fine), each written once, in one kernel.

    Each vesin pair ``(i, j, S)`` (``r = pos[j] - pos[i] + S @ cell``) becomes the edge
    sender ``i``, receiver ``j``, shift ``-S``: the same pair seen from ``j``
    (``pos[i] - pos[j] - S @ cell = -r``, as short), which a full list also holds as
    ``(j, i, -S)``. So ``edge_index`` is the plain transpose of ``pairs`` (one copy, not two
    strided ones) and the negation of the shifts is their copy out of vesin's buffer.
    """
    if isinstance(pairs, np.ndarray) or pairs.is_cpu:
        edge_index, sh = (torch.from_numpy(a) for a in _copies(pairs, shifts, 0))
        if device.type != "cpu":
            edge_index, sh = edge_index.to(device), sh.to(device)
        return edge_index, sh
    return _outputs_torch(pairs, shifts, device)


def _copies(pairs, shifts, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_outputs` by numpy (faster than torch's copies here) from vesin's CPU
    ``pairs`` and ``shifts`` (numpy arrays or CPU tensors), with ``offset`` added to the
    atom indices in the same pass; in chunks over threads for large lists (:func:`_in_chunks`)."""
    if isinstance(pairs, Tensor):
        pairs, shifts = pairs.numpy(), shifts.numpy()
    p = pairs.view(np.int64)  # size_t: reinterpret, never negative below 2**63
    s = shifts.reshape(-1, 3)
    edge_index = np.empty((2, p.shape[0]), dtype=np.int64)
    sh = np.empty(s.shape, dtype=s.dtype)

    def copy(a: int, b: int) -> None:
        for c in range(a, b, _BLOCK):  # blocks that stay in cache: faster than one pass
            d = min(c + _BLOCK, b)
            if offset:
                np.add(p[c:d].T, offset, out=edge_index[:, c:d])
            else:
                edge_index[:, c:d] = p[c:d].T
            np.negative(s[c:d], out=sh[c:d])

    _in_chunks(copy, p.shape[0])
    return edge_index, sh


_BLOCK = 1 << 16  # edges per block of the copies (1.8 MB of pairs and shifts read)
#: edges per thread below which :func:`_in_chunks` copies in the calling thread alone
PARALLEL_EDGES = 250_000
_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, workers, pool)
_POOL_LOCK = threading.Lock()


def _in_chunks(work, n: int) -> None:
    """``work(a, b)`` over ``[0, n)``: in one call, or for large ``n`` in contiguous chunks
    on up to ``torch.get_num_threads()`` threads (numpy's copies release the GIL; on the
    GPU machine's 16-core host the single-threaded copies were a quarter of a 10^5-atom
    build). The pool is made again in a forked child, whose copy has no threads."""
    workers = min(torch.get_num_threads(), n // PARALLEL_EDGES)
    if workers < 2:
        work(0, n)
        return
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] < workers:
            if _POOL is not None and _POOL[0] == os.getpid():
                _POOL[2].shutdown(wait=False)
            _POOL = (os.getpid(), workers, ThreadPoolExecutor(workers, "xnn-vesin-copy"))
        pool = _POOL[2]
    bounds = np.linspace(0, n, workers + 1).astype(np.int64)
    for f in [pool.submit(work, int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]:
        f.result()


def _outputs_torch(pairs: Tensor, shifts: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`_outputs` by torch ops (on CUDA): one copy kernel each, no host sync."""
    if pairs.dtype == torch.uint64:
        pairs = pairs.view(torch.int64)
    if pairs.device != device:
        pairs, shifts = pairs.to(device), shifts.to(device)
    # always a copy (contiguous() would return the view of vesin's buffer at E <= 1)
    edge_index = pairs.t().clone(memory_format=torch.contiguous_format)
    if shifts.dtype != torch.int32:
        shifts = shifts.to(torch.int32)
    if shifts.ndim != 2:
        shifts = shifts.reshape(-1, 3)
    return edge_index, torch.neg(shifts)


def _with_vesin_numpy(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    """Through the ``vesin`` package, which reads torch tensors in place (CPU, or CUDA when
    its library has CUDA; otherwise the inputs are copied to the CPU)."""
    device = pos.device
    if pos.requires_grad:
        pos = pos.detach()
    if not pos.is_cpu and not _vesin_cuda_ok():
        pos = pos.cpu()
    dev = pos.device
    if cell.requires_grad:
        cell = cell.detach()
    if cell.dtype != pos.dtype or cell.device != dev:
        cell = cell.to(pos)
    if pbc.device != dev:
        pbc = pbc.to(dev)
    nl = _calculator(_vesin, dev, cutoff)
    # copy=False: views into nl's buffers, copied out once by _outputs before nl is reused;
    # on the CPU numpy views in and out, as for several systems (vesin's numpy and torch
    # routes measured equal from 108 to 97,556 atoms)
    if dev.type == "cpu" and pos.dtype in NUMPY_FLOATS:
        views = numpy_view(pos), numpy_view(cell), numpy_view(pbc)
        pairs, shifts = nl.compute(*views, "PS", copy=False)
    else:
        pairs, shifts = nl.compute(pos, cell, pbc, "PS", copy=not _ordered_with_vesin(dev))
    return _outputs(pairs, shifts, device)


def _vesin_cuda_ok() -> bool:  # pragma: no cover - needs CUDA
    """True when the installed vesin library computes on CUDA (probed once)."""
    ok = getattr(_CACHE, "cuda_ok", None)
    if ok is None:
        try:
            x = torch.zeros(2, 3, dtype=torch.float64, device="cuda")
            x[1, 0] = 1.0
            box = torch.eye(3, dtype=torch.float64, device="cuda") * 10
            _vesin.NeighborList(cutoff=2.0, full_list=True).compute(x, box, False, "P")
            ok = True
        except _VESIN_ERRORS:
            ok = False
        _CACHE.cuda_ok = ok
    return ok


def _with_vesin_torch(pos: Tensor, cell: Tensor, pbc: Tensor, cutoff: float):
    """Through ``vesin.torch`` (CUDA, or CPU without the ``vesin`` package)."""
    nl = _calculator(_vesin_torch, pos.device, cutoff)
    if cell.dtype != pos.dtype:
        cell = cell.to(pos.dtype)
    if pbc.dtype != torch.bool:
        pbc = pbc.to(torch.bool)
    if pos.requires_grad:
        pos = pos.detach()
    if cell.requires_grad:
        cell = cell.detach()
    device = pos.device
    pairs, shifts = nl.compute(pos, cell, pbc, "PS", copy=not _ordered_with_vesin(device))
    return _outputs(pairs, shifts, device)


def _ordered_with_vesin(device: torch.device) -> bool:
    """Whether our copies out of vesin's reused buffers are ordered before its next build:
    always on the CPU; on CUDA while torch runs on the default stream (which vesin's
    kernels also use). On a side stream vesin's own copies (``copy=True``) are taken."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:  # stream ids without building two Stream objects (µs per build)
        current, default = torch._C._cuda_getCurrentStream, torch._C._cuda_getDefaultStream
        return current(index)[0] == default(index)[0]
    except (AttributeError, TypeError, IndexError):  # pragma: no cover - other torch versions
        return torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
