"""``SevenNetWrapper``: a SevenNet checkpoint (e.g. the pretrained SevenNet-0) as an xnn model.

Edge conventions. SevenNet (``sevenn.train.dataload``, ``sevenn.nn.convolution``):
``edge_index[0]`` = receiver ("edge_dst", where messages are summed), ``edge_index[1]`` =
sender ("edge_src"), and ``edge_vec = pos[sender] - pos[receiver] + shift @ cell``, i.e.
xnn's ``r_ij``. So xnn's ``edge_index`` is flipped and ``r_ij`` is passed as ``edge_vec``.

SevenNet's model is an ``nn.Sequential`` of modules reading and writing a dict. The wrapper
runs it up to the module that writes the per-atom energies (``atomic_energy``, after the
species-wise scale and shift) and skips the total-energy reduction and SevenNet's own
force/stress output: xnn derives forces and stress by autograd through ``r_ij``, which
depends on positions and cell. SevenNet's XPLOR cutoff is *not* zero beyond the cutoff, so
edges at or beyond it (a Verlet skin) are dropped first. Nothing depends on the cell except
through the shifts, so the wrapper runs unchanged on owned + ghost atoms.

Sync points. One SevenNet interaction layer ``t`` is ``t_self_connection_intro``,
``t_self_interaction_1``, ``t_convolution``, ``t_self_interaction_2``,
``t_self_connection_outro`` and ``t_equivariant_gate``. All but the convolution are
node-local; the convolution gathers ``x[edge_src]`` (``data["x"]``, irreps
``128x0e+64x1e+32x2e`` = 480 numbers per atom for SevenNet-0 after the first layer). Edge
quantities (spherical harmonics, radial embedding) depend only on ``r_ij``, and the species
embedding only on the atom. So before the convolution of each layer ``t >= 1`` the wrapper
passes exactly the tensor that convolution gathers through ``self.sync[t - 1]`` (a
:class:`~xnn.models.base.SyncPoint`, the identity in one process). Under
``parallelize(model, mode="sync")`` these become halo feature exchanges, so the halo is
one cutoff (5 Å) plus skin instead of 5 x 5 Å.

Checkpoint names ("7net-0", "7net-l3i5", ...) are resolved by
``sevenn.util.load_checkpoint`` to files shipped inside the ``sevenn`` wheel (no download
for those). SevenNet checkpoint files are pickles, and loading one runs code from it: a path
is loaded only with the caller's ``trust=True`` (names are resolved by ``sevenn`` to the files
it ships or downloads itself, as trusted as the package; a ``checkpoint=PATH`` or ``trust``
read from a file's hyperparameters counts for nothing, see :mod:`xnn.models.trust`). xnn
model files written from this wrapper hold only the config (primitives) and the state dict,
and load without unpickling.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn

from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, ModelFileError
from xnn.models.base import AtomisticModel, SyncPoints
from xnn.models.equivariant_ops import plain_harmonics
from xnn.models.external._common import check_dtype, edges_within
from xnn.models.external._optional import import_extra, preserved_environ
from xnn.models.heads import Heads, check_head_names

PAYLOAD_KIND = "sevenn-config-state"


def _sevenn():
    util, keys, build = import_extra("sevenn", "sevenn.util", "sevenn._keys", "sevenn.model_build")
    return util, keys, build


def _primitive(value):
    """``value`` with numpy arrays, devices and tuples made weights_only-loadable."""
    if isinstance(value, dict):
        return {k: _primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_primitive(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, Tensor):
        return value.detach().cpu()
    return value


def _as_dtype(data: dict, dtype: torch.dtype) -> dict:
    """Cast floating tensors of ``data`` to ``dtype`` (SevenNet's one-hot is always float32)."""
    for k, v in data.items():
        if isinstance(v, Tensor) and v.is_floating_point() and v.dtype != dtype:
            data[k] = v.to(dtype)
    return data


@contextmanager
def _float32_default():
    """SevenNet builds its modules in the default dtype but loads float32 weights: build them
    in float32 whatever the caller's default (``wrapper.double()`` converts afterwards)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _load(checkpoint: str | os.PathLike, trust: bool = False) -> tuple[nn.Module, dict]:
    from xnn.models.trust import require

    util, _, _ = _sevenn()
    if os.path.isfile(str(checkpoint)):  # sevenn reads a file first, else resolves a name
        require(f"SevenNet checkpoint {str(checkpoint)!r}", trust,
                "pass trust=True (xnn.models.build('sevenn', checkpoint=PATH, trust=True); "
                "model.hyperparameters.trust=true or model.trust_file=true in xnn md/relax/run)")
    try:
        with preserved_environ(), warnings.catch_warnings(), _float32_default():
            warnings.simplefilter("ignore")
            cp = util.load_checkpoint(str(checkpoint))
            model = cp.build_model()
            config = dict(cp.config)
    except ValueError as err:  # unknown name: sevenn lists the valid ones
        reason = " ".join(str(err).split())
        raise InputError(f"SevenNet checkpoint {checkpoint!r}: {reason}") from None
    except Exception as err:  # missing/corrupt file, failed download of a non-shipped model
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ModelFileError(f"cannot load SevenNet checkpoint {checkpoint!r}: {reason}") from None
    return model, config


def _build_from_config(config: dict) -> nn.Module:
    _, _, build = _sevenn()
    with preserved_environ(), warnings.catch_warnings(), _float32_default():
        warnings.simplefilter("ignore")
        return build.build_E3_equivariant_model(dict(config))


#: SevenNet's modules from the last node features to the per-atom energies (one head)
READOUT = ("reduce_input_to_hidden", "reduce_hidden_to_energy", "rescale_atomic_energy")


class SevenNetHead(nn.Module):
    """One readout head of a multi-head SevenNet wrapper: copies of SevenNet's readout
    modules (:data:`READOUT`, with its species-wise scale and shift) and ``e0_table
    [120]`` float64 reference energies added per atom (0 as copied)."""

    def __init__(self, layers: dict[str, nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict(layers)
        self.register_buffer("e0_table", torch.zeros(120, dtype=torch.float64))

    def _apply(self, fn, recurse=True):
        table = self._buffers["e0_table"]  # device moves apply, dtype casts do not
        super()._apply(fn, recurse)
        self._buffers["e0_table"] = table.to(device=self._buffers["e0_table"].device)
        return self


class SevenNetWrapper(Heads, SyncPoints, AtomisticModel):
    """A SevenNet model returning per-atom energies ``[n_atoms]`` (eV) from xnn graphs.

    Args:
        checkpoint: a pretrained name known to ``sevenn`` (``"7net-0"``, ``"7net-l3i5"``,
            ...) or the path of a SevenNet checkpoint file.
        modal: fidelity for multi-modal checkpoints (e.g. ``"R2SCAN"`` for
            ``7net-mf-0``); must be ``None`` for single-modal ones.
        trust: load a checkpoint *file* although it is a pickle (it can run code: only for
            files you trust); without it a path is refused. Names need no trust.

    Attributes:
        cutoff: the checkpoint's cutoff (Å).
        num_interactions: number of convolution layers.
        sync: ``nn.ModuleList`` of ``num_interactions - 1`` :class:`SyncPoint` identities,
            applied to the node features gathered by convolutions ``1 .. num_interactions-1``.
        species: atomic numbers of the checkpoint's type map.

    The pretrained models are float32; ``wrapper.double()`` gives a float64 model.

    Heads (:mod:`xnn.models.heads`): :meth:`multihead` gives the shared network one copy of
    SevenNet's readout (:data:`READOUT`) per head, each with its own reference energies
    (``e0``, 0 as copied: every head predicts, untrained, what the checkpoint predicted).

    It declares ``traceable = False``: SevenNet's polynomial cutoff is not zero beyond the
    cutoff, so the wrapper must select the edges within it (a data-dependent shape), which
    the compiled MD step cannot trace (``compile=true`` refuses it up front).
    """

    traceable = False

    def __init__(self, checkpoint: str | os.PathLike = "7net-0", modal: str | None = None,
                 trust: bool = False):
        super().__init__()
        model, config = _load(checkpoint, trust)
        self._setup(model, config, modal, str(checkpoint))

    def _setup(self, model: nn.Module, config: dict, modal: str | None, source: str) -> None:
        _, keys, _ = _sevenn()
        # picklable (sent to spawned ranks) and copyable whatever e3nn's jit_mode was
        self.model = plain_harmonics(model)
        self.config = _primitive(config)
        self.source = source
        self.cutoff = float(model.cutoff)
        self.convolutions = [n for n in model._modules if n.endswith("_convolution")]
        self.num_interactions = len(self.convolutions)
        self.init_sync_points(self.num_interactions - 1)
        self.species = sorted(int(z) for z in model.type_map)
        self.keys = {
            n: getattr(keys, n)
            for n in ("EDGE_IDX", "EDGE_VEC", "ATOMIC_NUMBERS", "NODE_FEATURE", "POS", "BATCH",
                      "MODAL_TYPE", "ATOMIC_ENERGY")
        }
        modal_map = getattr(model, "modal_map", None) or {}
        if modal_map and modal not in modal_map:
            raise InputError(f"SevenNet model {source!r} needs modal= one of {sorted(modal_map)}")
        if not modal_map and modal is not None:
            raise InputError(f"SevenNet model {source!r} is single-modal: leave modal=None")
        self.modal = modal
        table = torch.full((120,), -1, dtype=torch.long)
        for z, k in model.type_map.items():
            table[int(z)] = int(k)
        # on the wrapped module's device: a wrapper built around a CUDA model runs there
        device = next(iter(model.parameters()), table).device
        self.register_buffer("z_to_type", table.to(device), persistent=False)
        self.names = ()
        self.readout_heads = None

    # ------------------------------------------------------------------ heads
    @property
    def head_names(self) -> tuple[str, ...]:
        """Names of the readout heads (``()``: SevenNet's own readout)."""
        return self.names

    def _set_heads(self, names: list[str], heads: list[SevenNetHead]) -> None:
        self.names = tuple(names)
        self.readout_heads = nn.ModuleList(heads)
        for name in READOUT:  # the checkpoint's own readout no longer predicts
            for p in self.model._modules[name].parameters():
                p.requires_grad_(False)

    def multihead(self, names) -> SevenNetWrapper:
        """A new wrapper with the heads ``names`` (see :class:`~xnn.models.heads.Heads`):
        the network copied (through :meth:`to_payload`: the same values bitwise); each head
        a copy of this wrapper's head of the same name, else of its selected readout
        (SevenNet's own without heads)."""
        names = check_head_names(names, "SevenNet: heads")
        states = {n: h.state_dict() for n, h in zip(self.names, self.readout_heads or [])}
        if self.names:
            default = states[self.names[self.active_head]]
        else:
            default = {f"layers.{n}.{k}": v for n in READOUT
                       for k, v in self.model._modules[n].state_dict().items()}
            default["e0_table"] = torch.zeros(120, dtype=torch.float64)
        device = next(self.model.parameters()).device
        new = SevenNetWrapper.from_payload(self.to_payload()).to(device)
        new._set_heads(names, [new._new_head(states.get(n, default)) for n in names])
        return new.train(self.training)

    def _new_head(self, state: dict) -> SevenNetHead:
        """A head with the values of ``state`` (a :class:`SevenNetHead` state dict), its
        modules those of a fresh SevenNet network of this config (no deep copy: the e3nn
        modules' generated code does not survive one cleanly)."""
        fresh = _build_from_config(self.config)
        ref = next(self.model.parameters())
        head = SevenNetHead({n: fresh._modules[n] for n in READOUT}).to(ref.device, ref.dtype)
        head.load_state_dict(state, strict=True)
        return head

    def set_head_statistics(self, name: str, e0=None, scale=None, shift=None) -> None:
        """Set the reference energies ``{Z: eV}`` of head ``name`` (its scale and shift are
        SevenNet's species-wise ones, trained with the head).

        Raises:
            InputError: an unknown head, or ``scale``/``shift`` given.
        """
        if scale is not None or shift is not None:
            raise InputError("SevenNet heads take reference energies only (their scale and "
                             "shift are SevenNet's species-wise rescale, trained)")
        table = self.readout_heads[self.head_index(name)].e0_table
        with torch.no_grad():
            for z, value in (e0 or {}).items():
                table[int(z)] = float(value)

    @property
    def e0(self) -> dict[int, float] | None:
        """Reference energies ``{Z: eV}`` of the selected head (``None`` without heads:
        SevenNet's shift is species-wise inside its readout)."""
        if not self.names:
            return None
        table = self.readout_heads[self.active_head].e0_table
        return {z: float(table[z]) for z in self.species}

    def parts(self) -> dict[str, tuple[str, ...]]:
        """Fine-tuning parts of the SevenNet network: ``embedding`` (edge and species
        embedding), ``interactions`` and ``interactions.K`` (the K-th convolution with its
        self-interactions and self-connection), ``readout`` (reduction to atomic energies
        and their scale/shift; with heads: every head's, and ``head.NAME`` one head's)."""
        names = [n for n, m in self.model.named_children() if any(True for _ in m.parameters())]
        layers = sorted({int(n.split("_")[0]) for n in names if n.split("_")[0].isdigit()})
        out = {"embedding": tuple(f"model.{n}" for n in names if not n[0].isdigit()
                                  and not n.startswith(("reduce", "rescale"))),
               "interactions": tuple(f"model.{n}" for n in names if n[0].isdigit())}
        for k in layers:
            out[f"interactions.{k}"] = tuple(f"model.{n}" for n in names
                                             if n.startswith(f"{k}_"))
        out["readout"] = tuple(f"model.{n}" for n in names
                               if n.startswith(("reduce", "rescale")))
        if self.names:  # the heads' readouts (SevenNet's own is frozen)
            out["readout"] = ("readout_heads",)
            out.update({f"head.{n}": (f"readout_heads.{k}",) for k, n in enumerate(self.names)})
        return out

    def sevenn_inputs(self, graph: AtomicGraph) -> dict:
        """SevenNet's input dict for ``graph`` (edges within the cutoff, flipped)."""
        key = self.keys
        edge_index, _, vec = edges_within(graph, self.cutoff)
        data = {
            key["EDGE_IDX"]: torch.stack([edge_index[1], edge_index[0]]),
            key["EDGE_VEC"]: vec,
            key["ATOMIC_NUMBERS"]: graph.numbers,
            key["NODE_FEATURE"]: self.z_to_type[graph.numbers],
            key["POS"]: graph.positions,
            key["BATCH"]: graph.batch,
        }
        if self.modal is not None:  # batched form of AtomGraphSequential._eval_modal_map
            index = int(self.model.modal_map[self.modal])
            data[key["MODAL_TYPE"]] = torch.full(
                (graph.n_systems,), index, dtype=torch.long, device=graph.device
            )
        return data

    def _synced(self, name: str, module: nn.Module, data: dict, graph: AtomicGraph) -> dict:
        """``data`` with the features convolution ``name`` gathers passed through its sync."""
        layer = self.convolutions.index(name)
        if layer == 0:
            return data
        key = getattr(module, "key_x", self.keys["NODE_FEATURE"])
        data[key] = self.sync[layer - 1](data[key], graph)
        return data

    def forward(self, graph: AtomicGraph) -> Tensor:
        """Per-atom energies ``[n_atoms]`` (eV); ``graph`` must carry edges."""
        check_dtype(graph, self.model)
        out_key = self.keys["ATOMIC_ENERGY"]
        data = self.sevenn_inputs(graph)
        for name, module in self.model.named_children():
            if self.names and name == READOUT[0]:
                return self._head_energies(data, graph)
            if name in self.convolutions:
                data = self._synced(name, module, data, graph)
            data = _as_dtype(module(data), graph.dtype)
            if out_key in data:
                return data[out_key].reshape(-1).to(graph.dtype)
        raise InputError(f"SevenNet model {self.source!r} wrote no {out_key!r}")

    def _head_energies(self, data: dict, graph: AtomicGraph) -> Tensor:
        """Per-atom energies from the heads' readouts of the node features in ``data``: the
        selected head's, or each atom's own head (the graph's ``head`` field)."""
        which = self.atom_heads(graph, graph.n_atoms)

        def energies(head: SevenNetHead) -> Tensor:
            out = dict(data)
            for module in head.layers.values():
                out = _as_dtype(module(out), graph.dtype)
            e = out[self.keys["ATOMIC_ENERGY"]].reshape(-1).to(graph.dtype)
            return e + head.e0_table[graph.numbers].to(e.dtype)

        if which is None:
            return energies(self.readout_heads[self.active_head])
        e = torch.stack([energies(head) for head in self.readout_heads])
        return e.gather(0, which.unsqueeze(0)).squeeze(0)

    # ------------------------------------------------------------------ serialization
    def to_payload(self) -> dict:
        """Config (primitives) and state dict for ``xnn.save_model`` (no pickled objects)."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {
            "kind": PAYLOAD_KIND,
            "config": self.config,
            "state_dict": state,
            "modal": self.modal,
            "source": self.source,
            "heads": list(self.names),
            "head_states": [{k: v.detach().cpu() for k, v in h.state_dict().items()}
                            for h in (self.readout_heads or [])],
        }

    @classmethod
    def from_payload(cls, payload: dict) -> SevenNetWrapper:
        """Rebuild from :meth:`to_payload` output (architecture from the stored config)."""
        if payload.get("kind") != PAYLOAD_KIND or not isinstance(payload.get("config"), dict):
            raise ModelFileError("not a SevenNet wrapper payload (missing kind/config)")
        model = _build_from_config(payload["config"])
        state = payload["state_dict"]
        dtype = next(iter(v for v in state.values() if v.is_floating_point()), None)
        if dtype is not None:
            model = model.to(dtype.dtype)
        model.load_state_dict(state, strict=True)
        self = cls.__new__(cls)
        AtomisticModel.__init__(self)
        self._setup(model, payload["config"], payload.get("modal"), str(payload.get("source")))
        names = payload.get("heads") or []  # files of earlier versions have none
        if names:
            self._set_heads(check_head_names(names, "SevenNet: heads"),
                            [self._new_head(state) for state in payload["head_states"]])
        return self
