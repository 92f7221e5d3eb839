"""torch-sim interoperability: xnn models inside torch-sim, torch-sim models inside xnn.

* :class:`XnnTorchSimModel` makes any xnn model (native, classical, external wrapper) a
  torch-sim ``ModelInterface``: torch-sim's integrators, optimizers, runners and
  autobatcher then drive it on batched ``SimState`` objects.
* :class:`TorchSimPotential` goes the other way: a torch-sim model evaluated on xnn graphs,
  with the call signature of :class:`xnn.models.Potential`, so xnn's MD integrators
  (:mod:`xnn.dynamics`) can run it.

Conventions (torch-sim 0.3):

* torch-sim's ``SimState.cell`` holds the lattice vectors as **columns**
  (``state.cell = atoms.cell.T``); xnn's cell rows are lattice vectors. The adapters
  transpose (``state.row_vector_cell``).
* ``SimState.pbc`` is one bool for the whole batch; xnn's is ``[n_systems, 3]``. A
  ``SimState`` whose ``pbc`` is a tensor (``[3]`` or ``[n_systems, 3]``, e.g. a slab) is
  accepted by :class:`XnnTorchSimModel`; torch-sim's own integrators only wrap positions
  for ``pbc=True``. :class:`TorchSimPotential` refuses graphs with mixed or per-system pbc.
* Units are the same: eV, Å, amu; stress eV/Å³ with ASE's sign (positive under tension),
  ``[n_systems, 3, 3]``. torch-sim's time unit is ``sqrt(amu Å² / eV)`` (≈ 10.18 fs, ASE's);
  its ``units.MetalUnits.time`` is one ps in that unit, and ``torch_sim.integrate`` takes
  ``timestep`` in ps.

torch-sim is imported only when one of the classes is first used: ``import xnn`` and
``import xnn.interop.torchsim`` work without it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.interop import load_xnn_model
from xnn.neighbors.coincident import MIN_DISTANCE

# XnnTorchSimModel subclasses torch-sim's ModelInterface: built on first access (__getattr__)
__all__ = ["XnnTorchSimModel", "TorchSimPotential", "require_torch_sim"]  # noqa: F822

INSTALL_HINT = "pip install torch-sim-atomistic (or pip install 'xnn[torchsim]')"


#: the uncertainties a committee model returns besides the means (keys of xnn.data.keys)
UNCERTAINTY = (K.ENERGY_STD, K.FORCES_STD, K.STRESS_STD)


def require_torch_sim():
    """Import and return the ``torch_sim`` package.

    Raises:
        InputError: torch-sim is not installed (the message gives the pip command).
    """
    try:
        import torch_sim
    except ImportError as err:
        raise InputError(f"torch-sim is not installed ({err}); {INSTALL_HINT}") from None
    return torch_sim


def _pbc_rows(pbc, n_systems: int, device: torch.device) -> Tensor:
    """torch-sim's ``pbc`` (bool, ``[3]`` or ``[n_systems, 3]`` tensor) as ``[n_systems, 3]``."""
    p = torch.as_tensor(pbc, dtype=torch.bool, device=device)
    if p.ndim == 0:
        p = p.expand(3)
    if p.ndim == 1:
        p = p.expand(n_systems, 3)
    if tuple(p.shape) != (n_systems, 3):
        raise InputError(f"SimState.pbc must be a bool or have shape [3] or [{n_systems}, 3], "
                         f"got {tuple(p.shape)}")
    return p.clone()


def _state_fields(state) -> dict[str, object]:
    """positions, cell (columns), pbc, atomic_numbers, system_idx, masses of a SimState or dict."""
    names = ("positions", "cell", "pbc", "atomic_numbers", "system_idx", "masses")
    if isinstance(state, dict):
        missing = [n for n in names[:4] if n not in state]
        if missing:
            raise InputError(f"torch-sim state dict lacks {missing}; pass a torch_sim.SimState")
        return {n: state.get(n) for n in names}
    return {n: getattr(state, n, None) for n in names}


def state_to_graph(state, dtype: torch.dtype, device: torch.device) -> AtomicGraph:
    """An xnn :class:`AtomicGraph` (no edges) from a torch-sim ``SimState`` (or state dict).

    Args:
        state: ``positions [n_atoms, 3]`` Å, ``cell [n_systems, 3, 3]`` (columns are lattice
            vectors), ``pbc``, ``atomic_numbers [n_atoms]``, ``system_idx [n_atoms]``,
            ``masses [n_atoms]`` amu (standard masses when absent).
    Returns:
        the graph, rows of its cell the lattice vectors, ``pbc [n_systems, 3]``.
    """
    f = _state_fields(state)
    cell = torch.as_tensor(f["cell"])
    if cell.ndim == 2:
        cell = cell.unsqueeze(0)
    n_atoms = f["positions"].shape[0]
    batch = f["system_idx"]
    if batch is None:
        batch = torch.zeros(n_atoms, dtype=torch.long)
    return AtomicGraph.from_arrays(
        positions=f["positions"],
        numbers=f["atomic_numbers"],
        cell=cell.mT,
        pbc=_pbc_rows(f["pbc"], cell.shape[0], cell.device),
        batch=batch,
        masses=f["masses"],
        dtype=dtype,
        device=device,
    )


class _XnnTorchSimMixin:
    """The body of :class:`XnnTorchSimModel` (mixed into torch-sim's ``ModelInterface``)."""

    def __init__(
        self,
        model_or_path: torch.nn.Module | str | os.PathLike,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float64,
        compute_forces: bool = True,
        compute_stress: bool = True,
        neighbor_backend: str = "auto",
        skin: float = 0.0,
        trust: bool = False,
        min_distance: float = MIN_DISTANCE,
    ):
        from xnn.devices import resolve_device
        from xnn.io.calculator import check_dtype, check_min_distance
        from xnn.models.potential import Potential

        super().__init__()
        self._device = resolve_device(device)
        self._dtype = check_dtype(dtype, "XnnTorchSimModel")
        self.min_distance = check_min_distance(min_distance, "XnnTorchSimModel")
        self._compute_forces = bool(compute_forces)
        self._compute_stress = bool(compute_stress)
        self.model = load_xnn_model(model_or_path, trust).to(device=self._device, dtype=dtype)
        self.potential = Potential(self.model, skin=skin, backend=neighbor_backend)

    # torch-sim's ModelInterface makes these read-only; its validate_model_outputs and
    # NPT set them, and they are plain switches here.
    @property
    def compute_stress(self) -> bool:
        return self._compute_stress

    @compute_stress.setter
    def compute_stress(self, value: bool) -> None:
        self._compute_stress = bool(value)

    @property
    def compute_forces(self) -> bool:
        return self._compute_forces

    @compute_forces.setter
    def compute_forces(self, value: bool) -> None:
        self._compute_forces = bool(value)

    @property
    def cutoff(self) -> float:
        """The xnn model's cutoff (Å)."""
        return float(self.model.cutoff)

    def forward(self, state) -> dict[str, Tensor]:
        """Energy, per-atom energies, forces and stress of every system of ``state``.

        Args:
            state: a ``torch_sim.SimState`` (or a state dict with its fields).
        Returns:
            ``energy [n_systems]`` eV, ``energies [n_atoms]`` eV, ``forces [n_atoms, 3]``
            eV/Å (when ``compute_forces``), ``stress [n_systems, 3, 3]`` eV/Å³ ASE sign,
            zero for systems not periodic along x, y and z (when ``compute_stress``); for a
            committee model also its spreads (:data:`UNCERTAINTY`): ``energy_std
            [n_systems]`` eV, ``forces_std [n_atoms]`` eV/Å (with forces), ``stress_std
            [n_systems, 3, 3]`` eV/Å³ (with stress).
        Raises:
            InputError: two atoms of a system closer than ``min_distance`` (named by their
                indices in that system), or a malformed state.
        """
        from xnn.io.calculator import refuse_close_atoms

        graph = state_to_graph(state, self._dtype, self._device)
        refuse_close_atoms(self.potential, graph, self.min_distance, "XnnTorchSimModel")
        out = self.potential(graph, forces=self._compute_forces, stress=self._compute_stress)
        res = {"energy": out[K.ENERGY], "energies": out[K.ENERGIES]}
        if self._compute_forces:
            res["forces"] = out[K.FORCES]
        if self._compute_stress:
            res["stress"] = out[K.STRESS]
        for key in UNCERTAINTY:  # a committee's spreads, next to the means
            if key in out:
                res[key] = out[key]
        return res


_CLASSES: dict[str, type] = {}


def _model_class() -> type:
    if "model" not in _CLASSES:
        require_torch_sim()
        from torch_sim.models.interface import ModelInterface

        class XnnTorchSimModel(_XnnTorchSimMixin, ModelInterface):
            __doc__ = _MODEL_DOC

        XnnTorchSimModel.__module__ = __name__
        _CLASSES["model"] = XnnTorchSimModel
    return _CLASSES["model"]


_MODEL_DOC = """An xnn model as a torch-sim ``ModelInterface`` (batched ``SimState`` in, dict out).

    The model's own cutoff drives an xnn neighbor list (:mod:`xnn.neighbors`); energy,
    forces and stress come from :func:`xnn.models.derivatives.compute_properties`, exactly
    as :class:`xnn.Calculator` computes them.

    Args:
        model_or_path: an xnn model (any ``AtomisticModel``, classical or external wrapper),
            or the path of a model file written by ``xnn.save_model``. A model is moved in
            place to ``device`` and ``dtype``.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...
        dtype: dtype of the evaluation, ``torch.float64`` or ``torch.float32`` (torch-sim
            states are cast to it).
        compute_forces: return ``forces [n_atoms, 3]`` (eV/Å).
        compute_stress: return ``stress [n_systems, 3, 3]`` (eV/Å³, ASE sign).
        neighbor_backend: ``"auto"``, ``"torch"``, ``"vesin"`` or ``"brute"``.
        skin: Verlet skin (Å) of the neighbor list reused between calls.
        trust: the caller trusts the model file: it may unpickle what it holds or names,
            which can run code (:mod:`xnn.models.trust`); a file never grants trust itself.
        min_distance: refuse (:class:`~xnn.errors.InputError`) a state with two atoms of a
            system closer than this (Å; default 0.1, as :class:`xnn.Calculator`: coincident
            atoms, on which a model's energy means nothing); 0 evaluates anything.

    Example::

        import torch, torch_sim as ts, xnn
        from xnn.interop.torchsim import XnnTorchSimModel
        model = XnnTorchSimModel("model.pt", device="cpu", dtype=torch.float64)
        final = ts.integrate(atoms, model, integrator=ts.nvt_langevin, n_steps=100,
                             temperature=300.0, timestep=0.001)  # timestep in ps
    """


class TorchSimPotential:
    """A torch-sim model evaluated on xnn graphs, with :class:`xnn.models.Potential`'s call.

    Usable wherever xnn takes a potential callable, in particular xnn's MD integrators
    (``xnn.dynamics.nve.init(graph, TorchSimPotential(ts_model))``). Per-atom energies are
    returned only when the torch-sim model provides them (key ``energies``).

    Args:
        ts_model: a torch-sim ``ModelInterface``; it computes in its own ``device`` and
            ``dtype``, results are cast back to the graph's.
    """

    def __init__(self, ts_model: torch.nn.Module):
        self.ts = require_torch_sim()
        self.ts_model = ts_model

    def graph_to_state(self, graph: AtomicGraph):
        """The ``torch_sim.SimState`` of ``graph`` (cell transposed to columns, one bool pbc)."""
        pbc = graph.pbc
        if not (pbc.all() or not pbc.any()):
            raise InputError("torch-sim 0.3 states have one pbc flag for all systems and "
                             f"axes; this graph has pbc {pbc.tolist()}: evaluate "
                             "fully periodic and non-periodic systems separately")
        dev, dt = self.ts_model.device, self.ts_model.dtype
        return self.ts.SimState(
            positions=graph.positions.detach().to(dev, dt),
            masses=graph.masses.detach().to(dev, dt),
            cell=graph.cell.detach().mT.to(dev, dt).contiguous(),
            pbc=bool(pbc.all()),
            atomic_numbers=graph.numbers.to(dev),
            system_idx=graph.batch.to(dev),
        )

    def __call__(
        self, graph: AtomicGraph, forces: bool = True, stress: bool = True,
        training: bool = False,
    ) -> dict[str, Tensor]:
        """``energy [n_systems]`` and, as requested, ``forces [n_atoms, 3]``, ``stress`` and
        ``virial [n_systems, 3, 3]`` (zero for non-periodic systems), ``energies [n_atoms]``
        when the torch-sim model returns them."""
        if training:
            raise InputError("a TorchSimPotential evaluates torch-sim models for inference "
                             "only; train an xnn model instead")
        if forces and not self.ts_model.compute_forces:
            raise InputError("this torch-sim model does not compute forces; build it with "
                             "compute_forces=True")
        periodic = graph.pbc.all(-1)
        if stress and bool(periodic.any()) and not self.ts_model.compute_stress:
            raise InputError("this torch-sim model does not compute stress; build it with "
                             "compute_stress=True (or ask for stress=False)")
        raw = self.ts_model(self.graph_to_state(graph))
        like = graph.positions
        out = {K.ENERGY: raw["energy"].detach().to(like).reshape(graph.n_systems)}
        if "energies" in raw:
            out[K.ENERGIES] = raw["energies"].detach().to(like)
        if forces:
            out[K.FORCES] = raw["forces"].detach().to(like)
        if stress:
            s = raw.get("stress")
            s = torch.zeros_like(graph.cell) if s is None else s.detach().to(like)
            s = torch.where(periodic[:, None, None], s, torch.zeros_like(s))
            out[K.STRESS] = s
            out[K.VIRIAL] = -s * graph.volume()[:, None, None]
        return out


def __getattr__(name: str):
    if name == "XnnTorchSimModel":
        require_torch_sim()
        return _model_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
