"""Small models of the tests: Lennard-Jones (Cu-like and argon), small noisy native networks,
a model that cannot be decomposed, tiny MACE models; the relative error of two results."""

from __future__ import annotations

import torch

from xnn.models import Potential, build
from xnn.models.classical import LennardJones

#: small sizes of the native networks (fast on two CPU cores)
SMALL = {
    "schnet": dict(num_features=8, num_filters=8, num_basis=8),
    "painn": dict(num_features=8, num_basis=8),
    "equivariant": dict(channels=4, l_max=1, hidden_l_max=1, correlation=2,
                        radial_mlp=(8,), readout_hidden=4, num_bessel=4),
}


def rel(a, b) -> float:
    """``max|a - b| / max|b|``."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def lj(cutoff=5.0, dtype=None):
    """Lennard-Jones near the Cu lattice (sigma 2.3 Å, epsilon 0.4 eV)."""
    model = build("lj", sigma=2.3, epsilon=0.4, cutoff=cutoff)
    return model if dtype is None else model.to(dtype)


def argon_lj(rc=6.5, eps=0.0104, sigma=3.405, skin=1.0):
    """A ``Potential`` of argon's Lennard-Jones in fp64 (Verlet skin ``skin`` Å)."""
    return Potential(build("lj", sigma=sigma, epsilon=eps, cutoff=rc).double(), skin=skin)


def native(name, layers=2, cutoff=3.0, activation_checkpointing=False):
    """A small fp64 ``schnet``/``painn``/``equivariant`` for Cu whose weights are perturbed
    (non-trivial outputs); the same weights for the same arguments."""
    torch.manual_seed(0)
    small = dict(SMALL[name])
    if activation_checkpointing:
        small["activation_checkpointing"] = True
    model = build(name, species=[29], cutoff=cutoff, num_interactions=layers, **small).double()
    with torch.no_grad():  # non-trivial outputs
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


class CountingLJ(LennardJones):
    """Lennard-Jones whose per-atom energies grow with the number of atoms it is given: not
    a local model (a rank's graph of owned atoms and ghosts gives other energies), so the
    decomposition contract must fail on it."""

    def forward(self, graph):
        return super().forward(graph) * (1.0 + 0.01 * graph.n_atoms)


def counting_lj():
    return CountingLJ(sigma=2.3, epsilon=0.4, cutoff=5.0)


def small_mace():
    """A random-weight ScaleShiftMACE for Cu (2 layers, l <= 1) in an xnn wrapper, fp64."""
    import numpy as np
    from e3nn import o3

    from xnn.models.external._optional import import_extra
    from xnn.models.external.mace import MACEWrapper

    (mace_modules,) = import_extra("mace", "mace.modules")
    torch.manual_seed(0)
    block = mace_modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    model = mace_modules.ScaleShiftMACE(
        atomic_inter_scale=1.3, atomic_inter_shift=0.2, r_max=3.0, num_bessel=4,
        num_polynomial_cutoff=5, max_ell=1, interaction_cls=block, interaction_cls_first=block,
        num_interactions=2, num_elements=1, hidden_irreps=o3.Irreps("4x0e + 4x1o"),
        MLP_irreps=o3.Irreps("4x0e"), gate=torch.nn.functional.silu,
        atomic_energies=np.array([-1.5]), avg_num_neighbors=8.0, atomic_numbers=[29],
        correlation=2)
    return MACEWrapper(model.double())


def sevenn_0():
    """Pretrained SevenNet-0 (5 layers, 4 sync points, 25 Å receptive field) in float64."""
    import warnings

    with warnings.catch_warnings():  # workers run under torch.set_default_dtype(float64)
        warnings.simplefilter("ignore")
        return build("sevenn", checkpoint="7net-0").double()


#: elements of :func:`mace_model` (Si, Cu)
MACE_SPECIES = [14, 29]


def mace_model(seed: int = 0, cls: str = "ScaleShiftMACE") -> torch.nn.Module:
    """A random-weight mace-torch model for Si/Cu (2 layers, l <= 2), fp64, evaluation mode
    (not wrapped); ``cls="MACE"``: SO(3)-only, not invariant under inversion."""
    import numpy as np
    from e3nn import o3

    from xnn.models.external._optional import import_extra

    (mace_modules,) = import_extra("mace", "mace.modules")
    torch.manual_seed(seed)
    block = mace_modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    cfg = dict(
        r_max=3.2, num_bessel=6, num_polynomial_cutoff=5, max_ell=2,
        interaction_cls=block, interaction_cls_first=block, num_interactions=2,
        num_elements=len(MACE_SPECIES), hidden_irreps=o3.Irreps("8x0e + 8x1o"),
        MLP_irreps=o3.Irreps("8x0e"), gate=torch.nn.functional.silu,
        atomic_energies=np.array([-1.5, -3.25]), avg_num_neighbors=8.0,
        atomic_numbers=MACE_SPECIES, correlation=2,
    )
    if cls == "ScaleShiftMACE":
        model = mace_modules.ScaleShiftMACE(atomic_inter_scale=1.3, atomic_inter_shift=0.2, **cfg)
    else:  # SO(3)-only: not invariant under inversion, so edge directions matter
        cfg["hidden_irreps"] = o3.Irreps("8x0e + 8x1o + 8x1e")
        model = mace_modules.MACE(use_so3=True, **cfg)
    return model.double().eval()


def si_cu_periodic():
    """4 atoms (2 Si, 2 Cu) in a strained, rattled FCC cell (ASE atoms)."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.numbers[[1, 2]] = 14
    atoms.set_cell(atoms.cell.array + [[0.0, 0.3, -0.2], [0.25, 0.0, 0.1], [0.0, -0.15, 0.0]],
                   scale_atoms=True)
    atoms.rattle(0.08, seed=1)
    return atoms


def si_cu_molecule():
    """6 Si/Cu atoms at random in a 4 Å cube, no cell (ASE atoms)."""
    import numpy as np
    from ase import Atoms

    rng = np.random.default_rng(3)
    pos = rng.uniform(0.0, 4.0, size=(6, 3))
    return Atoms(numbers=[14, 29, 29, 14, 29, 14], positions=pos)


def schnet_hccu():
    """A random-weight fp64 SchNet for H, C and Cu (cutoff 4 Å, 2 layers, 16 features)."""
    torch.manual_seed(0)
    return build("schnet", species=[1, 6, 29], cutoff=4.0, num_features=16, num_filters=16,
                 num_interactions=2, num_basis=8).double()
