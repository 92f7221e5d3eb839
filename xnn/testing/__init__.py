"""Test contracts any model author can import: finite-difference forces and stress,
rotation/reflection, translation, permutation, batching, supercells, cutoff smoothness
(``run_all_contracts(model)`` runs them all); and what the execution modes promise:
decomposed over gloo ranks equals one process (:func:`check_decomposition`), the compiled
MD step traces the model and equals eager (:func:`check_compiled_step`), the ASE, torch-sim
and LAMMPS front ends give the numbers of ``Potential`` (:func:`check_adapters`).

Each ``check_*`` raises ``AssertionError`` with a clear message and takes tolerances;
all run in float64 on small systems.
"""

from xnn.testing.adapters import (
    check_adapters,
    check_ase_calculator,
    check_lammps_adapter,
    check_torchsim_adapter,
)
from xnn.testing.batching import (
    check_batch_consistency,
    check_cross_system_gradient_zero,
    check_edges_beyond_cutoff_ignored,
)
from xnn.testing.common import assert_close, evaluate
from xnn.testing.compiled import check_compiled_step
from xnn.testing.cutoff import check_cutoff_smoothness, check_isolated_atom_e0
from xnn.testing.decomposition import (
    DecompositionCase,
    assert_decomposition_errors,
    check_decomposition,
    compare_by_id,
    decomposition_errors,
    decomposition_modes,
    relative_error,
    run_decomposition_cases,
)
from xnn.testing.derivatives import check_forces_finite_difference, check_stress_finite_difference
from xnn.testing.mliap import check_mliap
from xnn.testing.potential import check_potential, shortest_pair
from xnn.testing.suite import CONTRACTS, default_systems, run_all_contracts
from xnn.testing.symmetry import (
    check_permutation_equivariance,
    check_rotation_equivariance,
    check_supercell_consistency,
    check_translation_invariance,
)
from xnn.testing.systems import (
    dimer,
    random_molecule,
    random_orthogonal,
    random_periodic_system,
    single_atom,
    supercell,
)

__all__ = [
    "CONTRACTS",
    "DecompositionCase",
    "assert_close",
    "assert_decomposition_errors",
    "check_adapters",
    "check_mliap",
    "check_ase_calculator",
    "check_batch_consistency",
    "check_compiled_step",
    "check_decomposition",
    "check_lammps_adapter",
    "check_torchsim_adapter",
    "compare_by_id",
    "decomposition_errors",
    "decomposition_modes",
    "relative_error",
    "run_decomposition_cases",
    "check_cross_system_gradient_zero",
    "check_cutoff_smoothness",
    "check_edges_beyond_cutoff_ignored",
    "check_forces_finite_difference",
    "check_isolated_atom_e0",
    "check_permutation_equivariance",
    "check_potential",
    "check_rotation_equivariance",
    "check_stress_finite_difference",
    "check_supercell_consistency",
    "check_translation_invariance",
    "default_systems",
    "dimer",
    "evaluate",
    "random_molecule",
    "random_orthogonal",
    "random_periodic_system",
    "run_all_contracts",
    "shortest_pair",
    "single_atom",
    "supercell",
]
