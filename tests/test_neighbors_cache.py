"""Neighbor-list input checks with remembered host values (the CUDA fast path, run on CPU).

On CUDA the cell, pbc and batch values read for the checks are remembered per tensor, so
that a repeated call with the same tensors reads only the positions' sum. Here the same
code runs on CPU (``REMEMBER_ON`` patched): every in-place edit, a reallocated tensor and
non-finite positions must still be seen, and the lists must equal fresh ones.
"""

from __future__ import annotations

import gc
import os
import signal
import time

import numpy as np
import pytest
import torch

import xnn.neighbors.common as common
from xnn.errors import InputError
from xnn.neighbors import neighbor_list

CUTOFF = 3.0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture
def remember(monkeypatch):
    """Remember host values on CPU as on CUDA; count the full reads of cell/pbc/batch."""
    monkeypatch.setattr(common, "REMEMBER_ON", {"cpu", "cuda"})
    monkeypatch.setattr(common, "_HOST_VALUES", {})
    monkeypatch.setattr(common, "_FAST", {})
    reads = []
    real = common._read_once
    monkeypatch.setattr(common, "_read_once", lambda *a: reads.append(1) or real(*a))
    return reads


def _system(seed=0, n=40, box=8.0, device="cpu"):
    rng = np.random.default_rng(seed)
    pos = torch.tensor(rng.random((n, 3)) * box, device=device)
    cell = torch.eye(3, dtype=torch.float64, device=device) * box
    return pos, cell, torch.tensor([True, True, True], device=device)


def _edges(ei, sh) -> set:
    ei, sh = ei.cpu().tolist(), sh.cpu().tolist()
    return {(a, b, *s) for a, b, s in zip(ei[0], ei[1], sh)}


def _fresh(pos, cell, pbc, batch=None, backend="torch") -> set:
    """The list from clones (never seen before: no remembered values apply)."""
    b = None if batch is None else batch.clone()
    return _edges(*neighbor_list(pos.clone(), cell.clone(), pbc.clone(), CUTOFF, b, backend))


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("device", DEVICES)
def test_repeated_call_reads_only_the_positions(remember, backend, device):
    """The second call with the same cell and pbc tensors does not read them again (the old
    code read cell, pbc and positions at every call) and gives the same list."""
    pos, cell, pbc = _system(device=device)
    first = _edges(*neighbor_list(pos, cell, pbc, CUTOFF, backend=backend))
    assert len(remember) == 1
    moved = pos + 0.1
    again = _edges(*neighbor_list(moved, cell, pbc, CUTOFF, backend=backend))
    assert len(remember) == 1
    assert first == _fresh(pos, cell, pbc) and again == _fresh(moved, cell, pbc)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("device", DEVICES)
def test_in_place_edits_are_seen(remember, backend, device):
    """Scaling the cell in place changes the list; zeroing a periodic vector in place, or
    switching on periodicity in place along a zero vector, is refused as singular."""
    pos, cell, pbc = _system(1, device=device)
    neighbor_list(pos, cell, pbc, CUTOFF, backend=backend)
    cell.mul_(0.8)  # denser periodic images: more pairs
    out = _edges(*neighbor_list(pos, cell, pbc, CUTOFF, backend=backend))
    assert len(remember) == 2  # read again
    assert out == _fresh(pos, cell, pbc)
    cell[2] = 0.0
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, cell, pbc, CUTOFF, backend=backend)
    slab_pbc = torch.tensor([True, True, False], device=device)
    neighbor_list(pos, cell, slab_pbc, CUTOFF, backend=backend)  # zero vector, open axis: fine
    slab_pbc[2] = True
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, cell, slab_pbc, CUTOFF, backend=backend)
    cell[2, 2] = float("nan")
    with pytest.raises(InputError, match="non-finite cell"):
        neighbor_list(pos, cell, pbc, CUTOFF, backend=backend)


def test_in_place_edit_of_the_batch_is_seen(remember):
    pos, cell, pbc = _system(2)
    cells = torch.stack([cell, cell * 1.1])
    batch = torch.repeat_interleave(torch.arange(2), 20)
    out = _edges(*neighbor_list(pos, cells, pbc, CUTOFF, batch, "torch"))
    assert out == _fresh(pos, cells, pbc, batch)
    batch[-1] = 2  # out of range for two systems
    with pytest.raises(InputError, match="batch"):
        neighbor_list(pos, cells, pbc, CUTOFF, batch, "torch")
    batch[-1] = 1
    batch[0] = 1  # decreasing
    with pytest.raises(InputError, match="batch"):
        neighbor_list(pos, cells, pbc, CUTOFF, batch, "torch")


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_positions_raise_with_a_remembered_cell(remember, backend, device):
    pos, cell, pbc = _system(3, device=device)
    neighbor_list(pos, cell, pbc, CUTOFF, backend=backend)
    for bad in (float("nan"), float("inf"), -float("inf")):
        p = pos.clone()
        p[5, 1] = bad
        with pytest.raises(InputError, match="non-finite positions"):
            neighbor_list(p, cell, pbc, CUTOFF, backend=backend)
    assert len(remember) == 1  # the cell was remembered: still the positions were checked


def test_reallocated_tensor_does_not_reuse_old_values(remember):
    """A new tensor that gets the id, memory and version of a freed one (simulated by
    filing the freed tensor's entry under the new id) is read afresh: identity is checked by
    weak reference, not by ``id()``."""
    pos, cell, pbc = _system(4)
    neighbor_list(pos, cell, pbc, CUTOFF, backend="torch")
    ref, (_, extra), values = common._HOST_VALUES[id(cell)]
    del cell
    gc.collect()
    singular = torch.zeros(3, 3, dtype=torch.float64)
    common._HOST_VALUES[id(singular)] = (ref, (common._meta(singular), extra), values)
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, singular, pbc, CUTOFF, backend="torch")


def test_cell_of_another_dtype_is_checked_in_the_positions_dtype(remember):
    """Values are remembered per positions dtype: a float64 cell used with float32 positions
    (so converted to float32) is checked again, not taken from its float64 check."""
    pos, cell, pbc = _system(5)
    cell[2, 2] = 1e39  # finite in float64, inf in float32
    neighbor_list(pos, cell, pbc, CUTOFF, backend="brute")  # a tall box: fine
    with pytest.raises(InputError, match="non-finite cell"):
        neighbor_list(pos.float(), cell, pbc, CUTOFF, backend="brute")


def test_inference_tensors_are_read_every_time(remember):
    """Inference tensors have no version counter: their values are never remembered, so an
    in-place edit under ``torch.inference_mode`` is still seen."""
    with torch.inference_mode():
        pos, cell, pbc = _system(6)
        neighbor_list(pos, cell, pbc, CUTOFF, backend="torch")
        cell[1] = 0.0
        with pytest.raises(InputError, match="singular"):
            neighbor_list(pos, cell, pbc, CUTOFF, backend="torch")
    assert len(remember) == 2


def test_torch_outputs_equal_ase_and_own_their_memory():
    """The CUDA form of the copies out of vesin's buffers (torch ops), run here on CPU: the
    same (sender, receiver, shift) set as ASE and as the numpy form, int32 shifts, and no
    memory shared with vesin's reused buffers (``copy=False``)."""
    vesin_torch = pytest.importorskip("vesin_torch")
    from ase.build import bulk
    from ase.neighborlist import neighbor_list as ase_neighbor_list

    import xnn.neighbors.vesin_backend as vb

    atoms = bulk("Cu", "fcc", a=3.61).repeat((3, 2, 2))  # triclinic primitive cell
    atoms.rattle(0.05, seed=1)
    pos, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    nl = vesin_torch.NeighborList(cutoff=CUTOFF, full_list=True)
    pairs, shifts = nl.compute(pos, cell, torch.tensor(atoms.pbc), "PS", copy=False)
    ei, sh = vb._outputs_torch(pairs, shifts, pos.device)
    i, j, s = ase_neighbor_list("ijS", atoms, CUTOFF)
    ref = {(int(b), int(a), *map(int, v)) for a, b, v in zip(i, j, s)}
    assert _edges(ei, sh) == ref == _edges(*vb._outputs(pairs, shifts, pos.device))
    assert ei.dtype == torch.long and ei.is_contiguous() and sh.dtype == torch.int32
    for ours, theirs in ((ei, pairs), (sh, shifts)):
        assert ours.untyped_storage().data_ptr() != theirs.untyped_storage().data_ptr()


def test_numpy_outputs_in_chunks_equal_one_copy(monkeypatch):
    """The CPU copies out of vesin's buffers split over threads (a low edge threshold
    forces chunks on a small list) write exactly what one copy writes, and a forked
    child (whose copy of the pool has no threads) makes its own pool and finishes."""
    vesin = pytest.importorskip("vesin")
    import xnn.neighbors.vesin_backend as vb

    pos, cell, pbc = _system(8)
    pairs, shifts = vesin.NeighborList(cutoff=CUTOFF, full_list=True).compute(
        pos, cell, pbc, "PS", copy=True)
    ei1, sh1 = vb._outputs(pairs, shifts, pos.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        monkeypatch.setattr(vb, "PARALLEL_EDGES", pairs.shape[0] // 5)
        ei3, sh3 = vb._outputs(pairs, shifts, pos.device)
        assert vb._POOL is not None and vb._POOL[1] == 3
        assert torch.equal(ei1, ei3) and torch.equal(sh1, sh3) and sh3.dtype == torch.int32
        want = torch.from_numpy(pairs.numpy().view(np.int64).T.copy())
        assert pairs.shape[0] > 100 and torch.equal(ei1, want)
        assert torch.equal(sh1, -shifts.reshape(-1, 3))
        monkeypatch.setattr(vb, "_BLOCK", 7)  # blocks within each thread's chunk, and an offset
        ei7, sh7 = vb._copies(pairs, shifts, 1000)
        assert np.array_equal(ei7, want.numpy() + 1000) and np.array_equal(sh7, sh1.numpy())
        child = os.fork()
        if child == 0:  # pragma: no cover - the child's result is its exit status
            torch.set_num_threads(3)  # (torch starts a forked child with one thread)
            ok = torch.equal(vb._outputs(pairs, shifts, pos.device)[0], ei1)
            os._exit(0 if ok and vb._POOL[0] == os.getpid() else 1)
        for _ in range(300):  # a child waiting on a pool without threads never returns
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            pytest.fail("the forked child hung in the copies")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        torch.set_num_threads(threads)


def test_whole_call_entry_follows_each_tensor(remember):
    """The whole-call entry (``common._FAST``, keyed on the cell) applies only with the very
    pbc and batch tensors of the stored call: a new pbc tensor periodic along the cell's zero
    vector, or a new unsorted batch, is refused although the cell is the same object."""
    pos, cell, _ = _system(7)
    cell[2] = 0.0  # a slab: periodic along a and b only
    slab = torch.tensor([True, True, False])
    neighbor_list(pos, cell, slab, CUTOFF, backend="auto")
    neighbor_list(pos, cell, slab, CUTOFF, backend="auto")  # from the entry
    assert len(remember) == 1 and id(cell) in common._FAST
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, cell, torch.tensor([True, True, True]), CUTOFF, backend="auto")
    cells = torch.stack([torch.eye(3, dtype=torch.float64) * 8] * 2)
    pbc = torch.tensor([[True] * 3] * 2)
    batch = torch.tensor([0] * 20 + [1] * 20)
    neighbor_list(pos, cells, pbc, CUTOFF, batch, "auto")
    neighbor_list(pos, cells, pbc, CUTOFF, batch, "auto")
    with pytest.raises(InputError, match="non-decreasing"):
        neighbor_list(pos, cells, pbc, CUTOFF, batch.flip(0), "auto")
    moved = pos[:30] + 0.1  # fewer atoms: the batch no longer fits
    with pytest.raises(InputError, match="batch must have shape"):
        neighbor_list(moved, cells, pbc, CUTOFF, batch, "auto")


def test_whole_call_entry_is_not_used_once_the_cell_requires_grad(remember):
    """``requires_grad_`` changes no version: the stored grad-less float32 copy of a float64
    cell must not be returned once the cell requires grad (its conversion keeps the graph)."""
    pos, cell, pbc = _system(8)
    pos = pos.float()
    common.validate_lazy(pos, cell, pbc, CUTOFF, None)
    assert not common.validate_lazy(pos, cell, pbc, CUTOFF, None)[1].requires_grad
    cell.requires_grad_(True)
    assert common.validate_lazy(pos, cell, pbc, CUTOFF, None)[1].requires_grad


def test_cpu_checks_run_no_torch_kernels_and_still_refuse_bad_input():
    """On the CPU the input checks read positions, cell, pbc and batch by numpy: a torch
    reduction would wake torch's OpenMP workers, which then spin on the cores vesin's
    threads need (a 10,976-atom build took 27 ms after one, 20 ms without). No aten
    operator may run on the positions or the batch; the checks must still refuse
    non-finite positions and a bad batch, and accept a negated view and positions with
    grad."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append((func, [a.shape for a in args if isinstance(a, torch.Tensor)]))
            return func(*args, **(kwargs or {}))

    pos, cell, pbc = _system(11, n=200)
    batch = torch.cat([torch.zeros(120, dtype=torch.long), torch.ones(80, dtype=torch.long)])
    cells = torch.stack([cell, cell])
    pbcs = torch.stack([pbc, pbc])
    for args in ((pos, cell, pbc, None), (pos, cells, pbcs, batch)):
        with Ops() as ops:
            common.checked(args[0], args[1], args[2], CUTOFF, args[3])
        big = [f for f, shapes in ops.seen if any(s[:1] == (200,) for s in shapes)
               and f is not torch.ops.aten.detach.default]  # a view: no kernel
        assert not big, big
    grad = pos.clone().requires_grad_()
    assert common.checked(grad, cell, pbc, CUTOFF, None)[0] is grad
    neg = torch.neg(pos)._neg_view()  # pos's values, behind a negative bit numpy can't read
    assert neg.is_neg()
    common.checked(neg, cell, pbc, CUTOFF, None)
    bad = pos.clone()
    bad[7, 2] = float("inf")
    with pytest.raises(InputError, match="non-finite"):
        common.checked(bad, cell, pbc, CUTOFF, None)
    common.checked(pos.bfloat16(), cell.bfloat16(), pbc, CUTOFF, None)  # no numpy dtype
    huge = torch.full((200, 3), 3e38, dtype=torch.float32)  # float32 sum overflows; float64 not
    common.checked(huge, cell.float(), pbc, CUTOFF, None)
    for wrong in (batch.flip(0), batch + 1, batch - 1):
        with pytest.raises(InputError, match="non-decreasing"):
            common.checked(pos, cells, pbcs, CUTOFF, wrong)
