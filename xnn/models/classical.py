"""Classical pair potentials: Lennard-Jones and Morse, shifted to zero at the cutoff.

Both are :class:`~xnn.models.base.AtomisticModel` s returning per-atom energies
``E_i = 1/2 sum_j u(r_ij)`` over a full neighbor list. Pairs at or beyond ``cutoff`` (present
in Verlet lists built with a skin) contribute exactly nothing. The pair energy is shifted,
``u(r) = phi(r) - phi(r_c)``, so the energy is continuous at the cutoff while the force jumps
(as ``ase.calculators.lj.LennardJones(smooth=False)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import AtomisticModel, squared_lengths
from xnn.models.registry import atomic_number, check_cutoff, species_numbers

ElementKey = int | str
PerElement = float | Mapping[ElementKey, float]


def _per_element(
    name: str, value: PerElement, species: list[int] | None
) -> dict[int, float] | float:
    """Normalise a scalar or a by-element dict into ``{Z: value}`` (or keep the scalar)."""
    if not isinstance(value, Mapping):
        return float(value)
    table = {atomic_number(k): float(v) for k, v in value.items()}
    if species is not None:
        missing = sorted(set(species) - set(table))
        if missing:
            raise InputError(f"{name} has no value for species {missing}")
    return table


def _hparams(**values) -> dict:
    """Constructor arguments as plain data (for ``xnn.models.serialization``)."""
    plain = {}
    for k, v in values.items():
        if isinstance(v, Mapping):
            v = {key: float(x) for key, x in v.items()}
        elif isinstance(v, (list, tuple)):
            v = list(v)
        elif v is not None:
            v = float(v)
        plain[k] = v
    return plain


class PairPotential(AtomisticModel):
    """Base of shifted, truncated pair potentials with per-species-pair parameter tables.

    Subclasses call :meth:`_setup_species` and register ``[n_types, n_types]`` parameter
    buffers, then implement :meth:`pair_energy` with :meth:`_param`. The shift ``u(r_c)`` is
    evaluated once per pair of types, not per edge; with one type no type is gathered per
    edge (the parameters are scalars).
    """

    num_interactions = 1

    def _setup_species(
        self, species: Sequence[ElementKey] | None, keys: Sequence[int]
    ) -> list[int]:
        """Set ``self.species`` and the ``type_of [119]`` lookup buffer; return the type list."""
        if species is not None:
            zs = sorted(species_numbers(species, f"{type(self).__name__}: species"))
        elif keys:
            zs = sorted(set(keys))
        else:
            zs = None
        self.species = zs
        type_of = torch.zeros(119, dtype=torch.long)
        if zs is not None:
            type_of[torch.tensor(zs)] = torch.arange(len(zs))
        self.register_buffer("type_of", type_of)
        self.n_types = len(zs or [0])
        return zs or [0]

    @staticmethod
    def _param(table: Tensor, ti: Tensor | None, tj: Tensor | None, dtype) -> Tensor:
        """``table[ti, tj]`` in ``dtype``; the one entry where ``ti`` is ``None`` (one type)."""
        table = table.to(dtype)
        return table[0, 0] if ti is None else table[ti, tj]

    def pair_energy(self, r2: Tensor, ti: Tensor | None, tj: Tensor | None
                    ) -> Tensor:  # pragma: no cover
        """Unshifted pair energy (eV) for squared distances ``r2`` (Å²) between types ``ti``
        and ``tj`` (broadcast with ``r2``; ``None``: the one type)."""
        raise NotImplementedError

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]`` (eV): ``E_i = 1/2 sum_j (u(r_ij) - u(r_c))``."""
        vec = graph.edge_vectors()
        r2 = squared_lengths(vec)
        rc2 = self.cutoff * self.cutoff
        inside = r2 < rc2
        # outside the cutoff the distance is replaced by a constant: no value, no gradient
        r2_safe = torch.where(inside, r2, torch.full_like(r2, rc2))
        j, i = graph.edge_index[0], graph.edge_index[1]
        if self.n_types == 1:
            ti = tj = None
            shift = self.pair_energy(r2.new_full((), rc2), None, None)
        else:
            types = self.type_of[graph.numbers]
            ti, tj = types[i], types[j]
            grid = torch.arange(self.n_types, device=r2.device)
            table = r2.new_full((self.n_types, self.n_types), rc2)
            shift = self.pair_energy(table, grid[:, None], grid[None, :])[ti, tj]
        e = self.pair_energy(r2_safe, ti, tj) - shift
        e = torch.where(inside, e, torch.zeros_like(e))
        out = torch.zeros(graph.n_atoms, dtype=r2.dtype, device=r2.device)
        return out.index_add(0, i, 0.5 * e)


class LennardJones(PairPotential):
    """Lennard-Jones ``u(r) = 4 ε [(σ/r)¹² - (σ/r)⁶] - u(r_c)`` for ``r < r_c``, else 0.

    Matches ``ase.calculators.lj.LennardJones(sigma, epsilon, rc=cutoff, smooth=False)``.

    Args:
        sigma: σ (Å), a number or a dict by element symbol / atomic number.
        epsilon: ε (eV), a number or a dict by element.
        cutoff: r_c (Å), > 0.
        species: elements the model accepts; default the dict keys, or any element when
            ``sigma`` and ``epsilon`` are numbers.

    ``hparams`` holds the constructor arguments (dicts keyed by atomic number), so
    ``xnn.save_model`` can rebuild the model.

    Unlike species are mixed by Lorentz–Berthelot: ``σ_ij = (σ_i + σ_j)/2``,
    ``ε_ij = sqrt(ε_i ε_j)``. Parameters are buffers (``[n_types, n_types]``), so
    ``.to(dtype/device)`` moves them.
    """

    def __init__(
        self,
        sigma: PerElement,
        epsilon: PerElement,
        cutoff: float,
        species: Sequence[ElementKey] | None = None,
    ):
        super().__init__()
        self.hparams = _hparams(sigma=sigma, epsilon=epsilon, cutoff=cutoff, species=species)
        self.cutoff = check_cutoff(cutoff, "LennardJones: cutoff")
        zs = None if species is None else species_numbers(species, "LennardJones: species")
        sig = _per_element("sigma", sigma, zs)
        eps = _per_element("epsilon", epsilon, zs)
        for v in sig.values() if isinstance(sig, dict) else [sig]:
            if not 0 < v < float("inf"):
                raise InputError(f"LennardJones needs sigma > 0 (Å), got {sigma!r}")
        keys = sorted(
            set(sig if isinstance(sig, dict) else []) | set(eps if isinstance(eps, dict) else [])
        )
        if zs is None and keys:
            sig = _per_element("sigma", sigma, keys)
            eps = _per_element("epsilon", epsilon, keys)
        types = self._setup_species(species, keys)
        s = torch.tensor(
            [sig[z] if isinstance(sig, dict) else sig for z in types], dtype=torch.float64
        )
        e = torch.tensor(
            [eps[z] if isinstance(eps, dict) else eps for z in types], dtype=torch.float64
        )
        if (s <= 0).any() or (e < 0).any():
            raise InputError("sigma must be > 0 and epsilon >= 0")
        self.hparams = {
            "sigma": sig,
            "epsilon": eps,
            "cutoff": self.cutoff,
            "species": None if species is None else list(self.species or []),
        }
        self.register_buffer("sigma_ij", 0.5 * (s[:, None] + s[None, :]))
        self.register_buffer("epsilon_ij", torch.sqrt(e[:, None] * e[None, :]))

    def pair_energy(self, r2: Tensor, ti: Tensor | None, tj: Tensor | None) -> Tensor:
        s2 = self._param(self.sigma_ij, ti, tj, r2.dtype) ** 2
        eps = self._param(self.epsilon_ij, ti, tj, r2.dtype)
        c6 = (s2 / r2) ** 3
        return 4.0 * eps * (c6 * c6 - c6)


class Morse(PairPotential):
    """Morse ``u(r) = D [e^{-2α(r - r0)} - 2 e^{-α(r - r0)}] - u(r_c)`` for ``r < r_c``, else 0.

    ASE's ``MorsePotential(epsilon=D, r0=r0, rho0=α r0)`` has the same unshifted form but a
    smooth cutoff window instead of a shift.

    Args:
        D: well depth (eV), > 0.
        alpha: inverse width α (1/Å), > 0.
        r0: equilibrium distance (Å), > 0.
        cutoff: r_c (Å), > 0.
        species: elements the model accepts (default: any).
    """

    def __init__(
        self,
        D: float,
        alpha: float,
        r0: float,
        cutoff: float,
        species: Sequence[ElementKey] | None = None,
    ):
        super().__init__()
        self.hparams = _hparams(D=D, alpha=alpha, r0=r0, cutoff=cutoff, species=species)
        self.cutoff = check_cutoff(cutoff, "Morse: cutoff")
        if not (D > 0 and alpha > 0 and r0 > 0):
            raise InputError(f"Morse needs D, alpha, r0 > 0, got D={D}, alpha={alpha}, r0={r0}")
        types = self._setup_species(species, [])
        self.hparams = {
            "D": float(D),
            "alpha": float(alpha),
            "r0": float(r0),
            "cutoff": self.cutoff,
            "species": None if species is None else list(self.species or []),
        }
        ones = torch.ones(len(types), len(types), dtype=torch.float64)
        self.register_buffer("D_ij", float(D) * ones)
        self.register_buffer("alpha_ij", float(alpha) * ones)
        self.register_buffer("r0_ij", float(r0) * ones)

    def pair_energy(self, r2: Tensor, ti: Tensor | None, tj: Tensor | None) -> Tensor:
        d = self._param(self.D_ij, ti, tj, r2.dtype)
        a = self._param(self.alpha_ij, ti, tj, r2.dtype)
        r0 = self._param(self.r0_ij, ti, tj, r2.dtype)
        x = torch.exp(-a * (torch.sqrt(r2) - r0))
        return d * (x * x - 2.0 * x)
