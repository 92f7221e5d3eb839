"""Field names of the batched atomic state, with their scope and shape.

Each field is declared once with a scope, so that slicing, concatenation, device moves and
(later) migration between ranks are written generically. A new per-atom field needs only a
``register_field(name, "atom")`` call.

Scopes:
    atom:   first dimension is n_atoms
    system: first dimension is n_systems
    edge:   last dimension of ``edge_index`` / first of others is n_edges
"""

from __future__ import annotations

POSITIONS = "positions"  # [n_atoms, 3] Å, float
NUMBERS = "numbers"  # [n_atoms] atomic numbers, long
MASSES = "masses"  # [n_atoms] amu, float
BATCH = "batch"  # [n_atoms] system index of each atom, long
ATOM_ID = "atom_id"  # [n_atoms] global integer atom id, long
VELOCITIES = "velocities"  # [n_atoms, 3] Å/fs, float
CHARGES = "charges"  # [n_atoms] e, float (initial charges)
FORCES = "forces"  # [n_atoms, 3] eV/Å, float (labels or results)
ENERGIES = "energies"  # [n_atoms] per-atom energies eV (results)
# [n_atoms, 3, 3] eV per-atom virials (results, on request): each edge's -r_ij ⊗ ∂E/∂r_ij
# half to each end atom; they sum to VIRIAL (xnn.models.derivatives)
VIRIALS = "virials"
FIXED = "fixed"  # [n_atoms] bool, atoms held fixed in dynamics
# [n_atoms, 3] Å, float: each atom's (unwrapped) position when the run started, kept by the
# MSD hook (xnn.dynamics.observers.MSD); moves with the atom, checkpointed by id
MSD_REFERENCE = "msd_reference"

CELL = "cell"  # [n_systems, 3, 3] Å, rows are lattice vectors
PBC = "pbc"  # [n_systems, 3] bool
ENERGY = "energy"  # [n_systems] eV (labels or results)
STRESS = "stress"  # [n_systems, 3, 3] eV/Å³, ASE sign (labels or results)
VIRIAL = "virial"  # [n_systems, 3, 3] eV (labels or results), virial = -stress * volume
SYSTEM_ID = "system_id"  # [n_systems] long, index of the structure in its dataset
WEIGHT = "weight"  # [n_systems] float, per-structure loss weight
# [n_systems] long: index of the readout head (into the model's head_names) that predicts
# each structure's energy, for multi-head models (xnn.models.heads); absent: the model's
# selected head. Set per dataset entry in multi-head fine-tuning.
HEAD = "head"
# [1] long: only the first n atoms of this (one-system) graph need updated features and
# energies; the others are senders only (a domain's ghosts, whose features a sync point
# refreshes). Absent: every atom. Models may ignore it.
N_UPDATE = "n_update"
# Domain decomposition, for long-range models (absent in one process): the local graph of a
# rank is non-periodic (explicit ghost images), so the decomposed system's true cell
# [1, 3, 3] Å (strained, when stress is asked), its pbc [1, 3] bool, and [1] long the number
# of owned atoms (the first rows; the k-space part runs over them only) travel as fields.
GLOBAL_CELL = "global_cell"
GLOBAL_PBC = "global_pbc"
N_OWNED = "n_owned"

# Committees (xnn.models.committee): the members' results stacked along a leading axis of
# size K (no field scope: results only) and the spread derived from them (population
# standard deviations over the K members, times the model's calibration factors).
ENERGY_MEMBERS = "energy_members"  # [K, n_systems] eV
ENERGIES_MEMBERS = "energies_members"  # [K, n_atoms] eV
FORCES_MEMBERS = "forces_members"  # [K, n_atoms, 3] eV/Å
STRESS_MEMBERS = "stress_members"  # [K, n_systems, 3, 3] eV/Å³
VIRIAL_MEMBERS = "virial_members"  # [K, n_systems, 3, 3] eV
ENERGY_STD = "energy_std"  # [n_systems] eV: std over members of the system's energy
# [n_atoms] eV/Å: sqrt(mean_k |F_k - F_mean|^2) per atom (the norm of the per-component
# standard deviations)
FORCES_STD = "forces_std"
STRESS_STD = "stress_std"  # [n_systems, 3, 3] eV/Å³: std over members per component
# [n_systems, K] float: bootstrap weight of each structure for each member when training a
# committee (integer counts of a seeded multinomial resample; absent: 1 for every member)
MEMBER_WEIGHT = "member_weight"

EDGE_INDEX = "edge_index"  # [2, n_edges] long, row 0 sender j, row 1 receiver i
SHIFTS = "shifts"  # [n_edges, 3] integer image shifts (stored as positions dtype)

ATOM, SYSTEM, EDGE = "atom", "system", "edge"

FIELD_SCOPES: dict[str, str] = {
    POSITIONS: ATOM,
    NUMBERS: ATOM,
    MASSES: ATOM,
    BATCH: ATOM,
    ATOM_ID: ATOM,
    VELOCITIES: ATOM,
    CHARGES: ATOM,
    FORCES: ATOM,
    ENERGIES: ATOM,
    VIRIALS: ATOM,
    FIXED: ATOM,
    MSD_REFERENCE: ATOM,
    CELL: SYSTEM,
    PBC: SYSTEM,
    ENERGY: SYSTEM,
    STRESS: SYSTEM,
    VIRIAL: SYSTEM,
    SYSTEM_ID: SYSTEM,
    WEIGHT: SYSTEM,
    HEAD: SYSTEM,
    N_UPDATE: SYSTEM,
    GLOBAL_CELL: SYSTEM,
    GLOBAL_PBC: SYSTEM,
    N_OWNED: SYSTEM,
    ENERGY_STD: SYSTEM,
    FORCES_STD: ATOM,
    STRESS_STD: SYSTEM,
    MEMBER_WEIGHT: SYSTEM,
    EDGE_INDEX: EDGE,
    SHIFTS: EDGE,
}

#: fields that hold labels (targets) read from data files
LABEL_FIELDS = (ENERGY, FORCES, STRESS, VIRIAL)


def register_field(name: str, scope: str) -> None:
    """Declare a new field so generic operations know how to slice and move it.

    Args:
        name: field name.
        scope: one of ``"atom"``, ``"system"``, ``"edge"``.
    """
    if scope not in (ATOM, SYSTEM, EDGE):
        raise ValueError(f"scope must be one of 'atom', 'system', 'edge', got {scope!r}")
    old = FIELD_SCOPES.get(name)
    if old is not None and old != scope:
        raise ValueError(f"field {name!r} is already registered with scope {old!r}")
    FIELD_SCOPES[name] = scope


def scope_of(name: str) -> str:
    try:
        return FIELD_SCOPES[name]
    except KeyError:
        raise KeyError(
            f"field {name!r} has no declared scope; call xnn.data.keys.register_field first"
        ) from None
