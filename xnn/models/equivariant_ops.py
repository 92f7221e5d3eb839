"""Equivariant operations on channel-wise irreducible features, written with explicit
Clebsch–Gordan contractions (``e3nn.o3.wigner_3j``) and ``torch.einsum``.

Feature layout: ``x [n, C, D]`` with ``C`` channels and ``D = (L + 1)^2`` components, the
block of degree ``l`` being ``x[..., l*l:(l+1)**2]`` in e3nn's real basis. Only
"natural-parity" irreps are used (degree ``l`` has parity ``(-1)^l``: 0e, 1o, 2e, 3o, ...),
which is closed under the coupling paths ``(l1, l2) -> l3`` with ``l1 + l2 + l3`` even.
Energies built from them are invariant under rotations *and* reflections.

Only APIs present in both e3nn 0.4.4 and 0.6 are used (``o3.wigner_3j``).

All operations are plain differentiable torch ops, so forces (backward) and force training
(double backward) work through them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# e3nn 0.4.4 loads its constants with torch.load(); since torch 2.6 that defaults to
# weights_only=True, which rejects the ``slice`` objects in that file. ``slice`` is inert.
torch.serialization.add_safe_globals([slice])
from e3nn import o3  # noqa: E402


def block(l: int) -> slice:
    """Slice of the degree-``l`` block in a ``(L+1)^2`` component axis."""
    return slice(l * l, (l + 1) * (l + 1))


def coupling_paths(l1_max: int, l2_max: int, l3_max: int) -> list[tuple[int, int, int]]:
    """Natural-parity coupling paths ``(l1, l2, l3)``: triangle rule and ``l1+l2+l3`` even."""
    return [
        (l1, l2, l3)
        for l1 in range(l1_max + 1)
        for l2 in range(l2_max + 1)
        for l3 in range(abs(l1 - l2), min(l1 + l2, l3_max) + 1)
        if (l1 + l2 + l3) % 2 == 0
    ]


def _cg(l1: int, l2: int, l3: int) -> Tensor:
    """``[2l1+1, 2l2+1, 2l3+1]`` coupling, component-normalised (``wigner_3j * sqrt(2l3+1)``)."""
    return o3.wigner_3j(l1, l2, l3, dtype=torch.float64) * math.sqrt(2 * l3 + 1)


class _CGTensors(nn.Module):
    """Holds one CG buffer per path (``cg_0``, ``cg_1``, ...) with path normalisation folded in.

    Each path into ``l3`` is divided by ``sqrt(number of paths into l3)`` so that the summed
    output keeps unit variance for unit-variance inputs and weights. Buffers are stored in
    float64 (a CG rounded to float32 is equivariant only to ~1e-7) and cast to the features'
    dtype when used.
    """

    def __init__(self, paths: list[tuple[int, int, int]]):
        super().__init__()
        self.paths = paths
        fan_in = {l3: sum(1 for p in paths if p[2] == l3) for _, _, l3 in paths}
        for k, (l1, l2, l3) in enumerate(paths):
            cg = _cg(l1, l2, l3) / math.sqrt(fan_in[l3])
            self.register_buffer(f"cg_{k}", cg, persistent=False)

    def get(self, k: int, like: Tensor) -> Tensor:
        """CG of path ``k`` in the dtype of ``like``."""
        return getattr(self, f"cg_{k}").to(like.dtype)


class EdgeTensorProduct(nn.Module):
    """Channel-wise ("uvu") tensor product of sender features and edge harmonics, with
    per-edge, per-path, per-channel weights (MACE's ``conv_tp`` with external weights).

    ``m[e, c, l3] = Σ_{(l1,l2,l3)} w[e, p, c] · CG_p(x[e, c, l1], Y[e, l2])``

    The weight is applied to the sender features *before* the contraction, so the tensors
    kept for backward are ``[n_edges, C, 2l1+1]`` per path (plus ``Y ⊗ CG``, which has no
    channel axis), never ``[n_edges, C, paths, D]``.

    Args:
        l_in: highest degree of the sender features.
        l_sh: highest degree of the spherical harmonics.
        l_out: highest degree of the messages.

    Shapes:
        ``x [n_edges, C, (l_in+1)^2]``, ``y [n_edges, (l_sh+1)^2]``,
        ``w [n_edges, num_paths, C]`` -> ``[n_edges, C, (l_out+1)^2]``.
    """

    def __init__(self, l_in: int, l_sh: int, l_out: int):
        super().__init__()
        self.l_out = l_out
        self.cg = _CGTensors(coupling_paths(l_in, l_sh, l_out))

    @property
    def num_paths(self) -> int:
        return len(self.cg.paths)

    def forward(self, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        blocks: list[Tensor | None] = [None] * (self.l_out + 1)
        for k, (l1, l2, l3) in enumerate(self.cg.paths):
            xw = x[:, :, block(l1)] * w[:, k, :, None]  # [E, C, 2l1+1]
            if l1 == 0:  # CG is diagonal: δ(m2, m3) * const
                t = xw * (y[:, None, block(l2)] * self.cg.get(k, x)[0, 0, 0])
            else:
                yc = torch.einsum("eb,abk->eak", y[:, block(l2)], self.cg.get(k, y))
                t = torch.einsum("eca,eak->eck", xw, yc)
            blocks[l3] = t if blocks[l3] is None else blocks[l3] + t
        return torch.cat(blocks, dim=-1)


class ProductBasis(nn.Module):
    """Many-body node update: per-channel symmetric products of ``A`` up to ``correlation``.

    ``B¹ = A``, ``Bᵛ[l3] = Σ_{(l1,l2,l3)} w_ν[z, p, c] · CG_p(Bᵛ⁻¹[c, l1], A[c, l2])``;
    every term of ``Bᵛ`` is a product of ``ν`` copies of ``A`` (body order ``ν + 1``), in
    the spirit of MACE's ``EquivariantProductBasisBlock``. The output is
    ``Σ_ν u_ν[z, l, c] · Bᵛ[l]`` for ``l <= l_out``. Weights depend on the species ``z``.

    Args:
        num_species: number of species (rows of the weight tables).
        channels: ``C``.
        l_max: highest degree of ``A`` and of the intermediate products.
        l_out: highest degree of the output.
        correlation: highest product order ``ν`` (1 = linear in ``A``: two-body).

    Shapes:
        ``a [n, C, (l_max+1)^2]``, ``species [n]`` -> ``[n, C, (l_out+1)^2]``.
    """

    def __init__(self, num_species: int, channels: int, l_max: int, l_out: int, correlation: int):
        super().__init__()
        self.l_max, self.l_out, self.correlation = l_max, l_out, correlation
        self.couplings = nn.ModuleList()
        self.weights = nn.ParameterList()
        for nu in range(2, correlation + 1):
            l3_max = l_max if nu < correlation else l_out
            cg = _CGTensors(coupling_paths(l_max, l_max, l3_max))
            self.couplings.append(cg)
            self.weights.append(nn.Parameter(torch.randn(num_species, len(cg.paths), channels)))
        self.out_weights = nn.Parameter(
            torch.randn(num_species, correlation, l_out + 1, channels) / math.sqrt(correlation)
        )
        ls = torch.arange(l_out + 1)
        self.register_buffer("degree", torch.repeat_interleave(ls, 2 * ls + 1), persistent=False)

    def _couple(self, cg: _CGTensors, b: Tensor, a: Tensor, w: Tensor, l3_max: int) -> Tensor:
        blocks: list[Tensor | None] = [None] * (l3_max + 1)
        for k, (l1, l2, l3) in enumerate(cg.paths):
            bl = b[:, :, block(l1)] * w[:, k, :, None]
            t = torch.einsum("nca,ncb,abk->nck", bl, a[:, :, block(l2)], cg.get(k, a))
            blocks[l3] = t if blocks[l3] is None else blocks[l3] + t
        return torch.cat(blocks, dim=-1)

    def forward(self, a: Tensor, species: Tensor) -> Tensor:
        d_out = (self.l_out + 1) ** 2
        u = self.out_weights[species]  # [n, ν, l_out+1, C]
        out = a[:, :, :d_out] * u[:, 0, self.degree, :].transpose(1, 2)
        b = a
        for k, nu in enumerate(range(2, self.correlation + 1)):
            l3_max = self.l_max if nu < self.correlation else self.l_out
            b = self._couple(self.couplings[k], b, a, self.weights[k][species], l3_max)
            out = out + b[:, :, :d_out] * u[:, nu - 1, self.degree, :].transpose(1, 2)
        return out


class IrrepsLinear(nn.Module):
    """Channel mixing within each degree (equivariant linear map), no bias except on l = 0.

    ``out[n, d, l m] = Σ_c x[n, c, l m] W_l[c, d] / sqrt(C_in)``

    Shapes:
        ``x [n, C_in, (l_max+1)^2]`` -> ``[n, C_out, (l_max+1)^2]``.
    """

    def __init__(self, c_in: int, c_out: int, l_max: int, bias: bool = False):
        super().__init__()
        self.l_max = l_max
        self.weight = nn.Parameter(torch.randn(l_max + 1, c_in, c_out))
        self.bias = nn.Parameter(torch.zeros(c_out)) if bias else None
        self.norm = 1.0 / math.sqrt(c_in)

    def forward(self, x: Tensor) -> Tensor:
        if self.l_max == 0:
            out = torch.einsum("ncm,cd->ndm", x, self.weight[0] * self.norm)
        else:
            out = torch.cat(
                [
                    torch.einsum("ncm,cd->ndm", x[:, :, block(l)], self.weight[l] * self.norm)
                    for l in range(self.l_max + 1)
                ],
                dim=-1,
            )
        if self.bias is not None:
            out = torch.cat([out[:, :, :1] + self.bias[:, None], out[:, :, 1:]], dim=-1)
        return out
