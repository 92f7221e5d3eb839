"""A compiled velocity-Verlet step: kick, drift, the model's energy, its force (and stress)
derivative and the second kick as one ``torch.compile``'d graph with fixed shapes.

The function ``(weights, x, v, F, edges, ...) -> (x', v', F', E', σ', d')`` is traced by
:func:`torch.fx.experimental.proxy_tensor.make_fx`, which records the autograd call that
gives forces and stress as ordinary operations, then compiled (inductor by default) for the
exact shapes of this run. Shapes stay fixed although the neighbor list changes size:

* edges are padded to a *capacity* with inert edges, self-edges of atoms shifted by a
  whole number of lattice vectors beyond ``cutoff + skin``; their vector does not depend on
  the positions, and every xnn model gives edges beyond its cutoff zero weight (the Verlet
  list relies on that too), so they change neither energy nor forces nor stress;
* the capacity grows geometrically (``growth``) when a rebuild overflows it, the only
  event that recompiles; neighbor lists are rebuilt outside the graph;
* with a skin, the model does not see the whole Verlet list: the graph keeps the edges
  shorter than the cutoff at the positions of the force call (in their order, compacted into
  a second, *active* capacity of inert edges; :func:`within_cutoff`), so the model's edge
  work is that of the edges it weighs (at 5 + 1 Å in FCC Cu, 42 of the list's 78 neighbours
  per atom). The graph counts those edges; a count above the active capacity (the step
  dropped edges) grows it, compiles again and repeats the step, so no result is ever one
  of a truncated list.

The graph also returns ``d'``, the largest distance of the *next* step's drifted positions
(``x' + dt (v' + a' dt / 2)``, exactly what the next call computes) from the positions of
the last build: the host reads this one scalar per step and, when it exceeds ``skin / 2``,
rebuilds the list at those positions before the next step. The list is thus valid at every
force evaluation, and a step costs one compiled call plus one host read.

This module compiles NVE; :mod:`xnn.dynamics.compiled_thermo` adds Langevin, CSVR and
Nosé–Hoover chains through the public :meth:`CompiledVerlet.run` (the traced module and its
extra inputs are the caller's) and :mod:`xnn.dynamics.compiled_graphs` the CUDA-graph
replay (``cuda_graph``). Kicks and drifts are :func:`xnn.dynamics.nve.kick` and
:func:`xnn.dynamics.nve.drift_positions`, those of the eager step. The cell stays fixed
(NPT runs eagerly; domain decomposition has its own compiled step,
:mod:`xnn.distributed.domain.compiled`); the model must be traceable (data-independent shapes under
:func:`~xnn.models.base.tracing_graph`). The result equals the eager step up to rounding.

A committee compiles like any model: the traced step's derivative is
:func:`~xnn.models.derivatives.compute_properties`, which evaluates every member with its own
leaves, and the step also returns the members' spread (:func:`spread_of`), set on the new
state's graph as the eager step sets it, for the thermo columns and the uncertainty guard.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.nve import drift_positions, kick
from xnn.dynamics.state import UNCERTAINTY, MDState, check_timestep, free_mask
from xnn.errors import InputError
from xnn.models.base import pairing_edges, squared_lengths
from xnn.neighbors.pairs import pair_order
from xnn.units import MVV2E

#: ``torch.compile`` backend of :class:`CompiledVerlet` (the one ``md.compile`` uses)
DEFAULT_BACKEND = "inductor"

#: graph fields the traced step takes besides positions and edges
_FIELDS = (K.NUMBERS, K.CELL, K.PBC, K.BATCH, K.MASSES, K.ATOM_ID)


class _Step(nn.Module):
    """What is traced: one velocity-Verlet step on padded edges."""

    def __init__(self, model: nn.Module, dt: float, stress: bool, cutoff: float,
                 paired: bool = False):
        super().__init__()
        self.model = model
        self.dt = dt
        self.stress = stress
        self.cutoff = cutoff
        self.paired = paired

    def forward(self, x: Tensor, v: Tensor, f: Tensor, ref: Tensor, fields: dict[str, Tensor],
                inv_m: Tensor, active: tuple) -> tuple[Tensor, ...]:
        from xnn.models.derivatives import compute_properties

        dt = self.dt
        v = kick(v, _acc(f, inv_m), dt)
        x = drift_positions(x, v, dt)
        graph, n_active, broken = model_graph(fields, x, self.cutoff, active, self.paired)
        with pairing_edges(self.paired):
            out = compute_properties(self.model, graph, True, self.stress)
        f = out[K.FORCES]
        v = kick(v, _acc(f, inv_m), dt)
        # where the next call will drift to, measured from the last build
        x_next = drift_positions(x, kick(v, _acc(f, inv_m), dt), dt)
        d_next = (x_next - ref).norm(dim=-1).max()
        stress = out[K.STRESS] if self.stress else torch.zeros_like(fields[K.CELL])
        return (x, v, f, out[K.ENERGY], stress, status(d_next, n_active, broken),
                *spread_of(out))


def spread_of(out: dict[str, Tensor]) -> tuple[Tensor, ...]:
    """A committee's :data:`~xnn.dynamics.state.UNCERTAINTY` of the results ``out`` of
    :func:`~xnn.models.derivatives.compute_properties` (``forces_std [n_atoms]``,
    ``energy_std [n_systems]``), the last outputs of a traced step; ``()`` for one model."""
    return tuple(out[k] for k in UNCERTAINTY if k in out)


def with_spread(graph: AtomicGraph, spread: tuple | list) -> AtomicGraph:
    """``graph`` with a step's :func:`spread_of` outputs as its uncertainty fields (as the
    eager step's :func:`~xnn.dynamics.state.evaluate_graph` sets them); unchanged without."""
    return graph.replace(dict(zip(UNCERTAINTY, spread))) if spread else graph


def model_graph(fields: dict[str, Tensor], x: Tensor, cutoff: float, active: tuple,
                paired: bool = False) -> tuple[AtomicGraph, Tensor, Tensor]:
    """The graph the model sees at positions ``x``: the padded Verlet list of ``fields``, or
    with ``active`` (inert edges ``(edge_index, shifts)`` of the active capacity) its edges
    within ``cutoff`` (:func:`within_cutoff`); their count (0 without ``active``); and, for
    a ``paired`` list, the number of pairs whose two edges the filter parted (0 unless the
    pairing is wrong)."""
    graph = AtomicGraph({**fields, K.POSITIONS: x}, validate=False)
    zero = torch.zeros((), dtype=torch.int64, device=x.device)
    if not active:
        return graph, zero, zero
    if paired:
        ei, sh, n, broken = within_cutoff_paired(graph, cutoff, active)
    else:
        (ei, sh, n), broken = within_cutoff(graph, cutoff, active), zero
    return AtomicGraph({**fields, K.EDGE_INDEX: ei, K.SHIFTS: sh, K.POSITIONS: x},
                       validate=False), n, broken


def within_cutoff(graph: AtomicGraph, cutoff: float, inert: tuple[Tensor, Tensor]
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """``(edge_index, shifts, n)``: the edges of ``graph`` shorter than ``cutoff`` at its
    positions, in their order, in the first slots of the inert edges ``inert`` (the active
    capacity; the other slots stay inert), and their number ``n`` (0-d int64; above the
    capacity, the edges beyond it were dropped). Fixed shapes, no host sync: traceable."""
    cap = inert[0].shape[1]
    with torch.no_grad():
        keep = _kept(graph, cutoff)
        ei, sh = _compact(graph, _slots(keep, cap, 0, cap), inert)
    return ei, sh, keep.sum()


def within_cutoff_paired(graph: AtomicGraph, cutoff: float, inert: tuple[Tensor, Tensor]
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`within_cutoff` of a paired list (its second half reverses its first, edge by
    edge; :func:`xnn.neighbors.pairs.pair_order`) into a paired active capacity: each half
    compacted into its half of the slots, so the kept edges stay paired (a pair's two
    lengths are bitwise equal, so both or neither are kept). Also returns the number of
    pairs with one edge kept and the other not (0; anything else is a wrong pairing)."""
    cap = inert[0].shape[1]
    half_cap, half = cap // 2, graph.edge_index.shape[1] // 2
    with torch.no_grad():
        keep = _kept(graph, cutoff)
        first, second = keep[:half], keep[half:]
        slot = torch.cat([_slots(first, half_cap, 0, cap), _slots(second, half_cap, half_cap, cap)])
        ei, sh = _compact(graph, slot, inert)
    return ei, sh, keep.sum(), (first != second).sum()


def _kept(graph: AtomicGraph, cutoff: float) -> Tensor:
    """``[E]`` bool: the edges of ``graph`` shorter than ``cutoff`` at its positions."""
    vec = graph.edge_vectors(graph.positions.detach())
    return (vec * vec).sum(-1) < cutoff * cutoff


def _slots(keep: Tensor, cap: int, offset: int, discard: int) -> Tensor:
    """The slot of each kept edge in a block of ``cap`` slots starting at ``offset``, in
    their order; ``discard`` for the others and for those beyond the block."""
    slot = torch.cumsum(keep, 0) - 1
    return torch.where(keep & (slot < cap), slot + offset, discard)


def _compact(graph: AtomicGraph, slot: Tensor, inert: tuple[Tensor, Tensor]
             ) -> tuple[Tensor, Tensor]:
    """The inert edges ``inert`` with the edges of ``graph`` written into their ``slot``
    (slot = capacity: a discarded extra column)."""
    inert_ei, inert_sh = inert
    cap = inert_ei.shape[1]
    ei = torch.cat([inert_ei, inert_ei[:, :1]], 1).index_copy(
        1, slot, graph.edge_index.to(inert_ei.dtype))
    sh = torch.cat([inert_sh, inert_sh[:1]]).index_copy(0, slot, graph.shifts.to(inert_sh.dtype))
    return ei[:, :cap], sh[:cap]


def status(d_next: Tensor, n_active: Tensor, broken: Tensor | None = None) -> Tensor:
    """``[3]`` float64: the look-ahead displacement, the active edge count (exact below
    2^53) and the count of parted pairs (:func:`model_graph`), read by the host with one
    transfer."""
    broken = torch.zeros_like(n_active) if broken is None else broken
    return torch.stack([d_next.detach().to(torch.float64), n_active.to(torch.float64),
                        broken.to(torch.float64)])


class CompiledVerlet:
    """Velocity-Verlet (NVE) steps of a :class:`~xnn.models.Potential` through one compiled
    graph per edge capacity.

    Args:
        potential: the model and its Verlet list (``potential.model``, ``.neighbors``).
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` for tests).
        growth: capacity factor applied when a rebuild overflows the capacity (> 1).
        headroom: capacity of the first build relative to its edge count (>= 1).
        cuda_graph: replay each compiled call as a CUDA graph.
        hashed_rng: the traced steps hash random numbers (:func:`compile_options`).

    :meth:`step` runs NVE; :meth:`run` runs any traced step module on the padded list
    (:class:`xnn.dynamics.compiled_thermo.CompiledSchemeStep` runs the thermostats with it).

    Attributes:
        n_compiles: graphs compiled so far (one per capacity, dt and stress setting).
        n_rebuilds: neighbor-list builds so far.
    """

    def __init__(self, potential, backend: str = "inductor", growth: float = 1.25,
                 headroom: float = 1.1, cuda_graph: bool = False, hashed_rng: bool = False):
        if cuda_graph and potential_device(potential).type != "cuda":
            raise InputError("md.cuda_graph needs a CUDA device (model.device=cuda); on the "
                             "CPU use md.compile alone")
        if growth <= 1.0 or headroom < 1.0:
            raise InputError(f"growth must be > 1 and headroom >= 1, got {growth}, {headroom}")
        self.potential = potential
        self.model = potential.model
        self.neighbors = potential.neighbors
        self.backend = backend
        self.growth = float(growth)
        self.headroom = float(headroom)
        self.cuda_graph = bool(cuda_graph)
        self.capacity = 0
        #: filter the list to the cutoff in the graph (with a skin; ``active_capacity``)
        self.filters = self.neighbors.skin > 0.0
        #: lists arranged as reverse pairs for a model that evaluates length-only edge
        #: work once per pair (its ``pairs_edges``; :func:`~xnn.models.base.edges_paired`);
        #: false from the first list that is not full
        self.paired = bool(self.model.pairs_edges)
        self.active_capacity = 0
        self.n_active = 0  # edges within the cutoff at the last force call
        self._active: tuple = ()  # inert edges of the active capacity
        self._overflowed = 0  # the count of the last step that overflowed it
        self.n_compiles = 0
        self.n_rebuilds = 0
        self._fn = None
        self._key: tuple | None = None
        self._edges: tuple[Tensor, Tensor] | None = None
        self._ref: Tensor | None = None
        self._next_disp: float | Tensor | None = None
        #: the traced steps hash random numbers (compile options, :func:`compile_options`)
        self.hashed_rng = bool(hashed_rng)
        self._mass: tuple | None = None  # (ids of masses and fixed, mass_mvv, masses)
        self._replay = None  # the CudaGraphStep of the current function (cuda_graph)
        self._returned: Tensor | None = None  # positions of the state the last step returned

    # ------------------------------------------------------------------ neighbor list
    def _rebuild(self, graph: AtomicGraph, positions: Tensor) -> None:
        """Build the list at ``positions`` and pad it to the capacity (grown if needed)."""
        nl = self.neighbors
        nl.reset()
        g = nl(graph.replace(positions=positions))
        ei, sh = g.edge_index, g.shifts
        n = ei.shape[1]
        order = pair_order(ei, sh) if self.paired else None
        self.paired = order is not None
        if n > self.capacity:
            grown = math.ceil(self.capacity * self.growth)
            self.capacity = max(math.ceil(n * self.headroom), grown, 1)
        if self.paired:  # [first half, padding, second half, the same padding]
            self.capacity += self.capacity % 2
            ei, sh = ei[:, order], sh[order]
        parts = 2 if self.paired else 1
        ei_pad, sh_pad = _inert_edges(graph, nl.cutoff + nl.skin, (self.capacity - n) // parts)
        self._edges = (torch.cat([x for e in ei.tensor_split(parts, 1) for x in (e, ei_pad)], 1),
                       torch.cat([x for e in sh.tensor_split(parts) for x in (e, sh_pad)]))
        self._ref = positions.detach().clone()
        self.n_rebuilds += 1
        if self.filters:
            vec = g.edge_vectors(positions.detach())
            self._grow_active(graph, int((squared_lengths(vec) < nl.cutoff ** 2).sum()))

    def _grow_active(self, graph: AtomicGraph, n: int) -> None:
        """The inert edges of an active capacity of at least ``n`` edges (grown as the
        list's capacity) for the atoms and cells of ``graph``."""
        if n > self.active_capacity:
            grown = math.ceil(self.active_capacity * self.growth)
            self.active_capacity = max(math.ceil(n * self.headroom), grown, 1)
        nl = self.neighbors
        if self.paired:  # two equal halves (within_cutoff_paired)
            self.active_capacity += self.active_capacity % 2
            ei, sh = _inert_edges(graph, nl.cutoff + nl.skin, self.active_capacity // 2)
            self._active = (torch.cat([ei, ei], 1), torch.cat([sh, sh]))
        else:
            self._active = _inert_edges(graph, nl.cutoff + nl.skin, self.active_capacity)

    def _run(self, key: tuple, make_step, inputs: tuple, graph: AtomicGraph) -> tuple:
        """The compiled step's outputs for ``inputs`` (their last is ``active``, the one
        before it the status); an overflow of the active capacity grows it and runs again."""
        while True:
            fn = self._function(key, make_step, inputs)
            out = fn(*inputs)
            d_next, n_active, broken = out[5].tolist()  # the step's one host read
            self._next_disp, self.n_active = d_next, int(n_active)
            if broken:  # pragma: no cover - a pair's lengths are bitwise equal
                raise RuntimeError(f"the paired neighbor list parted {int(broken)} pairs "
                                   "at the cutoff: please report this (xnn bug)")
            if not self.filters or self.n_active <= self.active_capacity:
                return out
            self._overflowed = self.n_active
            self._grow_active(graph, self.n_active)
            inputs = (*inputs[:-1], self._active)

    def _ensure_list(self, g: AtomicGraph, positions) -> None:
        """Rebuild the list at ``positions()`` (the next force call's positions) when there
        is none for this system, the state is not the one the last step returned (its
        look-ahead says nothing about it), or that look-ahead left the skin."""
        if self._edges is None or self._ref is None or g.positions is not self._returned:
            self._next_disp = None
            self._rebuild(g, positions())
        elif self._next_disp is not None and bool(self._next_disp > 0.5 * self.neighbors.skin):
            self._rebuild(g, positions())

    # ------------------------------------------------------------------ compiled step
    def _function(self, key: tuple, make_step, inputs):
        """The compiled function of the module ``make_step()`` for ``key`` (compiled again
        when it or the capacity changes), replayed as a CUDA graph under ``cuda_graph``."""
        key = (self.capacity, self.active_capacity, self.paired, *key)
        if self._fn is None or key != self._key:
            self._fn = self._compile(make_step(), inputs)
            self._replay = None
            self._key = key
        if not self.cuda_graph:
            return self._fn
        if self._replay is None:  # pragma: no cover - needs CUDA
            from xnn.dynamics.compiled_graphs import CudaGraphStep

            self._replay = CudaGraphStep(self._fn)
        return self._replay

    def _compile(self, step: nn.Module, inputs):
        from torch.func import functional_call
        from torch.fx.experimental.proxy_tensor import make_fx

        from xnn.models.base import tracing_graph

        weights = {**dict(step.named_parameters()), **dict(step.named_buffers())}
        weights = {k: t.detach() for k, t in weights.items()}

        def fn(weights, *args):
            return functional_call(step, weights, args)

        with tracing_graph():  # constants outside parameters/buffers (cuEquivariance's
            # descriptors) are kept as graph constants
            gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(weights, *inputs)
        compiled = torch.compile(gm, backend=self.backend, dynamic=False, fullgraph=True,
                                 options=compile_options(self.backend, self.hashed_rng))
        self.n_compiles += 1
        return lambda *args: compiled(weights, *args)

    def run(self, state: MDState, key: tuple, make_step, next_positions, names: tuple[str, ...],
            extra: tuple) -> tuple:
        """The outputs of one compiled step from ``state``.

        The list is rebuilt at ``next_positions()`` (the force call's positions) where it
        is stale; the function traced from the module ``make_step()`` (compiled once per
        ``key``, capacities, pairing) is called on ``(x, v, F, ref, fields, *extra,
        active)``, where ``fields`` holds the graph's fields ``names`` and the padded edges.
        Its outputs start with the new positions and have the status
        (:func:`status`) sixth; an overflow of the active capacity grows it and runs again.
        The next call must start from the positions returned (else the list is rebuilt).
        """
        g = state.graph
        self._ensure_list(g, next_positions)
        fields = {k: g[k] for k in names if k in g}
        fields[K.EDGE_INDEX], fields[K.SHIFTS] = self._edges
        inputs = (g.positions.detach(), g.velocities, state.forces, self._ref, fields, *extra,
                  self._active)
        out = self._run(key, make_step, inputs, g)
        self._returned = out[0]
        return out

    def step(self, state: MDState, dt: float) -> MDState:
        """Advance ``state`` by ``dt`` (fs) in NVE; the returned state's step count is +1."""
        dt = check_timestep(dt)
        g = state.graph
        if self._mass is None or self._mass[:2] != (id(g.masses), id(g.get(K.FIXED))):
            self._mass = (id(g.masses), id(g.get(K.FIXED)), mass_mvv(g), g.masses)
        inv_m = self._mass[2]
        x, v, f, energy, stress, _, *spread = self.run(
            state, (dt, state.compute_stress, g.n_atoms),
            lambda: _Step(self.model, dt, state.compute_stress, self.neighbors.cutoff,
                          self.paired),
            lambda: _drifted(g, state.forces, inv_m, dt), _FIELDS, (inv_m,))
        return state.replace(graph=with_spread(g.replace(positions=x, velocities=v), spread),
                             forces=f, energy=energy, stress=stress, step=state.step + 1)


def compile_options(backend: str, hashed_rng: bool) -> dict | None:
    """``torch.compile`` options of a step graph: with inductor, graphs that hash random
    numbers (``hashed_rng``: a :class:`~xnn.dynamics.compiled_thermo.Scheme` whose
    ``uses_hashed_rng``) run without constant and index propagation (hashed draws multiply
    index-derived words by 64-bit constants; the propagation folds them into int32 index
    arithmetic that Triton refuses: "Scalar ... out of range for type int32")."""
    if backend == "inductor" and hashed_rng:
        return {"constant_and_index_propagation": False}
    return None


def mass_mvv(g: AtomicGraph) -> Tensor:
    """``[n_atoms, 1]`` ``m MVV2E`` (eV fs²/Å²), infinite on fixed atoms: ``F /`` it is the
    eager step's acceleration (Å/fs²)."""
    return torch.where(free_mask(g)[:, None], g.masses[:, None] * MVV2E,
                       torch.full_like(g.positions[:, :1], math.inf))


def _drifted(g: AtomicGraph, forces: Tensor, inv_m: Tensor, dt: float) -> Tensor:
    """The positions the compiled step drifts to (same arithmetic as :class:`_Step`)."""
    return drift_positions(g.positions.detach(), kick(g.velocities, _acc(forces, inv_m), dt), dt)


def _acc(forces: Tensor, m_mvv: Tensor) -> Tensor:
    """Accelerations (Å/fs²) as :func:`~xnn.dynamics.state.accelerations` computes them:
    ``F / (m MVV2E)``, zero where ``m_mvv`` is infinite (fixed atoms)."""
    return forces / m_mvv


def _inert_edges(graph: AtomicGraph, reach: float, n: int) -> tuple[Tensor, Tensor]:
    """``n`` self-edges, of atoms ``0, 1, 2, ...`` in turn (no two padding edges scatter
    onto one atom while ``n <= n_atoms``: no atomic contention on a GPU), each shifted by
    ``k`` times the longest lattice vector ``a`` of its system with ``k |a| > reach``:
    beyond every cutoff, and independent of the positions."""
    dev = graph.positions.device
    atoms = torch.arange(n, device=dev) % max(graph.n_atoms, 1)
    ei = torch.stack([atoms, atoms])
    sh = torch.zeros(n, 3, dtype=torch.long, device=dev)
    if n == 0:
        return ei, sh
    lengths = graph.cell.detach().norm(dim=-1)  # [n_systems, 3]
    longest, axis = lengths.max(dim=-1)
    if bool((longest < 1e-6).any()):
        raise InputError("the compiled MD step needs cells with a non-zero lattice vector "
                         "(give clusters a box) or run without compile")
    k = torch.floor(reach / longest).to(torch.long) + 2  # [n_systems]
    system = graph.batch.index_select(0, atoms)
    sh[torch.arange(n, device=dev), axis.index_select(0, system)] = k.index_select(0, system)
    return ei, sh


def potential_device(potential) -> torch.device:
    """The device of the potential's model (its first parameter or buffer; CPU if none)."""
    for t in (*potential.model.parameters(), *potential.model.buffers()):
        return t.device
    return torch.device("cpu")

