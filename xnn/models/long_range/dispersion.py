"""DFT-D3(BJ) dispersion on xnn's neighbor list, built from ``tad-dftd3``'s pieces.

``tad_dftd3.dftd3`` works on dense ``[nat, nat]`` distance matrices of one molecule (no
lattice, no periodic images). :class:`D3` therefore evaluates the same model on the edges of
an :class:`~xnn.data.graph.AtomicGraph` (periodic images within the cutoffs through the
edges' shifts), calling ``tad-dftd3`` / ``tad-mctc`` for every physical ingredient:

* coordination numbers ``CN_i = sum_j count(r_ij, R_cov,i + R_cov,j)`` over edges shorter
  than ``cn_cutoff`` (``tad_mctc.ncoord.exp_count``, ``tad_mctc`` D3 covalent radii);
* reference weights ``tad_dftd3.model.weight_references`` (Gaussian in ``CN``);
* ``C6_ij = w_i^T C6ref[Z_i, Z_j] w_j`` from ``tad_dftd3``'s reference table, contracted per
  edge (the bilinear form of ``tad_dftd3.model.atomic_c6``, factored over the elements
  present as there, but per edge rather than a dense ``[nat, nat]`` matrix);
* ``C8 = 3 C6 sqrt(Q_i Q_j)`` with ``tad_dftd3.data.R4R2`` and the Becke–Johnson damping
  ``tad_dftd3.damping.rational_damping``;
* damping parameters by functional name (``tad_dftd3.param.get_functional_params``, s-dftd3's
  parameter table), each overridable.

Per-atom energies are ``E_i = -1/2 sum_j (s6 C6 f6(r_ij) + s8 C8 f8(r_ij))`` over edges
shorter than ``cutoff`` (eV; tad-dftd3 works in Bohr/Hartree, converted with ``tad_mctc``'s
constants). Because everything is a function of edge vectors, forces and stress follow from
:func:`xnn.models.derivatives.compute_properties`, and batched, mixed-pbc graphs work.

Domain decomposition: an atom's energy depends on its neighbors' ``CN`` (a second hop), so
``num_interactions = 2`` and the halo must reach ``receptive_field = cutoff + cn_cutoff``
(not ``2 * max(cutoff, cn_cutoff)``: DD uses the declared receptive field); ghost atoms
within ``cutoff`` of the box need full neighborhoods to ``cn_cutoff``. There are no sync
points: ghosts' ``CN`` are recomputed from the halo.

Three-body (Axilrod–Teller–Muto) term: not implemented on edges; ``s9`` must be 0 (the
s-dftd3 tables' ``s9 = 1`` is not applied). The ``zero`` and other damping variants are not
offered.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError
from xnn.models.base import AtomisticModel, graph_tracing

MAX_Z = 103  # the last element with D3 reference data (tad_dftd3.defaults.MAX_ELEMENT - 1)


def _units() -> tuple[float, float]:
    """``(Å -> Bohr, Hartree -> eV)`` factors of ``tad_mctc``."""
    from tad_mctc.units.energy import AU2EV
    from tad_mctc.units.length import AA2AU

    return float(AA2AU), float(AU2EV)


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, Tensor]:
    """tad-dftd3's reference data (float64, CPU): ``cn [104, 7]``, ``c6 [104, 104, 7, 7]``,
    ``rcov [104]`` and ``r4r2 [104]`` (Bohr)."""
    import tad_dftd3
    from tad_mctc.data import radii

    dd = {"dtype": torch.float64, "device": torch.device("cpu")}
    ref = tad_dftd3.reference.Reference(**dd)
    return {"ref_cn": ref.cn, "ref_c6": ref.c6, "rcov": radii.COV_D3(**dd),
            "r4r2": tad_dftd3.data.R4R2(**dd)}


def damping_parameters(functional: str | None, s6: float | None, s8: float | None,
                       a1: float | None, a2: float | None) -> dict[str, float]:
    """D3(BJ) ``{s6, s8, a1, a2}`` of ``functional`` (s-dftd3's table), with overrides.

    Raises:
        InputError: unknown functional, no BJ parameters for it, or, without a functional,
            a missing ``s8``, ``a1`` or ``a2``.
    """
    given = {"s6": s6, "s8": s8, "a1": a1, "a2": a2}
    table: dict[str, float] = {"s6": 1.0}
    if functional is not None:
        from tad_dftd3.param import get_functional_params

        try:
            found = get_functional_params(functional, damping="bj", dtype=torch.float64)
        except (KeyError, ValueError) as err:
            raise InputError(f"d3: no D3(BJ) parameters for functional {functional!r} "
                             f"({str(err).strip(chr(39))}); give another name (e.g. pbe, "
                             "b3lyp, r2scan) or s8, a1, a2 explicitly") from None
        table.update({k: float(v) for k, v in found.items() if k in given})
    table.update({k: float(v) for k, v in given.items() if v is not None})
    missing = [k for k in ("s8", "a1", "a2") if k not in table]
    if missing:
        raise InputError(f"d3: set functional (e.g. pbe) or give {', '.join(missing)}")
    return table


class D3(AtomisticModel):
    """DFT-D3 with Becke–Johnson (rational) damping; per-atom energies (eV).

    Args:
        functional: functional name for the damping parameters (s-dftd3's table, aliases
            as there, e.g. ``"pbe"``, ``"b3lyp"``, ``"r2scan"``); ``None``: give ``s8``,
            ``a1``, ``a2``.
        cutoff: two-body cutoff (Å); default 25 Å (47 Bohr; s-dftd3 uses 60 Bohr).
        cn_cutoff: coordination-number cutoff (Å); default ``min(cutoff, 25 Bohr)``.
        s6, s8, a1, a2: override the functional's parameters (a2 in Bohr, as published).
        s9: three-body scaling; only 0 (the ATM term is not implemented).

    ``self.cutoff = max(cutoff, cn_cutoff)``: the neighbor list the model needs.
    """

    num_interactions = 2  # E_i depends on its neighbors' coordination numbers

    def __init__(self, functional: str | None = "pbe", cutoff: float = 25.0,
                 cn_cutoff: float | None = None, s6: float | None = None,
                 s8: float | None = None, a1: float | None = None, a2: float | None = None,
                 s9: float = 0.0):
        super().__init__()
        aa2au, _ = _units()
        if not 0 < float(cutoff) < float("inf"):
            raise InputError(f"d3: cutoff must be a positive finite number (Å), got {cutoff}")
        cn_cutoff = min(float(cutoff), 25.0 / aa2au) if cn_cutoff is None else cn_cutoff
        if not 0 < float(cn_cutoff) < float("inf"):
            raise InputError(f"d3: cn_cutoff must be a positive finite number (Å), got "
                             f"{cn_cutoff}")
        if float(s9) != 0.0:
            raise InputError("d3: the three-body (ATM) term is not implemented; set s9=0")
        self.params = damping_parameters(functional, s6, s8, a1, a2)
        self.disp_cutoff = float(cutoff)
        self.cn_cutoff = float(cn_cutoff)
        self.cutoff = max(self.disp_cutoff, self.cn_cutoff)
        self.species = None
        self.hparams = {"functional": functional, "cutoff": self.disp_cutoff,
                        "cn_cutoff": self.cn_cutoff, "s6": s6, "s8": s8, "a1": a1, "a2": a2,
                        "s9": 0.0}
        for name, table in _tables().items():  # not in state_dict: rebuilt from tad-dftd3
            self.register_buffer(name, table.clone(), persistent=False)

    @property
    def receptive_field(self) -> float:
        """``cutoff + cn_cutoff`` (Å): the pair term reaches neighbors whose ``CN`` reach
        ``cn_cutoff`` further."""
        return self.disp_cutoff + self.cn_cutoff

    def check_species(self, numbers: Tensor) -> None:
        """Raise :class:`UnknownSpeciesError` for elements without D3 reference data."""
        if numbers.numel() and (int(numbers.max()) > MAX_Z or int(numbers.min()) < 1):
            raise UnknownSpeciesError(f"d3 has reference data for elements 1..{MAX_Z} only")

    def coordination_numbers(self, graph: AtomicGraph, d: Tensor) -> Tensor:
        """D3 coordination numbers ``[n_atoms]`` from edge lengths ``d [n_edges]`` (Bohr)."""
        from tad_mctc.ncoord.count import exp_count

        aa2au, _ = _units()
        j, i = graph.edge_index[0], graph.edge_index[1]
        rc = torch.tensor(self.cn_cutoff * aa2au, dtype=d.dtype, device=d.device)
        inside = d < rc
        rcov = self.rcov.to(d.dtype)[graph.numbers]
        count = exp_count(torch.where(inside, d, rc), rcov[i] + rcov[j])
        count = torch.where(inside, count, torch.zeros_like(count))
        return torch.zeros(graph.n_atoms, dtype=d.dtype, device=d.device).index_add(0, i, count)

    def edge_c6(self, numbers: Tensor, weights: Tensor, i: Tensor, j: Tensor) -> Tensor:
        """``C6_ij [n_edges]`` (Hartree Bohr⁶) from reference weights ``[n_atoms, 7]``."""
        if graph_tracing():  # no data-dependent shapes: all elements
            present = torch.arange(self.ref_c6.shape[0], device=numbers.device)
        else:
            present = torch.unique(numbers)
        col = torch.searchsorted(present, numbers)
        rc6 = self.ref_c6.to(weights.dtype)[numbers[:, None], present[None, :]]
        g = torch.einsum("iuab,ia->iub", rc6, weights)  # [n_atoms, n_present, 7]
        return (g[i, col[j]] * weights[j]).sum(-1)

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom dispersion energies ``[n_atoms]`` (eV)."""
        import tad_dftd3

        aa2au, au2ev = _units()
        vec = graph.edge_vectors()
        r2 = (vec * vec).sum(-1)
        far = torch.full_like(r2, self.cutoff * self.cutoff)
        ok = r2 < far  # beyond the neighbor cutoff: a constant, no value and no gradient
        d = torch.sqrt(torch.where(ok, r2, far)) * aa2au
        numbers = graph.numbers
        cn = self.coordination_numbers(graph, d)
        ref = tad_dftd3.reference.Reference(cn=self.ref_cn.to(d.dtype),
                                            c6=self.ref_c6.to(d.dtype))
        weights = tad_dftd3.model.weight_references(numbers, cn, ref,
                                                    tad_dftd3.model.gaussian_weight)
        j, i = graph.edge_index[0], graph.edge_index[1]
        c6 = self.edge_c6(numbers, weights, i, j)
        r4r2 = self.r4r2.to(d.dtype)[numbers]
        qq = 3.0 * r4r2[i] * r4r2[j]
        rc = torch.tensor(self.disp_cutoff * aa2au, dtype=d.dtype, device=d.device)
        inside = d < rc
        d2 = torch.where(inside, d, rc)
        param = {k: torch.tensor(v, dtype=d.dtype, device=d.device)
                 for k, v in self.params.items()}
        damp = tad_dftd3.damping.rational_damping
        e = -(param["s6"] * c6 * damp(6, d2, qq, param)
              + param["s8"] * c6 * qq * damp(8, d2, qq, param))
        e = torch.where(inside, e, torch.zeros_like(e))
        out = torch.zeros(graph.n_atoms, dtype=d.dtype, device=d.device)
        return out.index_add(0, i, (0.5 * au2ev) * e)
