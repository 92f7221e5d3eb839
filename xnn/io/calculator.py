"""ASE calculator for any xnn model: every property from one model call per change of atoms."""

from __future__ import annotations

import os

import numpy as np
import torch
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.errors import InputError
from xnn.models.potential import Potential
from xnn.neighbors.coincident import MIN_DISTANCE, ClosePair, closest_pair, find_close_pair


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else is passed to ``torch.device``
    and must exist on this machine (one-line :class:`InputError` otherwise)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"invalid device {device!r}: {e}; use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise InputError(f"device {str(device)!r} requested but no CUDA GPU is available; "
                             "use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= n:
            raise InputError(f"device {str(device)!r} requested but this machine has {n} CUDA "
                             f"GPU(s) (cuda:0 to cuda:{n - 1})")
    return dev


def model_of(model: torch.nn.Module | str | os.PathLike, device: torch.device,
             trust: bool = False) -> torch.nn.Module:
    """``model`` itself, or the model of the file it names (read as data by
    :func:`xnn.load_model`, which ``trust`` is passed to) on ``device``.

    Raises:
        InputError: ``model`` is neither a module nor a path.
        ModelFileError: the file is missing, a folder, or not a model file.
    """
    if isinstance(model, (str, os.PathLike)):
        from xnn.models.serialization import load_model

        return load_model(model, map_location=device, trust=trust)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"xnn.Calculator takes an xnn model or a model file path, got "
                         f"{type(model).__name__} {model!r:.60}; e.g. xnn.Calculator('model.pt') "
                         "or xnn.Calculator(xnn.models.build('lj', ...))")
    return model


class Calculator(_AseCalculator):
    """An ``ase`` calculator wrapping an xnn model (through :class:`xnn.models.Potential`).

    Energy (``energy``, ``free_energy``), per-atom ``energies``, ``forces`` and — for systems
    periodic along all three axes — ``stress`` (Voigt-6, eV/Å³) are computed together in one
    model call and cached until the atoms change; asking for ``stress`` of a non-3D-periodic
    system raises ASE's ``PropertyNotImplementedError``.

    Args:
        model: an :class:`~xnn.models.base.AtomisticModel` (moved in place to ``device`` and
            ``dtype``), or the path of a model file (``xnn.Calculator("model.pt")``: read as
            data by :func:`xnn.load_model`).
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...
        dtype: floating-point dtype of the evaluation.
        skin: Verlet skin (Å) of the neighbor list reused between calls.
        neighbor_backend: neighbor-list backend (``"auto"``, ``"torch"``, ``"vesin"``, ``"brute"``).
        compile: ``torch.compile`` the model's hot path (equivariant model: ~1.5x faster on a
            GPU after a first call that compiles for tens of seconds; mace-torch wrapper: ~2x
            faster at 864 atoms on an H200 after a first call that compiles for minutes).
        min_distance: refuse (:class:`~xnn.errors.InputError`) structures with two atoms
            closer than this (Å; default 0.1: coincident atoms, on which a model's energy
            means nothing); 0 evaluates anything.
        trust: passed to :func:`xnn.load_model` with a path: also load older formats that
            hold pickled code (only for files you trust); unused with a model.

    Attributes:
        n_model_calls: how many times the model was evaluated.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]
    nolabel = True

    def __init__(
        self,
        model: torch.nn.Module | str | os.PathLike,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        skin: float = 0.0,
        neighbor_backend: str = "auto",
        compile: bool = False,
        min_distance: float = MIN_DISTANCE,
        trust: bool = False,
    ):
        super().__init__()
        self.min_distance = float(min_distance)
        self.device = resolve_device(device)
        self.dtype = dtype
        self.model = model_of(model, self.device, trust).to(device=self.device, dtype=dtype)
        self.potential = Potential(self.model, skin=skin, backend=neighbor_backend,
                                   compile=compile)
        self.n_model_calls = 0

    def calculate(self, atoms=None, properties=None, system_changes=all_changes) -> None:
        """Compute every implemented property in one pass (ASE calls this when the atoms change)."""
        super().calculate(atoms, properties, system_changes)
        periodic = bool(np.all(self.atoms.pbc))
        if not periodic and "stress" in (properties or ()):
            raise PropertyNotImplementedError(
                "stress is only defined for systems periodic along x, y and z"
            )
        # labels the atoms may carry are not read: results come from the model only
        no_labels = dict(energy_key=None, forces_key=None, stress_key=None, virial_key=None)
        graph = from_ase(self.atoms, **no_labels, dtype=self.dtype, device=self.device)
        self._refuse_coincident(graph)
        out = self.potential(graph, forces=True, stress=periodic)
        self.n_model_calls += 1
        energy = float(out[K.ENERGY].sum())
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "energies": out[K.ENERGIES].detach().cpu().double().numpy(),
            "forces": out[K.FORCES].detach().cpu().double().numpy(),
        }
        if periodic:
            stress = out[K.STRESS][0].detach().cpu().double().numpy()
            self.results["stress"] = full_3x3_to_voigt_6_stress(np.asarray(stress))

    def _refuse_coincident(self, graph) -> None:
        """Raise when two atoms are closer than ``min_distance``."""
        pair = too_close(self.potential, graph, self.min_distance)
        if pair is not None:
            raise InputError(f"atoms {pair.i} and {pair.j} are {pair.distance:.3g} Å apart, "
                             f"closer than min_distance={self.min_distance} Å (coincident "
                             "atoms: a duplicated atom?); fix the structure, or pass "
                             "min_distance=0 to evaluate it anyway")


def too_close(potential: Potential, graph, min_distance: float) -> ClosePair | None:
    """The closest pair of atoms of ``graph`` if closer than ``min_distance`` (Å; ``<= 0``:
    never), from the neighbor list that ``potential``'s model call then reuses (or a list of
    its own if the model's cutoff is shorter)."""
    if min_distance <= 0:
        return None
    nl = potential.neighbors
    pair = (closest_pair(nl(graph)) if nl.cutoff >= min_distance
            else find_close_pair(graph, min_distance))
    return pair if pair is not None and pair.distance < min_distance else None
