"""PaiNN: polarizable atom interaction neural network (Schütt, Unke, Gastegger, ICML 2021).

Each atom carries scalar features ``s_i [F]`` and vector features ``v_i [3, F]`` (``v = 0``
initially). With ``r_ij = pos[j] - pos[i] + shift @ cell`` and ``u_ij = r_ij / |r_ij|``:

Message (sum over neighbours j of receiver i)::

    φ_j = φ(s_j)                          [3F]  (Dense-SiLU-Dense, per atom, then gathered)
    W_ij = W(rbf(r_ij)) * fcut(r_ij)      [3F]
    (a, b, c) = split(φ_j ⊙ W_ij)
    Δs_i = Σ_j a ;   Δv_i = Σ_j (v_j ⊙ b + u_ij ⊗ c)

Update (per atom)::

    U v, V v  (feature-mixing linear maps, no bias)
    (a_vv, a_sv, a_ss) = split(MLP([s, ‖V v‖]))
    Δv = a_vv ⊙ U v ;   Δs = a_ss + a_sv ⊙ <U v, V v>

Per-atom energy ``E_i = scale * (readout(s_i) - readout(s_iso[Z_i])) + shift + E0[Z_i]``
with ``s_iso`` the features of an atom without neighbours, so that an isolated atom has
energy exactly ``shift + E0[Z]`` (as in MACE). Scalars and vectors pass
through one :class:`~xnn.models.base.SyncPoint` between interactions as one tensor
``[n_atoms, 4F]`` (scalars, then the three vector components).
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
    SpeciesEmbedding,
    cutoff_envelope,
    mlp,
    weigh_edges,
)
from xnn.models.blocks import (
    radial_basis as make_radial_basis,
)
from xnn.models.registry import check_sizes

_NORM_EPS = 1e-8  # keeps d‖Vv‖ finite when Vv = 0 (first layer)


class PaiNNMessage(nn.Module):
    """Message block. Shapes: ``s [n, F]``, ``v [n, 3, F]`` -> ``(Δs [n, F], Δv [n, 3, F])``."""

    def __init__(self, num_features: int, num_basis: int):
        super().__init__()
        self.num_features = num_features
        self.phi = mlp([num_features, num_features, 3 * num_features], nn.SiLU)
        self.filter = nn.Linear(num_basis, 3 * num_features)

    def forward(
        self,
        s: Tensor,
        v: Tensor,
        rbf_cut: Tensor,
        fcut: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        v_is_zero: bool = False,
        paired: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``rbf_cut = rbf * fcut [n_edges, B]``; ``v_is_zero`` skips the ``v_j`` term (layer 0);
        ``paired``: reverse pairs, ``rbf_cut`` and ``fcut`` with one row per pair (the filter
        once per pair, :func:`~xnn.models.blocks.weigh_edges`).

        ``W(r) fcut = (rbf fcut) Wᵀ + fcut b``: written so, autograd keeps the small
        ``[n_edges, B]`` input instead of another ``[n_edges, 3F]`` tensor.
        """
        sender, receiver = edge_index[0], edge_index[1]
        w = rbf_cut @ self.filter.weight.T + fcut.unsqueeze(-1) * self.filter.bias
        x = weigh_edges(self.phi(s).index_select(0, sender), w, paired)
        a, b, c = torch.split(x, self.num_features, dim=-1)
        dv_edge = unit.unsqueeze(-1) * c.unsqueeze(1)
        if not v_is_zero:
            dv_edge = dv_edge + v.index_select(0, sender) * b.unsqueeze(1)
        ds = torch.zeros_like(s).index_add(0, receiver, a)
        dv = torch.zeros_like(v).index_add(0, receiver, dv_edge)
        return ds, dv


class PaiNNUpdate(nn.Module):
    """Update block. Shapes: ``s [n, F]``, ``v [n, 3, F]`` -> ``(Δs [n, F], Δv [n, 3, F])``."""

    def __init__(self, num_features: int):
        super().__init__()
        self.num_features = num_features
        self.uv = nn.Linear(num_features, 2 * num_features, bias=False)
        self.mix = mlp([2 * num_features, num_features, 3 * num_features], nn.SiLU)

    def forward(self, s: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        u_v, v_v = torch.split(self.uv(v), self.num_features, dim=-1)
        v_norm = torch.sqrt((v_v * v_v).sum(dim=1) + _NORM_EPS)
        a_vv, a_sv, a_ss = torch.split(
            self.mix(torch.cat([s, v_norm], dim=-1)), self.num_features, dim=-1
        )
        dv = a_vv.unsqueeze(1) * u_v
        ds = a_ss + a_sv * (u_v * v_v).sum(dim=1)
        return ds, dv


class PaiNN(NativeModel):
    """PaiNN per-atom-energy model (rotation-invariant energies, equivariant vector features).

    Args:
        species: atomic numbers the model knows, e.g. ``[29, 79]``.
        cutoff: Å.
        num_features: width ``F`` of scalar and vector features.
        num_interactions: message + update blocks (hops).
        num_basis: radial basis functions.
        radial_basis: ``"bessel"`` (PaiNN) or ``"gaussian"``.
        cutoff_fn: ``"cosine"`` (PaiNN) or ``"polynomial"``.
        scale: eV per network output unit.
        shift: eV added per atom.
        e0: ``{Z: eV}`` reference energies.
        activation_checkpointing: in training, recompute each message + update block in
            backward instead of keeping its intermediates (the per-edge ``[n_edges, 3F]``
            and ``[n_edges, 3, F]`` tensors); no effect in evaluation (see
            :meth:`NativeModel.checkpointed`).

    Parameter count with the defaults (F = 128, 3 interactions, 20 Bessel functions,
    2 species): 576,513 (each interaction 189,312, readout 8,321).

    Shapes:
        ``forward(graph)`` -> per-atom energies ``[n_atoms]`` (eV).
    """

    # hyperparameters that model files of earlier versions lack, with the value they implied
    saved_defaults = {"activation_checkpointing": False}
    #: on a paired list (:func:`~xnn.models.base.edges_paired`, the MD steps' list) the
    #: radial filters run once per edge pair (a pair's two lengths are bitwise equal)
    pairs_edges = True

    def __init__(
        self,
        species: Sequence[int],
        cutoff: float = 5.0,
        num_features: int = 128,
        num_interactions: int = 3,
        num_basis: int = 20,
        radial_basis: str = "bessel",
        cutoff_fn: str = "cosine",
        scale: float = 1.0,
        shift: float = 0.0,
        e0: Mapping[int, float] | None = None,
        activation_checkpointing: bool = False,
    ):
        check_sizes("painn", num_interactions=num_interactions, num_basis=num_basis)
        check_sizes("painn", 2, num_features=num_features)  # the readout is F // 2 wide
        hparams = dict(
            species=list(species), cutoff=cutoff, num_features=num_features,
            num_interactions=num_interactions, num_basis=num_basis, radial_basis=radial_basis,
            cutoff_fn=cutoff_fn, scale=scale, shift=shift,
            e0=None if e0 is None else {int(z): float(v) for z, v in e0.items()},
            activation_checkpointing=bool(activation_checkpointing),
        )
        super().__init__(hparams, species, cutoff, num_interactions)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.num_features = int(num_features)
        self.embedding = SpeciesEmbedding(self.species, num_features)
        self.rbf = make_radial_basis(radial_basis, cutoff, num_basis)
        self.fcut = cutoff_envelope(cutoff_fn, cutoff)
        self.messages = nn.ModuleList(
            [PaiNNMessage(num_features, num_basis) for _ in range(num_interactions)]
        )
        self.updates = nn.ModuleList([PaiNNUpdate(num_features) for _ in range(num_interactions)])
        self.readout = mlp([num_features, num_features // 2, 1], nn.SiLU)
        self.output = EnergyScaleShift(self.species, scale, shift, e0)

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Fine-tuning parts: ``embedding``, ``interactions`` (message and update blocks),
        ``interactions.K`` and ``readout``."""
        n = len(self.messages)
        return {"embedding": ("embedding",), "interactions": ("messages", "updates"),
                **{f"interactions.{k}": (f"messages.{k}", f"updates.{k}") for k in range(n)},
                "readout": ("readout",)}

    def _sync(self, k: int, s: Tensor, v: Tensor, graph: AtomicGraph) -> tuple[Tensor, Tensor]:
        """Pass ``s`` and ``v`` through sync point ``k`` as one ``[n_atoms, 4F]`` tensor."""
        n, f = s.shape
        packed = torch.cat([s.unsqueeze(1), v], dim=1).reshape(n, 4 * f)
        packed = self.sync[k](packed, graph).reshape(n, 4, f)
        return packed[:, 0], packed[:, 1:]

    def _interaction(self, k: int, s: Tensor, v: Tensor, rbf_cut: Tensor, fcut: Tensor,
                     unit: Tensor, edge_index: Tensor, paired: bool = False
                     ) -> tuple[Tensor, Tensor]:
        """Message + update of interaction ``k``: new ``(s [n, F], v [n, 3, F])``."""
        ds, dv = self.messages[k](s, v, rbf_cut, fcut, unit, edge_index, k == 0, paired)
        s, v = s + ds, v + dv
        ds, dv = self.updates[k](s, v)
        return s + ds, v + dv

    def forward(self, graph: AtomicGraph) -> Tensor:
        vec = graph.edge_vectors()
        r = vec.norm(dim=-1)
        unit = vec / r.unsqueeze(-1)
        paired = edges_paired()
        if paired:  # one row of radial features per reverse pair
            r = r[: r.shape[0] // 2]
        fcut = self.fcut(r)
        rbf_cut = self.rbf(r) * fcut.unsqueeze(-1)
        species = self.embedding.index(graph.numbers)
        s = self.embedding.embedding(species)
        v = s.new_zeros(s.shape[0], 3, s.shape[1])
        for k in range(self.num_interactions):
            if k > 0:
                s, v = self._sync(k - 1, s, v, graph)
            params = [*self.messages[k].parameters(), *self.updates[k].parameters()]
            s, v = self.checkpointed(self._interaction, k, s, v, rbf_cut, fcut, unit,
                                     graph.edge_index, paired, params=params)
        e = self.readout(s).squeeze(-1) - self.isolated_outputs()[species]
        return self.output(e, graph.numbers)

    def isolated_outputs(self) -> Tensor:
        """``[n_species]`` network output of an atom without neighbours (subtracted in forward).

        With no edges the messages vanish and ``v`` stays 0; only the updates act.
        Subtracting this makes an isolated atom's energy exactly ``shift + E0[Z]``.
        """
        s = self.embedding.embedding.weight
        v = s.new_zeros(s.shape[0], 3, s.shape[1])
        for update in self.updates:
            ds, dv = update(s, v)
            s, v = s + ds, v + dv
        return self.readout(s).squeeze(-1)
