"""MACE's radial networks once per edge pair (a copy's interaction blocks, patched).

An interaction block of mace-torch weighs its edge tensor product with ``R(r) * cutoff(r)``,
a radial MLP of the edge length (``conv_tp_weights``, two thirds of a compiled MACE MD
step's GEMM time at 10k atoms). The two edges of a pair (``j -> i`` and ``i -> j``) have the
same length bitwise, so on a paired list (:func:`xnn.models.base.edges_paired`: edge
``h + k`` reverses edge ``k``) the MLP and the cutoff product run on the first half and the
second half reuses them: the same values, the same energy, and the same forces (the
derivative through ``r_k`` alone is exact since ``r_{h+k} = r_k`` as functions of the
positions). cuEquivariance's fused convolution reads the half-size weights through an input
index (``FUSION``: or runs once per half of the edges, reading them directly); other
convolutions get them concatenated.

Only the blocks whose forward this module mirrors (``RealAgnosticInteractionBlock``,
``RealAgnosticResidualInteractionBlock``: MACE's defaults) are patched; :func:`pairable`
tells whether a model's blocks all are. The patched forward runs mace-torch's own code
whenever the list is not paired or LAMMPS arguments are given.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from xnn.models.base import edges_paired, triton_device

#: how cuEquivariance's fused convolution gets the half-size weights: ``"split"`` one call
#: per half of the edges, each reading them directly (the kernels of the per-edge call;
#: the fastest CUDA-graph step: peers_mace_variants_h200_s22.json at commit 41692e7 in
#: benchmarks/results/), ``"index"`` one call reading them through an input
#: index (cuEquivariance sizes that index by the weights' rows and compiles its kernel per
#: size: in eager MD, whose list is filtered to the cutoff every step, that was a new
#: compilation per call), ``"concat"`` one call on the weights concatenated to full
#: size (slowest: peers_mace_pairs_h200_s18.json at commit 34285fa)
FUSION = "split"
#: dtype of the edge indices given to the fused convolution on CUDA: int32 halves the bytes
#: of the sorts in cuEquivariance's backward (a faster CUDA-graph step, forces equal:
#: peers_mace_split_variants_h200_s22.json at commit 3d7b42e; the current table: Peers)
INDEX_DTYPE = torch.int32
#: how the radial MLP and its cutoff product run on the pairs when their weights need no
#: gradient (MD, relaxation; training keeps mace-torch's layers): ``"torch"`` (mace-torch's
#: e3nn layers: cuBLAS fp32 GEMMs and a pointwise product), ``"ieee"`` or ``"tf32x3"``: one
#: fused Triton kernel each way (:mod:`xnn.models.triton_mlp`: the weights written once,
#: their gradient read once; fp32 products, or three TF32 tensor-core products with errors
#: of fp32's order). CUDA only. tf32x3 is faster than torch forward + backward with errors
#: against fp64 of torch's fp32 order, ieee slower (benchmarks/results/README.md, Kernels),
#: and the CUDA-graph MACE step is faster with split + tf32x3 than with split + torch
#: (peers_mace_variants_h200_s22.json at commit 41692e7).
RADIAL = "tf32x3"


def _classes() -> tuple[type, type]:
    from mace.modules.blocks import (
        RealAgnosticInteractionBlock,
        RealAgnosticResidualInteractionBlock,
    )

    return RealAgnosticInteractionBlock, RealAgnosticResidualInteractionBlock


def pairable(model: nn.Module) -> bool:
    """Whether every interaction block of the mace-torch ``model`` is of a class
    :func:`patch` handles."""
    blocks = list(getattr(model, "interactions", []))
    return bool(blocks) and all(type(b) in _classes() for b in blocks)


def patch(model: nn.Module) -> nn.Module:
    """Give the interaction blocks of ``model`` (a copy: changed in place) the paired
    forward; returns ``model``."""
    if pairable(model):
        for block in model.interactions:
            block._mace_forward = block.forward
            block.forward = types.MethodType(_forward, block)
    return model


def _messages(block: nn.Module, node_feats: Tensor, edge_attrs: Tensor, edge_feats: Tensor,
              edge_index: Tensor, cutoff: Tensor | None) -> Tensor:
    """The block's summed messages ``[n_nodes, irreps]`` with the radial MLP on the first
    half of the paired edges."""
    from mace.tools.scatter import scatter_sum

    half = edge_index.shape[1] // 2
    w = _radial(block.conv_tp_weights, edge_feats[:half],
                None if cutoff is None else cutoff[:half])
    sender, receiver = edge_index[0], edge_index[1]
    conv = block.conv_tp
    if hasattr(block, "conv_fusion"):
        cueq = hasattr(conv, "original_forward") and hasattr(conv, "weight_numel")
        if cueq and edge_index.is_cuda:  # (the pure-PyTorch fallback takes int64 alone)
            sender, receiver = sender.to(INDEX_DTYPE), receiver.to(INDEX_DTYPE)
        if cueq and FUSION == "split":
            # mace's cuEquivariance fusion (with_cueq_conv_fusion), once per half
            n = {0: node_feats}
            out = conv.original_forward([w, node_feats, edge_attrs[:half]],
                                        {1: sender[:half]}, n, {0: receiver[:half]})[0]
            return out + conv.original_forward([w, node_feats, edge_attrs[half:]],
                                               {1: sender[half:]}, n, {0: receiver[half:]})[0]
        if cueq and FUSION == "index":
            slots = torch.arange(half, device=edge_index.device, dtype=sender.dtype)
            return conv.original_forward(
                [w, node_feats, edge_attrs], {0: torch.cat([slots, slots]), 1: sender},
                {0: node_feats}, {0: receiver})[0]
        return conv(node_feats, edge_attrs, torch.cat([w, w]), edge_index)
    mji = conv(node_feats[sender], edge_attrs, torch.cat([w, w]))
    return scatter_sum(src=mji, index=receiver, dim=0, dim_size=node_feats.shape[0])


def _radial(mlp: nn.Module, x: Tensor, cutoff: Tensor | None) -> Tensor:
    """``mlp(x) * cutoff`` (``[P, N]``): mace-torch's layers, or the fused kernel
    (:data:`RADIAL`) on CUDA, or on the CPU under Triton's interpreter."""
    layers = fused_layers(mlp) if RADIAL != "torch" and triton_device(x) else None
    if layers is not None:
        from xnn.models import triton_mlp

        s = None if cutoff is None else cutoff.reshape(-1)
        w = triton_mlp.fused(x, *layers, s, RADIAL)
        if w is not None:
            return w
    w = mlp(x)
    return w if cutoff is None else w * cutoff


def fused_layers(mlp: nn.Module) -> tuple[list, list[float]] | None:
    """``(layers, post_scales)`` of :func:`xnn.models.triton_mlp.pack` for an e3nn
    ``FullyConnectedNet`` with (normalised) SiLU between its layers and none after the last
    (MACE's radial networks), its normalisations folded into the matrices; ``None`` for any
    other network (which then runs as it is)."""
    from e3nn.math import normalize2mom
    from e3nn.nn import FullyConnectedNet

    if type(mlp) is not FullyConnectedNet:
        return None
    layers, scales = [], []
    children = list(mlp.children())
    for i, layer in enumerate(children):
        act, last = layer.act, i == len(children) - 1
        if last != (act is None) or layer.weight.requires_grad:
            return None
        if act is None:
            layers.append((layer.weight / (layer.h_in * layer.var_in / layer.var_out) ** 0.5,
                           None))
            continue
        silu = (torch.nn.functional.silu, torch.nn.SiLU)
        f = act.f if isinstance(act, normalize2mom) else act
        if not (f is silu[0] or isinstance(f, silu[1])):
            return None
        # (e3nn skips a factor within 1e-4 of one)
        cst = act.cst if isinstance(act, normalize2mom) and not act._is_id else 1.0
        layers.append((layer.weight / (layer.h_in * layer.var_in) ** 0.5, None))
        scales.append(cst * layer.var_out ** 0.5)
    return layers, scales


def _forward(self, node_attrs: Tensor, node_feats: Tensor, edge_attrs: Tensor,
             edge_feats: Tensor, edge_index: Tensor, cutoff: Tensor | None = None,
             *args, **kwargs):
    """mace-torch's forward of the two block classes (0.3.16), radial work once per pair."""
    if not edges_paired() or args or kwargs.get("lammps_class") is not None:
        return self._mace_forward(node_attrs, node_feats, edge_attrs, edge_feats, edge_index,
                                  cutoff, *args, **kwargs)
    plain, _ = _classes()
    if type(self) is plain:
        node_feats = self.linear_up(node_feats)
        message = _messages(self, node_feats, edge_attrs, edge_feats, edge_index, cutoff)
        message = self.linear(message) / self.avg_num_neighbors
        return self.reshape(self.skip_tp(message, node_attrs)), None
    sc = self.skip_tp(node_feats, node_attrs)
    node_feats = self.linear_up(node_feats)
    message = _messages(self, node_feats, edge_attrs, edge_feats, edge_index, cutoff)
    message = self.linear(message) / self.avg_num_neighbors
    return self.reshape(message), sc
