"""Builders shared by the test modules, in one place: no test module imports another
(``tests/test_test_layout.py`` checks that). Import them from here (``from helpers import
lj, triclinic``); the submodules group them:

* :mod:`.structures` — rattled Cu (cubic, triclinic, slab, molecule, cluster, corner, tiny,
  primitive) with permuted atom ids, hot velocities by id, rattled argon;
* :mod:`.models` — Lennard-Jones (Cu-like, argon), small native networks, tiny MACE,
  SevenNet-0, a model that is not local; ``rel``, the relative error of two results;
* :mod:`.compiled` — systems, models and the ``xnn md`` run of the compiled-MD tests;
* :mod:`.kernels` — models, systems and assertions of the kernel-backend tests;
* :mod:`.training` — labelled data, small models and a trainer of the training tests.
"""

from .models import (
    MACE_SPECIES,
    SMALL,
    CountingLJ,
    argon_lj,
    counting_lj,
    lj,
    mace_model,
    native,
    rel,
    schnet_hccu,
    sevenn_0,
    si_cu_molecule,
    si_cu_periodic,
    small_mace,
)
from .structures import (
    atoms_graph,
    cluster,
    corner,
    cubic,
    fcc,
    graph,
    hot,
    molecule,
    primitive,
    rattled_argon,
    rod,
    slab,
    tiny,
    triclinic,
    vacuum_slab,
)

__all__ = [
    "MACE_SPECIES", "SMALL", "CountingLJ", "argon_lj", "atoms_graph", "cluster", "corner",
    "counting_lj", "cubic", "fcc", "graph", "hot", "lj", "mace_model", "molecule", "native",
    "primitive", "rattled_argon", "rod", "rel", "sevenn_0", "si_cu_molecule", "si_cu_periodic",
    "schnet_hccu", "slab", "small_mace", "tiny", "triclinic", "vacuum_slab",
]
