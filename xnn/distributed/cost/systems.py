"""Test systems of any size, generated block by block from integer FCC sites (for ghost plans
at scale, :mod:`.plan`): nothing is ever held for the whole system but what is asked for.

Every system is a set of FCC sites in half-lattice units ``(X, Y, Z)`` (integers with an even
sum; site ``(X, Y, Z)`` sits at ``(X % 2) * a/2 + (X // 2) * a`` along x and likewise, the
arithmetic of ``ase.build.bulk(..., cubic=True).repeat``, so that positions are bitwise
those of an ASE crystal), numbered in generation order (the atom ids):

* ``fcc``: a cubic crystal of ``n × n × n`` conventional cells, periodic along x, y, z
  (ids in ``ase ... .repeat((n, n, n))`` order).
* ``liquid``: the same sites and density, each atom displaced by a seeded uniform jitter of
  at most :data:`JITTER` Å per axis (a counter-based hash of the seed and the atom id, so
  that any atom's position is known without generating the others).
* ``slab``: ``4m × 4m × m`` cells, periodic along x and y; along z **not periodic** (pbc
  false) in a cell with :data:`VACUUM` Å of vacuum (the atoms sit 10 Å above z = 0).
* ``cylinder``: a rod of radius ``R`` cells and length ``16 R`` cells along z, periodic
  along z only, with :data:`VACUUM` Å of vacuum around it (x, y not periodic).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from xnn.errors import InputError

SYSTEMS = ("fcc", "liquid", "slab", "cylinder")
A_CU = 3.61  #: Å, the lattice constant of Cu
JITTER = 0.5  #: Å, the liquid's largest displacement per axis from its site
VACUUM = 20.0  #: Å of vacuum along the non-periodic axes (slab: z; cylinder: x, y)
_NEIGHBOUR_CHUNK = 16384  #: atoms whose neighbours are looked up at once (memory)
_BASIS = np.array([[0, 0, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=np.int64)  # ase order


_BASIS_OF = np.full(8, -1, dtype=np.int64)  # parities (px, py, pz) -> basis index
_BASIS_OF[_BASIS[:, 0] * 4 + _BASIS[:, 1] * 2 + _BASIS[:, 2]] = np.arange(4)


def _hash(seed: int, ids: np.ndarray, k: int) -> np.ndarray:
    """``[n]`` uniform floats in [0, 1) from (seed, id, k): splitmix64 of a counter."""
    with np.errstate(over="ignore"):
        x = (ids.astype(np.uint64) * np.uint64(4) + np.uint64(k)
             + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15))
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class System:
    """One generated system.

    Attributes:
        name: one of :data:`SYSTEMS`. a: lattice constant (Å). seed: the liquid's jitter.
        cells: ``(nx, ny, nz)`` conventional cells (cylinder: ``(2R, 2R, length)``).
        cell: ``[3, 3]`` Å (diagonal). pbc: ``[3]`` bool. offset: ``[3]`` Å added to sites.
        radius: cylinder radius in half-lattice units (0 otherwise).
    """

    name: str
    a: float
    seed: int
    cells: tuple[int, int, int]
    cell: Tensor
    pbc: Tensor
    offset: np.ndarray
    radius: int = 0
    _layer: list[np.ndarray] = field(default_factory=list)  # cylinder: [k, 2] sites/parity
    _lookup: list[np.ndarray] = field(default_factory=list)  # cylinder: [X, Y] -> k or -1

    @property
    def jitter(self) -> float:
        return JITTER if self.name == "liquid" else 0.0

    @property
    def n_atoms(self) -> int:
        if self.name == "cylinder":
            return self.cells[2] * (len(self._layer[0]) + len(self._layer[1]))
        return 4 * math.prod(self.cells)

    # ------------------------------------------------------------------ sites and ids
    def sites(self, ids: np.ndarray) -> np.ndarray:
        """``[n, 3]`` int64 half-lattice sites of atoms ``ids [n]``."""
        if self.name == "cylinder":
            n0, n1 = len(self._layer[0]), len(self._layer[1])
            cz, rest = np.divmod(ids, n0 + n1)
            odd = rest >= n0
            k = np.where(odd, rest - n0, rest)
            xy = np.where(odd[:, None], self._layer[1][np.minimum(k, n1 - 1)],
                          self._layer[0][np.minimum(k, n0 - 1)])
            return np.concatenate([xy, (2 * cz + odd)[:, None]], axis=1)
        nx, ny, nz = self.cells
        c, b = np.divmod(ids, 4)
        cxy, cz = np.divmod(c, nz)
        cx, cy = np.divmod(cxy, ny)
        return 2 * np.stack([cx, cy, cz], axis=1) + _BASIS[b]

    def ids_of(self, sites: np.ndarray) -> np.ndarray:
        """``[n]`` ids of the atoms at ``sites [n, 3]`` (wrapped along periodic axes), ``-1``
        where there is no atom."""
        span = 2 * np.array(self.cells, dtype=np.int64)
        s = np.where(self.pbc.numpy(), np.mod(sites, span), sites)
        if self.name == "cylinder":
            ok = ((s[:, :2] >= 0) & (s[:, :2] <= 2 * self.radius)).all(1)
            x, y = np.where(ok, s[:, 0], 0), np.where(ok, s[:, 1], 0)
            odd = s[:, 2] % 2
            k = np.where(odd == 1, self._lookup[1][x, y], self._lookup[0][x, y])
            n0, n1 = len(self._layer[0]), len(self._layer[1])
            idx = (s[:, 2] // 2) * (n0 + n1) + odd * n0 + k
            return np.where(ok & (k >= 0), idx, -1)
        ok = ((s >= 0) & (s < span)).all(1)
        c, p = np.divmod(s, 2)
        b = _BASIS_OF[p[:, 0] * 4 + p[:, 1] * 2 + p[:, 2]]
        ny, nz = self.cells[1], self.cells[2]
        idx = ((c[:, 0] * ny + c[:, 1]) * nz + c[:, 2]) * 4 + b
        return np.where(ok & (b >= 0), idx, -1)

    def positions(self, ids: np.ndarray, sites: np.ndarray | None = None) -> np.ndarray:
        """``[n, 3]`` float64 positions (Å) of atoms ``ids``."""
        x = self.site_positions(self.sites(ids) if sites is None else sites)
        if self.jitter:
            x = x + np.stack([(2 * _hash(self.seed, ids, k) - 1) * self.jitter
                              for k in range(3)], axis=1)
        return x

    def site_positions(self, sites: np.ndarray) -> np.ndarray:
        """``[n, 3]`` float64 positions (Å) of the lattice sites ``sites [n, 3]`` (half-lattice
        units), without the liquid's jitter."""
        half, whole = np.divmod(sites, 2)[1], np.divmod(sites, 2)[0]
        return half * (0.5 * self.a) + whole * self.a + self.offset

    def neighbors(self, ids: np.ndarray, reach: float) -> np.ndarray:
        """``[n, k]`` ids of the neighbours (each periodic image once, as a neighbor list
        holds it) of atoms ``ids [n]`` closer than ``reach`` (Å); ``-1`` pads.

        Exact: every site offset within ``reach`` (plus twice the largest jitter) is tried
        and, in the liquid, the jittered distance is compared with ``reach``.
        """
        if len(ids) > _NEIGHBOUR_CHUNK:
            parts = [self.neighbors(ids[i: i + _NEIGHBOUR_CHUNK], reach)
                     for i in range(0, len(ids), _NEIGHBOUR_CHUNK)]
            return np.concatenate(parts)
        offsets = _offsets(self.a, reach + 2 * math.sqrt(3) * self.jitter)
        s = self.sites(ids)
        nbr = self.ids_of((s[:, None, :] + offsets[None]).reshape(-1, 3)).reshape(len(ids), -1)
        if self.jitter:
            span = 2 * np.array(self.cells, dtype=np.int64)
            safe = np.where(nbr >= 0, nbr, 0)
            d = (self.positions(safe.ravel()).reshape(*nbr.shape, 3)
                 - self.positions(ids)[:, None, :])
            # the image: the neighbour's site offset, not its wrapped site
            wrap = (s[:, None, :] + offsets[None]) - self.sites(safe.ravel()).reshape(
                *nbr.shape, 3)
            d = d + (wrap // span * span) * (0.5 * self.a)
            nbr = np.where((d * d).sum(-1) < reach * reach, nbr, -1)
        return nbr

    def blocks(self, size: int) -> Iterator[np.ndarray]:
        """Atom ids in blocks of at most ``size``, in id order."""
        for start in range(0, self.n_atoms, size):
            yield np.arange(start, min(start + size, self.n_atoms), dtype=np.int64)

    def build(self) -> tuple[Tensor, Tensor, Tensor]:
        """The whole system: ``(positions [n, 3] float64, cell [3, 3], pbc [3])``."""
        ids = np.arange(self.n_atoms, dtype=np.int64)
        return torch.from_numpy(self.positions(ids)), self.cell.clone(), self.pbc.clone()


def _offsets(a: float, reach: float) -> np.ndarray:
    """``[k, 3]`` nonzero FCC site offsets (half-lattice units) shorter than ``reach`` Å."""
    m = int(math.ceil(2 * reach / a))
    g = np.arange(-m, m + 1)
    d = np.stack(np.meshgrid(g, g, g, indexing="ij"), -1).reshape(-1, 3)
    d = d[(d.sum(1) % 2 == 0) & (d != 0).any(1)]
    return d[(d * d).sum(1) * (0.25 * a * a) < reach * reach]


def _cylinder_layers(radius: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sites ``(X, Y)`` of the two FCC layer parities within ``radius`` of the axis."""
    n = 2 * radius + 1
    xy = np.stack(np.meshgrid(np.arange(n), np.arange(n), indexing="ij"), -1).reshape(-1, 2)
    inside = ((xy - radius) ** 2).sum(1) <= radius * radius
    layers, lookups = [], []
    for parity in (0, 1):
        sel = xy[inside & (xy.sum(1) % 2 == parity)]
        table = np.full((n + 1, n + 1), -1, dtype=np.int64)
        table[sel[:, 0], sel[:, 1]] = np.arange(len(sel))
        layers.append(sel)
        lookups.append(table)
    return layers, lookups


def make_system(name: str, n_atoms: int, seed: int = 0, a: float = A_CU) -> System:
    """The system ``name`` with about ``n_atoms`` atoms (whole cells: see
    :attr:`System.n_atoms` for the exact number).

    Raises:
        InputError: an unknown system or fewer than 4 atoms.
    """
    if name not in SYSTEMS:
        raise InputError(f"system must be one of {list(SYSTEMS)}, got {name!r}")
    if n_atoms < 4:
        raise InputError(f"a system needs at least 4 atoms, got {n_atoms}")
    t = torch.tensor
    if name in ("fcc", "liquid"):
        n = max(1, round((n_atoms / 4) ** (1 / 3)))
        return System(name, a, seed, (n, n, n), torch.diag(t([n * a] * 3, dtype=torch.float64)),
                      t([True] * 3), np.zeros(3))
    if name == "slab":
        m = max(1, round((n_atoms / 64) ** (1 / 3)))
        cell = torch.diag(t([4 * m * a, 4 * m * a, m * a + VACUUM], dtype=torch.float64))
        return System(name, a, seed, (4 * m, 4 * m, m), cell, t([True, True, False]),
                      np.array([0.0, 0.0, VACUUM / 2]))
    r = max(1, round((n_atoms / (64 * math.pi)) ** (1 / 3)))  # radius in cells
    layers, lookups = _cylinder_layers(2 * r)
    side = 2 * r * a + VACUUM
    cell = torch.diag(t([side, side, 16 * r * a], dtype=torch.float64))
    return System(name, a, seed, (2 * r, 2 * r, 16 * r), cell, t([False, False, True]),
                  np.array([VACUUM / 2, VACUUM / 2, 0.0]), 2 * r, layers, lookups)
