"""Turning a config into a potential, a batch of structures and integrator arguments."""

from __future__ import annotations

import numpy as np
import torch

from xnn._files import require_file
from xnn._torch_files import refuse_non_model_file
from xnn.config.md import MDConfig
from xnn.config.model import ModelConfig
from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.dynamics.reduce import LOCAL, Reducer
from xnn.dynamics.state import check_graph, free_mask, has_fixed, maxwell_boltzmann
from xnn.dynamics.structure_checks import check_start_structures
from xnn.errors import InputError, ModelFileError
from xnn.units import BAR_TO_EV_PER_A3, GPA_TO_EV_PER_A3


def load_potential(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """A one-process :class:`~xnn.models.Potential` of :func:`load_model` (``model.skin``,
    ``model.neighbor_backend``, ``model.compile``)."""
    from xnn.models import Potential

    return Potential(load_model(cfg, device, dtype), skin=cfg.skin,
                     backend=cfg.neighbor_backend, compile=cfg.compile)


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The model of ``model.file`` or ``model.name`` built with ``model.cutoff``,
    ``model.species`` and ``model.hyperparameters`` (a sum: ``model.name=sum`` with
    ``hyperparameters.terms``), in eval mode without gradients. ``model.trust_file`` is the
    caller's trust in every model file the config names (:mod:`xnn.models.trust`)."""
    from xnn.models import build
    from xnn.models.base import AtomisticModel
    from xnn.models.heads import select_head
    from xnn.models.trust import granted

    cfg.check_source()
    if cfg.file is not None:
        from xnn.models.serialization import load_model

        require_file(cfg.file, "model file", ModelFileError, suggest=("model.pt",))
        refuse_non_model_file(cfg.file)  # truncated, or a training/MD checkpoint
        model = load_model(cfg.file, map_location=device, trust=cfg.trust_file)
    else:
        with granted(cfg.trust_file):
            model = build(cfg.name, **cfg.build_kwargs())
    if not isinstance(model, AtomisticModel):
        raise ModelFileError(f"{cfg.file or cfg.name} is not an xnn model")
    model = select_head(model, cfg.head, "model.head")
    if cfg.kernel_backend != "saved":
        if not hasattr(model, "set_backend"):
            raise InputError(f"model.kernel_backend={cfg.kernel_backend}: "
                             f"{type(model).__name__} has no kernel backends to choose (the "
                             f"equivariant model has; a MACE wrapper takes backend= when "
                             f"built): set model.kernel_backend: saved")
        model.set_backend(cfg.kernel_backend)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_structure(path: str, index: str, device: torch.device, dtype: torch.dtype) -> AtomicGraph:
    """All selected frames of ``path`` as one batch (``system`` = frame), refused when a
    simulation cannot start from them (:func:`~xnn.dynamics.structure_checks.
    check_start_structures`: a frame without atoms, non-finite velocities, coincident
    atoms)."""
    from xnn.data.ase_io import from_ase, read

    if not path:
        raise InputError("no structure file given (structure=PATH)")
    require_file(path, "structure file")
    index = ":" if index == "all" else str(index)
    idx: str | int = int(index) if index.lstrip("-").isdigit() else index
    frames = read(path, index=idx)
    graph = from_ase(frames, dtype=dtype, device=device)
    check_start_structures(graph, path)
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


def check_species(model, graph: AtomicGraph) -> None:
    """Raise when ``graph`` holds elements ``model`` was not built for."""
    model.check_species(graph.numbers)


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
    """Refuse a temperature > 0 for a system without kinetic degrees of freedom
    (:func:`no_kinetic_dof`): a thermostat target > 0, or Maxwell–Boltzmann velocities at
    T > 0 (not for velocities from the file).

    Args:
        targets: ``[n_systems]`` target temperatures (K).
    Raises:
        InputError: naming the first such system.
    """
    mb = None if velocities_from_file(cfg, graph) else (
        targets if cfg.initial_temperature is None else torch.full_like(
            targets, float(cfg.initial_temperature)))
    asked = targets if cfg.ensemble != "nve" else torch.zeros_like(targets)
    if mb is not None:
        asked = torch.maximum(asked, mb)
    problem = no_kinetic_dof(graph, asked)
    if problem is not None:
        s, why = problem
        raise InputError(f"system {s} has {why}; simulate at least 2 free atoms (e.g. a "
                         "supercell), or set temperature=0")


def no_kinetic_dof(graph: AtomicGraph, asked: torch.Tensor) -> tuple[int, str] | None:
    """The first system asked for a temperature > 0 that has no kinetic degrees of freedom,
    and why: ``(system, "no kinetic degrees of freedom (...): it cannot be given a
    temperature of T K")``; ``None`` when every system can take its temperature.

    A system without fixed atoms keeps zero total momentum, so it has ``3 N - 3`` degrees
    of freedom: none for one atom; one whose atoms are all fixed has none either. Its
    temperature stays 0 K whatever is asked, so, as LAMMPS refuses to create or rescale
    velocities of a zero temperature, ``xnn md`` refuses such a run and an ``xnn run``
    stage fails such a system instead of running it silently at 0 K.

    Args:
        asked: ``[n_systems]`` temperatures (K) asked of each system (a thermostat's
            target, or that of the Maxwell–Boltzmann velocities drawn).
    """
    free = free_mask(graph).to(torch.float64)
    n_free = torch.zeros(graph.n_systems, dtype=torch.float64, device=free.device)
    n_free = n_free.index_add(0, graph.batch, free)
    dof = torch.where(has_fixed(graph), 3 * n_free, 3 * n_free - 3)
    bad = torch.nonzero((dof <= 0) & (asked.to(dof.device) > 0)).flatten()
    if not bad.numel():
        return None
    s = int(bad[0])
    n = int((graph.batch == s).sum())
    why = ("all its atoms are fixed" if bool(has_fixed(graph)[s]) else
           f"{n} atom{'s' if n != 1 else ''}, whose total momentum is kept at zero")
    return s, (f"no kinetic degrees of freedom ({why}): it cannot be given a temperature "
               f"of {float(asked[s]):g} K")


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


def check_compile(cfg: MDConfig, model: torch.nn.Module, device: torch.device,
                  several_ranks: bool) -> None:
    """Refuse, before anything is read or written, every part of the run that
    ``compile=true`` (or ``cuda_graph=true``) does not support, all named in one line.

    Args:
        model: the run's model (a :class:`~xnn.models.Sum` is searched term by term).
        device: the run's device. several_ranks: the run is decomposed (torchrun).
    Raises:
        InputError: naming the ensemble, model terms or options it cannot compile.
    """
    from xnn.dynamics.compiled_thermo import SCHEMES

    if not (cfg.compile or cfg.cuda_graph):
        return
    problems = []
    if cfg.ensemble not in SCHEMES:
        problems.append(f"ensemble={cfg.ensemble} (it compiles ensembles "
                        f"{', '.join(SCHEMES)}; npt moves the cell)")
    terms = untraceable_terms(model)
    if terms:
        problems.append(f"the term(s) {terms} of the model, which declare traceable=False "
                        "(data-dependent shapes, which do not trace: long-range sums over "
                        "the system, SevenNet's selection of the edges within its cutoff)")
    if cfg.model.compile:
        problems.append("model.compile=true (compile=true compiles the whole step, model "
                        "included; set model.compile: false)")
    if cfg.cuda_graph and device.type != "cuda":
        problems.append(f"cuda_graph=true on device {device.type} (CUDA graphs need "
                        "model.device=cuda; on a CPU use compile: true alone)")
    if several_ranks and cfg.cuda_graph:
        problems.append("cuda_graph=true on several ranks (it runs in one process)")
    if several_ranks and cfg.parallel.mode == "graph":
        problems.append("parallel.mode=graph (on several ranks it compiles parallel.mode "
                        "spatial)")
    if problems:
        key = "compile=true" if cfg.compile else "cuda_graph=true"
        raise InputError(f"{key} does not support {'; nor '.join(problems)}: change "
                         f"{'it' if len(problems) == 1 else 'them'} or set compile: false "
                         "and cuda_graph: false (the eager step runs every combination)")


def check_uncertainty(cfg, model: torch.nn.Module) -> None:
    """Refuse ``safety.max_force_uncertainty`` of ``cfg`` (an ``MDConfig``, ``RelaxConfig``
    or ``WorkflowConfig``) for a model that is not a committee (it has no spread to check)."""
    if cfg.safety.max_force_uncertainty is not None and model.committee_size < 2:
        raise InputError(f"safety.max_force_uncertainty={cfg.safety.max_force_uncertainty} "
                         f"needs a committee model (its members' spread); {type(model).__name__}"
                         " is one model: train one with committee.size=K or set "
                         "safety.max_force_uncertainty: null")


def untraceable_terms(model: torch.nn.Module) -> list[str]:
    """Registry names of the model's terms (itself, a :class:`~xnn.models.Sum`'s terms, and
    modules inside them) that declare ``traceable = False``."""
    from xnn.models.base import AtomisticModel
    from xnn.models.serialization import registry_name

    names = [registry_name(m) for m in model.modules()
             if isinstance(m, AtomisticModel) and not m.traceable]
    return list(dict.fromkeys(names))


def check_compile_cells(cfg: MDConfig, graph: AtomicGraph) -> None:
    """``compile=true`` pads neighbor lists with edges shifted by a lattice vector: refuse a
    system without one (a cluster without a box) before the first step."""
    if not (cfg.compile or cfg.cuda_graph):
        return
    longest = graph.cell.detach().norm(dim=-1).max(dim=-1).values  # [n_systems]
    empty = torch.nonzero(longest < 1e-6).flatten()
    if empty.numel():
        raise InputError(f"compile=true needs a cell with a non-zero lattice vector in every "
                         f"system; system {int(empty[0])} has none: give it a box (a cell "
                         "larger than the cluster, pbc false) or set compile: false")


def compiled_integrator(cfg: MDConfig, par):
    """The integrator of ``md.compile=true`` (:class:`~xnn.dynamics.compiled_thermo.
    CompiledIntegrator`), after checking that the run is one it compiles."""
    from xnn.dynamics.compiled_thermo import compiled_ensemble

    compiled_ensemble(cfg.ensemble)  # refused before the decomposed or one-process choice
    # the run layer of parallelize_md declares its compiled integrator: the one-process
    # step, the compiled decomposed step, or a refusal (an eager decomposed run)
    return par.compiled_integrator(cfg.ensemble, cuda_graph=cfg.cuda_graph)
