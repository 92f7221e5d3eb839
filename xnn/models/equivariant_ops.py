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
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# e3nn 0.4.4 loads its constants with torch.load(); since torch 2.6 that defaults to
# weights_only=True, which rejects the ``slice`` objects in that file. ``slice`` is inert.
torch.serialization.add_safe_globals([slice])
from e3nn import o3  # noqa: E402
from e3nn.o3._spherical_harmonics import _spherical_harmonics  # noqa: E402

from xnn.errors import InputError  # noqa: E402
from xnn.models import cueq  # noqa: E402


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


def _fan_in(paths: list[tuple[int, int, int]]) -> dict[int, int]:
    return {l3: sum(1 for p in paths if p[2] == l3) for _, _, l3 in paths}


class EdgeTensorProduct(nn.Module):
    """Channel-wise ("uvu") tensor product of sender features and edge harmonics, with
    per-edge, per-path, per-channel weights (MACE's ``conv_tp`` with external weights).

    ``m[e, c, k] = Σ_p w[e, c, p] Σ_{a,b} G_p[a, b, k] x[e, c, a] Y[e, b]``

    with ``G_p`` the CG of path ``p = (l1, l2, l3)`` placed in the blocks of ``l1``, ``l2``,
    ``l3`` and divided by ``sqrt(number of paths into l3)``. Evaluated per group of paths with
    the same ``l1`` as one batched matmul: ``M[e, (p,a), k] = Σ_b Y[e, b] G[b, (p,a), k]``
    (no channel axis), ``Z[e, c, (p,a)] = w[e, c, p] x[e, c, a]``, ``m = Z @ M``.

    Args:
        l_in: highest degree of the sender features.
        l_sh: highest degree of the spherical harmonics.
        l_out: highest degree of the messages.

    ``backend`` (attribute, see :meth:`set_backend`): ``"reference"`` (this einsum/bmm
    code), ``"cueq"`` (the same coefficients as one cuEquivariance tensor product) or
    ``"triton"`` (the same groups, ``Σ_groups Z @ M`` by one fused kernel of
    :mod:`xnn.models.triton_tp`, which never materialises ``Z``).

    Shapes:
        ``x [n_edges, C, (l_in+1)^2]``, ``y [n_edges, (l_sh+1)^2]``,
        ``w [n_edges, C, num_paths]`` -> ``[n_edges, C, (l_out+1)^2]``.
    """

    def __init__(self, l_in: int, l_sh: int, l_out: int):
        super().__init__()
        self.paths = coupling_paths(l_in, l_sh, l_out)  # l1-major order
        self.l_in, self.l_sh, self.l_out = l_in, l_sh, l_out
        self.d_sh, self.d_out = (l_sh + 1) ** 2, (l_out + 1) ** 2
        self.backend, self._cue, self._fused, self._fused_groups = "reference", None, None, None
        fan_in = _fan_in(self.paths)
        self.groups: list[tuple[int, int, int]] = []  # (l1, first path, last path + 1)
        for l1 in range(l_in + 1):
            idx = [k for k, p in enumerate(self.paths) if p[0] == l1]
            if not idx:
                continue
            g = torch.zeros(self.d_sh, len(idx), 2 * l1 + 1, self.d_out, dtype=torch.float64)
            for q, k in enumerate(idx):
                _, l2, l3 = self.paths[k]
                cg = _cg(l1, l2, l3) / math.sqrt(fan_in[l3])  # [a, b, k]
                g[block(l2), q, :, block(l3)] = cg.permute(1, 0, 2)
            self.register_buffer(f"g_{len(self.groups)}", g, persistent=False)
            self.groups.append((l1, idx[0], idx[-1] + 1))

    @property
    def num_paths(self) -> int:
        return len(self.paths)

    def coefficients(self) -> list:
        """Per path, the ``[2l1+1, 2l2+1, 2l3+1]`` coefficients (float64 numpy)."""
        fan_in = _fan_in(self.paths)
        return [(_cg(*p) / math.sqrt(fan_in[p[2]])).numpy() for p in self.paths]

    def set_backend(self, backend: str) -> None:
        """``"reference"``, ``"cueq"`` or ``"triton"`` (same parameters, same result)."""
        self.backend = cueq.check_backend(backend)
        self._cue = None if backend != "cueq" else cueq.CueOp(partial(
            cueq.edge_tp_descriptor, self.paths, self.coefficients(), self.l_in, self.l_sh,
            self.l_out))
        self._fused, self._fused_groups = None, None
        if backend == "triton":
            from xnn.models import triton_tp

            self._fused = triton_tp.weighted_bmm
            if len(self.groups) <= triton_tp.MAX_GROUPS:  # all groups in one kernel
                self._fused_groups = [v for l1, p0, p1 in self.groups
                                      for v in (p1 - p0, 2 * l1 + 1, l1 * l1)]

    @property
    def fuses_conv(self) -> bool:
        """Whether :meth:`conv` runs one fused kernel (the ``triton`` backend with at most
        ``triton_tp.MAX_GROUPS`` groups)."""
        return self._fused_groups is not None

    def _coupling(self, y: Tensor) -> Tensor:
        """``M [n_edges, Σ_groups P*A, d_out]``: all groups' coupling matrices, stacked."""
        g = torch.cat([getattr(self, f"g_{k}").to(y.dtype).reshape(self.d_sh, -1)
                       for k in range(len(self.groups))], dim=1)
        return (y @ g).view(y.shape[0], -1, self.d_out)

    def conv(self, h: Tensor, y: Tensor, w: Tensor, sender: Tensor, receiver: Tensor,
             n: int) -> Tensor:
        """``[n, C, (l_out+1)^2]``: ``forward(h[sender], y, w)`` summed into ``receiver``
        (values in ``0 .. n-1``). With :attr:`fuses_conv`, one kernel gathers, multiplies and
        scatters (:func:`~xnn.models.triton_tp.tp_conv`); else the gather, :meth:`forward`
        and an ``index_add``.

        Shapes:
            ``h [n_nodes, C, (l_in+1)^2]``, ``y [n_edges, (l_sh+1)^2]``,
            ``w [n_edges, C, num_paths]``, ``sender, receiver [n_edges]``.
        """
        if self.fuses_conv:
            from xnn.models import triton_tp

            return triton_tp.tp_conv(w, h, self._coupling(y), sender, receiver, n,
                                     self._fused_groups)
        m = self(h.index_select(0, sender), y, w)
        return m.new_zeros((n, *m.shape[1:])).index_add(0, receiver, m)

    def forward(self, x: Tensor, y: Tensor, w: Tensor, recompute: bool = False,
                paired: bool = False) -> Tensor:
        """With ``recompute``, ``Z`` is recomputed in backward instead of being kept
        (reference backend; cueq keeps its own intermediates; triton never forms ``Z`` and
        keeps only the inputs of each group's product, as the recomputation does).

        ``paired`` (reference backend): the edges are reverse pairs (edge ``E/2 + k``
        reverses edge ``k``) and ``w [E/2, C, num_paths]`` holds one row per pair, used by
        both of its edges (broadcast, not copied)."""
        if paired and (self._cue is not None or self._fused is not None):
            raise InputError(f"paired edge weights need the reference backend, not "
                             f"{self.backend}")
        if self._cue is not None:
            c = x.shape[1]
            out = self._cue([cueq.to_ir_mul(w), cueq.to_ir_mul(x), y], c)
            return cueq.from_ir_mul(out, c)
        e = x.shape[0]
        if self._fused_groups is not None:  # triton: every group in one call
            return self._fused(w, x, self._coupling(y), self._fused_groups)
        out = None
        w_groups = w.split([p1 - p0 for _, p0, p1 in self.groups], dim=-1)
        for k, (l1, p0, p1) in enumerate(self.groups):
            g = getattr(self, f"g_{k}").to(y.dtype)
            pa = (p1 - p0) * (2 * l1 + 1)
            m = (y @ g.reshape(self.d_sh, pa * self.d_out)).view(e, pa, self.d_out)
            xl = x[:, :, block(l1)]
            if self._fused is not None:
                t = self._fused(w_groups[k], xl, m)
            elif recompute:
                t = checkpoint(_weighted_bmm, w_groups[k], xl, m, paired, use_reentrant=False)
            else:
                t = _weighted_bmm(w_groups[k], xl, m, paired)
            out = t if out is None else out + t
        return out


def _weighted_bmm(w: Tensor, x: Tensor, m: Tensor, paired: bool = False) -> Tensor:
    """``Z @ M`` with ``Z[e, c, (p, a)] = w[e, c, p] x[e, c, a]``; ``paired``: ``w`` has one
    row per reverse pair (``E/2``), row ``k`` weighing edges ``k`` and ``E/2 + k``.

    Shapes:
        ``w [E, C, P]`` (paired ``[E/2, C, P]``), ``x [E, C, A]``, ``m [E, P*A, K]`` ->
        ``[E, C, K]``.
    """
    e, c, a = x.shape
    if paired:  # [2, E/2, C, P, A]: both halves weighed by the same rows
        z = w[None, :, :, :, None] * x.view(2, e // 2, c, 1, a)
    else:
        z = w[:, :, :, None] * x[:, :, None, :]
    return torch.bmm(z.reshape(e, c, w.shape[2] * a), m)


class ProductBasis(nn.Module):
    """Many-body node update: per-channel symmetric products of ``A`` up to ``correlation``.

    ``B¹ = A``, ``Bᵛ[c, k] = Σ_p w_ν[z, p, c] Σ_{a,b} G_p[a, b, k] Bᵛ⁻¹[c, a] A[c, b]``;
    every term of ``Bᵛ`` is a product of ``ν`` copies of ``A`` (body order ``ν + 1``), in
    the spirit of MACE's ``EquivariantProductBasisBlock``. The output is
    ``Σ_ν u_ν[z, l, c] · Bᵛ[l]`` for ``l <= l_out``. Weights depend on the species ``z``.

    Each step is two matmuls with constant matrices: the outer product ``[n, C, D*D]`` times
    the stacked CGs ``[D*D, Σ_p (2l3+1)]``, a per-path weight, and a 0/1 matrix summing the
    paths into their output blocks.

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
        self.backend, self._cue = "reference", None
        self.step_paths: list[tuple[int, list[tuple[int, int, int]]]] = []  # (l3_max, paths)
        self.weights = nn.ParameterList()
        d = (l_max + 1) ** 2
        for k, nu in enumerate(range(2, correlation + 1)):
            l3_max = l_max if nu < correlation else l_out
            paths = coupling_paths(l_max, l_max, l3_max)
            self.step_paths.append((l3_max, paths))
            fan_in = _fan_in(paths)
            cols = [(q, m) for q, p in enumerate(paths) for m in range(p[2] ** 2, (p[2] + 1) ** 2)]
            g = torch.zeros(d, d, len(cols), dtype=torch.float64)
            col = 0
            for l1, l2, l3 in paths:
                n3 = 2 * l3 + 1
                cg = _cg(l1, l2, l3) / math.sqrt(fan_in[l3])
                g[block(l1), block(l2), col : col + n3] = cg
                col += n3
            s = torch.zeros(len(cols), (l3_max + 1) ** 2, dtype=torch.float64)
            s[torch.arange(len(cols)), torch.tensor([m for _, m in cols])] = 1.0
            self.register_buffer(f"g_{k}", g.reshape(d * d, len(cols)), persistent=False)
            self.register_buffer(f"s_{k}", s, persistent=False)
            path_of_col = torch.tensor([q for q, _ in cols])
            self.register_buffer(f"path_of_col_{k}", path_of_col, persistent=False)
            self.weights.append(nn.Parameter(torch.randn(num_species, channels, len(paths))))
        self.out_weights = nn.Parameter(
            torch.randn(num_species, correlation, channels, l_out + 1) / math.sqrt(correlation)
        )
        ls = torch.arange(l_out + 1)
        self.register_buffer("degree", torch.repeat_interleave(ls, 2 * ls + 1), persistent=False)

    def set_backend(self, backend: str) -> None:
        """``"reference"`` or ``"cueq"`` (same parameters, same result); ``"triton"`` (a
        backend of the edge tensor product only) keeps the reference code here."""
        self.backend = cueq.check_backend(backend)
        self._cue = None
        if backend == "cueq":
            self._cue = []
            for l3_max, paths in self.step_paths:
                fan_in = _fan_in(paths)
                coeffs = [(_cg(*p) / math.sqrt(fan_in[p[2]])).numpy() for p in paths]
                self._cue.append(cueq.CueOp(partial(
                    cueq.contraction_descriptor, paths, coeffs, self.l_max, l3_max)))

    def _cue_forward(self, a: Tensor, species: Tensor, recompute: bool) -> Tensor:
        """The cueq path: each product step is one cuEquivariance contraction, on flat
        ``ir_mul`` features, with the species' weights gathered by the kernel."""
        c, d_out = a.shape[1], (self.l_out + 1) ** 2
        u = self.out_weights[species][:, :, :, self.degree].transpose(2, 3)  # [n, ν, d_out, C]
        a_flat = cueq.to_ir_mul(a)
        out = a_flat[:, : d_out * c] * u[:, 0].reshape(a.shape[0], -1)
        b = a_flat
        for k, nu in enumerate(range(2, self.correlation + 1)):
            w = self.weights[k].transpose(1, 2).reshape(self.weights[k].shape[0], -1)
            if recompute:
                b = checkpoint(self._cue_step, k, w, b, a_flat, species, use_reentrant=False)
            else:
                b = self._cue_step(k, w, b, a_flat, species)
            out = out + b[:, : d_out * c] * u[:, nu - 1].reshape(a.shape[0], -1)
        return cueq.from_ir_mul(out, c)

    def _cue_step(self, k: int, w: Tensor, b: Tensor, a: Tensor, species: Tensor) -> Tensor:
        """``w [num_species, P*C]``, flat ``b`` and ``a [n, D*C]``."""
        return self._cue[k]([w, b, a], w.shape[1] // len(self.step_paths[k][1]),
                            input_indices={0: species})

    def _step(self, k: int, b: Tensor, a: Tensor, species: Tensor) -> Tensor:
        n, c, d = a.shape
        g = getattr(self, f"g_{k}").to(a.dtype)
        s = getattr(self, f"s_{k}").to(a.dtype)
        outer = (b[:, :, :, None] * a[:, :, None, :]).reshape(n * c, d * d)
        t = (outer @ g).view(n, c, g.shape[1])  # [n, C, Σ_p (2l3+1)]
        w = self.weights[k][species][:, :, getattr(self, f"path_of_col_{k}")]
        return ((t * w).view(n * c, s.shape[0]) @ s).view(n, c, s.shape[1])

    def forward(self, a: Tensor, species: Tensor, recompute: bool = True) -> Tensor:
        """With ``recompute``, the ``[n, C, Σ(2l3+1)]`` products of each step are recomputed
        in backward (only ``b`` and ``a`` are kept)."""
        if self._cue is not None:
            return self._cue_forward(a, species, recompute)
        d_out = (self.l_out + 1) ** 2
        u = self.out_weights[species][:, :, :, self.degree]  # [n, ν, C, d_out]
        out = a[:, :, :d_out] * u[:, 0]
        b = a
        for k, nu in enumerate(range(2, self.correlation + 1)):
            if recompute:
                b = checkpoint(self._step, k, b, a, species, use_reentrant=False)
            else:
                b = self._step(k, b, a, species)
            out = out + b[:, :, :d_out] * u[:, nu - 1]
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
        self.backend, self._cue = "reference", None

    def set_backend(self, backend: str) -> None:
        """``"reference"`` or ``"cueq"`` (same parameters, same result); ``"triton"`` (a
        backend of the edge tensor product only) keeps the reference code here."""
        self.backend = cueq.check_backend(backend)
        self._cue = None if backend != "cueq" else cueq.CueOp(partial(
            cueq.linear_descriptor, self.weight.shape[2], self.l_max, self.norm), "fused_tp")

    def forward(self, x: Tensor) -> Tensor:
        if self._cue is not None:
            flat = self._cue([self.weight.reshape(1, -1), cueq.to_ir_mul(x)], x.shape[1])
            out = cueq.from_ir_mul(flat, self.weight.shape[2])
        elif self.l_max == 0:
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


def plain_harmonics(module: nn.Module) -> nn.Module:
    """Give every e3nn ``SphericalHarmonics`` inside ``module`` the plain Python function,
    whatever e3nn's global ``jit_mode`` was when it was built (other packages set it to
    ``"script"``): a ``ScriptFunction`` attribute cannot be pickled (sending a model to
    spawned ranks), deep-copied, or traced by compiled training. The same numbers.
    Returns ``module``."""
    for m in module.modules():
        if isinstance(m, o3.SphericalHarmonics):
            m.sph_func = _spherical_harmonics
    return module

