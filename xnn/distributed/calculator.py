"""``DistributedCalculator``: an ASE calculator whose evaluation is spread over all ranks.

In a torchrun/srun job every rank builds the same calculator and calls it on the same
structure (rank 0's atoms are used); the system is decomposed over the ranks
(:func:`~xnn.distributed.parallelize.parallelize`, any mode of
:data:`~xnn.distributed.modes.MODES`) and every rank gets the full results::

    manager = DistributedManager.initialize()
    atoms.calc = DistributedCalculator(model, manager)
    e = atoms.get_potential_energy()   # collective: call on every rank
"""

from __future__ import annotations

import torch
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes
from ase.stress import full_3x3_to_voigt_6_stress

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.distributed import collectives as C
from xnn.distributed.parallelize import parallelize


class DistributedCalculator(Calculator):
    """ASE calculator evaluating an xnn model decomposed over the ranks of a group.

    Energy, per-atom energies, forces and (3-D periodic systems) stress come from one
    decomposed evaluation per change of the atoms. Every rank must call it together.

    Args:
        model: per-atom-energy model with a ``cutoff``; moved to the manager's device/dtype.
        manager_or_group: see :func:`~xnn.distributed.parallelize.parallelize`.
        grid: ``(px, py, pz)`` or ``None`` (automatic) of a spatial layout.
        skin: Verlet skin (Å).
        mode: a key of :data:`~xnn.distributed.modes.MODES`: ``"halo"``, ``"sync"``,
            ``"spatial"``, ``"graph"`` or ``"auto"`` (chosen on the first structure, by the
            cost model of :func:`~xnn.distributed.graph.auto.choose_mode`, and kept).
        order: atom order of mode ``"graph"`` (``"morton"`` or ``"index"``).
        balance: how a spatial layout cuts its boxes (``"none"`` or ``"shift"``;
            ``parallel.balance`` of the commands).
        exchange: how its ghost rows travel (``"direct"`` or ``"staged"``;
            ``parallel.exchange`` of the commands).
        dtype: floating-point dtype of the evaluation.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]
    #: what a committee adds, as :class:`xnn.Calculator` names them
    committee_properties = ["energy_std", "forces_std", "stress_std", "energy_members",
                            "energies_members", "forces_members", "stress_members"]

    def __init__(self, model, manager_or_group=None, grid=None, skin: float = 0.0,
                 mode: str = "halo", dtype: torch.dtype = torch.float64,
                 order: str = "morton", balance: str = "none", exchange: str = "direct"):
        from xnn.distributed.potential import resolve_group

        super().__init__()
        self.dtype, self.mode, self.order = dtype, mode, order
        self.grid, self.skin, self.manager_or_group = grid, skin, manager_or_group
        self.layout = {"balance": balance, "exchange": exchange}
        self.model = model.to(dtype=dtype)
        self.group, device = resolve_group(manager_or_group)
        if device is not None:
            self.model.to(device)
        if self.model.committee_size > 1:
            self.implemented_properties = [*DistributedCalculator.implemented_properties,
                                           *DistributedCalculator.committee_properties]
        self.dd = None  # mode auto: the decomposed potential of the first structure
        if mode != "auto":
            self.dd = parallelize(self.model, manager_or_group, mode, grid=grid, skin=skin,
                                  order=order, **self.layout)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        graph = None
        with C.guarded(self.group, "structure conversion"):  # a bad rank stops them all
            graph = from_ase(self.atoms, dtype=self.dtype)
            graph = graph.replace({k: None for k in K.LABEL_FIELDS if k in graph})
        if self.dd is None:
            self.dd = parallelize(self.model, self.manager_or_group, self.mode,
                                  graph=graph if C.group_rank(self.group) == 0 else None,
                                  grid=self.grid, skin=self.skin, order=self.order,
                                  **self.layout)
        out = self.dd.single_point(graph)
        # results are sorted by atom id; put them back in this Atoms' order
        rows = torch.searchsorted(out[K.ATOM_ID], graph.atom_id.to(out[K.ATOM_ID].device))
        energy = float(out[K.ENERGY].sum())
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "energies": out[K.ENERGIES][rows].cpu().numpy(),
            "forces": out[K.FORCES][rows].cpu().numpy(),
        }
        if bool(graph.pbc.all()):
            stress = out[K.STRESS][0].cpu().numpy()
            self.results["stress"] = full_3x3_to_voigt_6_stress(stress)
        elif "stress" in properties:
            raise PropertyNotImplementedError("stress needs a cell periodic along all axes")
        if self.model.committee_size > 1:
            self.results.update(_committee_results(out, rows, bool(graph.pbc.all())))

    def stats(self) -> dict:
        """This rank's domain sizes (owned, ghost atoms, peers, grid); empty before the
        first calculation."""
        return {} if self.dd is None else self.dd.stats()


def _committee_results(out: dict, rows: torch.Tensor, periodic: bool) -> dict:
    """A committee's results of a single point (rows sorted by atom id, put back in the
    Atoms' order by ``rows``) under the names and shapes of :class:`xnn.Calculator`'s:
    ``energy_std`` (eV), ``forces_std [n_atoms]`` (eV/Å), ``energy_members [K]``,
    ``energies_members [K, n_atoms]``, ``forces_members [K, n_atoms, 3]`` and, 3-D periodic,
    ``stress_std [6]`` and ``stress_members [K, 6]`` (Voigt, eV/Å³)."""
    def arr(key: str, per_atom: bool = False):
        x = out[key].detach()
        if per_atom:
            x = x[..., rows, :] if x.ndim == 3 else x[..., rows]
        return x.cpu().double().numpy()

    res = {"energy_std": float(arr(K.ENERGY_STD).sum()),
           "forces_std": arr(K.FORCES_STD, True),
           "energy_members": arr(K.ENERGY_MEMBERS)[:, 0],
           "energies_members": arr(K.ENERGIES_MEMBERS, True),
           "forces_members": arr(K.FORCES_MEMBERS, True)}
    if periodic:
        res["stress_std"] = full_3x3_to_voigt_6_stress(arr(K.STRESS_STD)[0])
        res["stress_members"] = full_3x3_to_voigt_6_stress(arr(K.STRESS_MEMBERS)[:, 0])
    return res


__all__ = ["DistributedCalculator"]
