"""The model interface: a module mapping an ``AtomicGraph`` (with edges) to per-atom energies."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError

#: Execution policy, carried by context variables (each thread and task sees its own; the
#: context managers below restore the previous value on exit, so they nest): whether model
#: code runs under a graph tracer torch does not announce, and whether the graph a model
#: sees holds its edges as reverse pairs.
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("xnn_tracing", default=False)
_PAIRED: contextvars.ContextVar[bool] = contextvars.ContextVar("xnn_edges_paired",
                                                               default=False)


def graph_tracing() -> bool:
    """Whether model code runs under a graph tracer (``torch.compile``, ``torch.export``, or
    the trace of compiled training, :mod:`xnn.models.compiled_training`): models then avoid
    data-dependent shapes and Python branches on tensor values."""
    return torch.compiler.is_compiling() or _TRACING.get()


def squared_lengths(vec: Tensor) -> Tensor:
    """``[n]`` ``|vec[e]|^2`` of ``vec [n, 3]`` (differentiable to any order).

    On the CPU in eager mode this is ``(vec * vec) @ 1``: torch's reduction over a last
    dimension of 3 is several times slower there than the matrix-vector product (the same
    values to round-off: the BLAS may add the three squares in another order). Tracers
    (inductor fuses the sum) and GPUs take ``sum(-1)``."""
    sq = vec * vec
    if vec.device.type == "cpu" and not graph_tracing():
        return sq @ torch.ones(vec.shape[-1], dtype=vec.dtype)
    return sq.sum(-1)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar[bool], value: bool) -> Iterator[None]:
    token = var.set(bool(value))
    try:
        yield
    finally:
        var.reset(token)  # the value before, whatever happened inside


def tracing_graph(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Make :func:`graph_tracing` ``enabled`` inside (for tracers that torch does not
    announce: ``make_fx``, compiled training); the previous value returns on exit, so
    the blocks nest."""
    return _setting(_TRACING, enabled)


def triton_device(x: Tensor) -> bool:
    """Whether Triton kernels run on ``x``: CUDA, or the CPU when Triton's interpreter is
    requested (``TRITON_INTERPRET=1`` at the call; the tests)."""
    return x.is_cuda or (x.device.type == "cpu"
                         and os.environ.get("TRITON_INTERPRET", "0") == "1")


def edges_paired() -> bool:
    """Whether the graph a model sees now holds its edges as reverse pairs: with
    ``h = n_edges // 2``, edge ``h + k`` is edge ``k`` reversed (receiver and sender
    swapped, shift negated: the same length bitwise; :func:`xnn.neighbors.pairs.pair_order`).
    Set by the compiled MD step (:func:`pairing_edges`) for models whose ``pairs_edges``
    attribute is true; such a model may evaluate length-only edge work once per pair.

    Read it outside ``torch.compile``d regions (model code that dynamo traces sees a graph
    break here: dynamo does not trace context variables); ``make_fx`` traces read it."""
    return _PAIRED.get()


def pairing_edges(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Make :func:`edges_paired` ``enabled`` inside; the previous value returns on exit."""
    return _setting(_PAIRED, enabled)


class AtomisticModel(nn.Module):
    """Base class of every xnn model.

    Subclasses implement ``forward(graph) -> [n_atoms]`` per-atom energies (eV) and set:

    Attributes:
        cutoff: interaction cutoff (Å). Edges longer than it may be present (Verlet skin)
            and must contribute exactly nothing.
        num_interactions: message-passing hops; the receptive field is
            ``cutoff * num_interactions``.
        species: atomic numbers the model knows, or ``None`` for any element.
        receiver_field: distance (Å) beyond the receptive field at which ghost atoms still
            receive something that counts (a Coulomb term's predicted charges); 0 for most.
        pairs_edges: the model may evaluate length-only edge work once per reverse pair
            when the graph says its edges are paired (:func:`edges_paired`).
        traceable: its forward traces into a graph of fixed shapes (``torch.fx`` /
            ``make_fx`` under :func:`tracing_graph`), so the compiled MD steps
            (``xnn md compile=true``) can compile it; long-range terms, whose sums over
            the system have data-dependent shapes, declare ``False``.
        hparams: the registry hyperparameters that rebuild the model
            (``xnn.models.build(name, **hparams)``); ``None`` for a model that is not
            rebuilt from them (the MACE and SevenNet wrappers store a payload).
        e0: ``{atomic number: eV}`` reference energies, or ``None`` without a table.

    Forces, stress and virial are never computed inside a model: see
    :func:`xnn.models.derivatives.compute_properties`.
    """

    cutoff: float
    num_interactions: int = 1
    species: list[int] | None = None
    receiver_field: float = 0.0
    pairs_edges: bool = False
    traceable: bool = True
    hparams: dict | None = None
    e0: dict[int, float] | None = None

    @property
    def sync_points(self) -> list[tuple[str, nn.Module]]:
        """``[(name, module)]`` of the sync points between interaction layers (none here;
        :class:`SyncPoints` models have them): domain decomposition's per-layer exchanges."""
        return []

    @property
    def receptive_field(self) -> float:
        """Distance (Å) beyond which atoms cannot influence an atom's energy."""
        return float(self.cutoff) * int(self.num_interactions)

    @property
    def sync_width(self) -> int | None:
        """Numbers per atom one sync point exchanges (the features between two layers; the
        largest over the sync points), which mode ``auto``'s cost model weighs; ``None``:
        not declared (auto estimates it from ``hparams``)."""
        return None

    @property
    def committee_size(self) -> int:
        """How many members the model's predictions average: 1 for a single model, K for a
        :class:`~xnn.models.committee.Committee` (whose ``member_energies`` then gives each
        member's per-atom energies, and ``compute_properties`` their spread)."""
        return 1

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Named parts of the model for fine-tuning (``finetune.freeze``, ``finetune.lr``):
        ``{part: parameter-name prefixes}``.

        The default names every top-level submodule that holds parameters (``embedding``,
        ``interactions``, ``readout``...) and each entry of a module list among them
        (``interactions.0``); models whose submodules are named otherwise declare the common
        names ``embedding``, ``interactions``, ``interactions.K`` and ``readout``.
        """
        out: dict[str, tuple[str, ...]] = {}
        for name, child in self.named_children():
            if not any(True for _ in child.parameters()):
                continue
            out[name] = (name,)
            if isinstance(child, nn.ModuleList):
                for k, sub in enumerate(child):
                    if any(True for _ in sub.parameters()):
                        out[f"{name}.{k}"] = (f"{name}.{k}",)
        return out

    def check_species(self, numbers: Tensor) -> None:
        """Raise :class:`UnknownSpeciesError` if ``numbers`` has elements the model lacks."""
        if self.species is None:
            return
        present = torch.unique(numbers).tolist()
        unknown = sorted(set(present) - set(int(z) for z in self.species))
        if unknown:
            from ase.data import chemical_symbols

            raise UnknownSpeciesError(
                f"structure holds species {[chemical_symbols[z] for z in unknown]} unknown to "
                f"the model (it knows {[chemical_symbols[z] for z in self.species]})"
            )

    def set_statistics(self, e0: dict[int, float] | None = None, scale: float | None = None,
                       shift: float | None = None) -> bool:
        """Take data statistics (reference energies ``{Z: eV}``, ``scale``, ``shift`` of the
        energy output) as ``xnn train`` computes them; returns whether the model took them
        (the base class takes none)."""
        return False

    def compile_for_inference(self, enabled: bool = True) -> bool:
        """Run the model's hot path through ``torch.compile`` (energy, forces, stress only).

        Compiled kernels support one backward (forces, stress) but not the double backward of
        force training, so trainers never enable this. The first call of each new input
        layout compiles (tens of seconds). Returns whether the model has anything to compile
        (the base class has not).
        """
        return False

    def forward(self, graph: AtomicGraph) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError


def as_model(obj: object, what: str = "model") -> AtomisticModel:
    """``obj`` itself when it is an xnn model (:class:`AtomisticModel`: it declares its
    cutoff, interactions, species and the other capabilities), else one error.

    Args:
        what: how the message names ``obj`` (e.g. ``"Sum term 2"``).

    Raises:
        InputError: ``obj`` is not an :class:`AtomisticModel`.
    """
    if isinstance(obj, AtomisticModel):
        return obj
    raise InputError(f"{what} is not an xnn model: {type(obj).__name__} does not subclass "
                     "xnn.models.AtomisticModel, which declares the cutoff, interactions and "
                     "species (MACE and SevenNet models: wrap them with xnn.models.external)")


class SyncPoints:
    """Mixin for models with sync points: ``self.sync``, an ``nn.ModuleList`` of
    :class:`SyncPoint` identities between interaction layers, swappable by name (domain
    decomposition replaces them by halo feature exchanges)."""

    sync: nn.ModuleList

    def init_sync_points(self, n: int) -> None:
        """Create ``n`` identity sync points (call after ``nn.Module.__init__``)."""
        self.sync = nn.ModuleList([SyncPoint() for _ in range(max(n, 0))])

    @property
    def sync_points(self) -> list[tuple[str, nn.Module]]:
        """``[(name, module)]`` of the sync points in layer order (names as in named_modules)."""
        return [(f"sync.{k}", m) for k, m in enumerate(self.sync)]

    def set_sync_point(self, name: str, module: nn.Module) -> None:
        """Replace the sync point ``name`` (e.g. ``"sync.0"``) by ``module``."""
        names = [n for n, _ in self.sync_points]
        if name not in names:
            raise InputError(f"model has no sync point {name!r}; it has {names}")
        self.sync[names.index(name)] = module


class SyncPoint(nn.Module):
    """Identity between interaction layers; swapped for a halo feature exchange under DD.

    ``forward(features, graph)`` returns ``features`` unchanged. It holds no parameters and
    costs nothing in a single process.
    """

    def forward(self, features: Tensor, graph: AtomicGraph) -> Tensor:
        return features


def sum_per_system(values: Tensor, batch: Tensor, n_systems: int) -> Tensor:
    """``[n_systems, ...]`` sum of per-atom ``values [n_atoms, ...]`` by system index."""
    if n_systems == 1:  # a plain reduction: no atomics all landing on one address on GPU
        return values.sum(0, keepdim=True)
    out = values.new_zeros((n_systems, *values.shape[1:]))
    return out.index_add(0, batch, values)
