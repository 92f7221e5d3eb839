"""Model files: one self-describing file per model, loaded without any config.

``save_model(model, path)`` writes, with ``torch.save``, a dict of tensors and primitives::

    {"format": "xnn-model", "format_version": 1, "xnn_version": "...",
     "name": <registry name>, "hparams": {...}, "state_dict": {...},
     "species": [...], "e0": {Z: eV}, "units": {"energy": "eV", "length": "Å"},
     "dtype": "float64", "precision": "fp32" | None, "e0_convention": "isolated" | None}

``precision`` is the training precision of the run that wrote the file (``xnn train``'s
``precision``; ``None`` for models saved outside a run); ``e0_convention`` how that run chose
the reference energies ``e0`` (``model.e0``: ``fit``, ``average``, ``zero``, ``isolated``, or
``given`` for a map; ``None`` for a model saved outside a run or fine-tuned, whose E0s are
the pretrained model's). :func:`model_metadata` reads every
entry but the weights, as data.

``load_model`` reads it back with ``torch.load(..., weights_only=True)`` (always: explicit,
so the ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` variable set by some packages cannot override
it) and rebuilds the model with ``xnn.models.build(name, **hparams)``. A model class may
define ``to_payload()`` / classmethod ``from_payload(payload)`` to store itself differently
(external wrappers); the payload must still hold only tensors and primitives, and rebuilding
it must run no code from the file. The payload and hyperparameters are data
(:mod:`xnn.models.trust`): they cannot grant trust or name a file to load; only the caller's
``load_model(..., trust=True)`` lets a nested load unpickle (a ``from_payload`` that reads an
older pickled format asks :func:`xnn.models.trust.require`).

``export_model(model, path)`` writes a ``torch.export`` program mapping plain tensors to
per-atom energies (differentiable, so forces follow by autograd); see :func:`load_exported`.
``torch.export.load`` unpickles parts of such a file, so :func:`load_exported` needs
``trust=True``. ``export_model(model, path, format="export" | "aoti" | "torchscript")``
writes instead a self-contained artefact returning energy, forces and stress that loads with
torch alone (:mod:`xnn.models.export`).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from xnn._files import atomic_write, check_output_file, check_path_argument, require_file
from xnn._torch_files import refuse_non_model_file
from xnn._version import __version__
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, ModelFileError, TrustError
from xnn.models.model_info import (
    UNITS,
    dtype_name,
    first_line,
    model_dtype,
    registry_name,
    safe_name,
)

FORMAT = "xnn-model"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- helpers
def _write_atomic(payload: object, path: Path) -> None:
    """``torch.save`` through :func:`xnn._files.atomic_write` (user's umask, fsynced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: torch.save(payload, tmp))


def read_as_data(path: str | os.PathLike, map_location="cpu", allow: tuple = ()) -> object:
    """``torch.load(path, weights_only=True)``: tensors and primitives only (and the
    ``allow``-ed globals), so no code from the file runs, whatever it holds."""
    with warnings.catch_warnings(), torch.serialization.safe_globals(list(allow)):
        warnings.simplefilter("ignore")  # "pickle protocol 4" of plain pickle files
        return torch.load(path, map_location=map_location, weights_only=True)


def refused_global(err: BaseException) -> str | None:
    """The object a weights-only load refused to unpickle (e.g. ``posix.system``), if any."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return found.group(1) if found else None


def load_failure(err: BaseException) -> str:
    """One line saying why :func:`read_as_data` failed (torch's message spans many lines)."""
    name = refused_global(err)
    if name is not None:
        return f"it holds pickled objects ({name}), not only tensors and numbers"
    if isinstance(err, pickle.UnpicklingError) and "WeightsUnpickler" in str(err):
        return "not a torch file of tensors and numbers (a plain pickle, or another format)"
    return first_line(err)


# --------------------------------------------------------------------------- save / load
def model_payload(model: nn.Module) -> dict:
    """The dict that :func:`save_model` writes (tensors and primitives only)."""
    name = registry_name(model)
    to_payload = getattr(model, "to_payload", None)
    if callable(to_payload):
        payload = dict(to_payload())
    else:
        hparams = getattr(model, "hparams", None)
        if not isinstance(hparams, Mapping):
            raise InputError(
                f"model {name!r} ({type(model).__name__}) has no `hparams` dict and no "
                "to_payload(); it cannot be saved"
            )
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        payload = {"hparams": copy.deepcopy(dict(hparams)), "state_dict": state}
    species = getattr(model, "species", None)
    e0 = getattr(model, "e0", None)
    payload.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        xnn_version=__version__,
        name=name,
        species=None if species is None else [int(z) for z in species],
        e0=None if not isinstance(e0, Mapping) else {int(z): float(v) for z, v in e0.items()},
        units=dict(UNITS),
        dtype=dtype_name(model_dtype(model)),
    )
    return payload


def save_model(model: nn.Module, path: str | os.PathLike, precision: str | None = None,
               e0_convention: str | None = None) -> Path:
    """Write ``model`` to one self-describing file (atomically); returns the path.

    Args:
        model: the model (native, or a wrapper with ``to_payload``).
        path: the file.
        precision: the training precision to record (``fp32``, ``tf32``, ``bf16_mixed``,
            ``fp64``), or ``None``.
        e0_convention: how the reference energies ``e0`` were chosen, to record
            (``xnn train``'s ``model.e0``: ``fit``, ``average``, ``zero``, ``isolated`` or
            ``given`` for a map), or ``None``.

    Raises:
        InputError: ``path`` is a folder, or its folder cannot be created (a file is in the
            way).
    """
    path = check_output_file(path, "model file", example="model.pt")
    payload = model_payload(model)
    payload["precision"] = None if precision is None else str(precision)
    payload["e0_convention"] = None if e0_convention is None else str(e0_convention)
    _write_atomic(payload, path)
    return path


def model_metadata(path: str | os.PathLike) -> dict:
    """Every entry of a model file except its weights (``state_dict``), read as data
    (``weights_only=True``): name, hparams, species, e0, units, dtype, xnn_version, the
    training ``precision`` and the ``e0_convention`` (each ``None`` when unknown, also for
    files of earlier versions).

    Raises:
        ModelFileError: as :func:`load_model`.
    """
    payload = _read_payload(Path(path), "cpu")
    meta = {k: v for k, v in payload.items() if k != "state_dict"}
    meta.setdefault("precision", None)
    meta.setdefault("e0_convention", None)
    return meta


def _read_payload(path: Path, map_location) -> dict:
    require_file(path, "model file", ModelFileError, suggest=("model.pt",))
    refuse_non_model_file(path)  # truncated, or a training/MD checkpoint: say what to use
    try:
        payload = read_as_data(path, map_location)
    except Exception as err:  # corrupt, truncated, not a torch file, pickled objects
        if refused_global(err):
            raise ModelFileError(f"{path} is not an xnn model file: {load_failure(err)} (xnn "
                                 "reads model files as data only)") from None
        raise ModelFileError(
            f"cannot read model file {path}: corrupt, truncated or not an xnn model "
            f"({load_failure(err)})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not an xnn model file (no format={FORMAT!r} header)")
    version = payload.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ModelFileError(
            f"{path} has format_version {version!r}; this xnn ({__version__}) reads "
            f"versions <= {FORMAT_VERSION}: upgrade xnn"
        )
    return payload


def load_model(
    path: str | os.PathLike, map_location: str | torch.device = "cpu", trust: bool = False
) -> nn.Module:
    """Rebuild a model saved with :func:`save_model` (no config needed).

    The file is read as data (``weights_only=True``); no code from it runs.

    Args:
        path: model file.
        map_location: device of the returned model.
        trust: the caller trusts this file: it may unpickle what it holds or names (MACE
            wrappers saved by an earlier xnn, a MACE ``.model`` or SevenNet checkpoint file
            or another model file named in its hyperparameters), which can run code; only for
            files you trust. Without it they are refused: nothing in a file grants trust
            (:mod:`xnn.models.trust`).
    Returns:
        the model in eval mode, in the dtype it was saved with.
    Raises:
        InputError: ``path`` is not a path (``None``, a number ...).
        ModelFileError: missing, corrupt, truncated, not-a-model or incompatible file, or one
            that asks for trust the caller did not give.
    """
    from xnn.models import trust as T

    check_path_argument(path, "xnn.load_model", "model file")
    path = Path(path)
    payload = _read_payload(path, map_location)
    try:
        with T.reading(path, trust):
            model = model_from_payload(payload)
    except TrustError:
        raise  # names the file the caller gave
    except ModelFileError as err:
        raise ModelFileError(f"{path}: {err}") from None
    return model.to(map_location).eval()


def model_from_payload(payload: dict) -> nn.Module:
    """The model of a :func:`model_payload` dict (read as data): its class's
    ``from_payload``, or ``build(name, **hparams)`` and the state dict. Runs inside
    :func:`load_model`'s trust context (a committee rebuilds its members' payloads with it).

    Raises:
        ModelFileError: unknown model name, missing package, or a payload that does not
            rebuild (:class:`~xnn.errors.TrustError` passes through).
    """
    from xnn.models.registry import model_class

    name = payload.get("name")
    try:
        cls = model_class(name)
    except InputError as err:
        raise ModelFileError(str(err)) from None
    except ImportError as err:
        raise ModelFileError(f"model {name!r} needs a missing package ({err})") from None
    try:
        from_payload = getattr(cls, "from_payload", None)
        return from_payload(payload) if callable(from_payload) else _rebuild(name, payload)
    except (TrustError, ModelFileError):
        raise
    except Exception as err:
        raise ModelFileError(f"cannot rebuild model {name!r} ({first_line(err)})") from None


def _rebuild(name: str, payload: dict) -> nn.Module:
    from xnn.models.registry import rebuild

    hparams = payload.get("hparams")
    state = payload.get("state_dict")
    if not isinstance(hparams, dict) or not isinstance(state, Mapping):
        raise ModelFileError("model file lacks `hparams` or `state_dict`")
    model = rebuild(name, hparams)
    dtype = getattr(torch, str(payload.get("dtype", "float32")), None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        model = model.to(dtype)
    model.load_state_dict(state, strict=True)
    return model


# --------------------------------------------------------------------------- export
class _TensorInterface(nn.Module):
    """``(positions, numbers, cell, pbc, batch, edge_index, shifts) -> energies [n_atoms]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        positions: Tensor,
        numbers: Tensor,
        cell: Tensor,
        pbc: Tensor,
        batch: Tensor,
        edge_index: Tensor,
        shifts: Tensor,
    ) -> Tensor:
        fields = {
            K.POSITIONS: positions, K.NUMBERS: numbers, K.CELL: cell, K.PBC: pbc,
            K.BATCH: batch, K.EDGE_INDEX: edge_index, K.SHIFTS: shifts,
        }
        return self.model(AtomicGraph(fields, validate=False))


def _export_inputs(graph: AtomicGraph) -> tuple[Tensor, ...]:
    return (
        graph.positions, graph.numbers, graph.cell, graph.pbc, graph.batch,
        graph.edge_index, graph.shifts,
    )


def default_example(model: nn.Module) -> AtomicGraph:
    """Two small random periodic systems of the model's species, with edges (for tracing)."""
    from xnn.neighbors import with_edges

    gen = torch.Generator().manual_seed(0)
    species = getattr(model, "species", None) or [1]
    sizes = (5, 7)
    side = max(2.0 * float(model.cutoff), 4.0)
    n = sum(sizes)
    pos = torch.rand(n, 3, generator=gen, dtype=torch.float64) * side
    numbers = torch.tensor(species, dtype=torch.long)[torch.arange(n) % len(species)]
    batch = torch.repeat_interleave(torch.arange(2), torch.tensor(sizes))
    cell = torch.eye(3, dtype=torch.float64).expand(2, 3, 3) * side
    dtype = model_dtype(model)
    graph = AtomicGraph.from_arrays(pos, numbers, cell, True, batch, dtype=dtype)
    return with_edges(graph, float(model.cutoff), backend="brute")


def export_model(
    model: nn.Module,
    path: str | os.PathLike,
    example: AtomicGraph | None = None,
    format: str = "energies",
) -> Path:
    """Export ``model`` (dynamic numbers of atoms, edges and systems).

    Args:
        model: a per-atom-energy model.
        path: output file (``.pt2``; ``.pt`` for TorchScript); metadata (name, hparams,
            cutoff, species) is stored inside as ``xnn.json``.
        example: for ``format="energies"``: a graph with edges (two or more systems, atoms
            and edges) used for tracing; by default :func:`default_example`.
        format: ``energies`` (default): a ``torch.export`` program mapping plain tensors
            to per-atom energies (forces by autograd; load with :func:`load_exported`).
            ``export``, ``aoti``, ``torchscript``: a self-contained artefact that returns
            ``(energy, forces, stress)`` and loads with torch alone, see
            :mod:`xnn.models.export`.
    Returns:
        the path.
    Raises:
        InputError: if the model cannot be exported (its reason in one line).
    """
    from torch.export import Dim

    check_output_file(path, "export file", example="model.pt2")  # before tracing
    if format != "energies":
        from xnn.models.export import export_forcefield

        if example is not None:
            raise InputError(f"export format {format!r} traces its own example; pass "
                             "example only with format='energies'")
        return export_forcefield(model, path, format)

    if example is None:
        example = default_example(model)
    tensors = list(model.parameters()) + list(model.buffers())
    if tensors:
        example = example.to(device=tensors[0].device)
    wrapper = _TensorInterface(model).eval()
    n, e, s = Dim("n_atoms", min=2), Dim("n_edges", min=2), Dim("n_systems", min=1)
    shapes = (
        {0: n}, {0: n}, {0: s}, {0: s}, {0: n}, {1: e}, {0: e},
    )
    try:
        program = torch.export.export(
            wrapper, _export_inputs(example), dynamic_shapes=shapes, strict=False
        )
    except Exception as err:
        raise InputError(f"{type(model).__name__} cannot be exported: {first_line(err)}") from None
    meta = {
        "name": getattr(model, "registry_name", None) or safe_name(model),
        "hparams": getattr(model, "hparams", None),
        "cutoff": float(model.cutoff),
        "species": getattr(model, "species", None),
        "dtype": dtype_name(model_dtype(model)),
        "units": UNITS,
        "inputs": ["positions", "numbers", "cell", "pbc", "batch", "edge_index", "shifts"],
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {"xnn.json": json.dumps(meta)}
    return atomic_write(path, lambda tmp: torch.export.save(program, tmp, extra_files=extra))


def load_exported(path: str | os.PathLike, trust: bool = False) -> tuple[nn.Module, dict]:
    """Load a program written by :func:`export_model`.

    Args:
        path: the ``.pt2`` file.
        trust: must be ``True``: ``torch.export.load`` unpickles parts of the file, which can
            run code from it (only for files you trust).
    Returns:
        ``(module, metadata)``; ``module(positions, numbers, cell, pbc, batch, edge_index,
        shifts)`` returns per-atom energies ``[n_atoms]`` (eV) and is differentiable.
    """
    path = require_file(path, "exported model", ModelFileError)
    from xnn.models.trust import require

    require(f"exported model {path}", trust, "pass trust=True (or load the xnn model file "
            "with xnn.load_model)", reason="is read by torch.export.load, which unpickles "
            "parts of the file and can run code from it")
    extra = {"xnn.json": ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except Exception as err:
        raise ModelFileError(f"cannot read exported model {path} ({first_line(err)})") from None
    return program.module(), json.loads(extra["xnn.json"] or "{}")
