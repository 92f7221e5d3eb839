"""Turning a config into a potential, a batch of structures and integrator arguments."""

from __future__ import annotations

import numpy as np
import torch

from xnn._files import require_file
from xnn._torch_files import refuse_non_model_file
from xnn.config.md import MDConfig, MDModelConfig
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import check_graph, free_mask, has_fixed, maxwell_boltzmann
from xnn.errors import InputError, ModelFileError
from xnn.units import BAR_TO_EV_PER_A3, GPA_TO_EV_PER_A3


def load_potential(cfg: MDModelConfig, device: torch.device, dtype: torch.dtype):
    """A :class:`~xnn.models.Potential` for ``model.file`` or ``model.name`` + ``model.params``
    (summed with the ``model.add`` terms, if any)."""
    from xnn.models import Potential, build

    cfg.check_source()
    if cfg.file is not None:
        from xnn.models.serialization import load_model

        require_file(cfg.file, "model file", ModelFileError, suggest=("model.pt",))
        refuse_non_model_file(cfg.file)  # truncated, or a training/MD checkpoint
        model = load_model(cfg.file, map_location=device, trust=cfg.trust_file)
    else:
        model = build(cfg.name, **dict(cfg.params))
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "cutoff"):
        raise ModelFileError(f"{cfg.file or cfg.name} is not an xnn model")
    if cfg.kernel_backend != "saved":
        if not hasattr(model, "set_backend"):
            raise InputError(f"model.kernel_backend={cfg.kernel_backend}: "
                             f"{type(model).__name__} has no kernel backends to choose (the "
                             f"equivariant model has; a MACE wrapper takes backend= when "
                             f"built): set model.kernel_backend: saved")
        model.set_backend(cfg.kernel_backend)
    if cfg.add:
        from xnn.models import Sum

        model = Sum([model, *[dict(t) if isinstance(t, dict) else t for t in cfg.add]])
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Potential(model, skin=cfg.skin, backend=cfg.neighbor_backend, compile=cfg.compile)


def load_structure(path: str, index: str, device: torch.device, dtype: torch.dtype) -> AtomicGraph:
    """All selected frames of ``path`` as one batch (``system`` = frame)."""
    from xnn.data.ase_io import from_ase, read

    if not path:
        raise InputError("no structure file given (structure=PATH)")
    require_file(path, "structure file")
    index = ":" if index == "all" else str(index)
    idx: str | int = int(index) if index.lstrip("-").isdigit() else index
    frames = read(path, index=idx)
    graph = from_ase(frames, dtype=dtype, device=device)
    keep = [k for k in graph.keys() if k not in K.LABEL_FIELDS]
    graph = AtomicGraph({k: graph[k] for k in keep}, validate=False)
    fixed = fixed_mask(frames)
    if fixed.any():
        graph = graph.replace(fixed=torch.as_tensor(fixed, device=device))
    return graph


def fixed_mask(frames) -> np.ndarray:
    """``[n_atoms]`` bool from ASE ``FixAtoms`` constraints (extxyz ``move_mask``)."""
    from ase.constraints import FixAtoms

    masks = []
    for atoms in frames:
        m = np.zeros(len(atoms), dtype=bool)
        for c in atoms.constraints:
            if isinstance(c, FixAtoms):
                m[c.get_indices()] = True
            else:
                raise InputError(f"constraint {type(c).__name__} is not supported by xnn md "
                                 "(only FixAtoms)")
        masks.append(m)
    return np.concatenate(masks)


def check_species(potential, graph: AtomicGraph) -> None:
    check = getattr(potential.model, "check_species", None)
    if check is not None:
        check(graph.numbers)


def velocities_from_file(cfg: MDConfig, graph: AtomicGraph) -> bool:
    if cfg.velocities == "file":
        if K.VELOCITIES not in graph:
            raise InputError(f"velocities=file but {cfg.structure} holds no velocities")
        return True
    has = K.VELOCITIES in graph and bool((graph.velocities != 0).any())
    return cfg.velocities == "auto" and has


def initial_velocities(cfg: MDConfig, graph: AtomicGraph, targets: torch.Tensor,
                       reduce: Reducer = LOCAL, from_file: bool | None = None) -> AtomicGraph:
    """Velocities from the file, or Maxwell–Boltzmann at the initial temperature (seeded,
    keyed by atom id: the same on any number of ranks).

    Args:
        reduce: global sums over the ranks holding the atoms.
        from_file: whether the file's velocities are used (decided where the whole file
            was read); ``None``: decided here from ``graph``.
    """
    if from_file is None:
        from_file = velocities_from_file(cfg, graph)
    if from_file:
        return check_graph(graph, reduce)
    t0 = targets if cfg.initial_temperature is None else cfg.initial_temperature
    return maxwell_boltzmann(graph, t0, seed=cfg.seed, reduce=reduce)


def check_kinetic_dof(cfg: MDConfig, graph: AtomicGraph, targets: torch.Tensor) -> None:
    """Refuse a temperature > 0 for a system without kinetic degrees of freedom.

    A system without fixed atoms keeps zero total momentum, so it has ``3 N - 3`` degrees
    of freedom: none for one atom; one whose atoms are all fixed has none either. Its
    temperature stays 0 K whatever is asked, so, as LAMMPS refuses to create or rescale
    velocities of a zero temperature, a thermostat target > 0 or Maxwell–Boltzmann
    velocities at T > 0 for such a system raise here instead of running silently at 0 K.

    Args:
        targets: ``[n_systems]`` target temperatures (K).
    Raises:
        InputError: naming the first such system.
    """
    free = free_mask(graph).to(torch.float64)
    n_free = torch.zeros(graph.n_systems, dtype=torch.float64, device=free.device)
    n_free = n_free.index_add(0, graph.batch, free)
    dof = torch.where(has_fixed(graph), 3 * n_free, 3 * n_free - 3)
    mb = None if velocities_from_file(cfg, graph) else (
        targets if cfg.initial_temperature is None else torch.full_like(
            targets, float(cfg.initial_temperature)))
    asked = targets if cfg.ensemble != "nve" else torch.zeros_like(targets)
    if mb is not None:
        asked = torch.maximum(asked, mb)
    bad = torch.nonzero((dof <= 0) & (asked > 0)).flatten()
    if bad.numel():
        s = int(bad[0])
        n = int((graph.batch == s).sum())
        why = ("all its atoms are fixed" if bool(has_fixed(graph)[s]) else
               f"{n} atom{'s' if n != 1 else ''}, whose total momentum is kept at zero")
        raise InputError(f"system {s} has no kinetic degrees of freedom ({why}): it cannot "
                         f"be given a temperature of {float(asked[s]):g} K; simulate at least "
                         "2 free atoms (e.g. a supercell), or set temperature=0")


def pressure_to_internal(value: float, unit: str) -> float:
    """Pressure in eV/Å³ from GPa or bar."""
    return float(value) * (GPA_TO_EV_PER_A3 if unit == "GPa" else BAR_TO_EV_PER_A3)


def target_temperatures(cfg: MDConfig, n_systems: int, like: torch.Tensor) -> torch.Tensor:
    if cfg.temperatures is not None:
        if len(cfg.temperatures) != n_systems:
            raise InputError(f"temperatures has {len(cfg.temperatures)} entries for "
                             f"{n_systems} systems")
        return torch.tensor(list(cfg.temperatures), dtype=like.dtype, device=like.device)
    return torch.full((n_systems,), float(cfg.temperature), dtype=like.dtype, device=like.device)


def integrator_args(cfg: MDConfig, temperatures: torch.Tensor) -> dict:
    """Keyword arguments of the chosen integrator's ``init`` from the config."""
    th, ba = cfg.thermostat, cfg.barostat
    if cfg.ensemble == "nve":
        return {}
    if cfg.ensemble == "langevin":
        return dict(temperature=temperatures, friction=th.friction, seed=cfg.seed)
    if cfg.ensemble == "csvr":
        return dict(temperature=temperatures, tau=th.tau, seed=cfg.seed)
    if cfg.ensemble == "nhc":
        return dict(temperature=temperatures, tau=th.tau, chain_length=th.chain_length)
    if cfg.ensemble == "npt":
        return dict(
            temperature=temperatures, tau=th.tau, seed=cfg.seed, tau_p=ba.tau_p,
            pressure=pressure_to_internal(cfg.pressure, cfg.pressure_unit),
            compressibility=ba.compressibility / GPA_TO_EV_PER_A3,
            anisotropic=ba.anisotropic,
        )
    raise InputError(f"unknown ensemble {cfg.ensemble!r}")


def compiled_integrator(cfg: MDConfig, par):
    """The integrator of ``md.compile=true`` (:class:`~xnn.dynamics.compiled_thermo.
    CompiledIntegrator`), after checking that the run is one it compiles."""
    from xnn.dynamics.compiled_thermo import CompiledIntegrator, compiled_ensemble
    from xnn.models.potential import Potential

    compiled_ensemble(cfg.ensemble)  # refused before the decomposed or one-process choice
    if hasattr(par, "compiled_integrator"):  # several ranks: the compiled decomposed step
        return par.compiled_integrator(cfg.ensemble, cuda_graph=cfg.cuda_graph)
    if type(par.potential) is not Potential:
        raise InputError("compile=true runs in one process: launch without torchrun or set "
                         "compile: false")
    return CompiledIntegrator(cfg.ensemble, par.potential, cuda_graph=cfg.cuda_graph)
