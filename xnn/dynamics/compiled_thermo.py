"""Compiled thermostatted steps: Langevin (BAOAB), CSVR and Nosé–Hoover chain through the
padded list and compiled graphs of :class:`~xnn.dynamics.compiled.CompiledVerlet`
(``md.compile=true``), by its public :meth:`~xnn.dynamics.compiled.CompiledVerlet.run`.

A :class:`Scheme` splits an eager step into the part before the force call (``pre``, up to
the positions the model is evaluated at) and the part after it (``post``), written with the
eager modules' own functions (:func:`~xnn.dynamics.nve.half_kick`, :func:`~xnn.dynamics.nhc.
chain_half`, :func:`~xnn.dynamics.state.kinetic_energy`, ... through the step's
:class:`~xnn.dynamics.reduce.Reducer`), so the compiled step does the eager step's
arithmetic. The traced function is ``pre``, model, forces (and stress), ``post``, and then
``pre`` of the *next* step once more, whose positions give the look-ahead displacement that
decides the next rebuild (as for NVE). The step number is a device int64 counter in the
graph's inputs and outputs, so nothing in the graph depends on a host value that changes.

Random numbers equal the eager ones bit for bit: Langevin's noise and CSVR's per-system
draws (a normal and a Gamma variate) are hashed in the graph (:mod:`xnn.dynamics.
compiled_random`: :mod:`xnn.dynamics.random`'s SplitMix64 chain in int64 ops, the key of
step ``n`` computed from the step counter), for this step and the next (the look-ahead),
elementwise and fused. (:meth:`Scheme.draws` can pass host-made inputs instead.)

NPT (cell moves) is not compiled.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics import compiled, csvr, langevin, nhc, nve, random
from xnn.dynamics.compiled import CompiledVerlet, model_graph, spread_of, status, with_spread
from xnn.dynamics.compiled_random import csvr_draws, normal_keyed, system_keys
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import (
    RNG_KEY,
    RNG_STEP0,
    MDState,
    check_timestep,
    seed_of,
)
from xnn.errors import InputError

#: graph fields the traced thermostatted step takes besides positions, velocities, edges
_FIELDS = (K.NUMBERS, K.CELL, K.PBC, K.BATCH, K.MASSES, K.ATOM_ID, K.FIXED)


class Scheme:
    """An ensemble as ``pre`` / ``post`` halves around the force call (here: NVE).

    Attributes:
        reads: the ``MDState.vars`` the graph takes; ``writes``: those it returns.
        uses_hashed_rng: the graph hashes random numbers (int64 arithmetic on index-derived
            words; see :func:`xnn.dynamics.compiled.compile_options`).
    """

    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    uses_hashed_rng: bool = False

    def key(self, state: MDState) -> tuple:
        """Host values baked into the graph (a change compiles again)."""
        return ()

    def draws(self, state: MDState, step: int) -> tuple[Tensor, ...]:
        """Host-drawn random inputs of step ``step`` (none here)."""
        return ()

    def pre(self, s: MDState, dt: float, reduce: Reducer, draws, step: Tensor) -> MDState:
        """From the start of step ``step`` to the positions of its force call."""
        s = nve.half_kick(s, dt)
        return s.replace(graph=nve.drift(s, dt))

    def post(self, s: MDState, dt: float, reduce: Reducer, draws, step: Tensor) -> MDState:
        """From the force call (new forces in ``s``) to the end of the step."""
        return nve.half_kick(s, dt)


class _Hashed(Scheme):
    """A scheme whose random numbers are hashed in the graph from the run's seed."""

    uses_hashed_rng = True

    def __init__(self):
        self.seed = 0

    def key(self, state: MDState) -> tuple:
        self.seed = seed_of(state.rng)
        return (self.seed, RNG_KEY in state.vars)


class LangevinScheme(_Hashed):
    """BAOAB as :func:`xnn.dynamics.langevin.step`, the noise hashed in the graph."""

    reads = ("temperature", "friction", "heat", RNG_KEY, RNG_STEP0)
    writes = ("heat",)

    def pre(self, s, dt, reduce, draws, step):
        s = nve.half_kick(s, dt)
        s = s.replace(graph=nve.drift(s, 0.5 * dt))
        s = self._ou(s, dt, reduce, step)
        return s.replace(graph=nve.drift(s, 0.5 * dt))

    def _ou(self, s: MDState, dt: float, reduce: Reducer, step: Tensor) -> MDState:
        """:func:`xnn.dynamics.langevin.ou_step` with the noise of the step counter."""
        return langevin.ou_step(s, dt, reduce, self.noise(s, step))

    def noise(self, s: MDState, step: Tensor) -> Tensor:
        """``[n_atoms, 3]`` the normals of :func:`xnn.dynamics.langevin.noise` at the step
        ``step`` (int64 0-d tensor), by the same hash on tensors."""
        g = s.graph
        k1, k2, systems = system_keys(self.seed, random.STREAMS["langevin"], s.vars, step,
                                      g.n_systems)
        words = random.atom_words(g.batch, g.atom_id, 3, systems)
        return normal_keyed(k1, k2, *words).to(g.dtype)


class CSVRScheme(_Hashed):
    """:func:`xnn.dynamics.csvr.step`, its draws made in the graph at the step counter."""

    reads = ("temperature", "tau", "heat", RNG_KEY, RNG_STEP0)
    writes = ("heat",)

    def _rescale(self, s: MDState, dt: float, reduce: Reducer, step: Tensor, stage: int):
        """:func:`xnn.dynamics.csvr.rescale`, its draws made in the graph (its reductions
        as fused: :func:`xnn.dynamics.csvr.totals`)."""
        nf, k = csvr.totals(s.graph, reduce)
        r, x = csvr_draws(self.seed, step, stage, nf, s.vars)
        return csvr.rescale_with(s, dt, reduce, r, x, nf, k)

    def pre(self, s, dt, reduce, draws, step):
        s = self._rescale(s, 0.5 * dt, reduce, step, 0)
        return super().pre(s, dt, reduce, draws, step)

    def post(self, s, dt, reduce, draws, step):
        s = nve.half_kick(s, dt)
        return self._rescale(s, 0.5 * dt, reduce, step, 1)


class NHCScheme(Scheme):
    """:func:`xnn.dynamics.nhc.step`: chain half steps around velocity Verlet."""

    reads = ("temperature", "tau", "eta", "v_eta")
    writes = ("eta", "v_eta")

    def __init__(self):
        self.n_yoshida = 1
        self._read: Tensor | None = None

    def key(self, state: MDState) -> tuple:
        # read on the host once per tensor (no device sync per step); the chain's half
        # step reads it as vars["n_yoshida"][0]
        if state.vars["n_yoshida"] is not self._read:
            self._read = state.vars["n_yoshida"]
            self.n_yoshida = int(self._read[0])
        return (self.n_yoshida, state.vars["eta"].shape[1])

    def _order(self, s: MDState) -> MDState:
        return s.replace(vars={"n_yoshida": (self.n_yoshida,)})

    def pre(self, s, dt, reduce, draws, step):
        s = nhc.chain_half(self._order(s), dt, reduce)
        return super().pre(s, dt, reduce, draws, step)

    def post(self, s, dt, reduce, draws, step):
        # the order also here: under domain decomposition post starts from a new state
        return nhc.chain_half(self._order(nve.half_kick(s, dt)), dt, reduce)


# ----------------------------------------------------------------------------- the step
def state_of(x: Tensor, v: Tensor, f: Tensor, fields: dict, vars: dict) -> MDState:
    """The traced rows as an :class:`~xnn.dynamics.state.MDState` for a scheme's ``pre`` and
    ``post``: positions ``x``, velocities ``v``, forces ``f``, the graph's other ``fields``
    and ``vars`` (energy and stress zero, step 0: the schemes do not read them)."""
    g = AtomicGraph({**fields, K.POSITIONS: x, K.VELOCITIES: v}, validate=False)
    zero = torch.zeros_like(fields[K.CELL])
    return MDState(g, f, zero[:, 0, 0], zero, 0, vars)


class _ThermoStep(nn.Module):
    """What is traced: ``pre``, the model's energy and derivatives, ``post``, and the next
    step's ``pre`` for the look-ahead displacement from the last build ``ref``."""

    def __init__(self, model: nn.Module, dt: float, stress: bool, scheme: Scheme,
                 reduce: Reducer, cutoff: float, paired: bool = False):
        super().__init__()
        self.model, self.dt, self.stress, self.scheme, self.reduce = (
            model, dt, stress, scheme, reduce)
        self.cutoff = cutoff
        self.paired = paired

    def forward(self, x: Tensor, v: Tensor, f: Tensor, ref: Tensor, fields: dict[str, Tensor],
                vars: dict[str, Tensor], step: Tensor, draws: tuple, next_draws: tuple,
                active: tuple):
        from xnn.models.base import pairing_edges
        from xnn.models.derivatives import compute_properties

        dt, sch, red = self.dt, self.scheme, self.reduce
        fields = dict(fields)
        edges = {k: fields.pop(k) for k in (K.EDGE_INDEX, K.SHIFTS)}
        zero = torch.zeros_like(fields[K.CELL])
        s = sch.pre(state_of(x, v, f, fields, vars), dt, red, draws, step)
        model_fields = {k: t for k, t in fields.items() if k != K.FIXED}
        graph, n_active, broken = model_graph({**model_fields, **edges}, s.positions,
                                              self.cutoff, active, self.paired)
        with pairing_edges(self.paired):
            out = compute_properties(self.model, graph, True, self.stress)
        stress = out[K.STRESS] if self.stress else zero
        s = s.replace(forces=out[K.FORCES], energy=out[K.ENERGY], stress=stress)
        s = sch.post(s, dt, red, draws, step)
        ahead = sch.pre(s, dt, red, next_draws, step + 1)
        d_next = (ahead.positions - ref).norm(dim=-1).max()
        return (s.positions, s.velocities, s.forces, s.energy, s.stress,
                status(d_next, n_active, broken), step + 1,
                *(s.vars[k] for k in sch.writes), *spread_of(out))


class CompiledSchemeStep:
    """Compiled steps of ``scheme`` through the list and graphs of ``verlet`` (its
    :meth:`~xnn.dynamics.compiled.CompiledVerlet.run`); each is the eager step's result up
    to rounding. Holds the device step counter and the draws of the next step between
    calls."""

    def __init__(self, scheme: Scheme, verlet: CompiledVerlet):
        self.scheme, self.verlet = scheme, verlet
        self._counter: tuple[int, Tensor] | None = None  # (step, its device int64 copy)
        self._draws: tuple | None = None  # (step, its host-made random inputs)

    def step(self, state: MDState, dt: float) -> MDState:
        """Advance ``state`` by ``dt`` (fs); the returned state's step count is +1."""
        dt = check_timestep(dt)
        sch, verlet, g = self.scheme, self.verlet, state.graph
        key = sch.key(state)
        counter = self._counter
        if counter is None or counter[0] != state.step:
            counter = (state.step, torch.tensor(state.step, dtype=torch.int64, device=g.device))
        cached = self._draws
        draws = cached[1] if cached and cached[0] == state.step else sch.draws(state, state.step)
        next_draws = sch.draws(state, state.step + 1)
        vars_ = {k: state.vars[k] for k in sch.reads if k in state.vars}
        x, v, f, energy, stress, _, step_t, *rest = verlet.run(
            state, (type(sch), *key, dt, state.compute_stress, g.n_atoms, tuple(vars_)),
            lambda: _ThermoStep(verlet.model, dt, state.compute_stress, sch, LOCAL,
                                verlet.neighbors.cutoff, verlet.paired),
            lambda: sch.pre(state, dt, LOCAL, draws, counter[1]).positions, _FIELDS,
            (vars_, counter[1], draws, next_draws))
        self._counter = (state.step + 1, step_t)
        self._draws = (state.step + 1, next_draws)
        written, spread = rest[:len(sch.writes)], rest[len(sch.writes):]
        return state.replace(graph=with_spread(g.replace(positions=x, velocities=v), spread),
                             forces=f, energy=energy, stress=stress, step=state.step + 1,
                             vars=dict(zip(sch.writes, written)))


#: the ensembles that compile, by ``md.ensemble`` name
SCHEMES = {"nve": Scheme, "langevin": LangevinScheme, "csvr": CSVRScheme, "nhc": NHCScheme}


def compiled_ensemble(name: str):
    """The eager integrator module of ensemble ``name`` (its ``init`` and ``conserved`` serve
    the compiled steps), refusing ensembles that do not compile (not in :data:`SCHEMES`)."""
    from xnn.dynamics import registry

    if name not in SCHEMES:
        raise InputError(f"compile=true compiles ensembles {', '.join(SCHEMES)}, not "
                         f"{name!r}: choose one of them or set compile: false")
    return registry.get_integrator(name)


class CompiledIntegrator:
    """The integrator interface (``init``, ``step``, ``conserved``) of ensemble ``name``
    (a key of :data:`SCHEMES`) with compiled steps, made for one potential; ``init`` and
    ``conserved`` are the eager module's.

    Args:
        name: ``nve``, ``langevin``, ``csvr`` or ``nhc``.
        potential: the :class:`~xnn.models.Potential` every step evaluates.
        backend: ``torch.compile`` backend (default :data:`~xnn.dynamics.compiled.DEFAULT_BACKEND`).
        cuda_graph: replay each step as a CUDA graph.
    """

    def __init__(self, name: str, potential, backend: str | None = None,
                 cuda_graph: bool = False):
        module = compiled_ensemble(name)
        self.init, self.conserved = module.init, module.conserved
        scheme = None if name == "nve" else SCHEMES[name]()  # NVE: the leaner step
        #: the :class:`~xnn.dynamics.compiled.CompiledVerlet` (list, graphs, counters)
        self.stepper = CompiledVerlet(
            potential, backend=backend or compiled.DEFAULT_BACKEND, cuda_graph=cuda_graph,
            hashed_rng=scheme is not None and scheme.uses_hashed_rng)
        #: the thermostat's steps through :attr:`stepper` (None: NVE)
        self.scheme_step = None if scheme is None else CompiledSchemeStep(scheme, self.stepper)

    def step(self, state: MDState, model, dt: float, reduce: Reducer = LOCAL) -> MDState:
        if model is not self.stepper.potential or reduce is not LOCAL:
            raise InputError("this compiled integrator runs its own potential in one process")
        if self.scheme_step is None:
            return self.stepper.step(state, dt)
        return self.scheme_step.step(state, dt)
