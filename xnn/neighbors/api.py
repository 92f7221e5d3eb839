"""One entry point for neighbor lists, whatever the backend, and a Verlet list with a skin."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph, complete_cell, rowvec_matmul
from xnn.errors import InputError
from xnn.neighbors.brute import brute_neighbor_list
from xnn.neighbors.common import checked, spectral_norm_3x3
from xnn.neighbors.torch_cells import torch_neighbor_list
from xnn.neighbors.vesin_backend import (
    one_system,
    vesin_available,
    vesin_neighbor_list,
    vesin_torch_available,
)

Backend = Callable[[Tensor, Tensor, Tensor, float, Tensor], tuple[Tensor, Tensor]]

_BACKENDS: dict[str, Backend] = {}
_TAKES_UNWRAPPED: set[str] = set()


def register_backend(name: str, fn: Backend, takes_unwrapped: bool = False) -> None:
    """Add a backend ``fn(positions, cell, pbc, cutoff, batch) -> (edge_index, shifts)``.

    Backends receive a cell whose zero (non-periodic) vectors are completed and positions
    wrapped into the cell along periodic axes (unless ``takes_unwrapped``: then positions
    are passed as given, and the backend's shifts must account for it, saving the wrap and
    the shift fix-up). They must return every pair with
    ``|pos[j] - pos[i] + shift @ cell| < cutoff`` in both directions, excluding self-pairs
    with zero shift.
    """
    _BACKENDS[name] = fn
    if takes_unwrapped:
        _TAKES_UNWRAPPED.add(name)
    else:
        _TAKES_UNWRAPPED.discard(name)


register_backend("brute", brute_neighbor_list)
register_backend("torch", torch_neighbor_list)
if vesin_available() or vesin_torch_available():
    register_backend("vesin", vesin_neighbor_list, takes_unwrapped=True)


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


#: up to this many systems, vesin's per-system loop beats the batched torch cell list on CUDA
VESIN_CUDA_MAX_SYSTEMS = 4


def _auto_backend(device: torch.device, n_systems: int) -> str:
    """The fastest correct backend for ``device`` (see ``benchmarks/neighbors.py``).

    CPU: vesin (compiled, multithreaded; several times faster than the torch cell list), else
    torch. CUDA: vesin-torch for a few systems (benchmarks/results/README.md, Neighbor lists);
    the torch cell list, vectorised over the whole
    batch, for batches of many systems (vesin loops over systems) or without vesin-torch.
    """
    if "vesin" in _BACKENDS:
        if device.type == "cpu":
            return "vesin"
        if device.type == "cuda" and n_systems <= VESIN_CUDA_MAX_SYSTEMS:
            if vesin_torch_available():
                return "vesin"
    return "torch" if "torch" in _BACKENDS else "brute"


def neighbor_list(
    positions: Tensor,
    cell: Tensor,
    pbc: Tensor,
    cutoff: float,
    batch: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Full (both directions) neighbor list, batched over systems.

    Args:
        positions: ``[n_atoms, 3]`` Å; need not be wrapped into the cell.
        cell: ``[n_systems, 3, 3]`` (or ``[3, 3]``); rows are lattice vectors.
        pbc: ``[n_systems, 3]`` (or ``[3]``) periodic axes.
        cutoff: Å, > 0. Pairs with distance strictly below it are returned.
        batch: ``[n_atoms]`` non-decreasing system index (may be omitted for one system).
        backend: ``"auto"``, ``"brute"``, ``"torch"`` or ``"vesin"``.
    Returns:
        ``edge_index [2, E]`` long (row 0 sender j, row 1 receiver i) and integer image
        ``shifts [E, 3]``, with ``r_ij = pos[j] - pos[i] + shifts @ cell[batch[i]]``: int32
        from vesin (its own dtype, returned without a widening copy), int64 from the torch
        and brute backends. Convert with ``shifts.to(positions.dtype)`` before use.
    """
    return _build(positions, cell, pbc, cutoff, batch, backend)[:2]


def _build(positions: Tensor, cell: Tensor, pbc: Tensor, cutoff: float, batch: Tensor | None,
           backend: str) -> tuple[Tensor, Tensor, bool]:
    """:func:`neighbor_list` and whether the cell has zero (completed) vectors."""
    positions, cell, pbc, batch, has_zero, views = checked(positions, cell, pbc, cutoff, batch)
    name = _auto_backend(positions.device, cell.shape[0]) if backend == "auto" else backend
    fn = _BACKENDS.get(name)
    if fn is None:
        choices = ["auto", *available_backends()]
        raise InputError(f"unknown neighbor-list backend {backend!r}; choose one of {choices}")
    pos = positions.detach() if positions.requires_grad else positions
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() without its context object (µs)
    try:
        if fn is vesin_neighbor_list and views is not None and not has_zero:
            # one system: vesin with the remembered [3, 3] cell and [3] pbc views
            edge_index, shifts = one_system(pos, views[0], views[1], float(cutoff))
            return edge_index, shifts, has_zero
        if batch is None and not (fn is vesin_neighbor_list and cell.shape[0] == 1):
            batch = torch.zeros(positions.shape[0], dtype=torch.long, device=positions.device)
        full = complete_cell(cell) if has_zero else cell
        n_wrap = None
        if name not in _TAKES_UNWRAPPED and bool(pbc.any()):
            # whole lattice vectors that bring each atom into the cell along periodic axes
            frac = rowvec_matmul(pos, torch.linalg.inv(full), batch)
            n = torch.where(pbc[batch], torch.floor(frac), torch.zeros_like(frac))
            if bool(n.any()):
                n_wrap = n.to(torch.long)
                pos = pos - rowvec_matmul(n, full, batch)
        edge_index, shifts = fn(pos, full, pbc, float(cutoff), batch)
        if n_wrap is not None and edge_index.shape[1] > 0:
            # pos_w = pos - n @ cell, so
            # r = pos_w[j] - pos_w[i] + s_w @ cell = pos[j] - pos[i] + (s_w - n_j + n_i) @ cell
            shifts = shifts - n_wrap.index_select(0, edge_index[0])
            shifts = shifts + n_wrap.index_select(0, edge_index[1])
    finally:
        torch._C._set_grad_enabled(grad)
    return edge_index, shifts, has_zero


def with_edges(graph: AtomicGraph, cutoff: float, backend: str = "auto") -> AtomicGraph:
    """Attach ``edge_index`` and ``shifts`` for ``cutoff`` to a graph."""
    ei, sh = neighbor_list(graph.positions, graph.cell, graph.pbc, cutoff, graph.batch, backend)
    return graph.replace({K.EDGE_INDEX: ei, K.SHIFTS: sh})


class VerletList:
    """A neighbor list for ``cutoff + skin`` reused until an atom moved more than ``skin / 2``.

    The list is rebuilt automatically when it may have become incomplete, or when the atoms
    (count, species, ids, pbc) changed. Under a cell change (NPT, cell relaxation) the list
    stays valid while ``(cutoff + skin) * |F - 1| + 2 d < skin`` in every system, where
    ``F = inv(cell_0) @ cell`` is the deformation since the build (spectral norm) and ``d``
    the largest displacement from the affinely deformed reference positions: a pair at
    ``>= cutoff + skin`` at the build is then still beyond ``cutoff``. With a fixed cell this
    is the usual "an atom moved more than skin / 2".
    Edges longer than ``cutoff`` remain in the list: models must give them zero weight
    (every xnn model masks or smoothly cuts off at its cutoff).
    """

    def __init__(self, cutoff: float, skin: float = 0.0, backend: str = "auto"):
        if cutoff <= 0:
            raise InputError(f"cutoff must be > 0, got {cutoff}")
        if skin < 0:
            raise InputError(f"skin must be >= 0, got {skin}")
        self.cutoff = float(cutoff)
        self.skin = float(skin)
        self.backend = backend
        self.n_builds = 0
        self._ref_positions: Tensor | None = None
        self._ref_cell: Tensor | None = None
        self._ref_frame: tuple[Tensor, Tensor, Tensor] | None = None
        self._ref_ids: Tensor | None = None
        self._ref_pbc: Tensor | None = None
        self._ref_numbers: Tensor | None = None
        self._edges: tuple[Tensor, Tensor] | None = None
        self._sources: dict[str, tuple[Tensor, int]] = {}

    def reset(self) -> None:
        self._edges = None

    def needs_rebuild(self, graph: AtomicGraph) -> bool:
        """True when the list must be rebuilt for ``graph`` (one host sync at most: the read
        of :meth:`rebuild_flag`, which itself does not sync)."""
        flag = self.rebuild_flag(graph)
        return flag if isinstance(flag, bool) else bool(flag)

    def rebuild_flag(self, graph: AtomicGraph) -> bool | Tensor:
        """Whether to rebuild, as a Python bool when known without reading the device, else
        a 0-d bool tensor on the device (every data check folded into it, no sync)."""
        if self._edges is None or self._ref_positions is None:
            return True
        if graph.positions.shape != self._ref_positions.shape:
            return True
        if graph.positions.device != self._ref_positions.device:
            return True
        flags = []
        for name, ref in (("atom_id", self._ref_ids), ("pbc", self._ref_pbc),
                          ("numbers", self._ref_numbers)):
            cur = getattr(graph, name)
            src, version = self._sources.get(name, (None, -1))  # none after a restore
            if cur is src and cur._version == version:
                continue  # the very tensor of the build, not modified in place since
            if cur.shape != ref.shape:
                return True
            flags.append((cur != ref).any())
        cell = graph.cell.detach()
        pos = graph.positions.detach()
        if cell.shape != self._ref_cell.shape:
            return True
        src, version = self._sources.get("cell", (None, -1))
        if graph.cell is src and graph.cell._version == version:
            cell_moved: bool | Tensor = False  # the build's own cell tensor, untouched
        elif cell.device.type == "cpu":
            cell_moved = not torch.equal(cell, self._ref_cell)  # no device to wait for
        else:
            cell_moved = (cell != self._ref_cell).any()
        if self.skin == 0.0:
            flags += [cell_moved, (pos != self._ref_positions).any()]
        elif graph.n_atoms == 0:
            flags.append(cell_moved)
        else:
            flags.append(self._beyond_skin(graph, cell, cell_moved))
        flags = [f for f in flags if f is not False]
        if any(f is True for f in flags):
            return True
        if not flags:
            return False
        return torch.stack(flags).any() if len(flags) > 1 else flags[0]

    def _beyond_skin(self, graph: AtomicGraph, cell: Tensor, cell_moved: bool | Tensor) -> Tensor:
        """0-d bool: some atom may have come within ``cutoff`` of a pair not in the list."""
        ref = self._ref_positions
        pos = graph.positions.detach()
        fixed = (pos - ref).norm(dim=-1).max() > 0.5 * self.skin
        if cell_moved is False:
            return fixed
        if cell_moved is True:
            cell_moved = torch.ones((), dtype=torch.bool, device=pos.device)
        # no host sync (no LAPACK, no completion by data): zero vectors of the build's cell
        # keep the build's completion; a change of which vectors are zero forces a rebuild
        ref_full, ref_inv, ref_zero = self._ref_frame
        zero = cell.norm(dim=-1) < 1e-12
        full = torch.where(ref_zero.unsqueeze(-1), ref_full, cell)
        deform = ref_inv @ full  # F = inv(C0) @ C1
        eye = torch.eye(3, dtype=deform.dtype, device=deform.device)
        strain = spectral_norm_3x3(deform - eye)  # [n_systems]
        affine = rowvec_matmul(ref, deform, graph.batch)
        disp = (pos - affine).norm(dim=-1)
        d_max = torch.zeros_like(strain).scatter_reduce(
            0, graph.batch, disp, reduce="amax", include_self=True
        )
        budget = (self.cutoff + self.skin) * strain + 2.0 * d_max
        # not (budget < skin): a NaN budget (a cell singular along an open axis) rebuilds
        moved_out = (~(budget < self.skin)).any() | (zero != ref_zero).any()
        return torch.where(cell_moved, moved_out, fixed)

    def reorder(self, order: Tensor) -> tuple[Tensor, Tensor]:
        """Keep the current list's edges in the order ``order`` (a permutation of them; the
        rebuild bookkeeping is unchanged) and return them as ``(edge_index, shifts)``."""
        if self._edges is None:
            raise RuntimeError("no neighbor list has been built yet")
        ei, sh = self._edges
        self._edges = (ei[:, order], sh[order])
        return self._edges

    def __call__(self, graph: AtomicGraph) -> AtomicGraph:
        """Return ``graph`` with ``edge_index`` and ``shifts`` attached (rebuilding if needed)."""
        if self.needs_rebuild(graph):
            ei, sh, has_zero = _build(graph.positions, graph.cell, graph.pbc,
                                      self.cutoff + self.skin, graph.batch, self.backend)
            self._edges = (ei, sh)
            self._ref_positions = graph.positions.detach().clone()
            self._ref_cell = graph.cell.detach().clone()
            # for the deformation check; no host sync without zero vectors (singular cells
            # were refused by the build)
            full = complete_cell(self._ref_cell) if has_zero else self._ref_cell
            self._ref_frame = (full, torch.linalg.inv_ex(full, check_errors=False)[0],
                               self._ref_cell.norm(dim=-1) < 1e-12)
            self._ref_ids = graph.atom_id.clone()
            self._ref_pbc = graph.pbc.clone()
            self._ref_numbers = graph.numbers.clone()
            self._sources = {k: (getattr(graph, k), getattr(graph, k)._version)
                             for k in ("atom_id", "pbc", "numbers", "cell")}
            self.n_builds += 1
        ei, sh = self._edges
        return graph.replace({K.EDGE_INDEX: ei, K.SHIFTS: sh})
