"""``MACEWrapper``: a mace-torch model (``MACE``, ``ScaleShiftMACE``, ...) as an xnn model.

Edge conventions. xnn: ``edge_index[0]`` = sender j, ``edge_index[1]`` = receiver i,
``r_ij = pos[j] - pos[i] + s @ cell``. mace-torch (``mace.data.get_neighborhood``,
``mace.modules.utils.get_edge_vectors_and_lengths``): ``edge_index[0]`` = sender,
``edge_index[1]`` = receiver, messages flow sender -> receiver, and the edge vector is
``pos[receiver] - pos[sender] + shifts`` with ``shifts = unit_shifts @ cell``. So the xnn
edge is passed unchanged and the shifts are negated: MACE's vector is ``-r_ij``.

The wrapper builds MACE's input dict from the graph only (positions, one-hot species,
edges, shifts): no internal neighbor list, so it runs unchanged on owned + ghost atoms under
domain decomposition. It calls the model with ``compute_force=False`` and returns
``node_energy`` (which includes the per-element reference energies E0); xnn derives forces
and stress. Edges at or beyond ``r_max`` (a Verlet skin) are dropped before the call.

Sync points. mace-torch's ``forward`` runs, per layer ``t``, ``interaction[t]`` (which reads
the node features of every atom: its skip connection and ``linear_up`` per node, then the
messages gathered from the senders ``node_feats[edge_index[0]]``) and ``product[t]`` (per
node). Everything else an interaction reads is exact on a ghost atom: its species
(``node_attrs``) and the edge features of edges whose receiver is owned (geometry only);
messages, densities and products summed over an incomplete ghost neighbourhood are wrong
only on ghosts, whose features layer ``t + 1`` must not read. So for ``t >= 1`` the node
features ``interaction[t]`` is called with pass through ``self.sync[t - 1]`` (a
:class:`~xnn.models.base.SyncPoint`, the identity in one process), through a forward
pre-hook held on the block for the call only (mace-torch's own ``forward`` runs unchanged,
every variant of it). mace's LAMMPS ML-IAP code exchanges at the same place (after
``linear_up``, inside the block; before it here, so one tensor serves every block class).
Under ``parallelize(model, mode="sync")`` the sync points become halo feature exchanges and
a rank holds ghosts of one cutoff (plus skin) instead of ``num_interactions`` cutoffs. The
``torch.compile`` copy (:meth:`MACEWrapper.compile_for_inference`) is one compiled region,
which cannot hold an exchange: while a sync point is anything but the identity, the eager
model runs instead. A TorchScript-compiled MACE module runs no Python hooks: wrapped, it has
no sync points (and runs decomposed in mode halo).

Files and trust. A MACE ``.model`` file is a pickle: loading one executes code from it, as
mace-torch itself does, so ``model="file.model"`` needs the caller's ``trust=True``. xnn model
files (:meth:`MACEWrapper.to_payload`) hold the MACE model as data: its constructor arguments
and state dict (see :mod:`xnn.models.external._mace_data`), read with ``weights_only=True``
and rebuilt without unpickling. Files written by earlier xnn versions hold the module pickled
(``kind`` ``mace-torch-pickle``); they load only with ``xnn.load_model(..., trust=True)``.
A ``model=PATH`` or ``trust`` read from a file's hyperparameters counts for nothing: only the
caller grants trust (:mod:`xnn.models.trust`).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor, nn

from xnn._files import require_file
from xnn.data.graph import AtomicGraph, rowvec_matmul
from xnn.errors import InputError, ModelFileError
from xnn.models.base import AtomisticModel, SyncPoint, SyncPoints
from xnn.models.cueq import check_backend
from xnn.models.external import _mace_data, _mace_pairs
from xnn.models.external._common import check_dtype, edges_within, leaf_safe
from xnn.models.external._optional import import_extra, preserved_environ

PAYLOAD_KIND = "mace-torch-config-state"  # constructor arguments + state dict (data only)
PICKLE_KIND = "mace-torch-pickle"  # the module pickled (earlier xnn versions): trust only
DIRECT_HINT = ("pass trust=True (xnn.models.build('mace', model=PATH, trust=True); "
               "model.hyperparameters.trust=true or model.trust_file=true in xnn md/relax/run)")
COMPILE_BACKEND = "inductor"  # torch.compile backend of compile_for_inference (tests: aot_eager)


def _load_module(source: str | os.PathLike | bytes, trust: bool = False) -> nn.Module:
    """Unpickle a mace-torch module from a file path or bytes (only with ``trust=True``)."""
    from xnn.models.trust import require

    import_extra("mace", "mace", "mace.modules")
    where = "<bytes>" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes):
        require_file(source, "MACE model file", ModelFileError)
    if isinstance(source, bytes):  # the payload of an earlier xnn's model file
        require("the MACE module this model file holds pickled (an earlier xnn's format; save "
                "it again with xnn.save_model for a data-only file)", trust,
                "load the file with xnn.load_model(PATH, trust=True)",
                reason="runs code from the file when unpickled")
    else:
        require(f"MACE model file {where}", trust, DIRECT_HINT)  # the caller's trust only
    f = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with preserved_environ():
            model = torch.load(f, map_location="cpu", weights_only=False)
    except Exception as err:  # corrupt file, missing classes, ...
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err) else ''}"
        raise ModelFileError(f"cannot load MACE model {where}: {reason}") from None
    if not isinstance(model, nn.Module) or not hasattr(model, "r_max"):
        got = type(model).__name__
        raise ModelFileError(f"{where} does not hold a mace-torch model (got {got})")
    return model


def _head_index(model: nn.Module, head: str | None) -> int:
    heads = list(getattr(model, "heads", None) or ["Default"])
    if head is None:
        if len(heads) == 1:
            return 0
        lower = [h.lower() for h in heads]
        if "default" in lower:
            return lower.index("default")
        raise InputError(f"this MACE model has several heads {heads}: choose one with head=...")
    if head not in heads:
        raise InputError(f"unknown MACE head {head!r}; the model has {heads}")
    return heads.index(head)


def _read_through(sync: nn.Module, graph: AtomicGraph, block: nn.Module, args: tuple,
                  kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of an interaction block: its ``node_feats`` through ``sync``."""
    if "node_feats" not in kwargs:  # mace-torch (0.3.x) calls its blocks with keywords
        raise InputError(f"the MACE wrapper's sync points need interaction blocks called with "
                         f"node_feats=...; {type(block).__name__} was called positionally")
    kwargs["node_feats"] = sync(kwargs["node_feats"], graph)
    return args, kwargs


class MACEWrapper(SyncPoints, AtomisticModel):
    """A mace-torch model returning per-atom energies ``[n_atoms]`` (eV) from xnn graphs.

    Args:
        model: a mace-torch ``nn.Module`` or the path of a ``.model`` file (a pickle: see
            ``trust``).
        head: head name for multi-head models; defaults to the only head or ``"default"``.
        trust: load a ``.model`` file although it is a pickle (it can run code: only for
            files you trust); without it a path is refused.
        backend: ``"reference"`` (the e3nn model as given) or ``"cueq"`` (not ``"triton"``,
            which is the equivariant model's): evaluate a copy
            converted by mace-torch's own ``mace.cli.convert_e3nn_cueq`` (cuEquivariance
            kernels; its pure-PyTorch path on CPU, equal to the reference to ~1e-13 in fp64).
            The wrapper's parameters stay those of the e3nn model (files, state dicts and
            training are unchanged: training runs the e3nn model); the copy is made at the
            first evaluation and remade when the weights, device or dtype change.

    Attributes:
        cutoff: ``model.r_max`` (Å).
        num_interactions: ``model.num_interactions``.
        species: ``model.atomic_numbers``, in the model's one-hot order.
        sync: ``nn.ModuleList`` of ``num_interactions - 1`` :class:`SyncPoint` identities,
            applied to the node features that interactions ``1 .. num_interactions - 1``
            read (see the module doc); none for a TorchScript module (``torch.jit``), which
            runs no Python hooks: decomposed, it runs in mode halo.
    """

    def __init__(self, model: nn.Module | str | os.PathLike, head: str | None = None,
                 trust: bool = False, backend: str = "reference"):
        super().__init__()
        self.backend = check_backend(backend)
        if self.backend == "triton":
            raise InputError("backend=triton is a kernel backend of xnn's equivariant model "
                             "only; the MACE wrapper takes reference or cueq")
        if isinstance(model, (str, os.PathLike)):
            model = _load_module(model, trust)
        elif not isinstance(model, nn.Module) or not hasattr(model, "r_max"):
            raise InputError(
                f"model must be a mace-torch module or a .model path, got {type(model).__name__}"
            )
        self.model = model
        self.head = head
        self.head_index = _head_index(model, head)
        self.cutoff = float(model.r_max)
        self.num_interactions = int(model.num_interactions)
        self.species = [int(z) for z in model.atomic_numbers]
        # a TorchScript module runs no Python hooks: no sync points (decomposed: mode halo)
        scripted = isinstance(model, torch.jit.ScriptModule)
        self.init_sync_points(0 if scripted else self.num_interactions - 1)
        table = torch.full((119,), -1, dtype=torch.long)
        table[torch.tensor(self.species)] = torch.arange(len(self.species))
        # on the wrapped module's device: a wrapper built around a CUDA model runs there
        device = next(iter(model.parameters()), table).device
        self.register_buffer("z_to_index", table.to(device), persistent=False)

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Fine-tuning parts of the MACE network: ``embedding`` (node and radial
        embeddings), ``interactions`` and ``interactions.K`` (the K-th interaction block with
        its product basis), ``readout`` (the readouts)."""
        children = dict(self.model.named_children())
        n = len(children.get("interactions", []))
        embed = tuple(f"model.{c}" for c in ("node_embedding", "radial_embedding")
                      if c in children)
        return {"embedding": embed, "interactions": ("model.interactions", "model.products"),
                **{f"interactions.{k}": (f"model.interactions.{k}", f"model.products.{k}")
                   for k in range(n)},
                "readout": ("model.readouts",)}

    def mace_inputs(self, graph: AtomicGraph, cell_grad: bool = False) -> dict[str, Tensor]:
        """MACE's input dict for ``graph`` (edges within ``r_max``; see the module doc).

        ``cell_grad``: the cell (and so the edge shifts) require grad even without stress, as
        they do with it (apply_strain): one compiled graph serves both (torch.compile guards
        on ``requires_grad`` and recompiled the whole model, minutes on a GPU, when an MD
        run's first step asked for stress and later ones did not)."""
        edge_index, shifts, _ = edges_within(graph, self.cutoff, zero_beyond=True)
        cell = graph.cell
        if cell_grad and torch.is_grad_enabled() and not cell.requires_grad:
            cell = cell.detach().requires_grad_(True)
        receiver = edge_index[1]
        unit_shifts = -shifts.to(cell.dtype)  # MACE vector = pos[recv] - pos[send] + shift
        cart_shifts = rowvec_matmul(unit_shifts, cell, graph.batch, receiver, key=edge_index)
        index = self.z_to_index[graph.numbers]
        node_attrs = nn.functional.one_hot(index, len(self.species)).to(cell.dtype)
        n_sys = graph.n_systems
        return {
            "positions": leaf_safe(graph.positions),
            "node_attrs": node_attrs,
            "edge_index": edge_index,
            "shifts": cart_shifts,
            "unit_shifts": unit_shifts,
            "cell": cell.reshape(n_sys * 3, 3),
            "batch": graph.batch,
            "ptr": graph.ptr,
            "head": torch.full((n_sys,), self.head_index, dtype=torch.long, device=cell.device),
            "pbc": graph.pbc,
        }

    @property
    def sync_width(self) -> int | None:
        """Numbers per atom a sync point exchanges: the node features that interactions
        ``1 ..`` read (their ``node_feats_irreps`` dimension, e.g. 128 for ``128x0e``, 512
        for ``128x0e + 128x1o``; the largest); ``None`` without sync points."""
        blocks = list(self.model.interactions)[1:len(self.sync) + 1]
        return max((int(b.node_feats_irreps.dim) for b in blocks), default=None)

    @property
    def pairs_edges(self) -> bool:
        """With ``backend="cueq"``: the converted copy runs its radial networks once per
        edge pair on a paired list (the compiled MD step's; :mod:`._mace_pairs`)."""
        return self.backend == "cueq" and _mace_pairs.pairable(self.model)

    def compile_for_inference(self, enabled: bool = True) -> bool:
        """Run MACE through ``torch.compile`` for energy, forces and stress (see the base
        class), prepared the way mace-torch's own ``MACECalculator(compile_mode=...)`` does:
        a copy of the model rebuilt without e3nn's TorchScript code generation, its
        registered blocks traced by ``torch.fx``, compiled with dynamic shapes (a neighbour
        list rebuild changes the number of edges without recompiling).

        The copy is made at the first evaluation, on that evaluation's device and dtype,
        from the weights the wrapper holds then; later changes to ``self.model`` (training,
        ``.to()``) drop it, and the next evaluation makes a new one.
        """
        if self.backend == "cueq":  # the converted copy runs eager
            return False
        if bool(enabled) != getattr(self, "_compile", False):
            self._compile = bool(enabled)
            self._compiled = None
        return True

    def _compiled_model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        key = (device, dtype, tuple(p._version for p in self.model.parameters()))
        cached = getattr(self, "_compiled", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        from mace.tools.compile import prepare
        from mace.tools.scripts_utils import extract_model

        with preserved_environ():
            copy = prepare(extract_model)(model=self.model, map_location=str(device))
        copy = copy.to(dtype=dtype).eval()
        for p in copy.parameters():
            p.requires_grad_(False)
        compiled = torch.compile(copy, dynamic=True, backend=COMPILE_BACKEND)
        object.__setattr__(self, "_compiled", (key, compiled))  # not a registered submodule
        return compiled

    def _cueq_model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The cuEquivariance copy of ``self.model`` (mace-torch's own conversion), cached."""
        key = (device, dtype, tuple(p._version for p in self.model.parameters()))
        cached = getattr(self, "_cueq", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        (convert,) = import_extra("mace", "mace.cli.convert_e3nn_cueq")
        default = torch.get_default_dtype()
        try:
            with preserved_environ():
                copy = convert.run(self.model, device=device.type, return_model=True)
        finally:
            torch.set_default_dtype(default)  # run() sets it to the model's dtype
        copy = _mace_pairs.patch(copy.to(device=device, dtype=dtype).eval())
        for p in copy.parameters():
            p.requires_grad_(False)
        object.__setattr__(self, "_cueq", (key, copy))  # not a registered submodule
        return copy

    def _exchanges(self) -> bool:
        """Whether a sync point is anything but the identity (an exchange under DD)."""
        return any(type(m) is not SyncPoint for _, m in self.sync_points)

    @contextlib.contextmanager
    def _synced(self, model: nn.Module, graph: AtomicGraph) -> Iterator[None]:
        """Within the block, interaction ``t >= 1`` of the mace-torch ``model`` reads its
        node features through ``self.sync[t - 1]`` (forward pre-hooks, removed on exit)."""
        blocks = list(model.interactions)[1:] if len(self.sync) else []
        handles = [block.register_forward_pre_hook(partial(_read_through, sync, graph),
                                                   with_kwargs=True)
                   for sync, block in zip(self.sync, blocks)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]`` (eV), including E0; ``graph`` must carry edges."""
        check_dtype(graph, self.model)
        model, compiled = self.model, getattr(self, "_compile", False) and not self.training
        if self.backend == "cueq" and not self.training:
            model, compiled = self._cueq_model(graph.positions.device, graph.dtype), False
        if compiled and not self._exchanges():  # one compiled region: no exchange inside
            model = self._compiled_model(graph.positions.device, graph.dtype)
        else:
            compiled = False
        with self._synced(model, graph) if not compiled else contextlib.nullcontext():
            out = model(self.mace_inputs(graph, cell_grad=compiled), training=False,
                        compute_force=False)
        return out["node_energy"].to(graph.dtype)

    # ------------------------------------------------------------------ serialization
    def to_payload(self) -> dict:
        """Tensors and primitives for ``xnn.save_model``: the MACE model's constructor
        arguments and state dict (no pickled objects; see :mod:`._mace_data`).

        Raises:
            InputError: the model cannot be stored as data (its class or an argument is not
                in mace-torch's tables, or rebuilt from its arguments it predicts otherwise).
        """
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {"kind": PAYLOAD_KIND, "config": self._data_config(), "state_dict": state,
                "head": self.head, "backend": self.backend}

    def _data_config(self) -> dict:
        """The constructor arguments, checked once: the model rebuilt from them (with the
        current weights) predicts the same per-atom energies on a small example."""
        cached = getattr(self, "_checked_config", None)
        if cached is not None:
            return cached
        from xnn.models.serialization import default_example

        config = _mace_data.constructor_config(self.model)
        param = next(iter(self.model.parameters()))
        rebuilt = _mace_data.build_module(config, self.model.state_dict(), param.dtype)
        graph = default_example(self).to(device=param.device)
        ref = self._energies(self.model, graph).detach()
        err = (self._energies(rebuilt.to(param.device), graph).detach() - ref).abs().max()
        tol = (1e-10 if param.dtype == torch.float64 else 1e-4) * max(1.0, ref.abs().max())
        if not bool(err <= tol):
            raise InputError(f"cannot store this MACE model as data: rebuilt from its "
                             f"arguments it predicts energies {float(err):.3g} eV apart; "
                             f"{_mace_data.KEEP_PICKLE}")
        self._checked_config = config
        return config

    def _energies(self, model: nn.Module, graph: AtomicGraph) -> Tensor:
        out = model(self.mace_inputs(graph), training=False, compute_force=False)
        return out["node_energy"].to(graph.dtype)

    @classmethod
    def from_payload(cls, payload: dict) -> MACEWrapper:
        """Rebuild from :meth:`to_payload` output. A payload of an earlier xnn version holds
        the module pickled: refused unless the caller of :func:`xnn.load_model` passed
        ``trust=True`` (:mod:`xnn.models.trust`)."""
        kind = payload.get("kind")
        if kind == PICKLE_KIND and isinstance(payload.get("module_bytes"), bytes):
            return cls(_load_module(payload["module_bytes"]), head=payload.get("head"))
        config = payload.get("config")
        if kind != PAYLOAD_KIND or not isinstance(config, dict):
            raise ModelFileError("not a MACE wrapper payload (missing kind/config)")
        state = payload.get("state_dict")
        tensors = [v for v in state.values() if isinstance(v, Tensor)] \
            if isinstance(state, dict) else []
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), torch.float64)
        return cls(_mace_data.build_module(config, state, dtype), head=payload.get("head"),
                   backend=payload.get("backend", "reference"))
