"""Physical constants and unit conversions.

Internal units: energy eV, length Å, mass amu, time fs, temperature K, stress eV/Å³.
Velocities are Å/fs; kinetic energy 0.5 * m v² is converted to eV with ``MVV2E``.
"""

from ase import units as _u

#: Boltzmann constant [eV/K]
KB = _u.kB
#: 1 amu·(Å/fs)² in eV
MVV2E = _u._amu * (1e-10 / 1e-15) ** 2 / _u._e
#: 1 eV/Å³ in GPa
EV_PER_A3_TO_GPA = 1.0 / _u.GPa
#: 1 GPa in eV/Å³
GPA_TO_EV_PER_A3 = _u.GPa
#: 1 bar in eV/Å³
BAR_TO_EV_PER_A3 = _u.bar
