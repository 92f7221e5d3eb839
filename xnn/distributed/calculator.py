"""``DistributedCalculator``: an ASE calculator whose evaluation is spread over all ranks.

In a torchrun/srun job every rank builds the same calculator and calls it on the same
structure (rank 0's atoms are used); the system is decomposed over the ranks and every rank
gets the full results::

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
from xnn.distributed.domain.decomposed import DomainDecomposed


class DistributedCalculator(Calculator):
    """ASE calculator evaluating an xnn model decomposed over the ranks of a group.

    Energy, per-atom energies, forces and (3-D periodic systems) stress come from one
    decomposed evaluation per change of the atoms. Every rank must call it together.

    Args:
        model: per-atom-energy model with a ``cutoff``; moved to the manager's device/dtype.
        manager_or_group: see :class:`~xnn.distributed.DomainDecomposed`.
        grid: ``(px, py, pz)`` or ``None`` (automatic).
        skin: Verlet skin (Å).
        mode: ``"halo"`` or ``"sync"``.
        dtype: floating-point dtype of the evaluation.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(self, model, manager_or_group=None, grid=None, skin: float = 0.0,
                 mode: str = "halo", dtype: torch.dtype = torch.float64):
        super().__init__()
        self.dtype = dtype
        self.dd = DomainDecomposed(model.to(dtype=dtype), manager_or_group, grid, skin, mode)
        if self.dd.device is not None:
            model.to(self.dd.device)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        graph = None
        with C.guarded(self.dd.group, "structure conversion"):  # a bad rank stops them all
            graph = from_ase(self.atoms, dtype=self.dtype)
            graph = graph.replace({k: None for k in K.LABEL_FIELDS if k in graph})
        out = self.dd(graph)
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

    def stats(self) -> dict:
        """This rank's domain sizes (owned, ghost atoms, peers, grid)."""
        return self.dd.stats()


__all__ = ["DistributedCalculator"]
