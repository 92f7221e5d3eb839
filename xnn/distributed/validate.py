"""Library side of ``xnn validate``: one process vs decomposed, compared by atom id.

Also the model spec parser (``lj``, ``lj:sigma=2.3,epsilon=0.4,cutoff=5.0``, a model file)
and the rank-0 structure reader used by the CLI; both are safe in a job of many ranks (read
on rank 0 and broadcast, errors raised on every rank).
"""

from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from xnn._files import require_file
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.dynamics.structure_checks import check_start_structures
from xnn.errors import InputError, ModelFileError
from xnn.models.trust import granted

#: defaults of built-in specs for hyperparameters a model requires (``lj`` alone works)
SPEC_DEFAULTS = {
    "lj": {"sigma": 2.3, "epsilon": 0.4, "cutoff": 5.0},
    "morse": {"D": 0.35, "alpha": 1.4, "r0": 2.5, "cutoff": 6.0},
}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_spec(spec: str) -> tuple[str, dict]:
    """``"name:key=value,..."`` to ``(name, hyperparameters)``."""
    name, _, rest = spec.partition(":")
    hp = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise InputError(f"model spec {spec!r}: expected key=value, got {item!r}")
        hp[key.strip()] = _value(value.strip())
    return name.strip(), hp


def build_from_spec(spec: str, species: list[int], seed: int = 0):
    """A registry model from a spec; ``species`` fills a required ``species`` argument.

    Weights of learnable models are initialised from ``seed`` (identical on every rank).
    """
    from xnn.models.registry import build, model_class

    name, hp = parse_spec(spec)
    cls = model_class(name)
    params = inspect.signature(cls.__init__).parameters
    hp = {**{k: v for k, v in SPEC_DEFAULTS.get(name, {}).items() if k in params}, **hp}
    if "species" in params and "species" not in hp and params["species"].default is inspect._empty:
        hp["species"] = species
    torch.manual_seed(seed)
    return build(name, **hp)


def load_model_everywhere(spec: str, species: list[int], group=None, trust: bool = False):
    """The model of ``spec`` on every rank: a file read on rank 0 and broadcast, or a spec.

    A file is read as data; ``trust`` (the caller's ``--trust-file``) is passed to
    :func:`xnn.load_model`, and holds for a file a spec names (``mace:model=x.model``)."""
    is_file = C.broadcast_object(Path(spec).is_file() if C.group_rank(group) == 0 else None,
                                 group)
    if not is_file:
        with C.guarded(group, "model build"):
            if os.sep in spec or spec.endswith((".pt", ".pth", ".model")) or Path(spec).is_dir():
                require_file(spec, "model file", InputError, suggest=("model.pt",))
                raise InputError(f"model file {spec!r} does not exist on rank 0")
            with granted(trust):
                model = build_from_spec(spec, species)
        return model
    data = None
    with C.guarded(group, "model file read"):
        if C.group_rank(group) == 0:
            data = Path(spec).read_bytes()
    data = C.broadcast_object(data, group)
    with C.guarded(group, "model load"), tempfile.TemporaryDirectory() as tmp:
        from xnn.models.serialization import load_model

        path = Path(tmp) / Path(spec).name
        path.write_bytes(data)
        try:
            model = load_model(path, trust=trust)
        except ModelFileError as err:  # name the user's file, not the temporary copy
            raise type(err)(str(err).replace(str(path), spec)) from None
    return model


def read_structure_rank0(path: str, index: str = "-1", group=None) -> AtomicGraph | None:
    """Read one structure on rank 0 (``None`` elsewhere); a bad file fails on every rank."""
    graph = None
    with C.guarded(group, f"reading {path}"):
        if C.group_rank(group) == 0:
            from xnn.data.ase_io import read

            graph = read(path, index=index, as_graph=True)
            if graph.n_systems != 1:
                raise InputError(f"{path}: index {index!r} selects {graph.n_systems} structures; "
                                 "give one (e.g. --index -1)")
            check_start_structures(graph, path)
            graph = graph.replace({k: None for k in K.LABEL_FIELDS if k in graph})
    return graph


def compare(out: dict[str, Tensor], ref: dict[str, Tensor], graph: AtomicGraph) -> dict:
    """Worst absolute and relative errors of energy, forces (by atom id) and stress/virial."""
    order = torch.argsort(graph.atom_id)
    if not torch.equal(out[K.ATOM_ID].cpu(), graph.atom_id[order].cpu()):
        raise InputError("the decomposed result lost or duplicated atom ids")
    pairs = {"energy": (out[K.ENERGY], ref[K.ENERGY]),
             "forces": (out[K.FORCES], ref[K.FORCES][order]),
             "energies": (out[K.ENERGIES], ref[K.ENERGIES][order])}
    if bool(graph.pbc.all()):
        pairs["stress"] = (out[K.STRESS], ref[K.STRESS])
    else:
        pairs["virial"] = (out[K.VIRIAL], ref[K.VIRIAL])
    floors = _scale_floors(ref, graph)
    report = {}
    for name, (a, b) in pairs.items():
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        scale = max(b.double().abs().max().item() if b.numel() else 0.0, floors[name])
        report[name] = {"max_abs": diff, "max_rel": diff / scale if scale > 0 else diff,
                        "scale": scale}
    return report


def _scale_floors(ref: dict[str, Tensor], graph: AtomicGraph) -> dict[str, float]:
    """The smallest scale each quantity's relative error is taken against: the system's
    energy per atom ``e`` (eV) as an energy, ``e`` per Å as a force, ``e N / V`` as a stress
    and ``e N`` as a virial. A quantity that vanishes by symmetry (the forces of a perfect
    crystal, the stress at equilibrium) is then judged on the system's own scale, not as
    round-off divided by round-off."""
    n = max(graph.n_atoms, 1)
    e = ref[K.ENERGY].double().abs().max().item() / n
    floors = {"energy": e * n, "energies": e, "forces": e, "virial": e * n}
    if bool(graph.pbc.all()):
        volume = graph.cell.double().det().abs().item()
        floors["stress"] = e * n / volume if volume > 0 else 0.0
    return floors


def validate_decomposition(model, graph: AtomicGraph | None, manager_or_group=None, grid=None,
                           mode: str = "halo", skin: float = 0.0,
                           order: str = "morton") -> dict | None:
    """Run ``model`` in one process (group rank 0) and decomposed; compare (collective).

    Args:
        model: the same model on every rank.
        graph: one system on group rank 0 (others may pass ``None``).
        manager_or_group, grid, mode, skin, order: see
            :func:`~xnn.distributed.parallelize.parallelize` (``mode`` any key of
            :data:`~xnn.distributed.modes.MODES`).
    Returns:
        On group rank 0 the report of :func:`compare` (worst absolute and relative errors of
        energy, per-atom energies, forces by atom id, stress or virial); ``None`` elsewhere.
    """
    from xnn.distributed.parallelize import parallelize
    from xnn.distributed.potential import model_device

    dd = parallelize(model, manager_or_group, mode, graph=graph, grid=grid, skin=skin,
                     order=order)
    ref = None
    with C.guarded(dd.group, "single-process reference"):
        if dd.rank == 0:
            graph = graph.to(dd.device or model_device(model) or graph.device)
            ref = single_process(model, graph)
    out = dd.single_point(graph if dd.rank == 0 else None)
    return compare(out, ref, graph) if dd.rank == 0 else None


def single_process(model, graph: AtomicGraph) -> dict[str, Tensor]:
    """Reference results of ``model`` on ``graph`` in this process (periodic neighbor list)."""
    from xnn.models import Potential

    return Potential(model)(graph)
