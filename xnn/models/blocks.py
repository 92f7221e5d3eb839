"""Building blocks shared by the native models (SchNet, PaiNN, the e3nn equivariant model).

Radial bases ``[n_edges] r -> [n_edges, num_basis]``, smooth cutoff envelopes
``[n_edges] -> [n_edges]`` that are exactly zero at and beyond the cutoff, species
embedding, the per-atom energy output ``E_i = scale * e_i + shift + E0[Z_i]``, and
:class:`NativeModel`, the base class that records hyperparameters and holds the sync
points between interaction layers.

All blocks are device- and dtype-agnostic: buffers follow ``model.to(...)``/``model.double()``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from xnn.models.base import AtomisticModel, SyncPoints, graph_tracing
from xnn.models.registry import check_cutoff, species_numbers

N_ELEMENTS = 119  # lookup tables are indexed by atomic number 0..118


# --------------------------------------------------------------------------- radial bases
class BesselBasis(nn.Module):
    """Bessel radial basis ``sqrt(2/rc) * sin(n π r / rc) / r`` for ``n = 1..num_basis``.

    Args:
        cutoff: ``rc`` (Å).
        num_basis: number of functions.
        trainable: learn the frequencies ``n π / rc`` (initialised as above).

    Shapes:
        ``r [n_edges]`` (Å, > 0) -> ``[n_edges, num_basis]`` (1/Å).
    """

    def __init__(self, cutoff: float, num_basis: int = 8, trainable: bool = False):
        super().__init__()
        self.cutoff = float(cutoff)
        self.num_basis = int(num_basis)
        freqs = math.pi * torch.arange(1, self.num_basis + 1, dtype=torch.get_default_dtype())
        freqs = freqs / self.cutoff
        if trainable:
            self.freqs = nn.Parameter(freqs)
        else:
            self.register_buffer("freqs", freqs)
        self.prefactor = math.sqrt(2.0 / self.cutoff)

    def forward(self, r: Tensor) -> Tensor:
        r = r.unsqueeze(-1)
        return self.prefactor * torch.sin(self.freqs * r) / r


class GaussianBasis(nn.Module):
    """Gaussian radial basis ``exp(-γ (r - μ_k)^2)`` with centres ``μ_k`` on ``[start, cutoff]``.

    ``γ = 1 / (2 Δ^2)`` with ``Δ`` the spacing of the centres (SchNet's choice).

    Shapes:
        ``r [n_edges]`` (Å) -> ``[n_edges, num_basis]``.
    """

    def __init__(self, cutoff: float, num_basis: int = 50, start: float = 0.0):
        super().__init__()
        self.num_basis = int(num_basis)
        centres = torch.linspace(start, float(cutoff), self.num_basis)
        self.register_buffer("centres", centres)
        width = (float(cutoff) - start) / max(self.num_basis - 1, 1)
        self.gamma = 0.5 / width**2

    def forward(self, r: Tensor) -> Tensor:
        return torch.exp(-self.gamma * (r.unsqueeze(-1) - self.centres) ** 2)


# --------------------------------------------------------------------------- cutoff envelopes
class PolynomialCutoff(nn.Module):
    """NequIP/MACE polynomial envelope, smooth to order ``p`` at ``rc``; exactly 0 beyond.

    With ``x = r / rc``:
    ``f(x) = 1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2)`` for ``x < 1``, else 0
    (``torch.where``, so edges in a Verlet skin get zero value and zero gradient).

    Shapes:
        ``r [n_edges]`` (Å) -> ``[n_edges]``.
    """

    def __init__(self, cutoff: float, p: int = 6):
        super().__init__()
        self.cutoff = float(cutoff)
        self.p = float(p)

    def forward(self, r: Tensor) -> Tensor:
        p = self.p
        x = r / self.cutoff
        inside = x < 1.0
        x = torch.where(inside, x, torch.zeros_like(x))  # keep the discarded branch finite
        xp = x**p
        f = (
            1.0
            - 0.5 * (p + 1.0) * (p + 2.0) * xp
            + p * (p + 2.0) * xp * x
            - 0.5 * p * (p + 1.0) * xp * x * x
        )
        return torch.where(inside, f, torch.zeros_like(f))


class CosineCutoff(nn.Module):
    """SchNet's cosine envelope ``0.5 (cos(π r / rc) + 1)`` for ``r < rc``, exactly 0 beyond.

    Shapes:
        ``r [n_edges]`` (Å) -> ``[n_edges]``.
    """

    def __init__(self, cutoff: float):
        super().__init__()
        self.cutoff = float(cutoff)

    def forward(self, r: Tensor) -> Tensor:
        inside = r < self.cutoff
        f = 0.5 * (torch.cos(r * (math.pi / self.cutoff)) + 1.0)
        return torch.where(inside, f, torch.zeros_like(f))


def radial_basis(kind: str, cutoff: float, num_basis: int) -> nn.Module:
    """``"gaussian"`` or ``"bessel"`` radial basis by name."""
    if kind == "gaussian":
        return GaussianBasis(cutoff, num_basis)
    if kind == "bessel":
        return BesselBasis(cutoff, num_basis)
    from xnn.errors import InputError

    raise InputError(f"unknown radial basis {kind!r}; choose one of ['gaussian', 'bessel']")


def cutoff_envelope(kind: str, cutoff: float) -> nn.Module:
    """``"cosine"`` or ``"polynomial"`` cutoff envelope by name."""
    if kind == "cosine":
        return CosineCutoff(cutoff)
    if kind == "polynomial":
        return PolynomialCutoff(cutoff)
    from xnn.errors import InputError

    raise InputError(f"unknown cutoff envelope {kind!r}; choose one of ['cosine', 'polynomial']")


# --------------------------------------------------------------------------- activations / MLP
class ShiftedSoftplus(nn.Module):
    """``softplus(x) - log(2)`` (zero at the origin), SchNet's activation."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.softplus(x) - math.log(2.0)


def weigh_edges(x: Tensor, w: Tensor, paired: bool = False) -> Tensor:
    """``x * w`` for per-edge ``x [E, ...]`` and radial weights ``w``; ``paired``: the edges
    are reverse pairs (edge ``E/2 + k`` reverses edge ``k``, the same length bitwise) and
    ``w [E/2, ...]`` holds one row per pair, weighing both of its edges (a broadcast, no
    copy; :func:`~xnn.models.base.edges_paired`)."""
    if not paired:
        return x * w
    return (x.view(2, *w.shape) * w).view(x.shape)


def mlp(sizes: Sequence[int], activation: type[nn.Module] = nn.SiLU, bias_last: bool = True):
    """``Linear -> act -> ... -> Linear`` for layer widths ``sizes`` (no activation at the end)."""
    layers: list[nn.Module] = []
    for k in range(len(sizes) - 1):
        last = k == len(sizes) - 2
        layers.append(nn.Linear(sizes[k], sizes[k + 1], bias=bias_last or not last))
        if not last:
            layers.append(activation())
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- species
class SpeciesEmbedding(nn.Module):
    """Map atomic numbers to contiguous indices and a learned embedding.

    Args:
        species: atomic numbers the model knows (order defines the index).
        dim: embedding width.

    ``lookup`` is a ``[119]`` long buffer (``-1`` for unknown elements); call
    ``AtomisticModel.check_species`` before evaluating structures of unknown origin.

    Shapes:
        ``numbers [n_atoms]`` -> ``[n_atoms, dim]``.
    """

    def __init__(self, species: Sequence[int], dim: int):
        super().__init__()
        species = [int(z) for z in species]
        lookup = torch.full((N_ELEMENTS,), -1, dtype=torch.long)
        lookup[torch.tensor(species, dtype=torch.long)] = torch.arange(len(species))
        self.register_buffer("lookup", lookup)
        self.embedding = nn.Embedding(len(species), dim)

    def index(self, numbers: Tensor) -> Tensor:
        """``[n_atoms]`` species index of each atom (``-1`` for unknown elements)."""
        return self.lookup[numbers]

    def forward(self, numbers: Tensor) -> Tensor:
        return self.embedding(self.index(numbers))


# --------------------------------------------------------------------------- energy output
class EnergyScaleShift(nn.Module):
    """Per-atom energy ``E_i = scale * e_i + shift + E0[Z_i]`` (eV).

    Args:
        species: atomic numbers the model knows.
        scale: eV per unit of the network output (e.g. the force RMS).
        shift: eV per atom added to every atom (e.g. the mean per-atom residual energy).
        e0: ``{atomic number: eV}`` isolated-atom / reference energies (0 when missing).

    ``scale``, ``shift`` and ``e0_table [119]`` are buffers, saved in the state dict and
    settable from statistics with :meth:`set_statistics`. They are kept in float64 whatever
    the model's dtype (reference energies of -400 eV would lose 1e-5 eV in float32); the
    output is cast to the dtype of ``e``.

    Shapes:
        ``e [n_atoms]``, ``numbers [n_atoms]`` -> ``[n_atoms]``.
    """

    def __init__(
        self,
        species: Sequence[int],
        scale: float = 1.0,
        shift: float = 0.0,
        e0: Mapping[int, float] | None = None,
    ):
        super().__init__()
        self.species = [int(z) for z in species]
        dtype = torch.float64
        self.register_buffer("scale", torch.tensor(float(scale), dtype=dtype))
        self.register_buffer("shift", torch.tensor(float(shift), dtype=dtype))
        self.register_buffer("e0_table", torch.zeros(N_ELEMENTS, dtype=dtype))
        if e0:
            self.set_statistics(e0=e0)

    def set_statistics(
        self,
        e0: Mapping[int, float] | None = None,
        scale: float | None = None,
        shift: float | None = None,
    ) -> None:
        """Set any of the reference energies (``{Z: eV}``), ``scale`` and ``shift`` in place."""
        with torch.no_grad():
            if e0 is not None:
                for z, value in e0.items():
                    self.e0_table[int(z)] = float(value)
            if scale is not None:
                self.scale.fill_(float(scale))
            if shift is not None:
                self.shift.fill_(float(shift))

    @property
    def e0(self) -> dict[int, float]:
        """``{atomic number: eV}`` reference energies of the model's species."""
        return {z: float(self.e0_table[z]) for z in self.species}

    def _apply(self, fn, recurse=True):
        # device moves apply; dtype casts do not (the buffers stay float64)
        kept = {n: self._buffers[n] for n in ("scale", "shift", "e0_table")}
        super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._buffers[n]
            if new.dtype != torch.float64:
                self._buffers[n] = old.to(device=new.device)
        return self

    def forward(self, e: Tensor, numbers: Tensor) -> Tensor:
        out = self.scale * e + self.shift + self.e0_table[numbers]
        return out.to(e.dtype)


# --------------------------------------------------------------------------- base class
def _jsonable(value, path: str = "hparams"):
    """Return ``value`` with tuples as lists and int keys kept; raise if not JSON-serialisable."""
    if isinstance(value, Mapping):
        return {k: _jsonable(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{path} = {value!r} is not JSON-serialisable")


class NativeModel(SyncPoints, AtomisticModel):
    """Base class of xnn's own models: hyperparameters, species, cutoff, sync points, output.

    Subclasses call ``super().__init__(hparams, species, cutoff, num_interactions)`` first,
    with ``hparams`` the keyword arguments of their ``__init__`` (so that
    ``xnn.models.build(name, **model.hparams)`` rebuilds the same architecture), then create
    ``self.output = EnergyScaleShift(...)`` and call ``self.sync[k](features, graph)``
    between interaction ``k`` and ``k + 1``.

    Attributes:
        hparams: JSON-serialisable dict of constructor arguments.
        species: sorted atomic numbers the model knows.
        cutoff: Å.
        num_interactions: interaction layers.
        sync: ``nn.ModuleList`` of ``num_interactions - 1`` :class:`SyncPoint` identities.
        activation_checkpointing: run each interaction block under
            :func:`checkpointed` (subclasses that support it set this from their
            ``activation_checkpointing`` hyperparameter).
    """

    output: EnergyScaleShift
    activation_checkpointing: bool = False

    def __init__(
        self,
        hparams: Mapping[str, object],
        species: Sequence[int],
        cutoff: float,
        num_interactions: int,
    ):
        super().__init__()
        # as xnn.models.build checks them, for a class constructed directly
        self.species = species_numbers(species, f"{type(self).__name__}: species")
        self.cutoff = check_cutoff(cutoff, f"{type(self).__name__}: cutoff")
        checked = {"species": self.species, "cutoff": self.cutoff}  # plain ints and float
        hp = _jsonable({k: checked.get(k, v) for k, v in hparams.items()})
        json.dumps(hp)
        self.hparams: dict = hp
        self.num_interactions = int(num_interactions)
        self.init_sync_points(self.num_interactions - 1)

    def checkpointed(self, fn, *args, params=None):
        """``fn(*args)``, under activation checkpointing when it saves memory.

        With ``activation_checkpointing`` set, in training mode and with gradients enabled
        (and not under a graph tracer), ``fn`` runs under
        :func:`~xnn.models.checkpointing.checkpoint_block`: autograd keeps only its inputs,
        and its intermediates (and those of its first derivative) are recomputed in each
        backward pass; twice-differentiable (force training). In evaluation or under
        ``torch.no_grad()`` it is a plain call. ``fn`` must not communicate (sync points
        stay outside) and must use no parameters other than ``params`` (default: those of
        ``fn``, a module).
        """
        if (self.activation_checkpointing and self.training and torch.is_grad_enabled()
                and not graph_tracing()):
            from xnn.models.checkpointing import checkpoint_block

            params = list(fn.parameters()) if params is None else list(params)
            return checkpoint_block(fn, args, [p for p in params if p.requires_grad])
        return fn(*args)

    def set_statistics(
        self,
        e0: Mapping[int, float] | None = None,
        scale: float | None = None,
        shift: float | None = None,
    ) -> bool:
        """Set reference energies ``{Z: eV}``, ``scale`` and ``shift`` of the energy output
        (returns true: taken)."""
        self.output.set_statistics(e0=e0, scale=scale, shift=shift)
        return True

    @property
    def e0(self) -> dict[int, float]:
        """``{atomic number: eV}`` reference energies."""
        return self.output.e0
