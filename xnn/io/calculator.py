"""ASE calculator for any xnn model: every property from one model call per change of atoms."""

from __future__ import annotations

import math
import numbers
import os

import numpy as np
import torch
from ase.calculators.calculator import Calculator as _AseCalculator
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.devices import resolve_device
from xnn.errors import InputError
from xnn.models.potential import Potential
from xnn.neighbors.coincident import MIN_DISTANCE, ClosePair, closest_pair, find_close_pair

#: the dtypes xnn evaluates models in (half precision has no ``linalg.inv`` for the cell)
DTYPES = (torch.float64, torch.float32)


def check_dtype(dtype: torch.dtype, who: str) -> torch.dtype:
    """``dtype`` after checking that xnn evaluates models in it (:data:`DTYPES`).

    Args:
        dtype: the dtype a caller gave.
        who: what it was given to, in the message (``"xnn.Calculator"``).
    Raises:
        InputError: one line (an integer, half-precision or complex dtype, a string ...).
    """
    if not (isinstance(dtype, torch.dtype) and dtype in DTYPES):
        raise InputError(f"{who}: dtype={dtype!r} is not supported; use torch.float64 or "
                         "torch.float32")
    return dtype


def check_min_distance(min_distance: float, who: str) -> float:
    """``min_distance`` as a float after checking that it is a finite distance >= 0 (Å).

    Args:
        min_distance: closest distance allowed between two atoms (0: no check).
        who: what it was given to, in the message (``"xnn.Calculator"``).
    Raises:
        InputError: one line.
    """
    ok = (isinstance(min_distance, numbers.Real) and not isinstance(min_distance, bool)
          and math.isfinite(min_distance) and min_distance >= 0)
    if not ok:
        raise InputError(f"{who}: min_distance={min_distance!r} must be a finite distance "
                         ">= 0 (Å; 0 turns the check for coincident atoms off)")
    return float(min_distance)


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
    system raises ASE's ``PropertyNotImplementedError``. A committee
    (:class:`~xnn.models.committee.Committee`) gives its mean under these names and adds its
    calibrated spread and members (:data:`committee_properties`, see
    :func:`committee_ase_results`), e.g. ``atoms.calc.results["forces_std"]``.

    Args:
        model: an :class:`~xnn.models.base.AtomisticModel` (moved in place to ``device`` and
            ``dtype``), or the path of a model file (``xnn.Calculator("model.pt")``: read as
            data by :func:`xnn.load_model`).
        device: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...
        dtype: dtype of the evaluation, ``torch.float64`` or ``torch.float32``.
        skin: Verlet skin (Å) of the neighbor list reused between calls.
        neighbor_backend: neighbor-list backend (``"auto"``, ``"torch"``, ``"vesin"``, ``"brute"``).
        compile: ``torch.compile`` the model's hot path (equivariant model and mace-torch
            wrapper, faster on a GPU after a first call that compiles for seconds to minutes:
            benchmarks/results/README.md, sections Models and MD).
        min_distance: refuse (:class:`~xnn.errors.InputError`) structures with two atoms
            closer than this (Å; default 0.1: coincident atoms, on which a model's energy
            means nothing); 0 evaluates anything.
        trust: passed to :func:`xnn.load_model` with a path: also load older formats that
            hold pickled code (only for files you trust); unused with a model.
        head: the head of a multi-head model that predicts (``None``: its default, the
            first; :mod:`xnn.models.heads`); an unknown name is refused listing the heads,
            a model without heads refuses any name.

    Attributes:
        n_model_calls: how many times the model was evaluated.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]
    #: what a committee's calculator adds (:func:`committee_ase_results`)
    committee_properties = ["energy_std", "forces_std", "stress_std", "energy_members",
                            "energies_members", "forces_members", "stress_members"]
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
        head: str | None = None,
    ):
        from xnn.models.heads import select_head

        super().__init__()
        self.min_distance = check_min_distance(min_distance, "xnn.Calculator")
        self.device = resolve_device(device)
        self.dtype = check_dtype(dtype, "xnn.Calculator")
        self.model = select_head(model_of(model, self.device, trust), head,
                                 "xnn.Calculator: head").to(device=self.device, dtype=dtype)
        self.potential = Potential(self.model, skin=skin, backend=neighbor_backend,
                                   compile=compile)
        if self.model.committee_size > 1:
            self.implemented_properties = [*Calculator.implemented_properties,
                                           *Calculator.committee_properties]
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
        refuse_close_atoms(self.potential, graph, self.min_distance)
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
        if self.model.committee_size > 1:
            self.results.update(committee_ase_results(out, periodic))


def committee_ase_results(out: dict, periodic: bool) -> dict[str, np.ndarray | float]:
    """The ASE results a committee adds to the means (calibrated spreads, see
    :func:`xnn.models.derivatives.committee_results`), as numpy fp64:

    * ``energy_std`` (float, eV), ``forces_std [n_atoms]`` (eV/Å, per atom:
      ``sqrt(mean_k |F_k - F̄|^2)``), and for a 3-D periodic system ``stress_std [6]``
      (Voigt, eV/Å³, per component);
    * ``energy_members [K]`` (eV), ``energies_members [K, n_atoms]`` (eV),
      ``forces_members [K, n_atoms, 3]`` (eV/Å), ``stress_members [K, 6]`` (eV/Å³): each
      member's own prediction (uncalibrated; the means are ``energy``, ``forces`` ...).
    """
    def arr(key: str) -> np.ndarray:
        return out[key].detach().cpu().double().numpy()

    res: dict[str, np.ndarray | float] = {
        "energy_std": float(arr(K.ENERGY_STD).sum()),
        "forces_std": arr(K.FORCES_STD),
        "energy_members": arr(K.ENERGY_MEMBERS)[:, 0],
        "energies_members": arr(K.ENERGIES_MEMBERS),
        "forces_members": arr(K.FORCES_MEMBERS),
    }
    if periodic:
        res["stress_std"] = full_3x3_to_voigt_6_stress(arr(K.STRESS_STD)[0])
        res["stress_members"] = np.stack([full_3x3_to_voigt_6_stress(s[0])
                                          for s in arr(K.STRESS_MEMBERS)])
    return res


def refuse_close_atoms(potential: Potential, graph, min_distance: float, who: str = "") -> None:
    """Raise when two atoms of ``graph`` are closer than ``min_distance`` (Å; ``<= 0``:
    never), found as :func:`too_close` finds them: the check of :class:`Calculator` and of
    the bridges that evaluate structures from elsewhere (torch-sim states).

    Args:
        potential: the potential that evaluates ``graph`` next (its neighbor list is reused).
        graph: one or more systems without edges.
        min_distance: Å.
        who: what takes ``min_distance``, named in the hint (``"XnnTorchSimModel"``); empty
            for the caller's own call.
    Raises:
        InputError: one line naming the two atoms (indices within their system, and the
            system in a batch of several) and their distance.
    """
    pair = too_close(potential, graph, min_distance)
    if pair is None:
        return
    where = f"system {pair.system}: " if graph.n_systems > 1 else ""
    to = f" to {who}" if who else ""
    raise InputError(f"{where}atoms {pair.i} and {pair.j} are {pair.distance:.3g} Å apart, "
                     f"closer than min_distance={min_distance} Å (coincident atoms: a "
                     f"duplicated atom?); fix the structure, or pass min_distance=0{to} to "
                     "evaluate it anyway")


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
