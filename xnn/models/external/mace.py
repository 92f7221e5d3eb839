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

Trust model. A MACE ``.model`` file is a pickle: loading one (``model="file.model"``)
executes code from it, as mace-torch itself does. The same holds for xnn model files that
hold a MACE model (see :meth:`MACEWrapper.to_payload`): the outer xnn file is read with
``weights_only=True``, the inner MACE module is unpickled. Load only files you trust.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph, rowvec_matmul
from xnn.errors import InputError, ModelFileError
from xnn.models.base import AtomisticModel
from xnn.models.external._common import check_dtype, edges_within, leaf_safe
from xnn.models.external._optional import import_extra, preserved_environ

PAYLOAD_KIND = "mace-torch-pickle"
COMPILE_BACKEND = "inductor"  # torch.compile backend of compile_for_inference (tests: aot_eager)


def _load_module(source: str | os.PathLike | bytes) -> nn.Module:
    """Unpickle a mace-torch module from a file path or bytes (trusted input only)."""
    import_extra("mace", "mace", "mace.modules")
    where = "<bytes>" if isinstance(source, bytes) else str(source)
    if not isinstance(source, bytes) and not Path(source).is_file():
        raise ModelFileError(f"MACE model file {where} does not exist")
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


class MACEWrapper(AtomisticModel):
    """A mace-torch model returning per-atom energies ``[n_atoms]`` (eV) from xnn graphs.

    Args:
        model: a mace-torch ``nn.Module`` or the path of a ``.model`` file (a pickle: trusted
            files only).
        head: head name for multi-head models; defaults to the only head or ``"default"``.

    Attributes:
        cutoff: ``model.r_max`` (Å).
        num_interactions: ``model.num_interactions``.
        species: ``model.atomic_numbers``, in the model's one-hot order.
    """

    def __init__(self, model: nn.Module | str | os.PathLike, head: str | None = None):
        super().__init__()
        if isinstance(model, (str, os.PathLike)):
            model = _load_module(model)
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
        table = torch.full((119,), -1, dtype=torch.long)
        table[torch.tensor(self.species)] = torch.arange(len(self.species))
        self.register_buffer("z_to_index", table, persistent=False)

    def mace_inputs(self, graph: AtomicGraph, cell_grad: bool = False) -> dict[str, Tensor]:
        """MACE's input dict for ``graph`` (edges within ``r_max``; see the module doc).

        ``cell_grad``: the cell (and so the edge shifts) require grad even without stress, as
        they do with it (apply_strain): one compiled graph serves both (torch.compile guards
        on ``requires_grad`` and recompiled the whole model, minutes on a GPU, when an MD
        run's first step asked for stress and later ones did not)."""
        edge_index, shifts, _ = edges_within(graph, self.cutoff)
        cell = graph.cell
        if cell_grad and torch.is_grad_enabled() and not cell.requires_grad:
            cell = cell.detach().requires_grad_(True)
        receiver = edge_index[1]
        unit_shifts = -shifts.to(cell.dtype)  # MACE vector = pos[recv] - pos[send] + shift
        cart_shifts = rowvec_matmul(unit_shifts, cell, graph.batch, receiver)
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

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]`` (eV), including E0; ``graph`` must carry edges."""
        check_dtype(graph, self.model)
        model, compiled = self.model, getattr(self, "_compile", False) and not self.training
        if compiled:
            model = self._compiled_model(graph.positions.device, graph.dtype)
        out = model(self.mace_inputs(graph, cell_grad=compiled), training=False,
                    compute_force=False)
        return out["node_energy"].to(graph.dtype)

    # ------------------------------------------------------------------ serialization
    def to_payload(self) -> dict:
        """Tensors and primitives for ``xnn.save_model``; the MACE module as pickled bytes."""
        buf = io.BytesIO()
        with preserved_environ():
            torch.save(self.model, buf)
        return {"kind": PAYLOAD_KIND, "module_bytes": buf.getvalue(), "head": self.head}

    @classmethod
    def from_payload(cls, payload: dict) -> MACEWrapper:
        """Rebuild from :meth:`to_payload` output (unpickles the module: trusted files only)."""
        blob = payload.get("module_bytes")
        if payload.get("kind") != PAYLOAD_KIND or not isinstance(blob, bytes):
            raise ModelFileError("not a MACE wrapper payload (missing kind/module_bytes)")
        return cls(_load_module(blob), head=payload.get("head"))
