"""Write nacl_216.xyz: 216 ions of rock salt (3 x 3 x 3 conventional cells) at the density of
molten NaCl near 1300 K (about 1.55 g/cm³, a = 6.3 Å instead of the crystal's 5.64 Å), with
formal charges as extxyz ``initial_charges``. Run from this folder: ``python make_structure.py``.
"""

import numpy as np
from ase.build import bulk
from ase.io import write

atoms = bulk("NaCl", "rocksalt", a=6.3, cubic=True).repeat((3, 3, 3))
atoms.rattle(0.05, seed=0)
atoms.set_initial_charges(np.where(atoms.numbers == 11, 1.0, -1.0))
write("nacl_216.xyz", atoms)
