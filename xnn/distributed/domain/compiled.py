"""The compiled velocity-Verlet step under domain decomposition (``md.compile=true`` on
several ranks, mode ``halo``).

A step of the eager decomposed NVE (:class:`~xnn.distributed.DecomposedPotential` with
:func:`xnn.dynamics.nve.step`) runs as three compiled regions with fixed shapes and three
communication points between them (the *graph breaks*, eager on purpose)::

    [1] kick, drift, gather of the rows each peer needs     (compiled)
        halo exchange of ghost positions                    (point-to-point, break 1)
    [2] model energy of the padded local graph, its forces
        on owned and ghost rows and its virial share        (compiled)
        reverse exchange of ghost forces                    (point-to-point, break 2)
    [3] force sum into owners, second kick, look-ahead
        displacements                                       (compiled)
        one all-gather of energy, virial share and the
        look-ahead displacements of every rank              (collective, break 3)

Shapes survive rebuilds and migrations through the padding of
:mod:`xnn.distributed.domain.compiled_plan` (inert atoms and edges, capacities grown
geometrically on overflow: the only recompile). Region 3 returns the largest distance of
the *next* drift's positions from the ghost plan's reference and from the last migration;
when either exceeds ``skin / 2`` on some rank, all ranks migrate
(:meth:`~xnn.distributed.DecomposedPotential.maybe_migrate`) and rebuild the plan at the next
positions (:meth:`~xnn.distributed.DecomposedPotential.update`) eagerly, outside the graphs, so
the plan is valid at every force evaluation. A steady step thus costs 3 compiled calls, 2
point-to-point exchanges and 1 all-gather (the eager step: 2 exchanges and 3 all-reduces).

With a skin, region 2 gives the model only the local edges shorter than the cutoff at its
positions (compacted in order into a fixed *active* capacity of inert edges, as the
one-process compiled step does) and counts them; the count travels in the all-gather, and a
step in which some rank found more than the capacity holds is repeated by all ranks at a
grown capacity (a recompile of region 2), so no result comes from a truncated list.

Forces, virial and stress are those of the eager decomposed step, by the same code: region 2
strains the local positions, ``x_local (1 + ε)`` (equal to the eager step's strained owners
and cell), and takes the rank's share ``E_r`` (its owned atoms' energies) with respect to
the exchange base (owned rows, then received ghost rows) and ``ε`` through
:func:`~xnn.models.derivatives.derive`; the ghost rows' forces go
back to their owners through the halo exchange's own adjoint
(:func:`~xnn.distributed.domain.halo.exchange_rows`, then
:func:`~xnn.distributed.domain.halo.add_returned` in region 3), so ``F_owned = -(∂E_r/∂x_owned
+ Σ_peers ∂E_q/∂x_ghost)``, the sum the eager step's backward through the exchange makes;
the virial shares add up in the all-gather (the eager step's strain reducer) and
:func:`~xnn.models.derivatives.virial_results` gives the stress. Kicks and drifts are
:func:`xnn.dynamics.nve.kick` and :func:`~xnn.dynamics.nve.drift_positions`. Results equal
the eager decomposed step (and one process) to rounding. Models with sync points run in
mode ``halo`` (ghosts of ``cutoff × num_interactions``); long-range models are refused.

With ``parallel.exchange=staged`` (the ghost plan carries a
:class:`~xnn.distributed.domain.staged.StagedRouting`) the two exchanges go through the
routing, at the same points and with the same compiled regions
(``CompiledDomainVerlet._forward`` and ``_reverse``): the ghost positions are the routing's
forward of the owned rows, and its adjoint sums the ghost rows' forces into the owned rows
before region 3 (whose returned rows then stay zero); ``direct`` runs as before.

A committee (``committee_size`` K > 1) runs through the same regions: region 2 evaluates
every member on its own leaves (base rows and strain) and derives them all by one
:func:`~xnn.models.derivatives.derive_members` call; the members' forces travel side by
side (rows ``[n, 3 K]``) through the same two exchanges, their energy and virial shares in
the same all-gather (:func:`head_of`); region 3 forms the mean force and each owned atom's
``forces_std`` after the ghosts' forces are summed into their owners, the host the totals'
``energy_std`` and stress (:func:`~xnn.models.derivatives.committee_results`, as the eager
decomposed step, :mod:`xnn.distributed.committee`); the state carries both as the eager
step's does (thermo columns, the uncertainty guard).

Regions 1 and 3 are methods (:meth:`~CompiledDomainVerlet.first`,
:meth:`~CompiledDomainVerlet.last`) that :mod:`xnn.distributed.domain.compiled_thermo`
overrides to run Langevin, CSVR and NHC.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.distributed.domain.compiled_plan import Capacities, PaddedPlan, pad_plan, plan_counts
from xnn.distributed.domain.halo import add_returned, exchange_rows
from xnn.dynamics.nve import drift_positions, kick
from xnn.dynamics.state import MDState, accelerations, check_timestep
from xnn.errors import InputError
from xnn.models.derivatives import (
    StrainedGraph,
    committee_results,
    derive_members,
    strain_rows,
    virial_results,
)

#: compiled regions and communication points (graph breaks) of a step without rebuild
REGIONS_PER_STEP = 3
BREAKS_PER_STEP = 3


class _Model(nn.Module):
    """Region 2: the rank's energy share on the padded local graph, the forces on the
    exchange base's rows and the virial share (with ``active``, on the local edges within
    ``cutoff``, and their count; ``paired``: the local edges are reverse pairs, and the
    model does its radial work once per pair). A committee of ``k`` members: each member
    on its own leaves (base rows and strain), as
    :func:`~xnn.models.derivatives.committee_properties`, all derived by one
    :func:`~xnn.models.derivatives.derive_members` call; the members' forces side by side
    (``[n_base, 3 k]``: the exchanges carry them as rows)."""

    def __init__(self, model: nn.Module, stress: bool, cutoff: float, paired: bool = False,
                 k: int = 1):
        super().__init__()
        self.model = model
        self.stress = stress
        self.cutoff = cutoff
        self.paired = paired
        self.k = k

    def forward(self, x_owned: Tensor, recv: Tensor, src: Tensor, shifts: Tensor,
                cell: Tensor, pbc: Tensor, owned: Tensor, fields: dict[str, Tensor],
                active: tuple):
        from xnn.dynamics.compiled import model_graph
        from xnn.models.base import pairing_edges

        # the leaves of derive_members, per member: the exchange base's rows and the strain
        # ε, applied to the local positions by derivatives.strain_rows, x_local (1 + ε),
        # which equals apply_strain's strained owners and cell by linearity (apply_strain's
        # own order, base (1 + ε) gathered plus shifts @ cell (1 + ε), is miscompiled by
        # inductor on the CPU in torch 2.13: wrong forces; tests/test_compiled_domain.py's
        # inductor test)
        strained, xs = [], []
        for _ in range(self.k):
            base = torch.cat([x_owned, recv]).detach().requires_grad_(True)
            eps = torch.zeros_like(cell)
            if self.stress:
                eps.requires_grad_(True)
            xs.append(strain_rows(base.index_select(0, src) + shifts @ cell[0], eps[0]))
            strained.append((base, eps))
        # (a paired filter keeps both edges of a pair or neither: their lengths are equal;
        # the members' positions are equal in value: one filter serves them all)
        graph, n_active, _ = model_graph(fields, xs[0], self.cutoff, active, self.paired)
        graphs = [graph] + [graph.replace(positions=x) for x in xs[1:]]
        with pairing_edges(self.paired):
            energies = (self.model.member_energies(graphs) if self.k > 1
                        else self.model(graph)[None])
        e = torch.where(owned, energies, torch.zeros_like(energies)).sum(-1)  # [k]
        leaves = [StrainedGraph(g, b, eps) for g, (b, eps) in zip(graphs, strained)]
        volume = torch.linalg.det(cell).abs()
        out = derive_members(e.sum(), leaves, volume, pbc, True, self.stress, False)
        f = out[K.FORCES]  # [k, n_base, 3]
        f = f[0] if self.k == 1 else f.transpose(0, 1).reshape(f.shape[1], 3 * self.k)
        virial = (out[K.VIRIAL][:, 0] if self.stress
                  else torch.zeros((self.k, 3, 3), dtype=cell.dtype, device=cell.device))
        return e.detach(), f, virial, xs[0].detach(), n_active


def member_forces(f: Tensor, k: int, calibration: dict | None) -> tuple[Tensor, tuple]:
    """``(forces [n, 3], spread)`` of the summed forces ``f [n, 3 k]`` of ``k`` members
    (region 2's layout): one model's own (spread ``()``); a committee's mean and
    ``(forces_std [n],)`` (:func:`~xnn.models.derivatives.committee_results`)."""
    if k == 1:
        return f, ()
    out = committee_results({K.FORCES: f.reshape(f.shape[0], k, 3).transpose(0, 1)},
                            calibration)
    return out[K.FORCES], (out[K.FORCES_STD],)


def _kick_drift(dt: float):
    def region(x, v, f, inv_m, send_index):
        v = kick(v, f / inv_m, dt)
        x = drift_positions(x, v, dt)
        return x, v, x.index_select(0, send_index)
    return region


def _finish(dt: float, k: int = 1, calibration: dict | None = None):
    def region(x, v, f_base, back, send_index, inv_m, ref, migrated, e, virial):
        f, spread = member_forces(add_returned(f_base, send_index, back), k, calibration)
        a = f / inv_m
        v = kick(v, a, dt)
        x_next = drift_positions(x, kick(v, a, dt), dt)  # where the next region 1 drifts to
        d = torch.stack([(x_next - ref).norm(dim=-1).max(),
                         (x_next - migrated).norm(dim=-1).max()])
        return v, f, head_of(e, virial, d), *spread
    return region


def head_of(e: Tensor, virial: Tensor, d: Tensor) -> Tensor:
    """The row each rank all-gathers: its members' energy shares ``e [k]``, virial shares
    ``[k, 3, 3]`` and the look-ahead displacements ``d [2]`` (the step appends its active
    edge count)."""
    return torch.cat([e.reshape(-1), virial.reshape(-1), d])


class CompiledDomainVerlet:
    """Velocity-Verlet (NVE) steps of a :class:`~xnn.distributed.DecomposedPotential` through
    three compiled regions per capacity (see the module docstring).

    Args:
        potential: the decomposed potential (mode ``halo``, no long-range terms).
        backend: ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` for tests).
        growth, headroom, slack: capacity policy (:class:`~.compiled_plan.Capacities`).
    Attributes:
        n_compiles: regions compiled so far (three per set of capacities).
        n_replans: padded plans made (first step, rebuilds, migrations).
        n_steps, n_region_calls, n_exchanges, n_collectives: per-run counts of steps,
            compiled calls, halo exchanges (2 per step; a staged one is a point-to-point
            call per stage) and collectives of the steps (rebuilds included; the initial
            evaluation excluded).
        filters: with a skin, the model region sees only the local edges within the cutoff
            (compacted into the capacity ``active``; :func:`~xnn.dynamics.compiled.within_cutoff`).
        n_active: the largest count over the ranks of those edges at the last step; a count
            above the capacity grows it and repeats the step (``n_active_overflows``).
        n_graph_collectives: all-reduces inside the compiled regions called so far (the
            thermostats' global sums, :mod:`~xnn.distributed.domain.compiled_thermo`; none
            for NVE).
        comm_s: host seconds spent in the steps' exchanges and all-gathers (waiting for
            the other ranks included; on a GPU, without a device synchronisation, a lower
            bound).
    """

    def __init__(self, potential, backend: str = "inductor", growth: float = 1.25,
                 headroom: float = 1.25, slack: int = 16):
        if potential.mode != "halo":
            raise InputError(f"the compiled decomposed step needs mode halo, not "
                             f"{potential.mode!r} (sync points exchange inside the model); "
                             "set parallel.mode: halo or compile: false")
        if potential.long_range:
            raise InputError("the compiled decomposed step does not run long-range models "
                             "(their global sums are collectives inside the model); set "
                             "compile: false")
        if growth <= 1.0 or headroom < 1.0:
            raise InputError(f"growth must be > 1 and headroom >= 1, got {growth}, {headroom}")
        self.potential = potential
        self.backend = backend
        #: committee members (1: one model) and a committee's calibration factors
        self.k = int(potential.model.committee_size)
        self.calibration = potential.model.calibration if self.k > 1 else None
        self.caps = Capacities(float(growth), float(headroom), int(slack))
        #: filter the local edges to the cutoff in the model region (with a skin)
        self.filters = potential.filters
        self.n_active = 0  # largest count over the ranks of edges within the cutoff, last step
        self.n_active_overflows = 0  # steps repeated at a grown active capacity
        self.n_compiles = self.n_replans = self.n_steps = 0
        self.n_region_calls = self.n_exchanges = self.n_collectives = 0
        self.n_graph_collectives = 0
        self.comm_s = 0.0
        #: the traced regions hash random numbers (:func:`~xnn.dynamics.compiled.compile_options`)
        self.hashed_rng = False
        self._in_graph: dict = {}  # collectives traced into each compiled region
        self._plan: PaddedPlan | None = None
        self._fns: dict = {}
        self._models: dict = {}
        self._pad_z: int | None = None
        self._x_local: Tensor | None = None

    # ------------------------------------------------------------------ compilation
    @property
    def plan(self) -> PaddedPlan | None:
        """The padded plan of the current ghost plan (None before the first step)."""
        return self._plan

    def compiled(self, name: str, key: tuple, make, inputs):
        """The compiled region ``name`` of the function ``make()`` for ``key`` (compiled on
        the first call with ``inputs``: the only recompile is a new key). The collectives
        traced into it (a region's :class:`~xnn.distributed.reducer.GroupReducer`) are
        counted per call: :attr:`n_graph_collectives` and every open
        :func:`~xnn.distributed.collectives.count_collectives` block."""
        full = (name, *key)
        if full not in self._fns:
            with C.traced_collectives() as calls:
                self._fns[full] = self._compile(make(), inputs)
            self._in_graph[full] = tuple(calls)
        self.n_region_calls += 1
        self.n_graph_collectives += len(self._in_graph[full])
        C.count_traced(self._in_graph[full])
        return self._fns[full]

    def _compile(self, fn, inputs):
        from torch.fx.experimental.proxy_tensor import make_fx

        from xnn.dynamics.compiled import compile_options
        from xnn.models.base import tracing_graph

        with tracing_graph():
            gm = make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*inputs)
        self.n_compiles += 1
        return torch.compile(gm, backend=self.backend, dynamic=False, fullgraph=True,
                             options=compile_options(self.backend, self.hashed_rng))

    def _model_region(self, stress: bool, inputs):
        from torch.func import functional_call

        paired = self._plan.paired
        if (stress, paired) not in self._models:  # the traced module and its weights, once
            step = _Model(self.potential.model, stress, self.potential.cutoff, paired, self.k)
            weights = {**dict(step.named_parameters()), **dict(step.named_buffers())}
            self._models[stress, paired] = (step, {k: t.detach() for k, t in weights.items()})
        step, weights = self._models[stress, paired]
        key = (tuple(sorted(self._plan.caps.items())), stress, paired)
        fn = self.compiled("model", key, lambda: lambda w, *a: functional_call(step, w, a),
                           (weights, *inputs))
        return fn(weights, *inputs)

    # ------------------------------------------------------------------ padding
    def _padded(self, t: Tensor, cap: int) -> Tensor:
        """``t [n_owned, ...]`` as ``[cap, ...]`` (zero rows appended); a view of the last
        step's padded output is used as it is."""
        base = t._base
        if base is not None and base.shape[0] == cap and t.data_ptr() == base.data_ptr() \
                and base.shape[1:] == t.shape[1:]:
            return base
        out = t.new_zeros((cap, *t.shape[1:]))
        out[: t.shape[0]] = t
        return out

    def _replan(self, state: MDState, dt: float) -> None:
        """Rebuild the ghost plan where it is stale at the next drift's positions, then
        pad it to capacities shared by the ranks. Collective."""
        pot, g = self.potential, state.graph
        if self._pad_z is None:  # a species of the system for the padding atoms
            z = g.numbers.max() if g.n_atoms else g.numbers.new_tensor(-1)
            self._pad_z = int(C.all_reduce_max(z.reshape(1).double(), pot.group)[0])
            self.n_collectives += 1
        pot.update(g.replace(positions=self.next_positions(state, dt)))
        self.n_collectives += 1
        if not torch.equal(pot.state.graph.atom_id, g.atom_id):
            raise InputError("the compiled decomposed step got other atoms than its "
                             "potential's plan holds; pass the states it returns")
        # capacities shared by the ranks (ranks alike in the mean: the largest count is the
        # best guess of any rank's next one; growth, and the recompile, happen together)
        counts = torch.tensor(plan_counts(pot.state), dtype=torch.float64, device=g.device)
        fit = [int(n) for n in C.all_reduce_max(counts, pot.group).tolist()]
        self.n_collectives += 1
        self._plan = pad_plan(pot.state, g, self.caps, self._pad_z, 2.0 * pot.halo_width
                              + 2.0 * pot.cutoff, fit, self.filters, 3 * self.k)
        self.n_replans += 1

    def _grow_active(self, n: int) -> None:
        """Grow the active capacity (shared by the ranks) to hold ``n`` edges."""
        from xnn.distributed.domain.compiled_plan import inert_active

        p = self._plan
        sizes = dict(self.caps.sizes)
        sizes["active"] = self.caps.grown(n, sizes["active"])
        sizes["active"] += sizes["active"] % 2  # (a paired list's two halves)
        self.caps.sizes = sizes
        p.caps = dict(sizes)
        p.active = inert_active(sizes["active"], sizes["local"], p.src.device, p.paired)
        self.n_active_overflows += 1

    # ------------------------------------------------------------------ exchanges
    def _forward(self, x: Tensor, send: Tensor) -> None:
        """Ghost positions into the plan's ``recv_buf`` (its padding rows untouched):
        direct, region 1's ``send`` rows (send order) to the peers
        (:func:`~xnn.distributed.domain.halo.exchange_rows`); staged, the routing's stages
        from the owned rows of ``x [cap_owned, 3]`` (``send`` unused)."""
        p = self._plan
        t0 = time.perf_counter()
        if p.routing is None:
            exchange_rows(send, p.send_counts, p.recv_buf, p.recv_counts, p.peers,
                          self.potential.group)
        else:
            p.recv_buf[: p.n_recv] = p.routing.forward(x[: p.n_owned])
        self.comm_s += time.perf_counter() - t0
        self.n_exchanges += 1

    def _reverse(self, f_base: Tensor) -> Tensor:
        """The ghost rows of region 2's forces ``f_base [cap_owned + cap_recv, w]`` back to
        their owners; returns the owned rows ``[cap_owned, w]`` region 3 starts from.
        Direct: the rows go into the plan's ``back_buf`` (send order), which region 3 adds
        into the owners (:func:`~xnn.distributed.domain.halo.add_returned`). Staged: the
        routing's adjoint sums them into the owned rows here (a new tensor: region 2's
        output is not written), and ``back_buf`` stays zero, so region 3 adds nothing."""
        p, co = self._plan, self._plan.caps["owned"]
        t0 = time.perf_counter()
        if p.routing is None:
            exchange_rows(f_base[co:], p.recv_counts, p.back_buf, p.send_counts, p.peers,
                          self.potential.group)
            f_owned = f_base[:co]
        else:
            n = p.n_owned
            back = p.routing.reverse(f_base[co: co + p.n_recv])
            f_owned = torch.cat([f_base[:n] + back, f_base[n:co]])
        self.comm_s += time.perf_counter() - t0
        self.n_exchanges += 1
        return f_owned

    # ------------------------------------------------------------------ regions 1 and 3
    def next_positions(self, state: MDState, dt: float) -> Tensor:
        """``[n_owned, 3]`` the positions region 1 moves ``state`` to (eager)."""
        return _drifted(state.graph, state.forces, dt)

    def first(self, state: MDState, x: Tensor, v: Tensor, f: Tensor, dt: float):
        """Region 1 on the padded rows: ``x, v`` at the force call and the rows to send."""
        p = self._plan
        args = (x, v, f, p.inv_m, p.send_index)
        return self.compiled("kick", (p.caps["owned"], p.caps["send"], dt),
                             lambda: _kick_drift(dt), args)(*args)

    def last(self, state: MDState, x: Tensor, v: Tensor, f_owned: Tensor, e: Tensor,
             virial: Tensor, dt: float):
        """Region 3: ``v, f`` at the end of the step (``f_owned [cap_owned, 3 k]``: region
        2's forces on the owned rows (:meth:`_reverse`), summed with the ghost forces sent
        back to ``back_buf``), the head to all-gather (:func:`head_of`), the
        ``MDState.vars`` written and a committee's ``(forces_std [cap_owned],)`` (``()``
        for one model)."""
        p = self._plan
        args = (x, v, f_owned, p.back_buf, p.send_index, p.inv_m, p.ref, p.migrated, e, virial)
        v, f, head, *spread = self.compiled(
            "finish", (p.caps["owned"], p.caps["send"], dt),
            lambda: _finish(dt, self.k, self.calibration), args)(*args)
        return v, f, head, {}, spread

    # ------------------------------------------------------------------ the step
    def step(self, state: MDState, dt: float) -> MDState:
        """Advance ``state`` (this rank's owned atoms) by ``dt`` (fs); atoms migrate when
        the look-ahead asks for it. Collective."""
        dt = check_timestep(dt)
        pot = self.potential
        if self._plan is None or self._plan.state is not pot.state:
            self._replan(state, dt)
        p, g = self._plan, state.graph
        co = p.caps["owned"]
        x, v, f = (self._padded(t, co).detach() for t in (g.positions, g.velocities,
                                                          state.forces))
        x, v, send = self.first(state, x, v, f, dt)
        self._forward(x, send)  # ghost positions
        cell = g.cell.detach()
        e, f_base, virial, self._x_local, n_active = self._model_region(
            state.compute_stress, (x, p.recv_buf, p.src, p.shifts, cell, g.pbc, p.owned_mask,
                                   p.fields, p.active))
        f_owned = self._reverse(f_base)  # ghost forces to their owners
        v, f, head, written, spread = self.last(state, x, v, f_owned, e, virial, dt)
        head = torch.cat([head, n_active.reshape(1).to(head.dtype)])
        t0 = time.perf_counter()
        every = C.all_gather_tensor(head, pot.group)
        self.comm_s += time.perf_counter() - t0
        self.n_collectives += 1
        self.n_steps += 1
        # the step's one host read: the look-ahead and the active edge counts of every rank
        k = self.k
        d_max, n_max = torch.stack([every[:, 10 * k:10 * k + 2].max(),
                                    every[:, 10 * k + 2].max()]).tolist()
        self.n_active = int(n_max)
        if self.filters and self.n_active > p.caps["active"]:
            # some rank found more edges within the cutoff than the graph held: all ranks
            # grow the capacity together and repeat the step (no result of a truncated list)
            self._grow_active(self.n_active)
            self.n_steps -= 1
            return self.step(state, dt)
        n = p.n_owned
        energy, stress, std = self._totals(every, g, state.compute_stress)
        spread = {K.FORCES_STD: spread[0][:n], K.ENERGY_STD: std} if spread else {}
        pot.record_evaluation(self._x_local[: p.state.local.n_local], p.state.local, g.atom_id,
                              g.cell)
        out = state.replace(graph=g.replace(spread, positions=x[:n], velocities=v[:n]),
                            forces=f[:n], energy=energy, stress=stress, step=state.step + 1,
                            vars=written)
        if d_max > 0.5 * pot.skin:
            out = pot.maybe_migrate(out)  # collective: every rank has the same maxima
            self.n_collectives += 1
            self._replan(out, dt)
        return out

    def _totals(self, every: Tensor, g: AtomicGraph, stress: bool
                ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(energy [1], stress [1, 3, 3], energy_std [1] or None)`` from the all-gathered
        heads ``every [n_ranks, ...]`` (:func:`head_of`): the members' shares summed over
        the ranks (the eager step's all-reduces), then a committee's means and spread
        (:func:`~xnn.models.derivatives.committee_results`, as the eager step)."""
        k = self.k
        energy = every[:, :k].sum(0).reshape(k, 1)
        virial = every[:, k:10 * k].sum(0).reshape(k, 1, 3, 3)
        members = {K.ENERGY: energy}
        if stress:  # the virial shares summed: the eager step's strain reducer
            members.update(virial_results(virial, g.volume(), g.pbc))
        if k == 1:
            stress = members.get(K.STRESS, torch.zeros((1, 1, 3, 3), dtype=g.dtype,
                                                       device=g.device))
            return energy[0], stress[0], None
        out = committee_results(members, self.calibration)
        return out[K.ENERGY], out.get(K.STRESS, torch.zeros_like(g.cell)), out[K.ENERGY_STD]


def _drifted(g: AtomicGraph, forces: Tensor, dt: float) -> Tensor:
    """The positions region 1 drifts to (fixed atoms stay)."""
    return drift_positions(g.positions.detach(),
                           kick(g.velocities, accelerations(forces, g), dt), dt)


def steps_summary(stepper: CompiledDomainVerlet) -> dict:
    """Counts per step of a run (for benchmarks and reports)."""
    n = max(stepper.n_steps, 1)
    return {"steps": stepper.n_steps, "compiles": stepper.n_compiles,
            "replans": stepper.n_replans, "regions_per_step": stepper.n_region_calls / n,
            "exchanges_per_step": stepper.n_exchanges / n,
            "collectives_per_step": stepper.n_collectives / n,
            "graph_collectives_per_step": stepper.n_graph_collectives / n,
            "breaks_per_step": (stepper.n_exchanges + stepper.n_collectives) / n,
            "comm_s_per_step": stepper.comm_s / n,
            "capacities": dict(stepper.caps.sizes or {}),
            "active_edges": stepper.n_active, "active_overflows": stepper.n_active_overflows}
