"""Long-range terms: electrostatics (``ewald``, ``pme``, ``coulomb``) on torch-pme."""

from xnn.models.long_range.coulomb import (
    COULOMB_CONSTANT,
    PME,
    DirectCoulomb,
    Ewald,
    ewald_parameters,
    pme_mesh_spacing,
)

__all__ = ["COULOMB_CONSTANT", "PME", "DirectCoulomb", "Ewald", "ewald_parameters",
           "pme_mesh_spacing"]
