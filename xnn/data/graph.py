"""``AtomicGraph``: one batched state object for many atomic systems.

Fields live in a dict and are declared by scope (atom / system / edge) in :mod:`xnn.data.keys`,
so that slicing, concatenation, device/dtype moves and migration are written once, here.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from xnn.data import keys as K
from xnn.errors import InputError

_REQUIRED = (K.POSITIONS, K.NUMBERS, K.CELL, K.PBC, K.BATCH, K.MASSES, K.ATOM_ID)
_INDEX_FIELDS = (K.NUMBERS, K.BATCH, K.ATOM_ID, K.EDGE_INDEX, K.SYSTEM_ID)


def _tensor(value, dtype: torch.dtype | None, device) -> Tensor:
    """A copy of ``value`` (tensor or array-like) as a tensor; never a view of the input."""
    if isinstance(value, Tensor):
        return value.detach().to(device=device, dtype=dtype, copy=True)
    return torch.tensor(np.asarray(value), dtype=dtype, device=device)


def _masses_for(numbers: Tensor, dtype: torch.dtype) -> Tensor:
    from ase.data import atomic_masses

    table = torch.as_tensor(atomic_masses, dtype=dtype, device=numbers.device)
    return table[numbers]


class AtomicGraph:
    """A batch of atomic systems (and, once a neighbor list is attached, their edges).

    Required fields: ``positions [n_atoms, 3]`` (Å), ``numbers [n_atoms]``, ``cell
    [n_systems, 3, 3]`` (rows are lattice vectors), ``pbc [n_systems, 3]``, ``batch [n_atoms]``
    (system index, non-decreasing), ``masses [n_atoms]`` (amu), ``atom_id [n_atoms]`` (global id).
    Optional: any field declared in :data:`xnn.data.keys.FIELD_SCOPES`.

    Objects are treated as immutable: methods return new graphs sharing unchanged tensors.
    """

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[str, Tensor], validate: bool = True):
        object.__setattr__(self, "_fields", dict(fields))
        if validate:
            self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_arrays(
        cls,
        positions,
        numbers,
        cell=None,
        pbc=None,
        batch=None,
        masses=None,
        atom_id=None,
        extra: Mapping[str, object] | None = None,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
    ) -> AtomicGraph:
        """Build a graph from array-likes; missing cell/pbc/masses/ids get defaults.

        Args:
            positions: ``[n_atoms, 3]`` Å.
            numbers: ``[n_atoms]`` atomic numbers.
            cell: ``[3, 3]`` or ``[n_systems, 3, 3]``; zeros when omitted (non-periodic).
            pbc: ``[3]`` or ``[n_systems, 3]``; ``False`` when omitted.
            batch: ``[n_atoms]`` system index; all zeros when omitted.
            masses: ``[n_atoms]`` amu; standard atomic masses when omitted.
            atom_id: ``[n_atoms]`` global ids; ``arange(n_atoms)`` when omitted.
            extra: more fields by name (must be declared in ``xnn.data.keys``).
        """
        # copies: ASE updates its arrays in place, a graph must not change underneath
        pos = _tensor(positions, dtype, device)
        if pos.ndim != 2 or pos.shape[-1] != 3:
            raise InputError(f"positions must have shape [n_atoms, 3], got {tuple(pos.shape)}")
        dev = pos.device
        num = _tensor(numbers, torch.long, dev)
        n = pos.shape[0]
        if batch is None:
            b = torch.zeros(n, dtype=torch.long, device=dev)
        else:
            b = _tensor(batch, torch.long, dev)
        n_sys = int(b.max().item()) + 1 if n > 0 else 1
        if cell is None:
            c = torch.zeros(n_sys, 3, 3, dtype=dtype, device=dev)
        else:
            c = _tensor(cell, dtype, dev)
            if c.ndim == 2:
                c = c.unsqueeze(0)
        if pbc is None:
            p = torch.zeros(c.shape[0], 3, dtype=torch.bool, device=dev)
        else:
            p = _tensor(pbc, torch.bool, dev)
            if p.ndim == 0:
                p = p.expand(3)
            if p.ndim == 1:
                p = p.unsqueeze(0).expand(c.shape[0], 3).clone()
        if masses is None:
            m = _masses_for(num, dtype) if num.numel() and num.min() >= 0 else None
            if m is None:
                m = torch.ones(n, dtype=dtype, device=dev)
        else:
            m = _tensor(masses, dtype, dev)
        ids = torch.arange(n, device=dev) if atom_id is None else _tensor(atom_id, torch.long, dev)
        fields = {
            K.POSITIONS: pos,
            K.NUMBERS: num,
            K.CELL: c,
            K.PBC: p,
            K.BATCH: b,
            K.MASSES: m,
            K.ATOM_ID: ids,
        }
        for name, value in (extra or {}).items():
            K.scope_of(name)
            t = _tensor(value, None, None)
            if t.is_floating_point():
                t = t.to(dtype)
            fields[name] = t.to(dev)
        return cls(fields)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Check presence, shapes and finiteness of fields; raise ``InputError`` otherwise."""
        f = self._fields
        missing = [k for k in _REQUIRED if k not in f]
        if missing:
            raise InputError(f"AtomicGraph is missing required fields {missing}")
        n = f[K.POSITIONS].shape[0]
        s = f[K.CELL].shape[0]
        if f[K.POSITIONS].ndim != 2 or f[K.POSITIONS].shape[1] != 3:
            raise InputError(
                f"positions must have shape [n_atoms, 3], got {tuple(f[K.POSITIONS].shape)}"
            )
        if f[K.CELL].shape[1:] != (3, 3):
            raise InputError(
                f"cell must have shape [n_systems, 3, 3], got {tuple(f[K.CELL].shape)}"
            )
        if tuple(f[K.PBC].shape) != (s, 3):
            raise InputError(f"pbc must have shape [{s}, 3], got {tuple(f[K.PBC].shape)}")
        n_edges = f[K.EDGE_INDEX].shape[1] if K.EDGE_INDEX in f else None
        for name, t in f.items():
            scope = K.scope_of(name)
            if name == K.EDGE_INDEX:
                if t.ndim != 2 or t.shape[0] != 2:
                    raise InputError(
                        f"edge_index must have shape [2, n_edges], got {tuple(t.shape)}"
                    )
                continue
            expected = {K.ATOM: n, K.SYSTEM: s, K.EDGE: n_edges}[scope]
            if t.ndim == 0 or t.shape[0] != expected:
                raise InputError(
                    f"field {name!r} ({scope} scope) must have first dimension {expected}, "
                    f"got shape {tuple(t.shape)}"
                )
        if not torch.isfinite(f[K.POSITIONS]).all():
            bad = torch.nonzero(~torch.isfinite(f[K.POSITIONS]).all(-1)).flatten()[:5].tolist()
            raise InputError(f"non-finite positions (atoms {bad})")
        if not torch.isfinite(f[K.CELL]).all():
            raise InputError("non-finite cell")
        b = f[K.BATCH]
        if n > 0 and (b.min() < 0 or b.max() >= s or (b[1:] < b[:-1]).any()):
            raise InputError("batch must be non-decreasing system indices in [0, n_systems)")

    # ------------------------------------------------------------------ field access
    def __getattr__(self, name: str) -> Tensor:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(f"AtomicGraph has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("AtomicGraph is immutable; use .replace(...)")

    def __getitem__(self, name: str) -> Tensor:
        return self._fields[name]

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def get(self, name: str, default=None):
        return self._fields.get(name, default)

    @property
    def fields(self) -> dict[str, Tensor]:
        """A shallow copy of the field dict."""
        return dict(self._fields)

    def keys(self) -> Iterable[str]:
        return self._fields.keys()

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={tuple(v.shape)}" for k, v in self._fields.items())
        return f"AtomicGraph(n_systems={self.n_systems}, n_atoms={self.n_atoms}, {shapes})"

    # ------------------------------------------------------------------ sizes
    @property
    def n_atoms(self) -> int:
        return self._fields[K.POSITIONS].shape[0]

    @property
    def n_update(self) -> int:
        """How many leading atoms need updated features (``K.N_UPDATE``; default all)."""
        value = self._fields.get(K.N_UPDATE)
        return self.n_atoms if value is None else int(value.reshape(-1)[0])

    @property
    def n_systems(self) -> int:
        return self._fields[K.CELL].shape[0]

    @property
    def n_edges(self) -> int:
        ei = self._fields.get(K.EDGE_INDEX)
        return 0 if ei is None else ei.shape[1]

    @property
    def device(self) -> torch.device:
        return self._fields[K.POSITIONS].device

    @property
    def dtype(self) -> torch.dtype:
        return self._fields[K.POSITIONS].dtype

    @property
    def n_atoms_per_system(self) -> Tensor:
        """``[n_systems]`` number of atoms in each system (a fixed-size sum, not
        ``bincount``, whose length depends on the values: graph tracers need static shapes)."""
        batch = self._fields[K.BATCH]
        counts = torch.zeros(self.n_systems, dtype=batch.dtype, device=batch.device)
        return counts.index_add_(0, batch, torch.ones_like(batch))

    @property
    def ptr(self) -> Tensor:
        """``[n_systems + 1]`` offsets of each system's first atom."""
        counts = self.n_atoms_per_system
        return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])

    def volume(self) -> Tensor:
        """``[n_systems]`` |det(cell)| in Å³ (0 for non-periodic systems with a zero cell)."""
        return torch.linalg.det(self._fields[K.CELL]).abs()

    # ------------------------------------------------------------------ transformations
    def replace(self, fields: Mapping[str, Tensor | None] | None = None, **kw: Tensor | None):
        """A new graph with some fields replaced (``None`` removes a field)."""
        new = dict(self._fields)
        for k, v in {**(fields or {}), **kw}.items():
            if v is None:
                new.pop(k, None)
            else:
                K.scope_of(k)
                new[k] = v
        return AtomicGraph(new, validate=False)

    def without_edges(self) -> AtomicGraph:
        return AtomicGraph(
            {k: v for k, v in self._fields.items() if K.scope_of(k) != K.EDGE}, validate=False
        )

    def to(self, device=None, dtype: torch.dtype | None = None) -> AtomicGraph:
        """Move to a device; cast float fields to ``dtype`` (int/bool fields keep theirs)."""
        out = {}
        for k, v in self._fields.items():
            if dtype is not None and v.is_floating_point():
                v = v.to(device=device, dtype=dtype)
            elif device is not None:
                v = v.to(device=device)
            out[k] = v
        return AtomicGraph(out, validate=False)

    def clone(self) -> AtomicGraph:
        return AtomicGraph({k: v.clone() for k, v in self._fields.items()}, validate=False)

    def detach(self) -> AtomicGraph:
        return AtomicGraph({k: v.detach() for k, v in self._fields.items()}, validate=False)

    def select_atoms(self, index: Tensor) -> AtomicGraph:
        """Keep only some atoms (bool mask or indices); drops edge fields; systems are kept."""
        if index.dtype == torch.bool:
            index = torch.nonzero(index).flatten()
        out = {}
        for k, v in self._fields.items():
            scope = K.scope_of(k)
            if scope == K.ATOM:
                out[k] = v.index_select(0, index)
            elif scope == K.SYSTEM:
                out[k] = v
        return AtomicGraph(out, validate=False)

    def select_systems(self, systems: Sequence[int] | Tensor) -> AtomicGraph:
        """Sub-batch of the given systems (in the given order); edges are kept and re-indexed."""
        sys_idx = torch.as_tensor(systems, dtype=torch.long, device=self.device).flatten()
        ptr = self.ptr
        counts = ptr[1:] - ptr[:-1]
        parts = [torch.arange(ptr[s], ptr[s + 1], device=self.device) for s in sys_idx.tolist()]
        atom_idx = (
            torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=self.device)
        )
        new_batch = torch.repeat_interleave(
            torch.arange(len(sys_idx), device=self.device), counts[sys_idx]
        )
        out = {}
        for k, v in self._fields.items():
            scope = K.scope_of(k)
            if scope == K.ATOM:
                out[k] = v.index_select(0, atom_idx)
            elif scope == K.SYSTEM:
                out[k] = v.index_select(0, sys_idx)
        out[K.BATCH] = new_batch
        if K.EDGE_INDEX in self._fields:
            old_to_new = torch.full((self.n_atoms,), -1, dtype=torch.long, device=self.device)
            old_to_new[atom_idx] = torch.arange(len(atom_idx), device=self.device)
            ei = self._fields[K.EDGE_INDEX]
            keep = old_to_new[ei[1]] >= 0
            edge_sel = torch.nonzero(keep).flatten()
            new_ei = old_to_new[ei[:, edge_sel]]
            # re-order edges to follow the new system order
            order = torch.argsort(new_ei[1], stable=True)
            edge_sel = edge_sel[order]
            for k, v in self._fields.items():
                if K.scope_of(k) == K.EDGE:
                    out[k] = new_ei[:, order] if k == K.EDGE_INDEX else v.index_select(0, edge_sel)
        return AtomicGraph(out, validate=False)

    def split(self) -> list[AtomicGraph]:
        """One graph per system."""
        return [self.select_systems([i]) for i in range(self.n_systems)]

    @staticmethod
    def concat(graphs: Sequence[AtomicGraph]) -> AtomicGraph:
        """Concatenate batches; system indices and edge indices are offset.

        Only fields present in every graph are kept.
        """
        if len(graphs) == 0:
            raise InputError("cannot concatenate an empty list of graphs")
        if len(graphs) == 1:
            return graphs[0]
        common = set(graphs[0].keys())
        for g in graphs[1:]:
            common &= set(g.keys())
        has_edges = K.EDGE_INDEX in common
        out: dict[str, Tensor] = {}
        atom_off = 0
        sys_off = 0
        pieces: dict[str, list[Tensor]] = {k: [] for k in common}
        for g in graphs:
            for k in common:
                v = g[k]
                if k == K.BATCH:
                    v = v + sys_off
                elif k == K.EDGE_INDEX:
                    v = v + atom_off
                pieces[k].append(v)
            atom_off += g.n_atoms
            sys_off += g.n_systems
        for k, vs in pieces.items():
            if k == K.EDGE_INDEX and has_edges:
                out[k] = torch.cat(vs, dim=1)
            else:
                out[k] = torch.cat(vs, dim=0)
        return AtomicGraph(out, validate=False)

    # ------------------------------------------------------------------ geometry
    def edge_vectors(self, positions: Tensor | None = None, cell: Tensor | None = None) -> Tensor:
        """``[n_edges, 3]`` r_ij = pos[j] - pos[i] + shift @ cell[batch[i]] (j = sender = row 0)."""
        pos = self._fields[K.POSITIONS] if positions is None else positions
        cell = self._fields[K.CELL] if cell is None else cell
        ei = self._fields[K.EDGE_INDEX]
        j, i = ei[0], ei[1]
        # index_select, not pos[j]: same values, a faster gather and (index_add) backward
        vec = pos.index_select(0, j) - pos.index_select(0, i)
        shifts = self._fields.get(K.SHIFTS)
        if shifts is not None:
            vec = vec + rowvec_matmul(shifts.to(pos.dtype), cell, self._fields[K.BATCH], i,
                                      key=ei)
        return vec

    def wrapped(self) -> AtomicGraph:
        """Positions wrapped into the cell along periodic axes only (triclinic-correct)."""
        return self.replace(
            positions=wrap_positions(self.positions, self.cell, self.pbc, self.batch)
        )


def rowvec_matmul(x: Tensor, mats: Tensor, batch: Tensor, rows: Tensor | None = None,
                  key: Tensor | None = None) -> Tensor:
    """``[M, 3]`` ``x[m] @ mats[batch[rows[m]]]`` for row vectors ``x [M, 3]``, ``mats [S, 3, 3]``.

    With one system this is one matrix product, whose backward is a GEMM reduction. The
    gathered form is kept for batches only: its backward (a scatter-add of ``[M, 3, 3]``
    onto ``S`` matrices) serializes on GPU atomics when all rows hit the same matrix,
    which made a 10k-atom stress evaluation far slower than the model itself.

    ``key``: a tensor that determines ``rows`` (the edge index of which ``rows`` is a row;
    without ``rows``, ``batch`` is its own key): on the CPU the rows' system counts are kept
    for it (and its version), so the calls of one evaluation (edge vectors, the filter,
    their derivatives) count them once.
    """
    if mats.shape[0] == 1:
        return x @ mats[0]
    counts = _cpu_segments(x, batch, rows, mats.shape[0], key)
    if counts is not None:
        # rows grouped by matrix (edges of concatenated systems): one product per system,
        # the 64-cell batch then costs what one cell of as many atoms does
        return _SegmentProduct.apply(x, mats, counts)
    idx = batch if rows is None else batch.index_select(0, rows)
    # the three rows of each gathered matrix weighted by x, summed in the order of
    # sum(-2): the values of (x[..., None] * mats[idx]).sum(-2), without its [M, 3, 3]
    # product (and index_select's backward is an index_add, not an index_put)
    g0, g1, g2 = mats.reshape(-1, 9).index_select(0, idx).view(-1, 3, 3).unbind(1)
    x0, x1, x2 = x.unsqueeze(-1).unbind(1)
    return x0 * g0 + x1 * g1 + x2 * g2


class _SegmentProduct(torch.autograd.Function):
    """``x[rows of system s] @ mats[s]`` for rows grouped by system (``counts`` rows each):
    one product per system written into one output (no ``torch.cat`` copy of the rows).
    Its backward is the same product with the transposed matrices (so it differentiates
    again, for forces' training) and one ``[3, M_s] @ [M_s, 3]`` reduction per matrix."""

    @staticmethod
    def forward(ctx, x: Tensor, mats: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, mats)
        ctx.counts = counts
        out = x.new_empty(x.shape[0], mats.shape[-1])
        start = 0
        for n, m in zip(counts, mats.unbind(0)):
            if n:
                torch.mm(x.narrow(0, start, n), m, out=out.narrow(0, start, n))
            start += n
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, mats = ctx.saved_tensors
        gx = gm = None
        if ctx.needs_input_grad[0]:
            gx = _SegmentProduct.apply(grad, mats.transpose(1, 2), ctx.counts)
        if ctx.needs_input_grad[1]:
            gm = torch.stack([xs.T @ gs for xs, gs in
                              zip(x.split(ctx.counts), grad.split(ctx.counts))])
        return gx, gm, None


#: key tensor -> (its version, weakref of batch, batch's version, n_mats, counts or None)
_SEGMENTS = WeakIdKeyDictionary()


def _cpu_segments(x: Tensor, batch: Tensor, rows: Tensor | None, n_mats: int,
                  key: Tensor | None) -> list[int] | None:
    """Row counts per matrix when the rows' systems ``batch[rows]`` are non-decreasing, on
    the CPU outside tracers (where reading the data is free); else ``None`` (the gathered
    form is used). Kept per ``key`` (see :func:`rowvec_matmul`)."""
    from torch._subclasses.fake_tensor import is_fake

    if x.device.type != "cpu" or x.shape[0] == 0 or torch.compiler.is_compiling() \
            or is_fake(x) or is_fake(batch) or (rows is not None and is_fake(rows)):
        return None
    key = batch if rows is None else key
    if key is not None:
        hit = _SEGMENTS.get(key)
        if hit is not None and hit[0] == key._version and hit[1]() is batch \
                and hit[2] == batch._version and hit[3] == n_mats:
            return hit[4]
    idx = batch if rows is None else batch.index_select(0, rows)
    counts = None if bool((idx[1:] < idx[:-1]).any()) else \
        torch.bincount(idx, minlength=n_mats).tolist()
    if key is not None:
        _SEGMENTS[key] = (key._version, weakref.ref(batch), batch._version, n_mats, counts)
    return counts


def complete_cell(cell: Tensor) -> Tensor:
    """Replace zero lattice vectors (non-periodic directions) by orthogonal unit vectors.

    Args:
        cell: ``[n_systems, 3, 3]``.
    Returns:
        ``[n_systems, 3, 3]`` invertible where the non-zero rows are linearly independent.
    """
    cell = cell.clone()
    norms = cell.norm(dim=-1)
    zero = norms < 1e-12
    if not zero.any():
        return cell
    for s in torch.nonzero(zero.any(-1)).flatten().tolist():
        c = cell[s]
        for a in range(3):
            if not zero[s, a]:
                continue
            others = [c[b] for b in range(3) if b != a and c[b].norm() > 1e-12]
            if len(others) == 2:
                v = torch.linalg.cross(others[0], others[1])
            elif len(others) == 1:
                o = others[0] / others[0].norm()
                trial = torch.eye(3, dtype=c.dtype, device=c.device)
                v = min(
                    (trial[k] - (trial[k] @ o) * o for k in range(3)),
                    key=lambda t: -float(t.norm()),
                )
            else:
                v = torch.eye(3, dtype=c.dtype, device=c.device)[a]
            c[a] = v / v.norm()
        # keep a right-handed frame when we invented vectors
        if torch.linalg.det(c) < 0:
            for a in range(3):
                if zero[s, a]:
                    c[a] = -c[a]
                    break
        cell[s] = c
    return cell


def wrap_positions(positions: Tensor, cell: Tensor, pbc: Tensor, batch: Tensor) -> Tensor:
    """Wrap positions into ``[0, 1)`` fractional coordinates along periodic axes only.

    Args:
        positions: ``[n_atoms, 3]`` Å.
        cell: ``[n_systems, 3, 3]`` rows are lattice vectors.
        pbc: ``[n_systems, 3]``.
        batch: ``[n_atoms]``.
    """
    full = complete_cell(cell)
    periodic = pbc[batch]
    if not periodic.any():
        return positions
    det = torch.linalg.det(full)
    if (det.abs() < 1e-12)[pbc.any(-1)].any():
        raise InputError("singular cell: cannot wrap positions into it")
    inv = torch.linalg.inv(full)
    frac = torch.einsum("ni,nij->nj", positions, inv[batch])
    frac = torch.where(periodic, frac - torch.floor(frac), frac)
    # floor can return 1.0 after round-off for tiny negative values
    frac = torch.where(periodic & (frac >= 1.0), frac - 1.0, frac)
    return torch.einsum("ni,nij->nj", frac, full[batch])
