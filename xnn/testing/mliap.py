"""LAMMPS's ML-IAP unified interface emulated on several ranks, without LAMMPS.

:func:`emulate_ranks` splits a system as LAMMPS's spatial decomposition would (slabs of
fractional coordinate along the first periodic axis, of x for a cluster): each emulated rank
holds its owned atoms, then ghost atoms (every periodic image, of any rank's atom, within
``ghost_width`` of one of its owned atoms, at explicit positions), the map of every ghost to
its owner (rank and row), and the pair list LAMMPS's ML-IAP gives: ``pair_i`` a receiver
(owned; also ghosts within ``receiver_width`` of an owned atom, for a deeper pair list than
LAMMPS's own), ``pair_j`` every local atom closer than ``cutoff``, ``rij = x_j - x_i``.
With ``listed`` only some atoms are in the list (``pair_style hybrid/overlay`` with
``pair_coeff * * mliap Cu NULL``): the listed owned atoms are the i-atoms
(``iatoms[:nlistatoms]``, not all ``nlocal``), pairs join listed atoms only, and the others'
``elems`` are ``-1``.

:class:`FakeMLIAPData` is one rank's ``data`` object (the attributes and calls of LAMMPS's
Kokkos ``MLIAPDataPy`` the unified model uses); its ``forward_exchange`` /
``reverse_exchange`` copy owner rows to ghost rows and sum ghost rows back into their owners
*across* the emulated ranks, which :func:`run_ranks` drives in lock-step (one thread per
rank, each with its own copy of the unified object, meeting at barriers in every exchange,
as LAMMPS's MPI ranks meet in theirs). :func:`assemble` then does what LAMMPS does with the
results: ``f[i] += fij``, ``f[j] -= fij``, ghost forces summed into their owners, the
virial ``-Σ rij ⊗ fij``. :func:`check_mliap` compares it all with one process.
"""

from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph

BARRIER_TIMEOUT_S = 120.0


@dataclass
class EmulatedRank:
    """One emulated LAMMPS rank (rows ``[owned | ghosts]``).

    Attributes:
        global_index: ``[ntotal]`` row in the whole system of the atom each row is an image of.
        positions: ``[ntotal, 3]`` explicit positions (Å).
        owner_rank, owner_row: ``[ntotal]`` who owns each row (owned rows: this rank, itself).
        pair_i, pair_j: ``[npairs]`` receiver and neighbour rows; ``rij [npairs, 3]``.
        iatoms: ``[natomneigh]`` the list's atoms (LAMMPS's ``ilist``): listed owned rows in
            order, then listed ghost receivers; ``nlistatoms`` of them are owned.
    """

    rank: int
    nlocal: int
    global_index: np.ndarray
    positions: np.ndarray
    owner_rank: np.ndarray
    owner_row: np.ndarray
    pair_i: np.ndarray
    pair_j: np.ndarray
    rij: np.ndarray
    iatoms: np.ndarray
    nlistatoms: int

    @property
    def ntotal(self) -> int:
        return int(self.global_index.shape[0])


def _owners(graph: AtomicGraph, n_ranks: int) -> np.ndarray:
    """``[n_atoms]`` rank of each atom: slabs of the first periodic axis, else of x."""
    pos = graph.positions.detach().double().numpy()
    pbc = graph.pbc[0].numpy()
    if pbc.any():
        axis = int(np.flatnonzero(pbc)[0])
        frac = pos @ np.linalg.inv(graph.cell[0].double().numpy())
        s = frac[:, axis] - np.floor(frac[:, axis])
    else:
        x = pos[:, 0]
        s = (x - x.min()) / max(float(x.max() - x.min()), 1e-12) * (1 - 1e-12)
    return np.minimum((s * n_ranks).astype(np.int64), n_ranks - 1)


def emulate_ranks(graph: AtomicGraph, n_ranks: int, ghost_width: float, cutoff: float,
                  receiver_width: float = 0.0, listed: np.ndarray | None = None
                  ) -> list[EmulatedRank]:
    """Split one system (an ``AtomicGraph`` of one system) over ``n_ranks`` emulated ranks.

    Args:
        ghost_width: ghosts are the images within this distance (Å) of an owned atom
            (LAMMPS: the ghost cutoff; one model cutoff for the ``sync`` mode).
        cutoff: pair cutoff (Å): LAMMPS's ``2 * rcutfac``.
        receiver_width: ghosts within this distance of an owned atom are receivers too
            (0: owned receivers only, as LAMMPS's ML-IAP list).
        listed: ``[n_atoms]`` bool, the atoms in the pair style's list (default all).
    """
    from xnn.neighbors import with_edges

    owner = _owners(graph, n_ranks)
    listed = np.ones(graph.n_atoms, dtype=bool) if listed is None else np.asarray(listed)
    g = with_edges(graph, ghost_width, backend="brute")
    pos = graph.positions.detach().double().numpy()
    cell = graph.cell[0].detach().double().numpy()
    snd, rcv = g.edge_index[0].numpy(), g.edge_index[1].numpy()
    shifts = np.rint(g.shifts.detach().double().numpy()).astype(np.int64)
    dist = np.linalg.norm(g.edge_vectors().detach().double().numpy(), axis=-1)
    owned_rows = [np.flatnonzero(owner == r) for r in range(n_ranks)]
    row_of = np.zeros(len(pos), dtype=np.int64)
    for rows in owned_rows:
        row_of[rows] = np.arange(len(rows))
    ranks = []
    for r in range(n_ranks):
        ranks.append(_one_rank(r, owned_rows[r], owner, row_of, pos, cell, snd, rcv, shifts,
                               dist, cutoff, receiver_width, listed))
    return ranks


def _one_rank(r, owned, owner, row_of, pos, cell, snd, rcv, shifts, dist, cutoff,
              receiver_width, listed) -> EmulatedRank:
    mine = owner[rcv] == r
    images: dict[tuple, float] = {}
    for j, s, d in zip(snd[mine], shifts[mine], dist[mine]):
        key = (int(j), *map(int, s))
        if owner[j] == r and not s.any():
            continue  # an owned atom itself
        images[key] = min(d, images.get(key, np.inf))
    keys = sorted(images)
    ghost_j = np.array([k[0] for k in keys], dtype=np.int64)
    ghost_s = np.array([k[1:] for k in keys], dtype=np.float64).reshape(-1, 3)
    gidx = np.concatenate([owned, ghost_j])
    x = np.concatenate([pos[owned], pos[ghost_j] + ghost_s @ cell])
    near = np.array([images[k] < receiver_width for k in keys], dtype=bool).reshape(-1)
    on = listed[gidx]
    own_listed = np.flatnonzero(on[: len(owned)])
    receivers = np.concatenate([own_listed, len(owned) + np.flatnonzero(
        near & on[len(owned):])]).astype(np.int64)
    vec = x[None, :, :] - x[receivers][:, None, :]  # [n_receivers, ntotal, 3] x_j - x_i
    within = (np.linalg.norm(vec, axis=-1) < cutoff) & on[None, :]
    within[np.arange(len(receivers)), receivers] = False
    a, b = np.nonzero(within)
    return EmulatedRank(
        rank=r, nlocal=len(owned), global_index=gidx, positions=x,
        owner_rank=owner[gidx], owner_row=row_of[gidx],
        pair_i=receivers[a].astype(np.int32), pair_j=b.astype(np.int32), rij=vec[a, b],
        iatoms=receivers.astype(np.int32), nlistatoms=len(own_listed))


class _World:
    """What the emulated ranks share: every rank's layout, a barrier and one slot per rank."""

    def __init__(self, parts: list[EmulatedRank]):
        self.parts = parts
        self.barrier = threading.Barrier(len(parts), timeout=BARRIER_TIMEOUT_S)
        self.slots: list[Tensor | None] = [None] * len(parts)


@dataclass
class FakeMLIAPData:
    """One emulated rank's ML-IAP ``data`` (LAMMPS's Kokkos ``MLIAPDataPy`` subset)."""

    part: EmulatedRank
    elems: np.ndarray
    world: _World
    eatoms: np.ndarray = field(init=False)
    energy: float = 0.0
    pair_forces: np.ndarray | None = None
    exchanges: int = 0

    def __post_init__(self):
        self.eatoms = np.zeros(self.part.nlistatoms)

    @property
    def nlocal(self) -> int:
        return self.part.nlocal

    @property
    def nlistatoms(self) -> int:
        return self.part.nlistatoms

    @property
    def iatoms(self) -> np.ndarray:
        return self.part.iatoms

    @property
    def ielems(self) -> np.ndarray:
        return self.elems[self.part.iatoms]

    @property
    def ntotal(self) -> int:
        return self.part.ntotal

    @property
    def npairs(self) -> int:
        return int(self.part.pair_i.shape[0])

    @property
    def rij(self) -> np.ndarray:
        return self.part.rij

    @property
    def pair_i(self) -> np.ndarray:
        return self.part.pair_i

    @property
    def pair_j(self) -> np.ndarray:
        return self.part.pair_j

    def update_pair_forces_gpu(self, fij: Tensor) -> None:
        assert fij.dtype == torch.float64 and fij.is_contiguous()
        assert tuple(fij.shape) == (self.npairs, 3)
        self.pair_forces = fij.detach().cpu().numpy().copy()

    def _peers(self):
        """``(q, rows of q whose owner is this rank, their owner rows)`` for every rank."""
        me = self.part.rank
        for q, other in enumerate(self.world.parts):
            rows = np.flatnonzero((other.owner_rank == me) & (np.arange(other.ntotal)
                                                               >= other.nlocal))
            yield q, torch.as_tensor(rows), torch.as_tensor(other.owner_row[rows])

    def forward_exchange(self, src: Tensor, dst: Tensor, vec_len: int) -> None:
        """Every ghost row of ``dst`` takes its owner's row of ``src`` (on its owner's rank);
        owned rows are copied."""
        assert src.is_contiguous() and src.shape == (self.ntotal, vec_len)
        self.exchanges += 1
        p, w = self.part, self.world
        w.slots[p.rank] = src
        w.barrier.wait()
        dst.copy_(src)
        for q in range(len(w.slots)):
            rows = np.flatnonzero((p.owner_rank == q) & (np.arange(p.ntotal) >= p.nlocal))
            if len(rows):
                idx = torch.as_tensor(rows)
                dst[idx] = w.slots[q][torch.as_tensor(p.owner_row[rows])]
        w.barrier.wait()

    def reverse_exchange(self, src: Tensor, dst: Tensor, vec_len: int) -> None:
        """Every ghost row of ``src`` (on any rank) is added to its owner's row of ``dst``;
        ghost rows of ``dst`` keep ``src``'s rows (what LAMMPS leaves there is not specified:
        the unified object must not read them)."""
        assert src.is_contiguous() and src.shape == (self.ntotal, vec_len)
        self.exchanges += 1
        p, w = self.part, self.world
        w.slots[p.rank] = src
        w.barrier.wait()
        dst.copy_(src)
        for q, rows, owner_rows in self._peers():
            if len(rows):
                dst.index_add_(0, owner_rows, w.slots[q][rows])
        w.barrier.wait()


def fake_data(parts: list[EmulatedRank], numbers: np.ndarray,
              elements: list[str], null_numbers: tuple[int, ...] = ()
              ) -> list[FakeMLIAPData]:
    """The ``data`` objects of ``parts``; ``numbers [n_atoms]`` atomic numbers of the
    system, ``elements`` the LAMMPS type names (``elems`` indexes them; ``-1`` for the
    elements ``null_numbers``, whose types are mapped to NULL)."""
    from ase.data import atomic_numbers

    index = {atomic_numbers[e]: k for k, e in enumerate(elements)}
    index.update({int(z): -1 for z in null_numbers})
    world = _World(parts)
    return [FakeMLIAPData(p, np.array([index[int(z)] for z in numbers[p.global_index]],
                                      dtype=np.int32), world) for p in parts]


def run_ranks(unified, datas: list[FakeMLIAPData]) -> None:
    """``compute_forces`` of a copy of ``unified`` on every emulated rank, in lock-step (one
    thread per rank); the first error of any rank is raised."""
    errors: list[BaseException] = []
    copies = [copy.deepcopy(unified) for _ in datas]  # one process each (copying is serial:
    # torch.fx, which e3nn modules hold, copies thread-unsafely)

    def one(rank_copy, data):
        try:
            rank_copy.compute_forces(data)
        except BaseException as err:  # noqa: BLE001 - reraised below
            errors.append(err)
            data.world.barrier.abort()

    threads = [threading.Thread(target=one, args=(c, d)) for c, d in zip(copies, datas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


#: LAMMPS's per-atom virial components (xx yy zz xy xz yz) in a 3x3 tensor
VOIGT = ((0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2))


def assemble(datas: list[FakeMLIAPData], n_atoms: int) -> dict[str, Tensor]:
    """What LAMMPS makes of the ranks' results, by atom of the whole system: ``energy``,
    ``energies [n_atoms]``, ``forces [n_atoms, 3]`` (``f[i] += fij``, ``f[j] -= fij``, ghost
    forces to owners), ``virial [3, 3]`` (``-Σ rij ⊗ fij``, LAMMPS's ``v_tally``) and
    ``virials [n_atoms, 6]`` (``compute stress/atom``'s virials, xx yy zz xy xz yz: each
    pair's ``-rij ⊗ fij`` half to ``i``, half to ``j`` as ``v_tally`` tallies them, ghost
    rows to their owners)."""
    energies = np.zeros(n_atoms)
    forces = np.zeros((n_atoms, 3))
    virial = np.zeros((3, 3))
    virials = np.zeros((n_atoms, 6))
    for d in datas:
        p = d.part  # LAMMPS's e_tally: eatom[iatoms[ii]] = eatoms[ii]
        energies[p.global_index[p.iatoms[: p.nlistatoms]]] = d.eatoms
        f = np.zeros((p.ntotal, 3))
        np.add.at(f, p.pair_i, d.pair_forces)
        np.add.at(f, p.pair_j, -d.pair_forces)
        np.add.at(forces, p.global_index, f)
        virial -= p.rij.T @ d.pair_forces
        v = np.stack([-p.rij[:, a] * d.pair_forces[:, b] for a, b in VOIGT], axis=1)
        w = np.zeros((p.ntotal, 6))
        np.add.at(w, p.pair_i, 0.5 * v)
        np.add.at(w, p.pair_j, 0.5 * v)
        np.add.at(virials, p.global_index, w)
    return {"energy": torch.tensor(sum(d.energy for d in datas), dtype=torch.float64),
            "energies": torch.as_tensor(energies), "forces": torch.as_tensor(forces),
            "virial": torch.as_tensor(virial), "virials": torch.as_tensor(virials)}


def check_mliap(unified, graph: AtomicGraph, n_ranks: int, tol: float = 1e-10,
                null_numbers: tuple[int, ...] = ()) -> dict[str, float]:
    """Assert that ``unified`` (an :class:`xnn.interop.mliap.XnnMLIAPUnified`) on
    ``n_ranks`` emulated LAMMPS ranks gives the one-process energy, per-atom energies, forces,
    virial and per-atom virials (LAMMPS's ``compute stress/atom`` from the pair forces
    against ``compute_properties(..., peratom_virial=True)``, the ``fix external`` route's)
    of its model (in float64) on ``graph`` (one fp64 system) to ``tol`` relative; returns
    the errors.

    The ranks hold the ghosts ``unified`` asks for (``ghost_cutoff``), every ghost a
    receiver too when it needs ghost neighbours (``ghost_neighbors``; those at the shell's
    edge miss some neighbours, as under LAMMPS).

    ``null_numbers``: elements whose LAMMPS types are mapped to NULL (``pair_style
    hybrid/overlay`` with ``pair_coeff * * mliap Cu NULL``): their atoms are not in the list
    and in no pair, and the one-process reference is the model on the other atoms alone
    (the NULL atoms' energies and forces from this style are zero).
    """
    from xnn.models.derivatives import compute_properties
    from xnn.neighbors import with_edges

    cutoff = 2.0 * float(unified.rcutfac)
    width = float(unified.ghost_cutoff)
    receivers = math.inf if unified.ghost_neighbors else 0.0  # LAMMPS: every ghost, or none
    listed = ~np.isin(graph.numbers.numpy(), list(null_numbers))
    parts = emulate_ranks(graph, n_ranks, width, cutoff, receivers, listed)
    datas = fake_data(parts, graph.numbers.numpy(), list(unified.element_types), null_numbers)
    run_ranks(unified, datas)
    got = assemble(datas, graph.n_atoms)
    reference = copy.deepcopy(unified.model).to(torch.float64)  # fp32 files: against fp64
    keep = torch.as_tensor(np.flatnonzero(listed))
    sub = graph if keep.numel() == graph.n_atoms else AtomicGraph.from_arrays(
        graph.positions[keep], graph.numbers[keep], graph.cell[0], graph.pbc[0],
        dtype=torch.float64)
    part = compute_properties(reference, with_edges(sub, cutoff, backend="brute"),
                              peratom_virial=True)
    per = torch.stack([part["virials"][:, a, b] for a, b in VOIGT], dim=1)
    ref = {"energy": part["energy"], "virial": part["virial"],
           "virials": per.new_zeros(graph.n_atoms, 6).index_copy(0, keep, per),
           "energies": part["energies"].new_zeros(graph.n_atoms).index_copy(
               0, keep, part["energies"]),
           "forces": part["forces"].new_zeros(graph.n_atoms, 3).index_copy(
               0, keep, part["forces"])}
    errors = {}
    for key, want in (("energy", ref["energy"][0]), ("energies", ref["energies"]),
                      ("forces", ref["forces"]), ("virial", ref["virial"][0]),
                      ("virials", ref["virials"])):
        a, b = got[key].double(), want.detach().double()
        errors[key] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"ML-IAP on {n_ranks} emulated ranks differs from one process: {bad}"
    return errors
