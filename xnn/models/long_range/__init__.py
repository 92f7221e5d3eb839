"""Long-range terms: electrostatics (``ewald``, ``pme``, ``coulomb``) on torch-pme and
dispersion (``d3``, DFT-D3(BJ)) on tad-dftd3."""

from xnn.models.long_range.coulomb import (
    COULOMB_CONSTANT,
    PME,
    DirectCoulomb,
    Ewald,
    ewald_parameters,
    pme_mesh_spacing,
)
from xnn.models.long_range.dispersion import D3

__all__ = ["COULOMB_CONSTANT", "D3", "PME", "DirectCoulomb", "Ewald", "ewald_parameters",
           "pme_mesh_spacing"]
