"""SchNet: continuous-filter convolutions (Schütt et al., J. Chem. Phys. 148, 241722, 2018).

Per atom ``i`` with features ``x_i [F]``, interaction ``t`` computes

    W_ij = filter(rbf(r_ij)) * fcut(r_ij)                 [n_edges, n_filters]
    m_i  = Σ_j in2f(x_j) ⊙ W_ij                            (index_add over receivers)
    x_i ← x_i + f2out(m_i)                                 (Dense-ssp-Dense)

and the per-atom energy is ``E_i = scale * (readout(x_i) - readout(x_iso[Z_i])) + shift + E0[Z_i]``
with ``x_iso`` the features of an atom without neighbours, so that an isolated atom has
energy exactly ``shift + E0[Z]`` (as in MACE). The cutoff
envelope is exactly zero for ``r >= cutoff``, so Verlet-skin edges contribute nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph
from xnn.models.base import edges_paired
from xnn.models.blocks import (
    EnergyScaleShift,
    NativeModel,
    ShiftedSoftplus,
    SpeciesEmbedding,
    cutoff_envelope,
    mlp,
    weigh_edges,
)
from xnn.models.blocks import (
    radial_basis as make_radial_basis,
)
from xnn.models.registry import check_sizes


class CFConv(nn.Module):
    """One SchNet interaction block (continuous-filter convolution + atom-wise update).

    Shapes:
        ``x [n_atoms, F]``, ``rbf [n_edges, B]``, ``fcut [n_edges]``,
        ``edge_index [2, n_edges]`` -> ``[n_atoms, F]`` (the residual update).
    """

    def __init__(self, num_features: int, num_filters: int, num_basis: int):
        super().__init__()
        self.filter = mlp([num_basis, num_filters, num_filters], ShiftedSoftplus)
        self.in2f = nn.Linear(num_features, num_filters, bias=False)
        self.f2out = mlp([num_filters, num_features, num_features], ShiftedSoftplus)

    def forward(self, x: Tensor, rbf: Tensor, fcut: Tensor, edge_index: Tensor,
                paired: bool = False) -> Tensor:
        """``paired``: the edges are reverse pairs (edge ``E/2 + k`` reverses edge ``k``) and
        ``rbf``, ``fcut`` hold one row per pair: each filter weighs both edges of its pair."""
        sender, receiver = edge_index[0], edge_index[1]
        w = self.filter(rbf) * fcut.unsqueeze(-1)
        msg = weigh_edges(self.in2f(x).index_select(0, sender), w, paired)
        agg = torch.zeros(x.shape[0], msg.shape[1], dtype=msg.dtype, device=msg.device)
        agg = agg.index_add(0, receiver, msg)
        return self.f2out(agg)


class SchNet(NativeModel):
    """SchNet per-atom-energy model.

    Args:
        species: atomic numbers the model knows, e.g. ``[29, 79]``.
        cutoff: Å.
        num_features: atom feature width ``F``.
        num_filters: filter width.
        num_interactions: interaction blocks (hops).
        num_basis: radial basis functions.
        radial_basis: ``"gaussian"`` (SchNet) or ``"bessel"``.
        cutoff_fn: ``"cosine"`` (SchNet) or ``"polynomial"``.
        scale: eV per network output unit.
        shift: eV added per atom.
        e0: ``{Z: eV}`` reference energies.
        activation_checkpointing: in training, recompute each interaction block in backward
            instead of keeping its intermediates (the per-edge filters ``[n_edges, filters]``
            and messages); no effect in evaluation (see :meth:`NativeModel.checkpointed`).

    Parameter count with the defaults (F = filters = 128, 3 interactions, 50 Gaussians,
    2 species): 225,921 (each interaction 72,448, readout 8,321).

    Shapes:
        ``forward(graph)`` -> per-atom energies ``[n_atoms]`` (eV).
    """

    # hyperparameters that model files of earlier versions lack, with the value they implied
    saved_defaults = {"activation_checkpointing": False}
    #: on a paired list (:func:`~xnn.models.base.edges_paired`, the MD steps' list) the
    #: filter networks run once per edge pair (a pair's two lengths are bitwise equal)
    pairs_edges = True

    def __init__(
        self,
        species: Sequence[int],
        cutoff: float = 5.0,
        num_features: int = 128,
        num_filters: int = 128,
        num_interactions: int = 3,
        num_basis: int = 50,
        radial_basis: str = "gaussian",
        cutoff_fn: str = "cosine",
        scale: float = 1.0,
        shift: float = 0.0,
        e0: Mapping[int, float] | None = None,
        activation_checkpointing: bool = False,
    ):
        check_sizes("schnet", num_filters=num_filters, num_interactions=num_interactions,
                    num_basis=num_basis)
        check_sizes("schnet", 2, num_features=num_features)  # the readout is F // 2 wide
        hparams = dict(
            species=list(species), cutoff=cutoff, num_features=num_features,
            num_filters=num_filters, num_interactions=num_interactions, num_basis=num_basis,
            radial_basis=radial_basis, cutoff_fn=cutoff_fn, scale=scale, shift=shift,
            e0=None if e0 is None else {int(z): float(v) for z, v in e0.items()},
            activation_checkpointing=bool(activation_checkpointing),
        )
        super().__init__(hparams, species, cutoff, num_interactions)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.embedding = SpeciesEmbedding(self.species, num_features)
        self.rbf = make_radial_basis(radial_basis, cutoff, num_basis)
        self.fcut = cutoff_envelope(cutoff_fn, cutoff)
        self.interactions = nn.ModuleList(
            [CFConv(num_features, num_filters, num_basis) for _ in range(num_interactions)]
        )
        self.readout = mlp([num_features, num_features // 2, 1], ShiftedSoftplus)
        self.output = EnergyScaleShift(self.species, scale, shift, e0)

    def forward(self, graph: AtomicGraph) -> Tensor:
        r = graph.edge_vectors().norm(dim=-1)
        paired = edges_paired()
        if paired:  # one row of radial features per reverse pair
            r = r[: r.shape[0] // 2]
        rbf = self.rbf(r)
        fcut = self.fcut(r)
        species = self.embedding.index(graph.numbers)
        x = self.embedding.embedding(species)
        for k, interaction in enumerate(self.interactions):
            if k > 0:
                x = self.sync[k - 1](x, graph)
            x = x + self.checkpointed(interaction, x, rbf, fcut, graph.edge_index, paired)
        e = self.readout(x).squeeze(-1) - self.isolated_outputs()[species]
        return self.output(e, graph.numbers)

    def isolated_outputs(self) -> Tensor:
        """``[n_species]`` network output of an atom without neighbours (subtracted in forward).

        With no edges every aggregate is zero, so each interaction adds ``f2out(0)``. Subtracting
        this makes an isolated atom's energy exactly ``shift + E0[Z]``.
        """
        x = self.embedding.embedding.weight
        for interaction in self.interactions:
            zero = x.new_zeros(x.shape[0], interaction.in2f.out_features)
            x = x + interaction.f2out(zero)
        return self.readout(x).squeeze(-1)

