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
``num_interactions = 2`` and the halo must reach ``receptive_field = max(cutoff,
atm_cutoff) + cn_cutoff`` (not ``2 * self.cutoff``: DD uses the declared receptive field);
ghost atoms within ``max(cutoff, atm_cutoff)`` of the box need full neighborhoods to
``cn_cutoff``. There are no sync points: ghosts' ``CN`` are recomputed from the halo.

Three-body (Axilrod–Teller–Muto) term, as ``tad_dftd3.damping.dispersion_atm``: for every
triple of atoms with all three distances ``<= atm_cutoff``,
``E_ijk = s9 sqrt(|C6_ij C6_ik C6_jk|) (3 cos a cos b cos c + 1) / (r_ij r_ik r_jk)^3 f``,
``f = 1 / (1 + 6 (r0_ij r0_ik r0_jk / (r_ij r_ik r_jk))^((alp + 2) / 3))``, ``alp = 14``
(i.e. the geometric-mean ratio to the power 16) and ``r0 = 4/3 R_vdW`` (tad-dftd3's pairwise
van der Waals radii, which it uses with every damping; s-dftd3's rational damping uses the BJ
radii ``a1 sqrt(3 Q_i Q_j) + a2`` instead, so s-dftd3 differs slightly from tad-dftd3 and
from this). Triples are the pairs of edges sharing a center atom (periodic images included);
each triple gives 1/3 of its energy to each member (the center of each of its three
appearances), so per-atom energies sum to the total and DD sees only the center's edges.
``s9`` defaults to the functional's table value (1.0 for every D3(BJ) entry of s-dftd3's
table, tad-dftd3's default): set ``s9=0`` to drop the term. Its cost is
``n_atoms * n_neighbors(atm_cutoff)^2 / 2`` triples (memory too, for forces): in dense
periodic systems use an ``atm_cutoff`` well below the 40 Bohr default. The ``zero`` and other
damping variants of the two-body term are not offered.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError
from xnn.models.base import AtomisticModel, graph_tracing
from xnn.models.registry import check_cutoff, check_sizes

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
            "r4r2": tad_dftd3.data.R4R2(**dd), "rvdw": radii.VDW_PAIRWISE(**dd)}


def damping_parameters(functional: str | None, s6: float | None, s8: float | None,
                       a1: float | None, a2: float | None,
                       s9: float | None = None) -> dict[str, float]:
    """D3(BJ) ``{s6, s8, a1, a2, s9, alp}`` of ``functional`` (s-dftd3's table), with
    overrides; ``s9`` and ``alp`` default to tad-dftd3's 1.0 and 14.0 without a functional.

    Raises:
        InputError: unknown functional, no BJ parameters for it, or, without a functional,
            a missing ``s8``, ``a1`` or ``a2``.
    """
    given = {"s6": s6, "s8": s8, "a1": a1, "a2": a2, "s9": s9}
    table: dict[str, float] = {"s6": 1.0, "s9": 1.0, "alp": 14.0}
    if functional is not None:
        from tad_dftd3.param import get_functional_params

        try:
            found = get_functional_params(functional, damping="bj", dtype=torch.float64)
        except (KeyError, ValueError) as err:
            raise InputError(f"d3: no D3(BJ) parameters for functional {functional!r} "
                             f"({str(err).strip(chr(39))}); give another name (e.g. pbe, "
                             "b3lyp, r2scan) or s8, a1, a2 explicitly") from None
        table.update({k: float(v) for k, v in found.items() if k in given or k == "alp"})
    table.update({k: float(v) for k, v in given.items() if v is not None})
    missing = [k for k in ("s8", "a1", "a2") if k not in table]
    if missing:
        raise InputError(f"d3: set functional (e.g. pbe) or give {', '.join(missing)}")
    return table


class D3(AtomisticModel):
    """DFT-D3 with Becke–Johnson (rational) damping, with the ATM three-body term; per-atom
    energies (eV).

    Args:
        functional: functional name for the damping parameters (s-dftd3's table, aliases
            as there, e.g. ``"pbe"``, ``"b3lyp"``, ``"r2scan"``); ``None``: give ``s8``,
            ``a1``, ``a2``.
        cutoff: two-body cutoff (Å); default 25 Å (47 Bohr; s-dftd3 uses 60 Bohr).
        cn_cutoff: coordination-number cutoff (Å); default ``min(cutoff, 25 Bohr)``.
        s6, s8, a1, a2: override the functional's parameters (a2 in Bohr, as published).
        s9: three-body (ATM) scaling; default the functional's (1.0, as tad-dftd3 and
            s-dftd3); 0 switches the term off.
        atm_cutoff: three-body cutoff on each of a triple's distances (Å); default
            ``min(cutoff, 40 Bohr)`` (tad-dftd3's and s-dftd3's 40 Bohr).
        max_triples: refuse (``InputError``) an evaluation with more candidate triples (edge
            pairs within ``atm_cutoff``) than this, rather than run out of memory (each
            takes a few hundred bytes with forces).

    ``self.cutoff = max(cutoff, cn_cutoff, atm_cutoff)``: the neighbor list the model needs.
    """

    num_interactions = 2  # E_i depends on its neighbors' coordination numbers
    traceable = False  # edge selections with data-dependent shapes

    def __init__(self, functional: str | None = "pbe", cutoff: float = 25.0,
                 cn_cutoff: float | None = None, s6: float | None = None,
                 s8: float | None = None, a1: float | None = None, a2: float | None = None,
                 s9: float | None = None, atm_cutoff: float | None = None,
                 max_triples: int = 20_000_000):
        super().__init__()
        aa2au, _ = _units()
        cutoff = check_cutoff(cutoff, "model 'd3': hyperparameter cutoff")
        cn_cutoff = min(cutoff, 25.0 / aa2au) if cn_cutoff is None else cn_cutoff
        atm_cutoff = min(cutoff, 40.0 / aa2au) if atm_cutoff is None else atm_cutoff
        for name, value in (("cn_cutoff", cn_cutoff), ("atm_cutoff", atm_cutoff)):
            check_cutoff(value, f"model 'd3': hyperparameter {name}")
        check_sizes("d3", 0, "a count of triples", max_triples=max_triples)
        self.params = damping_parameters(functional, s6, s8, a1, a2, s9)
        self.disp_cutoff = float(cutoff)
        self.cn_cutoff = float(cn_cutoff)
        self.atm_cutoff = float(atm_cutoff) if self.params["s9"] != 0.0 else 0.0
        self.cutoff = max(self.disp_cutoff, self.cn_cutoff, self.atm_cutoff)
        self.max_triples = int(max_triples)
        self.species = None
        self.hparams = {"functional": functional, "cutoff": self.disp_cutoff,
                        "cn_cutoff": self.cn_cutoff, "s6": s6, "s8": s8, "a1": a1, "a2": a2,
                        "s9": self.params["s9"], "atm_cutoff": float(atm_cutoff),
                        "max_triples": self.max_triples}
        for name, table in _tables().items():  # not in state_dict: rebuilt from tad-dftd3
            self.register_buffer(name, table.clone(), persistent=False)

    @property
    def receptive_field(self) -> float:
        """``max(cutoff, atm_cutoff) + cn_cutoff`` (Å): the pair and triple terms reach
        neighbors whose ``CN`` reach ``cn_cutoff`` further."""
        return max(self.disp_cutoff, self.atm_cutoff) + self.cn_cutoff

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

    def c6_factor(self, numbers: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """``(g [n_atoms, n_present, 7], col [n_atoms])``: ``C6_ij = g[i, col[j]] . w_j``,
        the bilinear form of ``tad_dftd3.model.atomic_c6`` factored over present elements."""
        if graph_tracing():  # no data-dependent shapes: all elements
            present = torch.arange(self.ref_c6.shape[0], device=numbers.device)
        else:
            present = torch.unique(numbers)
        col = torch.searchsorted(present, numbers)
        rc6 = self.ref_c6.to(weights.dtype)[numbers[:, None], present[None, :]]
        return torch.einsum("iuab,ia->iub", rc6, weights), col

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
        g, col = self.c6_factor(numbers, weights)
        j, i = graph.edge_index[0], graph.edge_index[1]
        c6 = (g[i, col[j]] * weights[j]).sum(-1)
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
        out = out.index_add(0, i, (0.5 * au2ev) * e)
        if self.params["s9"] != 0.0:
            out = out + au2ev * self.atm_energies(graph, vec * aa2au, r2 * aa2au**2,
                                                  weights, g, col)
        return out

    def atm_energies(self, graph: AtomicGraph, vec: Tensor, r2: Tensor, weights: Tensor,
                     g: Tensor, col: Tensor) -> Tensor:
        """ATM energies ``[n_atoms]`` (Hartree) from edge vectors ``[n_edges, 3]`` and
        squared lengths ``[n_edges]`` (Bohr), reference weights and the C6 factor."""
        if graph_tracing():
            raise InputError("d3: the three-body (ATM) term has data-dependent shapes and "
                             "cannot be compiled; set s9=0 for compiled evaluation")
        rc2 = (self.atm_cutoff * _units()[0]) ** 2
        i_all = graph.edge_index[1]
        a, b = _edge_pairs(i_all, r2 <= rc2, graph.n_atoms, self.max_triples,
                           self.atm_cutoff)
        i, j, k = i_all[a], graph.edge_index[0][a], graph.edge_index[0][b]
        r2ij, r2ik = r2[a], r2[b]
        vjk = vec[b] - vec[a]
        r2jk = (vjk * vjk).sum(-1)
        keep = r2jk <= rc2
        # triples beyond the cutoff: a harmless constant geometry, then zeroed
        r2jk = torch.where(keep, r2jk, r2ij)

        def c6(p: Tensor, q: Tensor) -> Tensor:
            return (g[p, col[q]] * weights[q]).sum(-1)

        c9 = self.params["s9"] * torch.sqrt(torch.abs(c6(i, j) * c6(i, k) * c6(j, k)))
        rvdw = self.rvdw.to(vec.dtype)
        z = graph.numbers
        r0 = (4.0 / 3.0) ** 3 * rvdw[z[i], z[j]] * rvdw[z[i], z[k]] * rvdw[z[j], z[k]]
        rr2 = r2ij * r2ik * r2jk
        r1 = torch.sqrt(rr2)
        r3 = r1 * rr2
        fdamp = 1.0 / (1.0 + 6.0 * (r0 / r1) ** ((self.params["alp"] + 2.0) / 3.0))
        s = ((r2ij + r2jk - r2ik) * (r2ij - r2jk + r2ik) * (-r2ij + r2jk + r2ik))
        ang = 0.375 * s / (r3 * rr2) + 1.0 / r3
        e = torch.where(keep, ang * fdamp * c9, torch.zeros_like(c9)) / 3.0
        return torch.zeros(graph.n_atoms, dtype=vec.dtype, device=vec.device).index_add(
            0, i, e)


def _edge_pairs(center: Tensor, mask: Tensor, n_atoms: int, limit: int,
                atm_cutoff: float) -> tuple[Tensor, Tensor]:
    """All unordered pairs ``(a, b)`` of distinct edges with the same center among those
    in ``mask`` (edge ids ``[n_pairs]`` each); ``InputError`` beyond ``limit`` pairs."""
    idx = torch.nonzero(mask).flatten()
    c = center[idx]
    order = torch.argsort(c, stable=True)
    idx, c = idx[order], c[order]
    counts = torch.bincount(c, minlength=n_atoms)
    n_pairs = int((counts * (counts - 1) // 2).sum())
    if n_pairs > limit:
        raise InputError(f"d3: {n_pairs} candidate ATM triples within atm_cutoff="
                         f"{atm_cutoff:.3g} Å exceed max_triples={limit}; set a smaller "
                         "atm_cutoff (e.g. 8-10 Å), s9=0, or a larger max_triples")
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(idx.numel(), device=idx.device) - start[c]
    n_after = counts[c] - rank - 1  # partners of each edge later in its center's group
    first = torch.repeat_interleave(torch.arange(idx.numel(), device=idx.device), n_after)
    base = torch.repeat_interleave(torch.cumsum(n_after, 0) - n_after, n_after)
    second = first + 1 + torch.arange(first.numel(), device=idx.device) - base
    return idx[first], idx[second]
