"""``equivariant``: an E(3)-equivariant many-body message-passing model (MACE class) on e3nn.

Notation: ``h_i [C, (L_h+1)^2]`` node features (``C`` channels, degrees ``l <= L_h``),
``Y(r̂_ij)`` real spherical harmonics up to ``l_max`` (e3nn, ``normalize=True``, component
normalisation), ``R(r_ij)`` the radial MLP of a Bessel basis times a polynomial envelope.
One interaction ``t``::

    h̃_j      = W_up h_j                                           (IrrepsLinear)
    A_i      = W_A Σ_j Σ_p R_p(r_ij) CG_p(h̃_j, Y(r̂_ij)) / avg_num_neighbors
               (channel-wise "uvu" tensor product, EdgeTensorProduct)
    B_i      = Σ_ν u_ν[z_i] (A_i ⊗ ... ⊗ A_i)_ν    ν = 1..correlation   (ProductBasis)
    h_i     <- W_out B_i + W_sc (s[z_i] ⊙ h_i)     (residual self-connection)
    e_i     += readout_t(h_i scalars)

and ``E_i = scale * e_i + shift + E0[z_i]``. The last interaction keeps only scalars.
Edges with ``r >= cutoff`` (Verlet skin) are dropped before the edge computations, and the
envelope is exactly zero at the cutoff, so they contribute exactly nothing.

Memory (what decides the largest system that fits). Per edge, autograd keeps only the radial
weights ``[n_edges, C, paths]``, the gathered sender features ``[n_edges, C, (L_h+1)^2]``, the
harmonics-times-CG matrices (no channel axis) and the radial MLP's last hidden layer: the
weighted sender tensor ``Z`` and the MLP's other activations are recomputed in backward, the
message ``[n_edges, C, (l_max+1)^2]`` exists only transiently, and the scatter keeps only its
index; the product basis is recomputed too (this "lean" mode is used above 2^17 edges; smaller
graphs, such as training batches, keep these intermediates and run fewer kernels). When
chunking (see ``edge_chunk_size``), the whole edge part runs per chunk of receivers under
activation checkpointing, so no per-edge tensor outlives its chunk and the memory per atom is
that of the node features. Memory per atom against mace-torch's MACE of the same size
(``benchmarks/bench_equivariant.py``): benchmarks/results/README.md, section Models. With
``activation_checkpointing`` (training), each interaction is checkpointed in pieces (one per
chunk of about ``4 * n_atoms`` edges, see :class:`Equivariant`) for both derivatives of
force training: the peak of the tensors saved over a force-training step falls several-fold
(``benchmarks/activation_memory.py``; benchmarks/results/README.md, Activation checkpointing).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import edges_paired, graph_tracing, triton_device
from xnn.models.blocks import (
    BesselBasis,
    EnergyScaleShift,
    NativeModel,
    PolynomialCutoff,
    SpeciesEmbedding,
)
from xnn.models.checkpointing import checkpoint_block
from xnn.models.cueq import check_backend
from xnn.models.equivariant_ops import (
    EdgeTensorProduct,
    IrrepsLinear,
    ProductBasis,
    o3,
    plain_harmonics,
)
from xnn.models.heads import Heads, check_head_names
from xnn.models.registry import check_sizes


class _ScatterSum(torch.autograd.Function):
    """``out[index[e]] += src[e]`` keeping only ``index`` for backward (``index_add`` keeps
    ``src`` too). The backward (``index_select``) is differentiable: double backward works."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, n: int) -> Tensor:
        ctx.save_for_backward(index)
        return src.new_zeros((n, *src.shape[1:])).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


def scatter_sum(src: Tensor, index: Tensor, n: int) -> Tensor:
    """``[n, ...]`` sums of the rows of ``src [E, ...]`` by ``index [E]`` (values in 0..n-1).

    Traced (``torch.compile``, ``torch.export``, compiled training) it is torch's own
    ``index_add``: under dynamo in torch 2.11 on CUDA, gradients did not flow through the
    custom Function (forces came out zero)."""
    if graph_tracing():
        return src.new_zeros((n, *src.shape[1:])).index_add(0, index, src)
    return _ScatterSum.apply(src, index, n)


AUTO_CHUNK = 131072  # edges per chunk when ``edge_chunk_size="auto"`` decides to chunk
LEAN_EDGES = 131072  # above this many edges, recompute cheap intermediates in backward
CKPT_EDGES_PER_ATOM = 4  # edges per checkpointed edge piece, per atom (see checkpoint_chunk)
CKPT_MIN_EDGES = 4096  # ... but at least this many


def checkpoint_chunk(n_edges: int, n_atoms: int) -> int:
    """Edges per piece of the edge part under activation checkpointing: about
    ``max(CKPT_EDGES_PER_ATOM * n_atoms, CKPT_MIN_EDGES)``, balanced over the pieces.

    A piece's recomputation (with the derivative's graph, inside the second backward) is then
    of the order of the node-sized tensors kept for all layers, whatever the system size,
    the node-sized work per piece (the
    gradient of the gathered sender features) stays a fixed fraction of the edge work, and a
    piece is never so small that kernel launches dominate on a GPU.
    """
    target = max(CKPT_EDGES_PER_ATOM * n_atoms, CKPT_MIN_EDGES)
    pieces = max(1, -(-n_edges // target))
    return -(-n_edges // pieces)


def available_memory(device: torch.device) -> int:
    """Bytes that a new allocation on ``device`` can still get (CUDA: free + cached; CPU:
    ``MemAvailable`` of ``/proc/meminfo``, or 16 GiB where that file does not exist)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


def _edge_messages(layer: Interaction, h_up, y, feats, sender, receiver, n: int,
                   paired: bool = False) -> Tensor:
    """``Interaction.messages`` for ``torch.compile`` (its scatter then uses ``index_add``)."""
    return layer.messages(h_up, y, feats, sender, receiver, n, paired=paired)


_COMPILED: dict[str, object] = {}


def compiled_edge_messages():
    """``torch.compile`` of the edge part of an interaction (dynamic shapes), built once."""
    if "messages" not in _COMPILED:
        _COMPILED["messages"] = torch.compile(_edge_messages, dynamic=True)
    return _COMPILED["messages"]


class EdgeData(NamedTuple):
    """Edges inside the cutoff and their features, shared by all interactions.

    Attributes:
        edge_index: ``[2, n_in]`` (row 0 sender j, row 1 receiver i).
        y: ``[n_in, (l_max+1)^2]`` spherical harmonics of ``r̂_ij``.
        feats: ``[n_in, num_bessel]`` Bessel basis times the cutoff envelope.
        chunks: ``[(e0, e1, a0, a1)]`` edge ranges whose receivers are atoms ``a0..a1-1``
            (edges sorted by receiver), or ``None`` to process all edges at once.
        lean: recompute cheap intermediates in backward instead of keeping them (large
            graphs); small graphs (training batches) keep them and run fewer kernels.
        density: ``[n_update]`` sum of the cutoff envelopes of each receiver's edges (a
            smooth neighbour count, 0 for an atom without neighbours), or ``None`` when the
            model has no first-layer self-connection.
        pieces: activation checkpointing is on (training): every interaction runs as
            separately checkpointed pieces (``linear_up``, one per edge chunk, the node
            update; see :meth:`Interaction.forward`), and ``chunks`` is never ``None``.
        paired: the edges are reverse pairs (edge ``h + k`` reverses edge ``k``,
            ``h = n_in // 2``; the compiled MD step's list, :func:`~xnn.models.base.
            edges_paired`) and ``feats`` holds the first half's rows only: a pair's two
            lengths are bitwise equal, so its radial weights are computed once.
    """

    edge_index: Tensor
    y: Tensor
    feats: Tensor
    chunks: list[tuple[int, int, int, int]] | None
    lean: bool = True
    density: Tensor | None = None
    pieces: bool = False
    paired: bool = False


def receiver_chunks(receiver: Tensor, n_atoms: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """Split edges sorted by receiver into ranges of about ``chunk`` edges on atom boundaries.

    Returns:
        ``[(e0, e1, a0, a1)]``: edges ``e0..e1-1`` are those received by atoms ``a0..a1-1``;
        the atom ranges cover ``0..n_atoms-1``.
    """
    counts = torch.bincount(receiver, minlength=n_atoms)
    ptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    n_edges = int(ptr[-1])
    targets = torch.arange(chunk, n_edges, chunk, device=ptr.device)
    cuts = (torch.searchsorted(ptr, targets, right=True) - 1).tolist()
    bounds = sorted({0, n_atoms, *[c for c in cuts if 0 < c < n_atoms]})
    ptr_list = ptr[bounds].tolist()
    return [
        (ptr_list[k], ptr_list[k + 1], bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)
    ]


class _NormalizedSiLU(nn.Module):
    """``silu(x) * 1.679``: unit second moment for unit-normal inputs (e3nn's normalize2mom)."""

    scale = 1.6790

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.silu(x) * self.scale


#: how a radial MLP whose weights need no gradient (inference: MD, relaxation; the MD
#: application freezes them) runs on CUDA: ``"torch"`` (its layers: cuBLAS GEMMs), or one
#: fused Triton kernel each way, ``"ieee"`` (fp32 products) or ``"tf32x3"`` (three TF32
#: tensor-core products, errors of fp32's order; :mod:`xnn.models.triton_mlp`). A switch
#: for benchmarks: on a GPU this model's step gained no more than run-to-run noise.
RADIAL_KERNEL = "torch"


class RadialMLP(nn.Module):
    """Bias-free MLP (SiLU) from envelope-weighted Bessel features to tensor-product weights.

    Without biases (and ``silu(0) = 0``) a zero input gives a zero output, so the weights
    vanish smoothly at the cutoff with the envelope.

    Shapes:
        ``[n_edges, num_bessel]`` -> ``[n_edges, C, num_paths]``.
    """

    def __init__(self, sizes: Sequence[int], num_paths: int, channels: int):
        super().__init__()
        dims = [*sizes, num_paths * channels]
        layers: list[nn.Module] = []
        for k in range(len(dims) - 1):
            linear = nn.Linear(dims[k], dims[k + 1], bias=False)
            nn.init.normal_(linear.weight, std=dims[k] ** -0.5)  # variance-preserving
            layers.append(linear)
            if k < len(dims) - 2:
                layers.append(_NormalizedSiLU())
        self.net = nn.Sequential(*layers)
        self.num_paths, self.channels = num_paths, channels

    def forward(self, x: Tensor, recompute: bool = False) -> Tensor:
        """With ``recompute``, the hidden activations are recomputed in backward, not kept.
        Weights that need no gradient: :data:`RADIAL_KERNEL`."""
        if (RADIAL_KERNEL != "torch" and triton_device(x)
                and not any(p.requires_grad for p in self.parameters())):
            from xnn.models import triton_mlp

            linears = self.net[::2]
            y = triton_mlp.fused(x, [(lin.weight.T, None) for lin in linears],
                                 [_NormalizedSiLU.scale] * (len(linears) - 1), None,
                                 RADIAL_KERNEL)
            if y is not None:
                return y.view(x.shape[0], self.channels, self.num_paths)
        trunk, last = self.net[:-1], self.net[-1]
        hidden = checkpoint(trunk, x, use_reentrant=False) if recompute else trunk(x)
        return last(hidden).view(x.shape[0], self.channels, self.num_paths)


class Interaction(nn.Module):
    """One message-passing + many-body update layer.

    Args:
        num_species, channels: species count and ``C``.
        l_in: highest degree of the input node features.
        l_max: highest degree of the spherical harmonics and of ``A``.
        l_out: highest degree of the output node features.
        correlation: product order of the many-body basis.
        radial_sizes: ``[num_bessel, hidden, ...]`` widths of the radial MLP.
        avg_num_neighbors: normalisation of the neighbour sum.
        residual: add the species-scaled self-connection (MACE has none in layer 1).

    Shapes:
        ``h [n_atoms, C, (l_in+1)^2]`` -> ``[n_atoms, C, (l_out+1)^2]``.
    """

    def __init__(
        self,
        num_species: int,
        channels: int,
        l_in: int,
        l_max: int,
        l_out: int,
        correlation: int,
        radial_sizes: Sequence[int],
        avg_num_neighbors: float,
        residual: bool = True,
    ):
        super().__init__()
        self.l_in, self.l_out = l_in, l_out
        self.compiled = False  # set by Equivariant.compile_for_inference
        self.avg_num_neighbors = float(avg_num_neighbors)
        self.linear_up = IrrepsLinear(channels, channels, l_in)
        self.tp = EdgeTensorProduct(l_in, l_max, l_max)
        self.radial = RadialMLP(radial_sizes, self.tp.num_paths, channels)
        self.linear_a = IrrepsLinear(channels, channels, l_max)
        self.product = ProductBasis(num_species, channels, l_max, l_out, correlation)
        self.linear_out = IrrepsLinear(channels, channels, l_out)
        l_sc = min(l_in, l_out)
        self.sc = IrrepsLinear(channels, channels, l_sc) if residual else None
        if residual:
            self.sc_species = nn.Parameter(torch.ones(num_species, channels))
        self.pad = (l_out + 1) ** 2 - (l_sc + 1) ** 2

    def messages(
        self,
        h_up: Tensor,
        y: Tensor,
        feats: Tensor,
        sender: Tensor,
        receiver: Tensor,
        n: int,
        recompute: bool = False,
        paired: bool = False,
    ) -> Tensor:
        """``[n, C, (l_max+1)^2]`` sum of the messages of some edges into receivers ``0..n-1``.

        ``recompute``: recompute the radial MLP's hidden layers and the tensor-product
        intermediates in backward instead of keeping them (cheap element-wise work).
        ``paired``: the edges are reverse pairs and ``feats`` holds the first half's rows
        (:class:`EdgeData`): the radial MLP runs once per pair.
        """
        w = self.radial(feats, recompute)
        # triton: gather, product and scatter in one kernel
        if self.tp.fuses_conv:
            return self.tp.conv(h_up, y, w, sender, receiver, n)
        m = self.tp(h_up.index_select(0, sender), y, w, recompute, paired)
        return scatter_sum(m, receiver, n)

    def aggregate(self, h: Tensor, edges: EdgeData, n_up: int | None = None) -> Tensor:
        """``A [n_up, C, (l_max+1)^2]``: the normalised sum of neighbour messages into the
        first ``n_up`` atoms (the only receivers; default all).

        With ``edges.chunks`` (edges sorted by receiver), each chunk of receivers is computed
        under ``torch.utils.checkpoint``: no per-edge tensor outlives its chunk; backward
        recomputes the chunk (twice-differentiable, non-reentrant checkpoint).
        """
        n_up = h.shape[0] if n_up is None else n_up
        h_up = self.linear_up(h)
        sender, receiver = edges.edge_index[0], edges.edge_index[1]
        if edges.chunks is None and self.compiled:
            a = compiled_edge_messages()(self, h_up, edges.y, edges.feats, sender, receiver,
                                         n_up, edges.paired)
        elif edges.chunks is None:
            a = self.messages(h_up, edges.y, edges.feats, sender, receiver, n_up, edges.lean,
                              edges.paired)
        else:
            a = torch.cat(
                [
                    checkpoint(
                        self.messages, h_up, edges.y[e0:e1], edges.feats[e0:e1],
                        sender[e0:e1], receiver[e0:e1] - a0, a1 - a0, use_reentrant=False,
                    )
                    for e0, e1, a0, a1 in edges.chunks
                ]
            )
        return self.linear_a(a / self.avg_num_neighbors)

    def forward(self, h: Tensor, species: Tensor, edges: EdgeData, n_up: int | None = None,
                sc_gate: Tensor | None = None) -> Tensor:
        """New features of the first ``n_up`` atoms (default all) from ``h`` of all atoms;
        ``sc_gate [n_up]`` multiplies the self-connection (first layer: ``1 - exp(-density)``,
        so that an atom without neighbours keeps zero features).

        With ``edges.pieces`` (activation checkpointing), ``linear_up``, the messages of each
        edge chunk and the node update (``linear_a``, product basis, ``linear_out``,
        self-connection) each run under :func:`checkpoint_block`: the second backward of
        force training recomputes one piece at a time, so its transient memory is that of one
        edge chunk, not of the whole layer.
        """
        n_up = h.shape[0] if n_up is None else n_up
        species = species[:n_up]
        if not edges.pieces:
            return self.update(self.aggregate(h, edges, n_up), h, species, sc_gate, edges.lean)
        h_up = checkpoint_block(self.linear_up, (h,), _trained(self.linear_up.parameters()))
        sender, receiver = edges.edge_index[0], edges.edge_index[1]
        radial = _trained(self.radial.parameters())
        a = torch.cat([
            checkpoint_block(self.messages, (h_up, edges.y[e0:e1], edges.feats[e0:e1],
                                             sender[e0:e1], receiver[e0:e1] - a0, a1 - a0),
                             radial)
            for e0, e1, a0, a1 in edges.chunks
        ])
        rest = _trained(p for name, p in self.named_parameters()
                        if not name.startswith(("linear_up.", "radial.")))
        return checkpoint_block(self._update_sum, (a, h, species, sc_gate), rest)

    def _update_sum(self, a: Tensor, h: Tensor, species: Tensor, sc_gate: Tensor | None):
        """:meth:`update` from the plain sum of messages ``a [n_up, C, (l_max+1)^2]``."""
        return self.update(self.linear_a(a / self.avg_num_neighbors), h, species, sc_gate,
                           False)

    def update(self, a: Tensor, h: Tensor, species: Tensor, sc_gate: Tensor | None,
               lean: bool) -> Tensor:
        """Node update ``W_out B(A) + W_sc (s[z] ⊙ h)`` of the first ``n_up`` atoms.

        Args:
            a: ``A [n_up, C, (l_max+1)^2]`` (see :meth:`aggregate`).
            h: ``[n_atoms, C, (l_in+1)^2]`` input features.
            species: ``[n_up]`` species indices.
            sc_gate: ``[n_up]`` factor of the self-connection, or ``None``.
            lean: recompute the product basis's intermediates in backward.
        """
        n_up = a.shape[0]
        b = self.linear_out(self.product(a, species, recompute=lean))
        if self.sc is None:
            return b
        d_sc = (min(self.l_in, self.l_out) + 1) ** 2
        x = h[:n_up, :, :d_sc] * self.sc_species[species][:, :, None]
        if sc_gate is not None:
            x = x * sc_gate[:, None, None]
        sc = self.sc(x)
        if self.pad:
            sc = torch.nn.functional.pad(sc, (0, self.pad))
        return b + sc


def _trained(params) -> list[Tensor]:
    return [p for p in params if p.requires_grad]


class Equivariant(Heads, NativeModel):
    """E(3)-equivariant many-body model in the NequIP/MACE family.

    Args:
        species: atomic numbers the model knows, e.g. ``[29, 79]``.
        cutoff: Å.
        channels: ``C``, width of every irreducible feature.
        l_max: highest degree of the spherical harmonics and of the ``A`` features.
        hidden_l_max: highest degree of node features passed between interactions
            (0: MACE ``Cx0e``, 1: MACE ``Cx0e + Cx1o``); the last layer keeps scalars only.
        num_interactions: message-passing layers (receptive field = ``cutoff * num_interactions``).
        correlation: product order of the many-body basis (body order ``correlation + 1``).
        num_bessel: Bessel radial functions.
        envelope_p: order of the polynomial cutoff envelope.
        radial_mlp: hidden widths of the radial MLP.
        avg_num_neighbors: the neighbour sum is divided by this (set from the data).
        readout_hidden: hidden width of the last layer's non-linear readout (0: linear).
        first_self_connection: give the first interaction a species-dependent
            self-connection too, like mace-torch's default (``RealAgnosticResidualInteraction
            Block`` for every layer). The features of the first layer then carry a per-species
            term, and the second layer's messages a direct, learnable two-body sum of it: on
            EMT Cu with energy + force training this is what lets the per-atom energy follow
            coordination early (5 epochs: energy MAE 27 instead of 75 meV/atom with MACE
            itself; xnn's model: 33 instead of 69, see ``benchmarks/results/README.md``).
            Here the self-connection is multiplied by ``1 - exp(-n_i)``, ``n_i`` the sum of
            the cutoff envelopes of the atom's edges (a smooth neighbour count): 1 to within
            1e-5 in condensed matter, 0 for an atom without neighbours, which therefore keeps
            zero features and ``E = E0`` exactly; the energy stays smooth at the cutoff.
            Model files saved before this option existed load with ``False``.
        edge_chunk_size: when a graph has more edges than this, process the edges in chunks
            of receivers under activation checkpointing: per-edge tensors are then never
            kept for backward (memory per atom drops several-fold, at the cost of recomputing
            the edge part in backward; 2^17 edges is ~3000 atoms at 43
            neighbours, and the transient memory of one chunk ~2.6 GB in fp32 at C = 64).
            ``"auto"``: chunks of 2^17 edges only when the unchunked per-edge tensors would
            not fit comfortably (estimated above 40% of the free device memory), so small
            and mid-sized systems run at full speed and large ones still fit. ``None``:
            never chunk.
        activation_checkpointing: in training, recompute each interaction in backward
            instead of keeping its intermediates (per-edge weights, gathered senders,
            product basis), also for the graph of the forces: each interaction runs as
            pieces under :func:`~xnn.models.checkpointing.checkpoint_block` (``linear_up``;
            the messages of each chunk of about ``4 * n_atoms`` edges, see
            :func:`checkpoint_chunk`; the node update), so force training keeps node-sized
            tensors only and the second backward recomputes one piece at a time. No effect
            in evaluation. Chunks are those of ``edge_chunk_size`` where smaller.
        scale: eV per network output unit.
        shift: eV added per atom.
        e0: ``{Z: eV}`` reference energies.
        heads: names of the readout heads (:mod:`xnn.models.heads`; ``None``: one readout):
            one set of per-layer readouts with its own E0s, scale and shift per head, on the
            shared body; a structure's ``head`` field picks its head, else the selected
            one (the first unless :meth:`with_head` chose another). Made by
            :meth:`multihead` (``finetune.heads``).
        backend: kernels of the tensor products, product basis and linear maps:
            ``"reference"`` (einsum/matmul), ``"cueq"`` (cuEquivariance, ``pip install
            cuequivariance-torch``; its CUDA kernels with ``cuequivariance-ops-torch-cu12``,
            else its pure-PyTorch path) or ``"triton"`` (fused Triton kernels for the edge
            tensor product only, :mod:`xnn.models.triton_tp`, ``pip install triton``; the
            product basis and linear maps keep the reference code; on CPU tensors the
            reference formula). Same parameters and, to rounding, the same result: a model
            trained with one backend loads and runs with the others (:meth:`set_backend`).

    Parameter count: 122,448 with the defaults and 2 species (C = 64, l_max = 2,
    hidden_l_max = 1, 2 interactions, correlation 3, radial MLP [64, 64, 64]); 342,160 with
    C = 128 (96,976 and 274,832 with ``hidden_l_max = 0``). mace-torch's MACE with the same
    settings (64x0e + 64x1o, one species) has 136,848.

    Shapes:
        ``forward(graph)`` -> per-atom energies ``[n_atoms]`` (eV).
    """

    # hyperparameters that model files of earlier versions lack, with the value they implied
    saved_defaults = {"first_self_connection": False, "activation_checkpointing": False,
                      "backend": "reference"}

    def __init__(
        self,
        species: Sequence[int],
        cutoff: float = 5.0,
        channels: int = 64,
        l_max: int = 2,
        hidden_l_max: int = 1,
        num_interactions: int = 2,
        correlation: int = 3,
        num_bessel: int = 8,
        envelope_p: int = 5,
        radial_mlp: Sequence[int] = (64, 64, 64),
        avg_num_neighbors: float = 20.0,
        readout_hidden: int = 16,
        first_self_connection: bool = True,
        edge_chunk_size: int | str | None = "auto",
        scale: float = 1.0,
        shift: float = 0.0,
        e0: Mapping[int, float] | None = None,
        activation_checkpointing: bool = False,
        backend: str = "reference",
        heads: Sequence[str] | None = None,
    ):
        check_sizes("equivariant", channels=channels, num_interactions=num_interactions,
                    correlation=correlation, num_bessel=num_bessel, envelope_p=envelope_p,
                    radial_mlp=list(radial_mlp))
        check_sizes("equivariant", 0, readout_hidden=readout_hidden)  # 0: a linear readout
        _check(channels, l_max, hidden_l_max, num_interactions, correlation, avg_num_neighbors)
        hparams = dict(
            species=list(species), cutoff=cutoff, channels=channels, l_max=l_max,
            hidden_l_max=hidden_l_max, num_interactions=num_interactions,
            correlation=correlation, num_bessel=num_bessel, envelope_p=envelope_p,
            radial_mlp=list(radial_mlp), avg_num_neighbors=avg_num_neighbors,
            readout_hidden=readout_hidden, first_self_connection=bool(first_self_connection),
            edge_chunk_size=edge_chunk_size, scale=scale,
            shift=shift,
            e0=None if e0 is None else {int(z): float(v) for z, v in e0.items()},
            activation_checkpointing=bool(activation_checkpointing),
            backend=check_backend(backend),
        )
        if heads is not None:
            hparams["heads"] = check_head_names(heads, "equivariant: heads")
        super().__init__(hparams, species, cutoff, num_interactions)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.channels, self.l_max, self.hidden_l_max = channels, l_max, hidden_l_max
        self.first_self_connection = bool(first_self_connection)
        if edge_chunk_size is not None and edge_chunk_size != "auto":
            edge_chunk_size = int(edge_chunk_size)
            if edge_chunk_size < 1:
                raise InputError(f"edge_chunk_size must be >= 1, 'auto' or None, "
                                 f"got {edge_chunk_size}")
        self.edge_chunk_size = edge_chunk_size
        self.embedding = SpeciesEmbedding(self.species, channels)
        self.bessel = BesselBasis(cutoff, num_bessel)
        self.envelope = PolynomialCutoff(cutoff, envelope_p)
        self.sh = o3.SphericalHarmonics(
            o3.Irreps.spherical_harmonics(l_max), normalize=True, normalization="component"
        )
        plain_harmonics(self.sh)
        self.interactions = nn.ModuleList()
        self.readouts = nn.ModuleList()
        for t in range(num_interactions):
            last = t == num_interactions - 1
            self.interactions.append(
                Interaction(
                    len(self.species), channels, 0 if t == 0 else hidden_l_max, l_max,
                    0 if last else hidden_l_max, correlation, [num_bessel, *radial_mlp],
                    avg_num_neighbors, residual=t > 0 or bool(first_self_connection),
                )
            )
            self.readouts.append(_readout(channels, readout_hidden if last else 0))
        self.output = EnergyScaleShift(self.species, scale, shift, e0)
        if heads is not None:  # one (readouts, output) per head, the single ones removed
            self.readout_heads = nn.ModuleList(
                [ReadoutHead(copy.deepcopy(self.readouts), copy.deepcopy(self.output))
                 for _ in hparams["heads"]])
            del self.readouts, self.output
        self.set_backend(backend)

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Fine-tuning parts: ``embedding``, ``interactions``, ``interactions.K``,
        ``readout`` (the readouts of every layer) and ``readout.K``; with heads, ``readout``
        and ``readout.K`` span every head, and ``head.NAME`` is one head."""
        n = len(self.interactions)
        body = {"embedding": ("embedding",), "interactions": ("interactions",),
                **{f"interactions.{k}": (f"interactions.{k}",) for k in range(n)}}
        if not self.head_names:
            return {**body, "readout": ("readouts",),
                    **{f"readout.{k}": (f"readouts.{k}",) for k in range(n)}}
        heads = range(len(self.head_names))
        return {**body, "readout": ("readout_heads",),
                **{f"readout.{k}": tuple(f"readout_heads.{h}.readouts.{k}" for h in heads)
                   for k in range(n)},
                **{f"head.{name}": (f"readout_heads.{h}",)
                   for h, name in enumerate(self.head_names)}}

    # ------------------------------------------------------------------ heads
    @property
    def head_names(self) -> tuple[str, ...]:
        """Names of the readout heads (``()``: one readout)."""
        return tuple(self.hparams.get("heads") or ())

    def _heads(self) -> list[tuple[nn.ModuleList, EnergyScaleShift]]:
        """``[(readouts, output)]`` of every head (one without heads)."""
        if not self.head_names:
            return [(self.readouts, self.output)]
        return [(head.readouts, head.output) for head in self.readout_heads]

    def multihead(self, names: Sequence[str]) -> Equivariant:
        """A new model with the heads ``names`` (see :class:`~xnn.models.heads.Heads`): the
        body's weights and buffers copied, each head a copy (readouts, E0s, scale, shift) of
        this model's head of the same name, else of its selected head; same dtype and
        device, bitwise the same values."""
        names = check_head_names(names, "equivariant: heads")
        hp = {**self.saved_defaults, **self.hparams, "heads": names}
        ref = next(self.parameters())
        new = type(self)(**hp).to(device=ref.device, dtype=ref.dtype)
        own = self._heads()
        state = {k: v for k, v in self.state_dict().items()
                 if not k.startswith(("readouts.", "output.", "readout_heads."))}
        for h, name in enumerate(names):
            src = own[list(self.head_names).index(name)] if name in self.head_names \
                else own[self.active_head]
            state.update({f"readout_heads.{h}.{part}.{k}": v
                          for part, module in zip(("readouts", "output"), src)
                          for k, v in module.state_dict().items()})
        new.load_state_dict(state)
        return new.train(self.training)

    def set_head_statistics(self, name: str, e0: Mapping[int, float] | None = None,
                            scale: float | None = None, shift: float | None = None) -> None:
        """Set the E0s ``{Z: eV}``, scale or shift of head ``name`` (listing the heads when
        unknown)."""
        self.readout_heads[self.head_index(name)].output.set_statistics(e0, scale, shift)

    def set_statistics(self, e0: Mapping[int, float] | None = None, scale: float | None = None,
                       shift: float | None = None) -> bool:
        """Set E0s, scale and shift of the output (of the selected head, with heads)."""
        self._heads()[self.active_head][1].set_statistics(e0=e0, scale=scale, shift=shift)
        return True

    @property
    def e0(self) -> dict[int, float]:
        """``{atomic number: eV}`` reference energies (of the selected head, with heads)."""
        return self._heads()[self.active_head][1].e0

    def set_backend(self, backend: str) -> None:
        """Switch the kernel backend (``"reference"``, ``"cueq"`` or ``"triton"``: the edge
        tensor products only) of every equivariant operation, also in ``hparams``;
        parameters are untouched.

        Raises:
            InputError: unknown backend, ``cueq`` without cuequivariance or ``triton``
                without triton installed.
        """
        check_backend(backend)
        for module in self.modules():
            if isinstance(module, (EdgeTensorProduct, IrrepsLinear, ProductBasis)):
                module.set_backend(backend)
        self.hparams["backend"] = backend

    @property
    def pairs_edges(self) -> bool:
        """With the reference kernels: on a paired list (the compiled MD step's;
        :func:`~xnn.models.base.edges_paired`) the radial MLPs run once per edge pair, the
        tensor products read each pair's weights for both of its edges."""
        return self.hparams.get("backend", "reference") == "reference"

    def compile_for_inference(self, enabled: bool = True) -> bool:
        """Compile the edge part of every interaction (see the base class): faster energy +
        forces on a GPU (benchmarks/results/README.md, Models, matched size). Only
        unchunked evaluations use it; chunked ones (very large systems) stay eager."""
        for layer in self.interactions:
            layer.compiled = bool(enabled)
        return True

    def bytes_per_edge(self, dtype: torch.dtype) -> int:
        """Estimate of the bytes per edge that an unchunked energy + forces keeps and needs
        transiently (per-edge weights, gathered senders and messages of every interaction)."""
        size = torch.empty((), dtype=dtype).element_size()
        floats = sum(3 * layer.tp.num_paths + 2 * (layer.l_in + 1) ** 2 + 2 * (self.l_max + 1) ** 2
                     for layer in self.interactions)
        return floats * self.channels * size

    def chunk_size_for(self, n_edges: int, device: torch.device, dtype: torch.dtype) -> int | None:
        """Edges per chunk for a graph of ``n_edges`` (``None``: evaluate all at once)."""
        if self.edge_chunk_size is None:
            return None
        if self.edge_chunk_size == "auto":
            need = n_edges * self.bytes_per_edge(dtype)
            fits = n_edges <= AUTO_CHUNK or need <= 0.4 * available_memory(device)
            return None if fits else AUTO_CHUNK
        return self.edge_chunk_size if n_edges > self.edge_chunk_size else None

    def edge_features(self, graph: AtomicGraph) -> EdgeData:
        """Edges with ``r < cutoff`` (others dropped), their harmonics and radial features.

        With more than ``edge_chunk_size`` edges, the edges are sorted by receiver and split
        into chunks (see :class:`EdgeData`). On a paired list (:func:`~xnn.models.base.
        edges_paired`; unchunked, every atom a receiver) the radial features are those of the
        first half: the selection of the edges inside the cutoff keeps the pairs (a pair's
        two lengths are bitwise equal).
        """
        vec = graph.edge_vectors()
        edge_index = graph.edge_index
        r = vec.norm(dim=-1)
        paired = edges_paired() and self.pairs_edges and graph.n_update == graph.n_atoms
        if graph_tracing():  # torch.export / compile / make_fx: no data-dependent shapes;
            env = self.envelope(r)  # envelope 0 beyond rc
            return EdgeData(edge_index, self.sh(vec), self._radial_features(r, env, paired),
                            None, False, self._density(env, edge_index, graph.n_update),
                            paired=paired)
        keep = None
        inside = r < self.cutoff
        if graph.n_update < graph.n_atoms:  # only the first n_update atoms receive
            inside &= edge_index[1] < graph.n_update
        if not bool(inside.all()):
            keep = torch.nonzero(inside).flatten()
        chunks = None
        n_in = int(inside.sum())
        chunk = self.chunk_size_for(n_in, vec.device, vec.dtype)
        pieces = (self.activation_checkpointing and self.training and torch.is_grad_enabled())
        if pieces:  # checkpointed pieces of the edge part (see Interaction.forward)
            chunk = min(chunk or n_in, checkpoint_chunk(n_in, graph.n_update))
            if chunk >= n_in:  # one piece: no need to sort
                chunk = None
        if chunk is not None:
            receiver = edge_index[1] if keep is None else edge_index[1, keep]
            if bool((receiver[1:] < receiver[:-1]).any()):
                order = torch.argsort(receiver, stable=True)
                keep = order if keep is None else keep[order]
        if keep is not None:
            vec, r, edge_index = vec[keep], r[keep], edge_index[:, keep]
        if chunk is not None:
            chunks = receiver_chunks(edge_index[1], graph.n_update, chunk)
        elif pieces:
            chunks = [(0, edge_index.shape[1], 0, graph.n_update)]
        paired = paired and chunks is None  # (chunks sort the edges by receiver)
        y = self.sh(vec)
        env = self.envelope(r)
        feats = self._radial_features(r, env, paired)
        lean = not pieces and (chunks is not None or edge_index.shape[1] > LEAN_EDGES)
        density = self._density(env, edge_index, graph.n_update)
        return EdgeData(edge_index, y, feats, chunks, lean, density, pieces, paired)

    def _radial_features(self, r: Tensor, env: Tensor, paired: bool) -> Tensor:
        """Bessel basis times envelope of every edge, or of the first half of a paired list
        (one row per pair)."""
        n = r.shape[0] // 2 if paired else r.shape[0]
        return self.bessel(r[:n]) * env[:n].unsqueeze(-1)

    def _density(self, env: Tensor, edge_index: Tensor, n: int) -> Tensor | None:
        """``[n]`` receivers' sums of edge envelopes (``None`` without first self-connection)."""
        if not self.first_self_connection:
            return None
        return scatter_sum(env, edge_index[1], n)

    def node_features(self, graph: AtomicGraph) -> list[Tensor]:
        """Node features after each interaction, ``[n_update, C, (l+1)^2]`` (all atoms unless
        the graph sets ``n_update``: then only those are updated, and the sync points must
        supply the other atoms' features, as under domain decomposition)."""
        species = self.embedding.index(graph.numbers)
        edges = self.edge_features(graph)
        h = self.embedding(graph.numbers).unsqueeze(-1)
        n_up = graph.n_update
        out = []
        for t, layer in enumerate(self.interactions):
            if t > 0:
                n, c, d = h.shape
                h = self.sync[t - 1](h.reshape(n, c * d), graph).reshape(-1, c, d)
                if h.shape[0] != graph.n_atoms:
                    raise InputError(f"graph sets n_update={n_up} < n_atoms={graph.n_atoms}, "
                                     f"but sync point {t - 1} did not supply the other atoms")
            gate = None
            if t == 0 and edges.density is not None:
                gate = -torch.expm1(-edges.density)
            h = layer(h, species, edges, n_up, gate)  # checkpointed pieces: edges.pieces
            out.append(h)
        return out

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]``; zero beyond ``graph.n_update`` (not computed)."""
        scalars = [h[:, :, 0] for h in self.node_features(graph)]
        n_up = scalars[0].shape[0]
        numbers = graph.numbers[:n_up]
        heads = self._heads()
        which = self.atom_heads(graph, n_up) if len(heads) > 1 else None
        if which is None:
            e = head_energies(scalars, *heads[self.active_head], numbers)
        else:  # every head on every atom (readouts are cheap), each atom takes its own
            e = torch.stack([head_energies(scalars, *head, numbers) for head in heads])
            e = e.gather(0, which.unsqueeze(0)).squeeze(0)
        if n_up < graph.n_atoms:
            e = torch.cat([e, e.new_zeros(graph.n_atoms - n_up)])
        return e


class ReadoutHead(nn.Module):
    """One head: the per-layer readouts of the scalar features and the output's E0s, scale
    and shift. ``forward(scalars, numbers)``: ``scalars`` the ``[n, C]`` scalar features
    after each interaction, ``numbers [n]``; per-atom energies ``[n]`` (eV)."""

    def __init__(self, readouts: nn.ModuleList, output: EnergyScaleShift):
        super().__init__()
        self.readouts, self.output = readouts, output

    def forward(self, scalars: list[Tensor], numbers: Tensor) -> Tensor:
        return head_energies(scalars, self.readouts, self.output, numbers)


def head_energies(scalars: list[Tensor], readouts: nn.ModuleList, output: EnergyScaleShift,
                  numbers: Tensor) -> Tensor:
    """``[n]`` per-atom energies (eV) of one head: the sum of its readouts of the ``[n, C]``
    scalar features after each interaction, through its E0s, scale and shift."""
    e = None
    for s, readout in zip(scalars, readouts):
        et = readout(s).squeeze(-1)
        e = et if e is None else e + et
    return output(e, numbers)


def _readout(channels: int, hidden: int) -> nn.Module:
    """Bias-free readout of the scalar channels: linear, or ``Linear-SiLU-Linear``.

    Without biases a zero feature gives a zero energy, so an isolated atom has ``E = E0``
    (its features vanish: no neighbours, and the first layer's self-connection is gated by
    ``1 - exp(-density)``).
    """
    if hidden <= 0:
        return nn.Linear(channels, 1, bias=False)
    return nn.Sequential(
        nn.Linear(channels, hidden, bias=False), nn.SiLU(), nn.Linear(hidden, 1, bias=False)
    )


def _check(channels, l_max, hidden_l_max, num_interactions, correlation, avg_num_neighbors):
    if channels < 1 or num_interactions < 1:
        raise InputError("channels and num_interactions must be >= 1")
    if not 0 <= l_max <= 6:
        raise InputError(f"l_max must be in [0, 6], got {l_max}")
    if not 0 <= hidden_l_max <= l_max:
        raise InputError(f"hidden_l_max must be in [0, l_max={l_max}], got {hidden_l_max}")
    if correlation < 1:
        raise InputError(f"correlation must be >= 1, got {correlation}")
    if avg_num_neighbors <= 0:
        raise InputError(f"avg_num_neighbors must be > 0, got {avg_num_neighbors}")
