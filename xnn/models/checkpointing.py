"""Activation checkpointing of one interaction block that also holds for force training.

Force training differentiates twice: ``F = -dE/dx`` with ``create_graph=True``, then the
loss of ``E`` and ``F`` backward. Plain ``torch.utils.checkpoint`` saves the forward pass's
intermediates, but the graph of the first derivative, built while recomputing, keeps them
(and that derivative's own intermediates) until the second backward: on a force loss it
saves little. :func:`checkpoint_block` checkpoints both levels:

* forward: the block runs without a graph; autograd keeps its inputs and parameters;
* first backward: the block's vector-Jacobian product (recomputed forward, then its
  backward) is itself a custom autograd function (``_BlockVJP``) when a graph is being
  built, so the graph of the first derivative keeps only the block's inputs and the
  incoming gradients ``[n_atoms, ...]``;
* second backward: that product is recomputed once more, block by block.

So per block only node-sized tensors outlive the block; per-edge intermediates exist for one
block at a time. A block may be a piece of a layer: the equivariant model checkpoints the
messages of each chunk of edges separately (``Interaction.forward``), so that the peak is
one chunk's recomputation rather than a whole layer's. It costs about two extra forward +
backward passes of each block. Results are those of the plain block up to the order of
floating-point sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten


class _CheckpointedBlock(torch.autograd.Function):
    """``fn(*inputs)`` keeping only its inputs and parameters for backward."""

    @staticmethod
    def forward(ctx, fn: Callable, n_inputs: int, *tensors: Tensor):
        ctx.fn, ctx.n_inputs = fn, n_inputs
        ctx.save_for_backward(*tensors[:n_inputs])
        ctx.params = tensors[n_inputs:]  # leaves, by reference (never copied or offloaded)
        with torch.no_grad():
            return fn(*tensors[:n_inputs])

    @staticmethod
    def backward(ctx, *grads: Tensor):
        tensors, needs = (*ctx.saved_tensors, *ctx.params), ctx.needs_input_grad[2:]
        if torch.is_grad_enabled():  # building the graph of the first derivative
            found = _BlockVJP.apply(ctx.fn, ctx.n_inputs, needs, len(tensors), *tensors,
                                    *grads)
            it = iter(found)
            return (None, None, *(next(it) if need else None for need in needs))
        with torch.enable_grad():
            leaves = _leaves(tensors, needs, ctx.n_inputs)
            found = _vjp(ctx.fn, ctx.n_inputs, leaves, needs, grads, create_graph=False)
        return (None, None, *found)


class _BlockVJP(torch.autograd.Function):
    """The vector-Jacobian product of a block, ``(x, θ, g_y) -> J(x, θ)ᵀ g_y``, keeping only
    ``x``, ``θ`` and ``g_y`` for backward (which recomputes the block and its derivative)."""

    @staticmethod
    def forward(ctx, fn: Callable, n_inputs: int, needs, n_tensors: int, *args: Tensor):
        tensors, grads = args[:n_tensors], args[n_tensors:]
        ctx.fn, ctx.n_inputs, ctx.needs, ctx.n_tensors = fn, n_inputs, needs, n_tensors
        ctx.save_for_backward(*tensors[:n_inputs], *grads)
        ctx.params = tensors[n_inputs:]
        ctx.set_materialize_grads(False)  # unused outputs (parameter gradients): None
        with torch.enable_grad():
            found = _vjp(fn, n_inputs, _leaves(tensors, needs, n_inputs), needs, grads, False)
        return tuple(g for g, need in zip(found, needs) if need)

    @staticmethod
    def backward(ctx, *h: Tensor):
        saved, n = ctx.saved_tensors, ctx.n_inputs
        tensors, grads = (*saved[:n], *ctx.params), saved[n:]
        with torch.enable_grad():
            leaves = _leaves(tensors, ctx.needs, n)
            g_leaves = [g.detach().requires_grad_(True) for g in grads]
            found = _vjp(ctx.fn, ctx.n_inputs, leaves, ctx.needs, g_leaves, True)
            firsts = [(f, hk) for f, hk in zip((f for f in found if f is not None), h)
                      if f.requires_grad and hk is not None]
            wrt = [t for t, need in zip(leaves, ctx.needs) if need] + g_leaves
            if not firsts:
                return (None,) * (4 + len(tensors) + len(grads))
            second = torch.autograd.grad([f for f, _ in firsts], wrt, [hk for _, hk in firsts],
                                         allow_unused=True, materialize_grads=True)
        it = iter(second)
        out = [next(it) if need else None for need in ctx.needs]
        return (None, None, None, None, *out, *it)


def _leaves(tensors: Sequence[Tensor], needs: Sequence[bool], n_inputs: int) -> list[Tensor]:
    """The first ``n_inputs`` (the block's inputs) as copies without history, requiring
    gradients where ``needs``; the parameters after them stay themselves (``fn`` reads them)."""
    return [t.detach().requires_grad_(bool(need)) if k < n_inputs else t
            for k, (t, need) in enumerate(zip(tensors, needs))]


def _vjp(fn: Callable, n_inputs: int, leaves: Sequence[Tensor], needs: Sequence[bool],
         grads: Sequence[Tensor], create_graph: bool) -> tuple:
    """Gradients of ``fn``'s outputs (weighted by ``grads``) w.r.t. the ``leaves`` in
    ``needs`` (``None`` for the others); call with gradients enabled."""
    wrt = [t for t, need in zip(leaves, needs) if need]
    out = fn(*leaves[:n_inputs])
    outs = (out,) if isinstance(out, Tensor) else tuple(out)
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
    found = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                create_graph=create_graph, allow_unused=True,
                                materialize_grads=True)
    it = iter(found)
    return tuple(next(it) if need else None for need in needs)


def checkpoint_block(fn: Callable, args: Sequence, params: Sequence[Tensor]):
    """``fn(*args)`` under two-level activation checkpointing (see the module docstring).

    Args:
        fn: the block; it must read no parameter outside ``params`` and must not
            communicate (it runs again in backward).
        args: its arguments; tensors may sit inside tuples and named tuples.
        params: every parameter ``fn`` uses.
    Returns:
        ``fn(*args)``, a tensor or a tuple of tensors.
    """
    leaves, spec = tree_flatten(list(args))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, Tensor)]

    def call(*tensors: Tensor):
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        return fn(*tree_unflatten(filled, spec))

    tensors = [leaves[i] for i in slots]
    return _CheckpointedBlock.apply(call, len(tensors), *tensors, *params)
