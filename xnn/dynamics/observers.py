"""Built-in hooks (:mod:`xnn.dynamics.hooks`): RDF, MSD, per-species temperature, and (from
:mod:`xnn.dynamics.callable_hooks`) user callables in each scope; :func:`build_hook` makes
one from plain settings.

Species are atomic numbers; rows name them by chemical symbol (``"all"``: every atom).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.dynamics.callable_hooks import (
    FrameCallable,
    GlobalCallable,
    OwnedCallable,
    load_target,
)
from xnn.dynamics.hooks import SCOPES, GlobalHook, Rank0Hook
from xnn.dynamics.reduce import Reducer
from xnn.dynamics.state import MDState, free_mask
from xnn.errors import InputError
from xnn.units import KB, MVV2E

__all__ = ["RDF", "MSD", "SpeciesTemperature", "FrameCallable", "OwnedCallable",
           "GlobalCallable", "build_hook", "HOOKS"]

N_Z = 119  # atomic numbers 0..118: species groups are system * N_Z + Z
#: the RDF refuses an ``r_max`` whose pairs per frame (estimated from the density, periodic
#: images included) exceed this: about 180 bytes each while a frame's histogram is made
RDF_MAX_PAIRS = 50_000_000


def _symbol(z: int) -> str:
    from ase.data import chemical_symbols

    return chemical_symbols[z]


def _groups(graph) -> Tensor:
    return graph.batch * N_Z + graph.numbers.to(torch.long)


def _group_sum(values: Tensor, graph) -> Tensor:
    """``[n_systems * N_Z, ...]`` sums of per-atom ``values`` by (system, species) here."""
    out = values.new_zeros((graph.n_systems * N_Z, *values.shape[1:]))
    return out.index_add(0, _groups(graph), values)


# ----------------------------------------------------------------------------- RDF
class RDF(Rank0Hook):
    """Radial distribution function ``g(r)`` averaged over the frames it sees.

    Per frame and system, ``g(r) = V n(r) / (N² V_shell(r))`` where ``n(r)`` counts ordered
    pairs (periodic images included, so ``r_max`` may exceed half the cell) with distance
    in the bin ``(r_k, r_k + dr]`` and ``V_shell`` is the bin's exact shell volume; partial
    ``g_ab = V n_ab(r) / (N_a N_b V_shell)`` (LAMMPS ``compute rdf``, ASE >= 3.27
    ``get_rdf``), so ``g = sum_ab c_a c_b g_ab``. Rows: ``system, r_A, g[, g_A_B...]`` with
    ``r_A`` the bin centre (Å).

    A frame's pairs are held in memory at once (about 180 bytes per pair): an ``r_max``
    whose expected pairs per frame, ``sum_s N_s² (4π/3) r_max³ / V_s``, exceed
    ``max_pairs`` is refused before the run (and at any frame, e.g. after NPT shrank the
    cell), with the largest ``r_max`` that fits.

    Args:
        every: steps between frames. r_max: largest distance (Å). bins: number of bins.
        partials: also the partial RDF of every species pair.
        backend: neighbor-list backend.
        max_pairs: the most pairs per frame (default :data:`RDF_MAX_PAIRS`).
    """

    accumulates = True

    def __init__(self, every: int = 10, r_max: float = 6.0, bins: int = 200,
                 partials: bool = False, name: str = "rdf", backend: str = "auto",
                 max_pairs: int = RDF_MAX_PAIRS):
        super().__init__(every, name)
        if not (r_max > 0 and math.isfinite(r_max)):
            raise InputError(f"hook {name!r}: r_max must be a positive number of Å, "
                             f"got {r_max!r}")
        if int(bins) != bins or bins < 1:
            raise InputError(f"hook {name!r}: bins must be a positive integer, got {bins!r}")
        if int(max_pairs) != max_pairs or max_pairs < 1:
            raise InputError(f"hook {name!r}: max_pairs must be a positive integer, got "
                             f"{max_pairs!r}")
        self.r_max, self.bins, self.partials = float(r_max), int(bins), bool(partials)
        self.backend, self.max_pairs = backend, int(max_pairs)
        self.frames = 0
        self.sum_g: Tensor | None = None  # [n_systems, bins]
        self.sum_partial: Tensor | None = None  # [n_systems, n_species, n_species, bins]
        self.species: list[int] = []

    @property
    def r(self) -> np.ndarray:
        """``[bins]`` bin centres (Å)."""
        edges = np.linspace(0.0, self.r_max, self.bins + 1)
        return 0.5 * (edges[:-1] + edges[1:])

    def prepare(self, state: MDState, reduce: Reducer) -> MDState:
        """Refuse a run it cannot observe: a cell not periodic on all axes, or more pairs
        per frame than ``max_pairs``. Collective (the atom counts)."""
        g = state.graph
        self.check(g.pbc, reduce.count_per_system(g.batch, g.n_systems), g.volume())
        return state

    def check(self, pbc: Tensor, n_atoms: Tensor, volume: Tensor) -> None:
        """Raise :class:`~xnn.errors.InputError` unless every system is periodic on all axes
        (``pbc [n_systems, 3]``) and the expected pairs of ``n_atoms [n_systems]`` in
        ``volume [n_systems]`` (Å³) within ``r_max`` fit ``max_pairs``."""
        if not bool(pbc.all()):
            raise InputError(f"hook {self.name!r}: the RDF needs a periodic cell on all three "
                             "axes (its normalization uses the cell volume)")
        n, vol = n_atoms.detach().double().cpu(), volume.detach().double().cpu()
        per_r3 = float((n * n / vol).sum()) * 4.0 / 3.0 * math.pi  # pairs / r_max³
        pairs = per_r3 * self.r_max ** 3
        if pairs > self.max_pairs:
            fit = (self.max_pairs / per_r3) ** (1.0 / 3.0)
            raise InputError(f"hook {self.name!r}: r_max={self.r_max:g} Å needs about "
                             f"{pairs:.2g} atom pairs per frame in memory ({int(n.sum())} "
                             f"atoms in {float(vol.sum()):.4g} Å³, periodic images "
                             f"included, ~180 bytes each), more than max_pairs="
                             f"{self.max_pairs:.3g}: use r_max <= {math.floor(fit * 10) / 10:g} "
                             "Å or raise max_pairs")

    def frame(self, graph) -> tuple[Tensor, Tensor | None]:
        """``g [n_systems, bins]`` (and the partials) of one frame ``graph``."""
        from xnn.neighbors import neighbor_list

        pos, cell, batch = graph.positions.detach(), graph.cell.detach(), graph.batch
        n = torch.zeros(graph.n_systems, dtype=pos.dtype, device=pos.device).index_add(
            0, batch, torch.ones_like(pos[:, 0]))
        self.check(graph.pbc, n, graph.volume())
        ei, sh = neighbor_list(pos, cell, graph.pbc, self.r_max, batch, self.backend)
        j, i = ei[0], ei[1]
        shift = torch.einsum("ek,ekl->el", sh.to(pos.dtype), cell[batch[i]])
        d = (pos[j] - pos[i] + shift).norm(dim=-1)
        dr = self.r_max / self.bins
        k = (torch.ceil(d / dr).to(torch.long) - 1).clamp(0, self.bins - 1)
        n_sys = graph.n_systems
        edges = torch.linspace(0.0, self.r_max, self.bins + 1, dtype=pos.dtype,
                               device=pos.device)
        shell = 4.0 / 3.0 * math.pi * (edges[1:] ** 3 - edges[:-1] ** 3)  # [bins]
        vol = graph.volume().to(pos.dtype)
        ones = torch.ones_like(d)
        hist = torch.zeros(n_sys * self.bins, dtype=pos.dtype, device=pos.device)
        hist = hist.index_add(0, batch[i] * self.bins + k, ones).reshape(n_sys, self.bins)
        g = hist * vol[:, None] / (n[:, None] ** 2 * shell)
        if not self.partials:
            return g, None
        z = torch.as_tensor(self.species, device=pos.device)
        code = torch.searchsorted(z, graph.numbers.to(torch.long))
        ns = len(self.species)
        idx = ((batch[i] * ns + code[i]) * ns + code[j]) * self.bins + k
        hp = torch.zeros(n_sys * ns * ns * self.bins, dtype=pos.dtype, device=pos.device)
        hp = hp.index_add(0, idx, ones).reshape(n_sys, ns, ns, self.bins)
        na = torch.zeros(n_sys * ns, dtype=pos.dtype, device=pos.device).index_add(
            0, batch * ns + code, torch.ones_like(pos[:, 0])).reshape(n_sys, ns)
        norm = na[:, :, None] * na[:, None, :]
        gp = hp * vol[:, None, None, None] / (norm[..., None] * shell)
        gp = torch.where(norm[..., None] > 0, gp, torch.zeros_like(gp))
        return g, gp

    def observe(self, state: MDState, time_fs: float) -> None:
        graph = state.graph
        if not self.species:
            self.species = sorted(set(graph.numbers.tolist()))
        g, gp = self.frame(graph)
        self.sum_g = g if self.sum_g is None else self.sum_g + g
        if gp is not None:
            self.sum_partial = gp if self.sum_partial is None else self.sum_partial + gp
        self.frames += 1
        pairs = self._pairs()
        self.columns = ("system", "r_A", "g", *(f"g_{_symbol(a)}_{_symbol(b)}"
                                                for a, b, _, _ in pairs))
        res = self.result()
        self._rows = [(s, float(r), *(float(res["g"][s, b]),),
                       *(float(res["partials"][f"{_symbol(a)}-{_symbol(c)}"][s, b])
                         for a, c, _, _ in pairs))
                      for s in range(res["g"].shape[0]) for b, r in enumerate(self.r)]

    def _pairs(self) -> list[tuple[int, int, int, int]]:
        if not self.partials:
            return []
        sp = self.species
        return [(sp[x], sp[y], x, y) for x in range(len(sp)) for y in range(x, len(sp))]

    def result(self) -> dict:
        """``r [bins]`` (Å), ``g [n_systems, bins]`` (mean over ``frames``), ``partials``
        (``{"A-B": [n_systems, bins]}``) and ``frames``."""
        if self.sum_g is None:
            return {"r": self.r, "g": np.zeros((0, self.bins)), "partials": {}, "frames": 0}
        mean = (self.sum_g / self.frames).cpu().numpy()
        partials = {}
        for a, b, x, y in self._pairs():
            partials[f"{_symbol(a)}-{_symbol(b)}"] = (self.sum_partial[:, x, y]
                                                      / self.frames).cpu().numpy()
        return {"r": self.r, "g": mean, "partials": partials, "frames": self.frames}

    def state_dict(self) -> dict:
        return {"frames": self.frames, "species": list(self.species),
                "settings": [self.r_max, self.bins, self.partials],
                "sum_g": None if self.sum_g is None else self.sum_g.cpu(),
                "sum_partial": None if self.sum_partial is None else self.sum_partial.cpu()}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("settings")
        if saved is not None and list(saved) != [self.r_max, self.bins, self.partials]:
            raise InputError(f"hook {self.name!r}: the checkpoint's RDF has r_max, bins, "
                             f"partials = {saved}; resume with the same settings (or "
                             "give this RDF another label)")
        self.frames, self.species = int(state["frames"]), list(state["species"])
        self.sum_g, self.sum_partial = state["sum_g"], state["sum_partial"]


# ----------------------------------------------------------------------------- MSD
class MSD(GlobalHook):
    """Mean squared displacement from the start of the run, per system and species.

    Positions in xnn are never wrapped into the cell, so the displacement of an atom is its
    true displacement. Each atom's position at the start is the per-atom field
    ``msd_reference`` of the state (:meth:`prepare`): it moves with the atom between
    processes (a process holds its owned atoms' rows only) and a checkpoint keeps it, so a
    resumed run measures from the original start (from the resumed step when the
    checkpoint has none). Rows: ``step, time_fs, system, species, n_atoms, msd_A2`` (Å²),
    species ``all`` first.
    """

    columns = ("step", "time_fs", "system", "species", "n_atoms", "msd_A2")

    def __init__(self, every: int = 10, name: str = "msd"):
        super().__init__(every, name)
        self.columns = MSD.columns
        self._by_id: Tensor | None = None  # [n_ids, 3]: a checkpoint of xnn <= 2026-12

    def prepare(self, state: MDState, reduce: Reducer) -> MDState:
        """``state`` with ``msd_reference`` (its positions, unless it has one)."""
        g = state.graph
        if K.MSD_REFERENCE in g:
            return state
        ref = g.positions.detach().clone()
        if self._by_id is not None:  # an older checkpoint kept every atom's row by id
            ref = self._by_id.to(ref).index_select(0, g.atom_id)
            self._by_id = None
        return state.replace(graph=g.replace({K.MSD_REFERENCE: ref}))

    def partial(self, state: MDState) -> dict[str, Tensor]:
        g = state.graph
        if K.MSD_REFERENCE not in g:
            raise InputError(f"hook {self.name!r}: the state has no msd_reference; continue "
                             "from the state HookRunner.prepare returned")
        disp = g.positions.detach() - g[K.MSD_REFERENCE]
        return {"sq": _group_sum((disp * disp).sum(-1), g),
                "n": _group_sum(torch.ones_like(disp[:, 0]), g)}

    def update(self, step: int, time_fs: float, sums: dict[str, Tensor]) -> None:
        _species_rows(self, step, time_fs, sums["n"], [sums["sq"]],
                      lambda n, sq: [sq / n])

    def load_state_dict(self, state: dict) -> None:
        self._by_id = state.get("reference")  # absent since the reference is in the state


def _species_rows(hook, step, time_fs, n: Tensor, values: list[Tensor], fn) -> None:
    """Rows ``step, time_fs, system, species, n_atoms, *fn(n, *values)`` per system (species
    ``all`` first, then every species present), from ``[n_systems * N_Z]`` group sums."""
    n = n.reshape(-1, N_Z).cpu().double()
    vals = [v.reshape(-1, N_Z).cpu().double() for v in values]
    for s in range(n.shape[0]):
        total = fn(n[s].sum(), *(v[s].sum() for v in vals))
        hook.add_row((step, time_fs, s, "all", int(n[s].sum()), *map(float, total)))
        for z in torch.nonzero(n[s] > 0).flatten().tolist():
            row = fn(n[s, z], *(v[s, z] for v in vals))
            hook.add_row((step, time_fs, s, _symbol(z), int(n[s, z]), *map(float, row)))


# ----------------------------------------------------------------------------- temperature
class SpeciesTemperature(GlobalHook):
    """Kinetic temperature of each species, ``T_a = 2 K_a / (f_a k_B)``.

    A system's kinetic degrees of freedom ``f`` (:func:`~xnn.dynamics.state.
    degrees_of_freedom`: ``3 N - 3`` without fixed atoms) are shared among its species in
    proportion to their free atoms, ``f_a = f N_free,a / N_free``, so the ``all`` row is
    the thermo log's temperature and ``sum_a f_a T_a = f T``. Rows: ``step, time_fs,
    system, species, n_atoms, ekin_eV, temperature_K``.
    """

    columns = ("step", "time_fs", "system", "species", "n_atoms", "ekin_eV", "temperature_K")

    def __init__(self, every: int = 10, name: str = "species_temperature"):
        super().__init__(every, name)
        self.columns = SpeciesTemperature.columns

    def partial(self, state: MDState) -> dict[str, Tensor]:
        g = state.graph
        free = free_mask(g).to(g.positions.dtype)
        v = g.velocities.detach()
        ke = 0.5 * MVV2E * g.masses * (v * v).sum(-1) * free
        fixed = torch.zeros(g.n_systems, dtype=free.dtype, device=free.device).index_add(
            0, g.batch, 1.0 - free)
        return {"ke": _group_sum(ke, g), "n": _group_sum(torch.ones_like(free), g),
                "free": _group_sum(free, g), "fixed": fixed}

    def update(self, step: int, time_fs: float, sums: dict[str, Tensor]) -> None:
        free = sums["free"].reshape(-1, N_Z).cpu().double()
        n_free = free.sum(-1)
        has_fixed = sums["fixed"].cpu() > 0
        dof = torch.where(has_fixed, 3 * n_free, 3 * n_free - 3).clamp(min=1.0)
        share = dof / n_free.clamp(min=1.0)  # degrees of freedom per free atom
        dof_g = (free * share[:, None]).reshape(-1)

        def temp(n, ke, f):
            return [ke, 2 * ke / (f * KB) if f > 0 else float("nan")]

        _species_rows(self, step, time_fs, sums["n"], [sums["ke"], dof_g], temp)


# ----------------------------------------------------------------------------- factory
HOOKS = ("rdf", "msd", "species_temperature", "callable")
DEFAULT_SCOPE = {"rdf": "rank0", "msd": "global", "species_temperature": "global",
                 "callable": "rank0"}


def build_hook(name: str, every: int, scope: str | None = None, r_max: float = 6.0,
               bins: int = 200, partials: bool = False, target: str | Callable | None = None,
               frame_format: str = "ase", label: str | None = None,
               max_pairs: int = RDF_MAX_PAIRS):
    """A built-in hook by ``name`` (one of :data:`HOOKS`).

    Args:
        every: steps between calls. scope: ``None`` (the hook's own) or one it supports
            (``callable``: any of ``owned``, ``global``, ``rank0``).
        r_max, bins, partials, max_pairs: of ``rdf``. target: of ``callable``: a function or
            ``"package.module:function"``. frame_format: ``callable`` in ``rank0``:
            ``ase`` or ``graph``. label: the file name (default: ``name``; for a callable
            the function's name); a plain file name (:func:`~xnn.dynamics.hooks.
            check_name`).
    """
    if name not in HOOKS:
        raise InputError(f"unknown hook {name!r}; choose one of {list(HOOKS)}")
    scope = DEFAULT_SCOPE[name] if scope is None else scope
    allowed = SCOPES if name == "callable" else (DEFAULT_SCOPE[name],)
    if scope not in allowed:
        raise InputError(f"hook {name!r} runs in scope {list(allowed)}, not {scope!r}")
    if name == "callable":
        if target is None:
            raise InputError("hook 'callable' needs target: 'package.module:function'")
        fn = load_target(target) if isinstance(target, str) else target
        label = getattr(fn, "__name__", "callable") if label is None else label
        if scope == "rank0":
            return FrameCallable(fn, every, label, frame_format)
        return (OwnedCallable if scope == "owned" else GlobalCallable)(fn, every, label)
    label = name if label is None else label
    if name == "rdf":
        return RDF(every, r_max, bins, partials, label, max_pairs=max_pairs)
    return (MSD if name == "msd" else SpeciesTemperature)(every, label)
