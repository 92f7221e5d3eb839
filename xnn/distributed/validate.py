"""Library side of ``xnn validate``: one process vs decomposed, compared by atom id, for a
built model (the model spec parser, ``lj:sigma=2.3``, is :mod:`xnn.app.model_spec`).

Also the rank-0 structure reader used by the CLI, safe in a job of many ranks (read on rank
0 and broadcast, errors raised on every rank).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.distributed import collectives as C
from xnn.dynamics.structure_checks import check_start_structures
from xnn.errors import InputError


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
                           order: str = "morton", balance: str = "none",
                           exchange: str = "direct") -> dict | None:
    """Run ``model`` in one process (group rank 0) and decomposed; compare (collective).

    Args:
        model: the same model on every rank.
        graph: one system on group rank 0 (others may pass ``None``).
        manager_or_group, grid, mode, skin, order, balance, exchange: see
            :func:`~xnn.distributed.parallelize.parallelize` (``mode`` any key of
            :data:`~xnn.distributed.modes.MODES`).
    Returns:
        On group rank 0 the report of :func:`compare` (worst absolute and relative errors of
        energy, per-atom energies, forces by atom id, stress or virial); ``None`` elsewhere.
    """
    from xnn.distributed.parallelize import parallelize
    from xnn.distributed.potential import model_device

    dd = parallelize(model, manager_or_group, mode, graph=graph, grid=grid, skin=skin,
                     order=order, balance=balance, exchange=exchange)
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
