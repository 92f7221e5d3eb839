"""Self-contained model artefacts: energy, forces and stress from plain tensors, no xnn needed.

:func:`export_forcefield` writes a file that ``torch`` alone loads and runs::

    energy, forces, stress = artefact(positions, numbers, cell, pbc, batch, edge_index, shifts)

Inputs (one batch of ``n_systems`` systems, ``n_atoms`` atoms, ``n_edges`` edges):

* ``positions [n_atoms, 3]`` Å, in the artefact's dtype (``metadata["dtype"]``)
* ``numbers [n_atoms]`` int64 atomic numbers
* ``cell [n_systems, 3, 3]`` Å, rows are lattice vectors, same dtype as positions
* ``pbc [n_systems, 3]`` bool
* ``batch [n_atoms]`` int64 system index of each atom, non-decreasing
* ``edge_index [2, n_edges]`` int64; row 0 the sender j, row 1 the receiver i
* ``shifts [n_edges, 3]`` int64 image shifts; the edge vector is
  ``r_ij = positions[j] - positions[i] + shifts @ cell[batch[i]]``

The neighbor list is the caller's: a **full** list (both directions), every pair closer than
``metadata["cutoff"]`` (longer edges are allowed and get zero weight), no self-pair with a
zero shift (``xnn.neighbors.with_edges`` or any list with the same convention; see
``docs/conventions.md``). Outputs: ``energy [n_systems]`` eV, ``forces [n_atoms, 3]`` eV/Å,
``stress [n_systems, 3, 3]`` eV/Å³ with the ASE sign (negative under compression; zero for
systems not periodic along all three axes). Forces and stress are part of the artefact: the
energy's gradient with respect to positions and a symmetric strain is traced into it
(``make_fx``), so the loader needs no autograd.

Formats:

* ``export``: a ``torch.export`` program (``.pt2``); ``torch.export.load(f).module()``.
* ``aoti``: an AOTInductor package (``.pt2``, compiled C++; needs a C++ compiler when
  exporting); ``torch._inductor.aoti_load_package(f)``.
* ``torchscript``: TorchScript (``.pt``); ``torch.jit.load(f)`` (TorchScript is deprecated:
  torch 2.13 warns on save and load; it is still the format that C++ hosts such as the
  LAMMPS pair styles of other packages load).

Every dimension above (atoms, edges, systems) is dynamic. External wrappers (``mace``,
``sevenn``) are refused: use their own packages' export tools.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import as_model
from xnn.models.model_info import UNITS, dtype_name, first_line, model_dtype, safe_name

FORMATS = ("export", "aoti", "torchscript")
INPUTS = ["positions", "numbers", "cell", "pbc", "batch", "edge_index", "shifts"]
OUTPUTS = ["energy", "forces", "stress"]
META_FILE = "xnn.json"


class ForceField(nn.Module):
    """``(positions, numbers, cell, pbc, batch, edge_index, shifts) -> (energy, forces,
    stress)`` for a per-atom-energy ``model``, derivatives as in
    :func:`xnn.models.derivatives.compute_properties` (one autograd call on positions and a
    symmetric strain)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self, positions: Tensor, numbers: Tensor, cell: Tensor, pbc: Tensor, batch: Tensor,
        edge_index: Tensor, shifts: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        from xnn.models.derivatives import apply_strain, derive

        fields = {
            K.POSITIONS: positions, K.NUMBERS: numbers, K.CELL: cell, K.PBC: pbc,
            K.BATCH: batch, K.EDGE_INDEX: edge_index, K.SHIFTS: shifts,
        }
        graph = AtomicGraph(fields, validate=False)
        with torch.enable_grad():
            strained = apply_strain(graph)
            energies = self.model(strained.graph)
            energy = energies.new_zeros(cell.shape[0]).index_add(0, batch, energies)
            out = derive(energy.sum(), strained, graph.volume(), pbc, True, True, False)
        return energy.detach(), out[K.FORCES].detach(), out[K.STRESS].detach()


def example_inputs(model: nn.Module) -> tuple[Tensor, ...]:
    """Inputs to trace with: four small random periodic systems of the model's species.

    Four systems, so that no input dimension equals another or the 2 and 3 of
    ``edge_index`` and the coordinates.
    """
    from xnn.neighbors import with_edges

    gen = torch.Generator().manual_seed(0)
    species = as_model(model, "the exported model").species or [1]
    sizes = torch.tensor([5, 6, 7, 9])
    side = max(2.0 * float(model.cutoff), 4.0)
    n = int(sizes.sum())
    pos = torch.rand(n, 3, generator=gen, dtype=torch.float64) * side
    numbers = torch.tensor(species, dtype=torch.long)[torch.arange(n) % len(species)]
    batch = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
    cell = torch.eye(3, dtype=torch.float64).expand(len(sizes), 3, 3) * side
    graph = AtomicGraph.from_arrays(pos, numbers, cell, True, batch, dtype=model_dtype(model))
    g = with_edges(graph, float(model.cutoff), backend="brute")
    return (g.positions, g.numbers, g.cell, g.pbc, g.batch, g.edge_index, g.shifts)


def refuse_unexportable(model: nn.Module) -> None:
    """Raise :class:`InputError` for models that cannot become a self-contained artefact."""
    module = type(model).__module__
    if module.startswith("xnn.models.external"):
        name = getattr(model, "registry_name", None) or type(model).__name__
        raise InputError(
            f"model {name!r} wraps an external package ({module.rsplit('.', 1)[-1]}); xnn "
            "exports native models only (schnet, painn, equivariant, lj, morse): export it "
            "with its own package's tools, or run it through xnn.Calculator"
        )
    as_model(model, "the exported model")


def trace_forcefield(model: nn.Module) -> torch.fx.GraphModule:
    """The aten graph of :class:`ForceField` (forward and backward), every size symbolic."""
    import torch.fx.experimental._config as fx_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from xnn.models.base import tracing_graph

    refuse_unexportable(model)
    model = _without_triton(model).eval()
    inputs = example_inputs(model)
    try:
        # no duck sizing: equal example sizes must not be fused into one symbol
        with tracing_graph(), fx_config.patch(use_duck_shape=False):
            return make_fx(ForceField(model), tracing_mode="symbolic",
                           _allow_non_fake_inputs=True)(*inputs)
    except Exception as err:
        raise InputError(f"{type(model).__name__} cannot be traced for export: "
                         f"{first_line(err)}") from None


def _without_triton(model: nn.Module) -> nn.Module:
    """A copy with the reference kernels if ``model`` runs the ``triton`` backend (whose
    operators, ``xnn::weighted_bmm``, only xnn registers): the artefact stays torch-only,
    the same function to rounding."""
    if not any(getattr(m, "_fused", None) is not None for m in model.modules()):
        return model
    from xnn.models.cueq import set_kernel_backend

    model = copy.deepcopy(model)
    set_kernel_backend(model, "reference")
    return model


def export_program(model: nn.Module) -> torch.export.ExportedProgram:
    """The ``torch.export`` program of the traced force field (dynamic atoms/edges/systems)."""
    from torch.export import Dim

    graph = trace_forcefield(model)
    inputs = example_inputs(model)
    n, e, s = Dim("n_atoms", min=1), Dim("n_edges", min=1), Dim("n_systems", min=1)
    shapes = ({0: n}, {0: n}, {0: s}, {0: s}, {0: n}, {1: e}, {0: e})
    try:
        return torch.export.export(graph, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as err:
        raise InputError(f"{type(model).__name__} cannot be exported: {first_line(err)}") from None


def scripted(graph: torch.fx.GraphModule) -> torch.jit.ScriptModule:
    """TorchScript of an aten graph: overloads become packets (``aten.mul.Tensor`` ->
    ``aten.mul``, which TorchScript resolves by schema) and symbolic sizes ``x.size(d)``."""
    for node in graph.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is torch.ops.aten.sym_size.int:
            node.op, node.target = "call_method", "size"
        else:
            node.target = node.target.overloadpacket
    graph.recompile()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and annotation warnings
        return torch.jit.script(graph)


def metadata(model: nn.Module, fmt: str) -> dict:
    """What the artefact carries besides its graph (JSON-able)."""
    return {
        "format": f"xnn-forcefield-{fmt}",
        "name": safe_name(model),
        "hparams": model.hparams,
        "cutoff": float(model.cutoff),
        "species": model.species,
        "dtype": dtype_name(model_dtype(model)),
        "units": dict(UNITS, stress="eV/Å^3"),
        "inputs": INPUTS,
        "outputs": OUTPUTS,
        "neighbors": "full list (both directions), distance < cutoff, no zero-shift self "
                     "pair; r_ij = positions[j] - positions[i] + shifts @ cell[batch[i]], "
                     "j = edge_index[0]",
    }


def export_forcefield(model: nn.Module, path: str | os.PathLike, fmt: str) -> Path:
    """Write ``model`` as a self-contained artefact computing energy, forces and stress.

    Args:
        model: a native per-atom-energy model (on CPU; its dtype is the artefact's).
        path: output file (``.pt2`` for ``export`` and ``aoti``, ``.pt`` for
            ``torchscript``). The metadata of :func:`metadata` is stored inside
            (``xnn.json`` extra file; AOTI: the package's metadata, key ``xnn.json``).
        fmt: ``export``, ``aoti`` or ``torchscript``.
    Returns:
        the path.
    Raises:
        InputError: unknown format, ``path`` a folder or under a file, an external model, or
            a model that cannot be traced.
    """
    from xnn._files import atomic_write, check_output_file

    if fmt not in FORMATS:
        raise InputError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    suffix = ".pt" if fmt == "torchscript" else ".pt2"
    path = check_output_file(path, "export file", example=f"model{suffix}")
    refuse_unexportable(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(metadata(model, fmt))
    if fmt == "torchscript":
        module = scripted(trace_forcefield(model))
        return atomic_write(path, lambda tmp: _jit_save(module, tmp, meta))
    program = export_program(model)
    if fmt == "export":
        return atomic_write(path, lambda tmp: torch.export.save(
            program, tmp, extra_files={META_FILE: meta}))
    return atomic_write(path, lambda tmp: _aoti(program, tmp, meta))


def _jit_save(module: torch.jit.ScriptModule, path: Path, meta: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # documented in the module
        torch.jit.save(module, str(path), _extra_files={META_FILE: meta})


def _aoti(program: torch.export.ExportedProgram, path: Path, meta: str) -> None:
    package = path.with_name(path.name + ".pt2")  # AOTInductor insists on the suffix
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(package),
            inductor_configs={"aot_inductor.metadata": {META_FILE: meta}},
        )
        os.replace(package, path)
    except Exception as err:
        raise InputError(f"AOTInductor compilation failed ({first_line(err)}); it needs a "
                         "working C++ compiler (g++ or clang on PATH)") from None
    finally:
        package.unlink(missing_ok=True)
