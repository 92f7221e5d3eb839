"""Compiled thermostatted steps under domain decomposition: Langevin (BAOAB), CSVR and
Nosé–Hoover chain through the regions of :class:`~xnn.distributed.domain.compiled.
CompiledDomainVerlet` (``md.compile=true`` with ``md.ensemble=langevin|csvr|nhc`` on
several ranks, mode ``halo``).

The ensembles are the one-process :class:`~xnn.dynamics.compiled_thermo.Scheme` objects,
unchanged: region 1 runs the scheme's ``pre`` (up to the positions of the force call),
region 3 its ``post`` and the next step's ``pre`` once more for the look-ahead
displacements. Their global reductions (kinetic energy, degrees of freedom, centre-of-mass
momentum) go through the eager step's :class:`~xnn.distributed.reducer.GroupReducer` (its
``rows``: the rank's real, not padding, rows), traced inside
:func:`~xnn.distributed.collectives.traced_collectives`: a sum over the rows, then an
all-reduce *inside* the compiled region (a functional collective, traced as
``_c10d_functional.all_reduce`` and ``wait_tensor``), the sums of one point of a step fused
into one all-reduce as in the eager step (``sums_per_system``). Every rank gets the global
value and a step keeps the 3 regions, 2 exchanges and 1 all-gather of NVE; the in-graph
all-reduces are counted per call (``n_graph_collectives`` and
:func:`~xnn.distributed.collectives.count_collectives`): per step 4 for Langevin, 6 for
CSVR and 3 for NHC (the scheme's ``pre`` runs twice per step: region 1 and the look-ahead
of region 3). The random numbers are hashed in the graph from the seed, the
step counter and the global atom id (:mod:`xnn.dynamics.compiled_random`): they do not
depend on how the atoms are split over the ranks, so the trajectory is the one-process one
to rounding.

Padding rows (capacity beyond the owned atoms) are fixed atoms of mass 1 at rest: every
update leaves them at zero, and the reducer leaves them out of every sum. NPT (cell moves)
is not compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.distributed.domain.compiled import CompiledDomainVerlet, head_of, member_forces
from xnn.distributed.domain.compiled_plan import pad_rows
from xnn.distributed.domain.halo import add_returned
from xnn.distributed.reducer import GroupReducer
from xnn.dynamics.compiled_thermo import state_of
from xnn.dynamics.state import MDState
from xnn.errors import InputError


def _pre(scheme, dt: float, reducer):
    """Region 1: the scheme's ``pre``, the rows to send and the ``vars`` it writes."""
    def region(x, v, f, send_index, fields, real, vars, step, draws):
        s = scheme.pre(state_of(x, v, f, fields, vars), dt, reducer(real), draws, step)
        return (s.positions, s.velocities, s.positions.index_select(0, send_index),
                *(s.vars[k] for k in scheme.writes))
    return region


def _post(scheme, dt: float, reducer, k: int = 1, calibration: dict | None = None):
    """Region 3: forces, the scheme's ``post``, the look-ahead (the next ``pre``'s
    positions against the plan's reference and the last migration) and the head."""
    def region(x, v, f_base, back, send_index, fields, real, ref, migrated, e, virial, vars,
               step, draws, next_draws):
        red = reducer(real)
        f, spread = member_forces(add_returned(f_base, send_index, back), k, calibration)
        s = scheme.post(state_of(x, v, f, fields, vars), dt, red, draws, step)
        ahead = scheme.pre(s, dt, red, next_draws, step + 1).positions
        d = torch.stack([(ahead - ref).norm(dim=-1).max(),
                         (ahead - migrated).norm(dim=-1).max()])
        return (s.velocities, f, head_of(e, virial, d), step + 1,
                *(s.vars[name] for name in scheme.writes), *spread)
    return region


class CompiledDomainScheme(CompiledDomainVerlet):
    """Steps of ``scheme`` (a :class:`~xnn.dynamics.compiled_thermo.Scheme`: Langevin, CSVR,
    NHC) on a :class:`~xnn.distributed.DecomposedPotential` through three compiled regions per
    capacity (see the module docstring); arguments and counters of
    :class:`~xnn.distributed.domain.compiled.CompiledDomainVerlet`."""

    def __init__(self, potential, scheme, backend: str = "inductor", growth: float = 1.25,
                 headroom: float = 1.25, slack: int = 16):
        super().__init__(potential, backend, growth, headroom, slack)
        self.scheme = scheme
        self.hashed_rng = scheme.uses_hashed_rng
        self._counter: tuple[int, Tensor] | None = None  # (step, its device int64 copy)
        self._rows: tuple | None = None  # (plan, padded owned fields, real-row mask)
        self._mid: dict = {}  # this step: key, vars, draws between regions 1 and 3

    def _reducer(self, real: Tensor) -> GroupReducer:
        return GroupReducer(self.potential.group, rows=real)

    def next_positions(self, state: MDState, dt: float) -> Tensor:
        counter = torch.tensor(state.step, dtype=torch.int64, device=state.graph.device)
        self.scheme.key(state)  # the seed of the hashed draws
        s = self.scheme.pre(state, dt, self.potential.reducer,
                            self.scheme.draws(state, state.step), counter)
        return s.positions.detach()

    def _fields(self, state: MDState) -> tuple[dict, Tensor]:
        """The owned graph's fields the scheme reads, padded to the owned capacity (padding:
        fixed atoms of mass 1, system 0, atom id -1), and the real-row mask."""
        p, g = self.plan, state.graph
        if self._rows is None or self._rows[0] is not p:
            co = p.caps["owned"]
            fixed = g[K.FIXED].to(torch.bool) if K.FIXED in g else torch.zeros(
                g.n_atoms, dtype=torch.bool, device=g.device)
            fields = {K.BATCH: pad_rows(g.batch, co, 0), K.MASSES: pad_rows(g.masses, co, 1.0),
                      K.ATOM_ID: pad_rows(g.atom_id, co, -1), K.FIXED: pad_rows(fixed, co, True)}
            self._rows = (p, fields, torch.arange(co, device=g.device) < p.n_owned)
        fields = {**self._rows[1], K.CELL: g.cell.detach(), K.PBC: g.pbc}
        return fields, self._rows[2]

    def first(self, state, x, v, f, dt):
        sch, p = self.scheme, self.plan
        key = sch.key(state)
        if self._counter is None or self._counter[0] != state.step:
            self._counter = (state.step, torch.tensor(state.step, dtype=torch.int64,
                                                      device=x.device))
        vars_ = {k: state.vars[k] for k in sch.reads if k in state.vars}
        draws = sch.draws(state, state.step)
        fields, real = self._fields(state)
        args = (x, v, f, p.send_index, fields, real, vars_, self._counter[1], draws)
        full = (p.caps["owned"], p.caps["send"], dt, type(sch), *key, tuple(vars_))
        x, v, send, *written = self.compiled("pre", full, lambda: _pre(sch, dt, self._reducer),
                                             args)(*args)
        self._mid = {"key": full, "vars": {**vars_, **dict(zip(sch.writes, written))},
                     "draws": draws, "fields": fields, "real": real}
        return x, v, send

    def last(self, state, x, v, f_owned, e, virial, dt):
        sch, p, mid = self.scheme, self.plan, self._mid
        args = (x, v, f_owned, p.back_buf, p.send_index, mid["fields"], mid["real"],
                p.ref, p.migrated, e, virial, mid["vars"], self._counter[1], mid["draws"],
                sch.draws(state, state.step + 1))
        v, f, head, step, *rest = self.compiled(
            "post", mid["key"], lambda: _post(sch, dt, self._reducer, self.k, self.calibration),
            args)(*args)
        self._counter = (state.step + 1, step)
        n = len(sch.writes)
        return v, f, head, dict(zip(sch.writes, rest[:n])), rest[n:]


class CompiledDomainIntegrator:
    """The integrator interface (``init``, ``step``, ``conserved``) of ensemble ``name``
    (``nve``, ``langevin``, ``csvr``, ``nhc``) with compiled decomposed steps, for one
    :class:`~xnn.distributed.DecomposedPotential`; ``init`` and ``conserved`` are the eager
    module's (called with the run's decomposed reducer). Migration happens inside the
    steps (the run layer must not migrate again)."""

    def __init__(self, name: str, potential, backend: str | None = None):
        from xnn.dynamics.compiled import DEFAULT_BACKEND
        from xnn.dynamics.compiled_thermo import SCHEMES, compiled_ensemble

        module = compiled_ensemble(name)
        self.init, self.conserved = module.init, module.conserved
        backend = backend or DEFAULT_BACKEND
        self.stepper = (CompiledDomainVerlet(potential, backend=backend) if name == "nve"
                        else CompiledDomainScheme(potential, SCHEMES[name](), backend=backend))

    def step(self, state: MDState, model, dt: float, reduce=None) -> MDState:
        if model is not self.stepper.potential:
            raise InputError("this compiled integrator runs its own decomposed potential")
        return self.stepper.step(state, dt)
