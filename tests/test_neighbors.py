"""Neighbor lists: every backend against ASE, input checks, and the Verlet skin list."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.geometry import cellpar_to_cell
from ase.neighborlist import neighbor_list as ase_neighbor_list

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel
from xnn.models.derivatives import compute_properties
from xnn.neighbors import VerletList, available_backends, neighbor_list

BACKENDS = ["brute", "torch", pytest.param("vesin", marks=pytest.mark.skipif(
    "vesin" not in available_backends(), reason="vesin not installed"))]
CUTOFF = 4.5


# ----------------------------------------------------------------------------- systems
def _random_atoms(cell, pbc, n, rng, spread=None) -> Atoms:
    cell = np.asarray(cell, dtype=float)
    if spread is None:
        pos = rng.random((n, 3)) @ cell
    else:
        pos = rng.random((n, 3)) * spread
    return Atoms(f"H{n}", positions=pos, cell=cell, pbc=pbc)


def _zoo() -> dict[str, Atoms]:
    """Small systems covering the hard cases, all used with ``CUTOFF``."""
    rng = np.random.default_rng(7)
    z = {}
    z["tri60"] = _random_atoms(
        cellpar_to_cell([6.1, 6.7, 7.3, *rng.uniform(56, 64, 3)]), True, 30, rng)
    z["tri120"] = _random_atoms(
        cellpar_to_cell([6.4, 7.0, 6.8, *rng.uniform(112, 118, 3)]), True, 30, rng)
    z["hex"] = _random_atoms(cellpar_to_cell([5.5, 5.5, 6.0, 90, 90, 120]), True, 20, rng)
    # cells thinner than the cutoff: several periodic images in every direction
    z["small"] = _random_atoms(cellpar_to_cell([2.1, 2.4, 2.6, 66, 113, 80]), True, 3, rng)
    z["one_atom_small"] = _random_atoms(cellpar_to_cell([1.9, 2.2, 2.0, 75, 95, 115]), True, 1, rng)
    z["cluster"] = _random_atoms(np.zeros((3, 3)), False, 25, rng, spread=7.0)
    z["mixed_slab"] = _random_atoms(cellpar_to_cell([5.0, 6.0, 9.0, 80, 100, 70]),
                                    [True, True, False], 25, rng)
    wire = _random_atoms(np.diag([3.1, 0.0, 0.0]), [True, False, False], 6, rng)
    wire.positions[:, 1:] = rng.random((6, 2)) * 5.0
    wire.positions[:, 0] = rng.random(6) * 3.1
    z["wire_zero_rows"] = wire
    isolated = Atoms("H3", positions=[[0, 0, 0], [20, 0, 0], [0, -30, 12]])
    z["isolated"] = isolated
    z["one_atom_open"] = Atoms("H", positions=[[1.0, 2.0, 3.0]])
    z["one_atom_big_cell"] = Atoms("H", positions=[[1.0, 2.0, 3.0]], cell=np.eye(3) * 20, pbc=True)
    far = z["tri60"].copy()
    far.positions += rng.integers(-50, 50, (len(far), 3)) @ far.cell.array
    far.positions += rng.normal(scale=3.0, size=far.positions.shape)  # off-lattice too
    z["unwrapped_far"] = far
    slab_far = z["mixed_slab"].copy()
    jumps = rng.integers(-40, 40, (len(slab_far), 3)) * [1, 1, 0]
    slab_far.positions += jumps @ slab_far.cell.array
    z["unwrapped_mixed"] = slab_far
    return z


ZOO = _zoo()


# ----------------------------------------------------------------------------- helpers
def _reference(atoms: Atoms, cutoff: float, offset: int = 0) -> set:
    """ASE pairs as (sender j, receiver i, shift) — ASE's r = pos[j] - pos[i] + S @ cell."""
    i, j, s = ase_neighbor_list("ijS", atoms, cutoff)
    return {(int(a) + offset, int(b) + offset, *map(int, c)) for a, b, c in zip(j, i, s)}


def _as_set(edge_index: torch.Tensor, shifts: torch.Tensor) -> set:
    assert edge_index.dtype == torch.long and shifts.dtype in (torch.int32, torch.long)
    rows = torch.cat([edge_index.t(), shifts.long()], dim=1).tolist()
    out = {tuple(r) for r in rows}
    assert len(out) == len(rows), "duplicate edges"
    return out


def _drop_near_cutoff(pairs: set, pos: np.ndarray, cells: list, sys_of: np.ndarray, tol: float):
    """Pairs whose float64 length is not within ``tol`` of the cutoff (float32 cannot decide)."""
    if not pairs:
        return pairs
    rows = sorted(pairs)
    arr = np.array(rows, dtype=np.int64)
    j, i, s = arr[:, 0], arr[:, 1], arr[:, 2:].astype(float)
    cell = np.stack(cells)[sys_of[i]]
    d = np.linalg.norm(pos[j] - pos[i] + np.einsum("ek,ekl->el", s, cell), axis=1)
    return {r for r, dist in zip(rows, d) if abs(dist - CUTOFF) > tol}


def _run(atoms_list: list[Atoms], backend: str, dtype: torch.dtype):
    pos = np.concatenate([a.positions for a in atoms_list]) if atoms_list else np.zeros((0, 3))
    cells = [a.cell.array for a in atoms_list]
    batch = np.concatenate([np.full(len(a), k) for k, a in enumerate(atoms_list)]).astype(int)
    ei, sh = neighbor_list(
        torch.tensor(pos, dtype=dtype),
        torch.tensor(np.stack(cells), dtype=dtype),
        torch.tensor(np.stack([a.pbc for a in atoms_list])),
        CUTOFF,
        torch.tensor(batch, dtype=torch.long),
        backend=backend,
    )
    return ei, sh, batch


def _check(atoms_list: list[Atoms], backend: str, dtype: torch.dtype) -> int:
    if dtype == torch.float32:  # compare with ASE on the rounded inputs
        atoms_list = [a.copy() for a in atoms_list]
        for a in atoms_list:
            a.positions = a.positions.astype(np.float32).astype(np.float64)
            a.cell = a.cell.array.astype(np.float32).astype(np.float64)
    ei, sh, batch = _run(atoms_list, backend, dtype)
    ref, start = set(), 0
    for a in atoms_list:
        ref |= _reference(a, CUTOFF, start)
        start += len(a)
    got = _as_set(ei, sh)
    if dtype == torch.float32:
        pos = np.concatenate([a.positions for a in atoms_list])
        cells = [a.cell.array for a in atoms_list]
        ref = _drop_near_cutoff(ref, pos, cells, batch, 1e-3)
        got = _drop_near_cutoff(got, pos, cells, batch, 1e-3)
    assert got == ref, f"missing {sorted(ref - got)[:5]}, extra {sorted(got - ref)[:5]}"
    return len(ref)


# ----------------------------------------------------------------------------- against ASE
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_single_system_matches_ase(name, backend, dtype):
    n = _check([ZOO[name]], backend, dtype)
    if name.startswith(("tri", "hex", "small", "cluster", "mixed", "unwrapped")):
        assert n > 0  # the case is not vacuous
    if name in ("isolated", "one_atom_open", "one_atom_big_cell"):
        assert n == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_everything_matches_ase(backend, dtype):
    names = sorted(ZOO)
    atoms = [ZOO[k] for k in names]
    atoms.insert(3, Atoms(cell=np.eye(3) * 5, pbc=True))  # an empty system in the middle
    _check(atoms, backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_several_random_triclinic_cells(backend):
    rng = np.random.default_rng(11)
    systems = []
    for k in range(6):
        near = 60 if k % 2 == 0 else 115
        par = [*rng.uniform(2.5, 8.0, 3), *rng.uniform(near - 4, near + 4, 3)]
        pbc = rng.random(3) < 0.7
        systems.append(_random_atoms(cellpar_to_cell(par), pbc, int(rng.integers(1, 25)), rng))
    _check(systems, backend, torch.float64)


def test_auto_backend_agrees_with_brute():
    atoms = [ZOO["tri120"], ZOO["small"], ZOO["cluster"]]
    a = _as_set(*_run(atoms, "auto", torch.float64)[:2])
    b = _as_set(*_run(atoms, "brute", torch.float64)[:2])
    assert a == b and len(a) > 0


def test_edge_vectors_are_short_and_signed_like_ase():
    """r_ij from our edges equals ASE's distance vectors D for the same (i, j, S)."""
    atoms = ZOO["unwrapped_far"]
    ei, sh, _ = _run([atoms], "torch", torch.float64)
    graph = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc)
    graph = graph.replace(edge_index=ei, shifts=sh)
    vec = graph.edge_vectors().numpy()
    i, j, s, d_ase = ase_neighbor_list("ijSD", atoms, CUTOFF)
    ref = {(int(b), int(a), *map(int, c)): v for a, b, c, v in zip(i, j, s, d_ase)}
    rows = torch.cat([ei.t(), sh], 1).tolist()
    for r, v in zip(rows, vec):
        np.testing.assert_allclose(v, ref[tuple(r)], atol=1e-9)
    assert np.linalg.norm(vec, axis=1).max() < CUTOFF


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("backend", ["brute", "torch", "vesin", "auto"])
def test_bad_input_raises_input_error(backend):
    pos = torch.rand(4, 3, dtype=torch.float64)
    cell = torch.eye(3, dtype=torch.float64) * 5
    pbc = torch.tensor([True, True, True])
    for cutoff in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="cutoff"):
            neighbor_list(pos, cell, pbc, cutoff, backend=backend)
    with pytest.raises(InputError, match="positions"):
        neighbor_list(torch.rand(4, 2), cell, pbc, 2.0, backend=backend)
    with pytest.raises(InputError, match="batch"):
        neighbor_list(pos, cell, pbc, 2.0, torch.zeros(3, dtype=torch.long), backend=backend)
    with pytest.raises(InputError, match="pbc"):
        neighbor_list(pos, cell, torch.tensor([True, False]), 2.0, backend=backend)
    with pytest.raises(InputError, match="cell"):
        neighbor_list(pos, torch.eye(2), pbc, 2.0, backend=backend)
    for bad in (float("nan"), float("inf")):
        p = pos.clone()
        p[2, 1] = bad
        with pytest.raises(InputError, match="non-finite"):
            neighbor_list(p, cell, pbc, 2.0, backend=backend)
    flat = cell.clone()
    flat[2] = flat[0] + flat[1]  # coplanar lattice vectors
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, flat, pbc, 2.0, backend=backend)
    with pytest.raises(InputError, match="singular"):
        neighbor_list(pos, torch.zeros(3, 3, dtype=torch.float64), pbc, 2.0, backend=backend)


def test_unknown_backend_lists_choices():
    with pytest.raises(InputError, match="torch"):
        neighbor_list(torch.rand(2, 3), torch.eye(3), False, 1.0, backend="nope")


# ----------------------------------------------------------------------------- Verlet skin
class _SmoothPair(AtomisticModel):
    """Morse-like pair energy times a cosine cutoff; exactly zero at and beyond ``cutoff``."""

    def __init__(self, cutoff: float):
        super().__init__()
        self.cutoff = cutoff

    def forward(self, graph: AtomicGraph) -> torch.Tensor:
        d = graph.edge_vectors().norm(dim=-1)
        inside = d < self.cutoff
        ds = torch.where(inside, d, torch.zeros_like(d))
        x = torch.exp(-1.5 * (ds - 2.3))
        fc = 0.5 * (torch.cos(math.pi * ds / self.cutoff) + 1.0)
        e = torch.where(inside, 0.5 * 0.3 * (x * x - 2 * x) * fc, torch.zeros_like(d))
        return torch.zeros_like(graph.positions[:, 0]).index_add(0, graph.edge_index[1], e)


def _fcc_graph(rng) -> AtomicGraph:
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2))
    atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
    atoms.cell = cellpar_to_cell([7.22, 7.4, 7.1, 85, 95, 100])  # make it triclinic
    return AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True)


def _short_edges(graph: AtomicGraph, cutoff: float) -> set:
    keep = graph.edge_vectors().norm(dim=-1) < cutoff
    return _as_set(graph.edge_index[:, keep], graph.shifts[keep])


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_verlet_list_reuse_and_rebuild(backend):
    rng = np.random.default_rng(3)
    cutoff, skin = 3.0, 1.0
    graph = _fcc_graph(rng)
    nl = VerletList(cutoff, skin, backend)
    nl(graph)
    assert nl.n_builds == 1
    ref_pos = graph.positions.clone()

    def moved(max_disp: float) -> AtomicGraph:
        step = torch.tensor(rng.normal(size=ref_pos.shape))
        length = torch.tensor(rng.uniform(0, max_disp, (len(step), 1)))
        step = step / step.norm(dim=-1, keepdim=True) * length
        return graph.replace(positions=ref_pos + step)

    # small moves (< skin / 2): reused, and still complete within the cutoff
    for _ in range(3):
        g = moved(0.49 * skin)
        out = nl(g)
        assert nl.n_builds == 1
        fresh = g.replace(**dict(zip(("edge_index", "shifts"), neighbor_list(
            g.positions, g.cell, g.pbc, cutoff, g.batch, "brute"))))
        assert _short_edges(out, cutoff) == _as_set(fresh.edge_index, fresh.shifts)
    # one atom beyond skin / 2 from the last build: rebuilt
    far = ref_pos.clone()
    far[5, 0] += 0.51 * skin
    nl(graph.replace(positions=far))
    assert nl.n_builds == 2
    # drift accumulates from the last build, not from the previous step
    p = far.clone()
    p[7, 1] += 0.3 * skin
    nl(graph.replace(positions=p))
    assert nl.n_builds == 2
    p[7, 1] += 0.3 * skin
    nl(graph.replace(positions=p))
    assert nl.n_builds == 3
    # a small deformation of cell and atoms (NPT-like): reused while
    # (cutoff + skin) |F - 1| + 2 d < skin, and still complete within the cutoff
    shear = torch.tensor([[1.0, 0.03, 0.0], [0.0, 0.98, 0.02], [0.01, 0.0, 1.02]],
                         dtype=p.dtype)
    g = graph.replace(positions=p @ shear, cell=graph.cell @ shear)
    out = nl(g)
    assert nl.n_builds == 3
    ei, sh = neighbor_list(g.positions, g.cell, g.pbc, cutoff, g.batch, "brute")
    assert _short_edges(out, cutoff) == _as_set(ei, sh)
    # a deformation beyond that bound: rebuilt even without motion relative to the cell
    strong = torch.diag(torch.tensor([1.3, 1.0, 1.0], dtype=p.dtype))
    g = graph.replace(positions=p @ strong, cell=graph.cell @ strong)
    nl(g)
    assert nl.n_builds == 4
    # changed periodicity: rebuilt, and the list matches the new boundary conditions
    slab = g.replace(pbc=torch.tensor([[True, True, False]]))
    out = nl(slab)
    assert nl.n_builds == 5
    ei, sh = neighbor_list(slab.positions, slab.cell, slab.pbc, cutoff + skin, slab.batch, "brute")
    assert _as_set(out.edge_index, out.shifts) == _as_set(ei, sh)
    nl(slab)
    assert nl.n_builds == 5


def test_forces_from_skin_list_equal_fresh_list():
    rng = np.random.default_rng(5)
    cutoff, skin = 3.0, 1.2
    model = _SmoothPair(cutoff)
    graph = _fcc_graph(rng)
    nl = VerletList(cutoff, skin, "torch")
    nl(graph)
    step = torch.tensor(rng.normal(scale=0.15, size=graph.positions.shape)).clamp(-0.3, 0.3)
    g = graph.replace(positions=graph.positions + step)
    with_skin = nl(g)
    assert nl.n_builds == 1
    assert with_skin.n_edges > 0
    ei, sh = neighbor_list(g.positions, g.cell, g.pbc, cutoff, g.batch, "torch")
    fresh = g.replace(edge_index=ei, shifts=sh)
    assert with_skin.n_edges > fresh.n_edges  # the skin list does carry longer edges
    a = compute_properties(model, with_skin)
    b = compute_properties(model, fresh)
    assert abs(float(a["energy"][0])) > 1e-3
    for key in ("energy", "forces", "stress"):
        torch.testing.assert_close(a[key], b[key], rtol=1e-12, atol=1e-12)


def _larger_systems() -> list[Atoms]:
    """Cells several cutoffs wide, so the cell list has many bins (and 2 along one axis)."""
    from ase.build import bulk

    rng = np.random.default_rng(21)
    fcc = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 3, 3))
    fcc.positions += rng.normal(scale=0.1, size=fcc.positions.shape)
    sheared = fcc.copy()
    sheared.set_cell(cellpar_to_cell([14.44, 11.0, 10.83, 70, 115, 62]), scale_atoms=True)
    slab = fcc.copy()
    slab.pbc = [True, False, True]
    slab.positions[:, 1] *= 1.8  # vacuum gaps along the open axis
    cluster = _random_atoms(np.zeros((3, 3)), False, 100, rng, spread=[25.0, 12.0, 9.0])
    return [fcc, sheared, slab, cluster]


@pytest.mark.parametrize("backend", BACKENDS[1:])  # brute is checked on the small zoo
def test_many_bins_match_ase(backend):
    for atoms in _larger_systems():
        assert _check([atoms], backend, torch.float64) > 500
    _check(_larger_systems(), backend, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "vesin", "auto"])
def test_cuda_matches_cpu(backend):
    atoms = [*_larger_systems(), *ZOO.values()]
    pos = torch.tensor(np.concatenate([a.positions for a in atoms]))
    cell = torch.tensor(np.stack([a.cell.array for a in atoms]))
    pbc = torch.tensor(np.stack([a.pbc for a in atoms]))
    batch = torch.tensor(np.concatenate([np.full(len(a), k) for k, a in enumerate(atoms)]))
    ref = _as_set(*neighbor_list(pos, cell, pbc, CUTOFF, batch, "brute"))
    dev = [t.cuda() for t in (pos, cell, pbc, batch)]
    ei, sh = neighbor_list(*dev[:3], CUTOFF, dev[3], backend)
    assert ei.is_cuda and sh.is_cuda
    assert _as_set(ei.cpu(), sh.cpu()) == ref


def test_torch_backend_chunking_does_not_change_results(monkeypatch):
    """Tiny work budgets force many (atom, offset) and candidate chunks: same edges."""
    import xnn.neighbors.torch_cells as tc

    atoms = [*_larger_systems()[:2], ZOO["small"], ZOO["mixed_slab"], ZOO["cluster"]]
    ref = _as_set(*_run(atoms, "torch", torch.float64)[:2])
    monkeypatch.setitem(tc._BUDGETS, "cpu", (211, 3000))
    assert _as_set(*_run(atoms, "torch", torch.float64)[:2]) == ref


def test_vesin_fallback_to_torch(monkeypatch):
    """A system vesin refuses is computed by the torch cell list instead."""
    pytest.importorskip("vesin")
    import xnn.neighbors.vesin_backend as vb

    class Refuses:
        def compute(self, *args, **kwargs):
            raise ValueError("unsupported")

    monkeypatch.setattr(vb, "_calculator", lambda *a: Refuses())
    fallbacks = []
    real = vb._torch_fallback
    monkeypatch.setattr(vb, "_torch_fallback", lambda *a: fallbacks.append(1) or real(*a))
    systems = [ZOO["tri60"], ZOO["wire_zero_rows"], ZOO["small"]]
    _check(systems, "vesin", torch.float64)  # batched
    assert len(fallbacks) == 3
    for one in systems:
        _check([one], "vesin", torch.float64)
    assert len(fallbacks) == 6


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_perfect_lattice_on_bin_edges(backend):
    """Unrattled FCC: atoms sit exactly on bin boundaries and cell faces (frac 0, 1/4, 1/2)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((4, 4, 4))
    n = _check([atoms], backend, torch.float64)
    assert n == len(atoms) * 42  # 12 + 6 + 24 neighbours within 4.5 Å (shells 2.55, 3.61, 4.42)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_systems_do_not_allocate_huge_grids(backend):
    """Atoms 1e5 Å apart, and a periodic box of 1e4 Å: bin counts are capped by atom counts."""
    far = Atoms("H4", positions=[[0, 0, 0], [1e5, 0, 0], [0, 1e5, 1e5], [1.0, 0.5, 0.0]])
    vacuum = Atoms("H3", positions=[[1, 1, 1], [2, 2, 2], [5e3, 5e3, 5e3]],
                   cell=np.eye(3) * 1e4, pbc=True)
    ei, sh, _ = _run([far, vacuum], backend, torch.float64)
    # the only pairs: atoms 0-3 of the first system and atoms 4-5 (0-1 of the second)
    assert _as_set(ei, sh) == {(0, 3, 0, 0, 0), (3, 0, 0, 0, 0), (4, 5, 0, 0, 0), (5, 4, 0, 0, 0)}


def test_vesin_torch_path_on_cpu(monkeypatch):
    """The vesin.torch code path (used for CUDA tensors) also matches ASE, run here on CPU."""
    import xnn.neighbors.vesin_backend as vb

    if not vb.vesin_torch_available():
        pytest.skip("vesin-torch not installed")
    monkeypatch.setattr(vb, "_vesin", None)
    calls = []
    real = vb._with_vesin_torch
    monkeypatch.setattr(vb, "_with_vesin_torch", lambda *a: calls.append(1) or real(*a))
    atoms = [ZOO["unwrapped_far"], ZOO["unwrapped_mixed"], ZOO["small"], ZOO["cluster"]]
    for dtype in (torch.float64, torch.float32):
        _check(atoms, "vesin", dtype)
    assert len(calls) == 8


def test_verlet_list_stays_complete_under_random_deformations():
    """Whenever the list is reused after cell + atom changes, it holds every pair < cutoff."""
    rng = np.random.default_rng(11)
    cutoff, skin = 3.0, 0.8
    graph = _fcc_graph(rng)
    nl = VerletList(cutoff, skin, "torch")
    nl(graph)
    reused = 0
    for _ in range(40):
        deform = torch.eye(3, dtype=torch.float64) + torch.tensor(
            rng.normal(scale=0.03, size=(3, 3)))
        step = torch.tensor(rng.normal(scale=0.08, size=graph.positions.shape))
        g = graph.replace(positions=graph.positions @ deform + step,
                          cell=graph.cell @ deform)
        before = nl.n_builds
        out = nl(g)
        reused += nl.n_builds == before
        ei, sh = neighbor_list(g.positions, g.cell, g.pbc, cutoff, g.batch, "brute")
        assert _short_edges(out, cutoff) == _as_set(ei, sh)
    assert reused > 0  # the deformation-aware rule does reuse lists


def test_verlet_list_sees_in_place_edits_of_the_build_tensors():
    """Unchanged tensors are recognised without comparing them (identity and version), so an
    in-place edit of the very tensors the list was built from must still trigger a rebuild."""
    graph = _fcc_graph(np.random.default_rng(11))
    nl = VerletList(3.0, 1.0)
    nl(graph)
    flag = nl.rebuild_flag(graph)
    assert isinstance(flag, torch.Tensor) and not bool(flag)  # the skin check, on the device
    nl(graph)
    assert nl.n_builds == 1
    graph.numbers[3] = 8  # same tensor object, edited in place
    nl(graph)
    assert nl.n_builds == 2
    graph.cell.mul_(1.2)  # the cell tensor of the last build, scaled in place: beyond skin
    nl(graph)
    assert nl.n_builds == 3
    graph.positions[0, 0] += 0.6  # > skin / 2 on the tensor of the last build
    nl(graph)
    assert nl.n_builds == 4


@pytest.mark.skipif("vesin" not in available_backends(), reason="vesin not installed")
def test_vesin_results_survive_the_next_build():
    """vesin's buffers are reused between builds (copy=False): earlier results must be
    copies, unchanged by later builds of other systems with the same cutoff."""
    first = ZOO["tri60"]
    ei, sh = neighbor_list(torch.tensor(first.positions), torch.tensor(first.cell.array),
                           torch.tensor(first.pbc), CUTOFF, backend="vesin")
    before = _as_set(ei, sh)
    for other in ("hex", "small", "tri120"):
        a = ZOO[other]
        neighbor_list(torch.tensor(a.positions), torch.tensor(a.cell.array),
                      torch.tensor(a.pbc), CUTOFF, backend="vesin")
    assert _as_set(ei, sh) == before == _reference(first, CUTOFF)


def test_rowvec_matmul_per_system_products_equal_the_gather():
    """Rows grouped by system (the edges of concatenated cells) take one product per system
    on the CPU; values and gradients equal the gathered form, also for unsorted rows."""
    from xnn.data.graph import rowvec_matmul

    gen = torch.Generator().manual_seed(0)
    mats = torch.randn(5, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    batch = torch.sort(torch.randint(0, 5, (300,), generator=gen)).values
    batch[batch == 2] = 3  # a system with no rows
    shifts = torch.randint(-2, 3, (300, 3), generator=gen).double()
    pos = torch.randn(300, 3, dtype=torch.float64, generator=gen)
    for x, rows in ((shifts, None), (pos, None), (shifts, torch.randperm(300, generator=gen))):
        idx = batch if rows is None else batch[rows]
        ref = (x.unsqueeze(-1) * mats[idx]).sum(-2)
        out = rowvec_matmul(x, mats, batch, rows)
        if x is shifts:
            assert torch.equal(out, ref)  # integer shifts: exact either way
        torch.testing.assert_close(out, ref, rtol=1e-14, atol=1e-14)
        w = torch.randn(300, 3, dtype=torch.float64, generator=gen)
        g_out, = torch.autograd.grad((out * w).sum(), mats)
        g_ref, = torch.autograd.grad((ref * w).sum(), mats)
        torch.testing.assert_close(g_out, g_ref, rtol=1e-13, atol=1e-13)


def test_rowvec_matmul_per_system_product_differentiates_twice():
    """The per-system product (one output, no concatenation) has first and second
    derivatives in x and in the matrices equal to finite differences, with a system of
    no rows among them (forces' training differentiates the edge vectors twice)."""
    from xnn.data.graph import _SegmentProduct

    gen = torch.Generator().manual_seed(2)
    counts = [4, 0, 3, 5]
    x = torch.randn(12, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    mats = torch.randn(4, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    fn = lambda a, m: _SegmentProduct.apply(a, m, counts)  # noqa: E731
    idx = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    torch.testing.assert_close(fn(x, mats), (x.unsqueeze(-1) * mats[idx]).sum(-2),
                               rtol=1e-14, atol=1e-14)
    assert torch.autograd.gradcheck(fn, (x, mats))
    assert torch.autograd.gradgradcheck(fn, (x, mats))


def test_rowvec_matmul_keeps_the_counts_of_a_key_until_it_or_the_batch_changes():
    """With ``key`` (the edge index) the rows' system counts are read once per key; an
    in-place change of the key or another batch counts again, so the result is never one
    of stale counts."""
    import xnn.data.graph as graph_module
    from xnn.data.graph import rowvec_matmul

    gen = torch.Generator().manual_seed(1)
    mats = torch.randn(3, 3, 3, dtype=torch.float64, generator=gen)
    batch = torch.tensor([0] * 4 + [1] * 3 + [2] * 5)
    ei = torch.stack([torch.arange(12), torch.arange(12)])  # receivers sorted by system
    x = torch.randn(12, 3, dtype=torch.float64, generator=gen)

    def ref(rows, b):
        return (x.unsqueeze(-1) * mats[b[rows]]).sum(-2)

    for _ in range(3):
        torch.testing.assert_close(rowvec_matmul(x, mats, batch, ei[1], key=ei),
                                   ref(ei[1], batch), rtol=1e-14, atol=1e-15)
    assert graph_module._SEGMENTS[ei][4] == [4, 3, 5]
    ei[1] = torch.tensor([0, 1, 2, 3, 0, 1, 2, 4, 5, 7, 8, 9])  # in place: counted again
    torch.testing.assert_close(rowvec_matmul(x, mats, batch, ei[1], key=ei),
                               ref(ei[1], batch), rtol=1e-14, atol=1e-15)
    assert graph_module._SEGMENTS[ei][4] == [7, 2, 3]
    other = torch.tensor([0] * 2 + [1] * 8 + [2] * 2)  # another batch: counted again
    ei[1] = torch.arange(12)
    torch.testing.assert_close(rowvec_matmul(x, mats, other, ei[1], key=ei),
                               ref(ei[1], other), rtol=1e-14, atol=1e-15)
    assert graph_module._SEGMENTS[ei][4] == [2, 8, 2]


# ----------------------------------------------------------------------------- no overhead
@pytest.mark.skipif("vesin" not in available_backends(), reason="vesin not installed")
def test_vesin_shifts_keep_vesins_int32():
    """vesin's shifts come back in its own int32 (no widening copy: 12 B per edge, as in
    vesin's output) and give the same edge vectors as ASE's int64 shifts."""
    atoms = ZOO["unwrapped_far"]
    pos, cell = torch.tensor(atoms.positions), torch.tensor(atoms.cell.array)
    ei, sh = neighbor_list(pos, cell, torch.tensor(atoms.pbc), CUTOFF, backend="vesin")
    assert sh.dtype == torch.int32 and ei.dtype == torch.long and ei.is_contiguous()
    assert _as_set(ei, sh) == _reference(atoms, CUTOFF)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, True)
    vec = g.replace(edge_index=ei, shifts=sh).edge_vectors()
    ref = pos[ei[0]] - pos[ei[1]] + sh.long().double() @ cell
    assert torch.equal(vec, ref)


def test_spectral_norm_3x3_equals_svd():
    from xnn.neighbors.common import spectral_norm_3x3

    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-9, 1, 500, dtype=torch.float64)[:, None, None]
    m = torch.randn(500, 3, 3, dtype=torch.float64, generator=gen) * scale
    eye = torch.eye(3, dtype=torch.float64)
    m = torch.cat([m, torch.stack([eye * 0, eye * 0.01, torch.diag(torch.tensor(
        [0.01, 0.01, -0.02], dtype=torch.float64))])])  # repeated singular values
    ref = torch.linalg.matrix_norm(m, ord=2)
    torch.testing.assert_close(spectral_norm_3x3(m), ref, rtol=1e-12, atol=1e-300)


def _host_reads(fn) -> list[str]:
    """The ops of ``fn()`` that read a tensor's value to the host (host syncs on CUDA) or
    call LAPACK (which checks its errors on the host). (On the CPU the Verlet list compares
    cells with ``torch.equal``, a host read by design there: not recorded.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = str(func).split(".")[1]
            lapack = op.startswith(("linalg_", "_linalg_")) and op not in (
                "linalg_vector_norm", "linalg_cross")
            if op == "_local_scalar_dense" or lapack:
                seen.append(op)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def test_verlet_rebuild_check_reads_nothing_to_the_host(monkeypatch):
    """Under cell deformation and atom motion the check builds its flag from device ops only:
    no value read to the host, no LAPACK call (both host-sync on CUDA). The decision still
    equals a fresh comparison: reuse only while every pair < cutoff is in the list."""
    import xnn.data.graph as graph_module

    # rowvec_matmul's per-system products read the batch on the CPU only (as on CUDA: off)
    monkeypatch.setattr(graph_module, "_cpu_segments", lambda *a: None)
    rng = np.random.default_rng(5)
    cutoff, skin = 3.0, 0.8
    single = _fcc_graph(rng)
    slab = _fcc_graph(rng).replace(pbc=torch.tensor([[True, True, False]]))
    reused = 0
    for graph in (single, AtomicGraph.concat([single, slab])):
        nl = VerletList(cutoff, skin, "torch")
        nl(graph)
        for k in range(6):
            deform = torch.eye(3, dtype=torch.float64) + torch.tensor(
                rng.normal(scale=0.02 * (k + 1), size=(3, 3)))
            g = graph.replace(positions=graph.positions @ deform, cell=graph.cell @ deform)
            assert _host_reads(lambda nl=nl, g=g: nl.rebuild_flag(g)) == []
            flag = nl.rebuild_flag(g)
            assert isinstance(flag, torch.Tensor)
            if not bool(flag):
                reused += 1
                out = nl(g)
                ei, sh = neighbor_list(g.positions, g.cell, g.pbc, cutoff, g.batch, "brute")
                assert _short_edges(out, cutoff) == _as_set(ei, sh)
    assert 0 < reused < 12  # both decisions were taken


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n_cells", [3, 10])
def test_cuda_auto_list_equals_torch_reference(n_cells):
    """One system on CUDA (auto: vesin-torch where installed): the same (j, i, shift) set as
    the pure-torch cell list, tensors on the device, one host sync of xnn's own."""
    import warnings

    from ase.build import bulk

    import xnn.neighbors.vesin_backend as vb

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n_cells,) * 3)
    rng = np.random.default_rng(n_cells)
    atoms.positions += rng.normal(scale=0.05, size=atoms.positions.shape)
    atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.normal(scale=0.02, size=(3, 3))),
                   scale_atoms=True)  # triclinic
    atoms.positions += rng.integers(-2, 3, (len(atoms), 3)) @ atoms.cell.array  # unwrapped
    args = [torch.tensor(x, device="cuda") for x in (atoms.positions, atoms.cell.array,
                                                      atoms.pbc)]
    real = vb._calculator

    class Quiet:  # vesin's own count read is vesin's sync, not ours
        def __init__(self, nl):
            self.nl = nl

        def compute(self, *a, **k):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return self.nl.compute(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode(mode)

    vb._calculator = lambda *a: Quiet(real(*a))
    try:
        neighbor_list(*args, 5.0)  # warm-up: cached NeighborList, CUDA context
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                ei, sh = neighbor_list(*args, 5.0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    finally:
        vb._calculator = real
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    assert ei.is_cuda and sh.is_cuda and ei.dtype == torch.long
    if vb.vesin_torch_available():
        assert sh.dtype == torch.int32
    ref = neighbor_list(*args, 5.0, backend="torch")
    assert _as_set(ei.cpu(), sh.cpu()) == _as_set(ref[0].cpu(), ref[1].cpu())
    assert ei.shape[1] > 40 * len(atoms)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verlet_rebuild_check_does_not_sync():
    """The rebuild check of a CUDA Verlet list (moved atoms, deformed cell, a batch with a
    slab) raises no synchronizing-operation error; its decision equals the CPU list's."""
    rng = np.random.default_rng(9)
    single = _fcc_graph(rng)
    slab = _fcc_graph(rng).replace(pbc=torch.tensor([[True, True, False]]))
    for graph in (single, AtomicGraph.concat([single, slab])):
        lists = {d: VerletList(3.0, 0.8, "auto") for d in ("cpu", "cuda")}
        graphs = {"cpu": graph, "cuda": graph.to("cuda")}
        for d in lists:
            lists[d](graphs[d])
        for k in range(5):
            deform = torch.eye(3, dtype=torch.float64) + torch.tensor(
                rng.normal(scale=0.004 * (k + 1), size=(3, 3)))
            step = torch.tensor(rng.normal(scale=0.05 * k, size=graph.positions.shape))
            flags = {}
            for d, g in graphs.items():
                moved = g.replace(positions=g.positions @ deform.to(d) + step.to(d),
                                  cell=g.cell @ deform.to(d), numbers=g.numbers.clone())
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    flags[d] = lists[d].rebuild_flag(moved)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            assert isinstance(flags["cuda"], torch.Tensor) and flags["cuda"].is_cuda
            assert bool(flags["cuda"]) == bool(flags["cpu"])
