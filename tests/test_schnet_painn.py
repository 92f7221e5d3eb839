"""SchNet and PaiNN: physics contracts (fp64), fp32, E0/scale/shift, sync points."""

import pytest
import torch

from xnn.data import keys as K
from xnn.errors import InputError
from xnn.models import SyncPoint, build
from xnn.testing.batching import (
    check_batch_consistency,
    check_cross_system_gradient_zero,
    check_edges_beyond_cutoff_ignored,
)
from xnn.testing.common import evaluate
from xnn.testing.cutoff import check_cutoff_smoothness, check_isolated_atom_e0
from xnn.testing.derivatives import check_forces_finite_difference, check_stress_finite_difference
from xnn.testing.symmetry import (
    check_permutation_equivariance,
    check_rotation_equivariance,
    check_supercell_consistency,
    check_translation_invariance,
)
from xnn.testing.systems import random_molecule, random_periodic_system

SPECIES = [29, 79]
E0 = {29: -1.25, 79: -3.5}
VARIANTS = [
    ("schnet", {}),
    ("schnet", {"radial_basis": "bessel", "cutoff_fn": "polynomial"}),
    ("painn", {}),
    ("painn", {"radial_basis": "gaussian", "cutoff_fn": "polynomial"}),
]
IDS = ["schnet", "schnet-bessel-poly", "painn", "painn-gauss-poly"]


def small_model(name, seed=0, **hp):
    torch.manual_seed(seed)
    hp = {"species": SPECIES, "cutoff": 3.5, "num_features": 16, "num_interactions": 2, **hp}
    if name == "schnet":
        hp.setdefault("num_filters", 16)
        hp.setdefault("num_basis", 12)
    model = build(name, **hp).double()
    model.set_statistics(e0=E0, scale=1.7, shift=0.3)
    return model


def crystal(seed=0, n_atoms=8, dtype=torch.float64):
    return random_periodic_system(
        SPECIES, n_atoms=n_atoms, volume_per_atom=14.0, min_distance=1.9, seed=seed, dtype=dtype
    )


@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=IDS)
def test_derivatives_and_symmetries(name, hp):
    model = small_model(name, **hp)
    g = crystal()
    check_forces_finite_difference(model, g, max_atoms=4)
    check_stress_finite_difference(model, g)
    check_rotation_equivariance(model, g, n_trials=1)
    check_translation_invariance(model, g)
    check_permutation_equivariance(model, g)


@pytest.mark.parametrize(("name", "hp"), VARIANTS, ids=IDS)
def test_batching_cutoff_and_isolated_atoms(name, hp):
    model = small_model(name, **hp)
    g = crystal(seed=1)
    check_batch_consistency(model, g)
    check_cross_system_gradient_zero(model, g)
    check_edges_beyond_cutoff_ignored(model, g, skin=1.0)
    check_cutoff_smoothness(model)
    for z in SPECIES:
        # isolated atom: shift + E0 (atol: the contract builds its reference in fp32)
        check_isolated_atom_e0(model, z, E0[z] + 0.3, atol=1e-6)


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_supercell_and_molecule(name):
    model = small_model(name, num_interactions=3)
    check_supercell_consistency(model, crystal(seed=2, n_atoms=6), reps=(2, 1, 2))
    mol = random_molecule(SPECIES, n_atoms=6, volume_per_atom=10.0, min_distance=1.9, seed=3)
    check_forces_finite_difference(model, mol, max_atoms=3)
    check_rotation_equivariance(model, mol, n_trials=1)


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_float32_matches_float64(name):
    model64 = small_model(name)
    model32 = small_model(name).float()
    g = crystal(seed=4)
    ref = evaluate(model64, g)
    out = evaluate(model32, g.to(dtype=torch.float32))
    assert out[K.ENERGY].dtype == torch.float32
    assert out[K.FORCES].dtype == torch.float32
    torch.testing.assert_close(out[K.ENERGY].double(), ref[K.ENERGY], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[K.FORCES].double(), ref[K.FORCES], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_energy_scale_shift_and_e0(name):
    model = small_model(name)
    g = crystal(seed=5)
    out = evaluate(model, g, forces=True, stress=False)
    model.set_statistics(e0={29: 10.0, 79: -20.0}, scale=3.4, shift=-0.2)
    new = evaluate(model, g, forces=True, stress=False)
    e0_old = torch.tensor([E0[int(z)] for z in g.numbers], dtype=torch.float64)
    e0_new = torch.tensor([{29: 10.0, 79: -20.0}[int(z)] for z in g.numbers], dtype=torch.float64)
    learned = (out[K.ENERGIES] - 0.3 - e0_old) / 1.7
    torch.testing.assert_close(new[K.ENERGIES], 3.4 * learned - 0.2 + e0_new)
    torch.testing.assert_close(new[K.FORCES], out[K.FORCES] * (3.4 / 1.7))
    assert model.e0 == {29: 10.0, 79: -20.0}


class _Recorder(SyncPoint):
    def __init__(self, factor=1.0):
        super().__init__()
        self.factor = factor
        self.shapes = []

    def forward(self, features, graph):
        self.shapes.append(tuple(features.shape))
        return features * self.factor


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_sync_points_present_identity_and_swappable(name):
    model = small_model(name, num_interactions=3)
    names = [n for n, _ in model.sync_points]
    assert names == ["sync.0", "sync.1"]
    assert all(type(m) is SyncPoint for _, m in model.sync_points)
    assert dict(model.named_modules())["sync.1"] is model.sync_points[1][1]
    g = crystal(seed=6)
    ref = evaluate(model, g)
    rec = _Recorder()
    model.set_sync_point("sync.1", rec)
    same = evaluate(model, g)
    width = 16 if name == "schnet" else 4 * 16  # PaiNN packs scalars and vectors
    assert rec.shapes == [(g.n_atoms, width)]
    torch.testing.assert_close(same[K.ENERGY], ref[K.ENERGY], rtol=0, atol=0)
    model.set_sync_point("sync.0", _Recorder(factor=1.5))
    changed = evaluate(model, g)
    assert (changed[K.ENERGY] - ref[K.ENERGY]).abs().max() > 1e-6
    with pytest.raises(InputError, match="sync.7"):
        model.set_sync_point("sync.7", SyncPoint())


def test_defaults_hparams_and_bad_options():
    schnet = build("schnet", species=SPECIES, cutoff=5.0)
    painn = build("painn", species=SPECIES, cutoff=5.0)
    assert sum(p.numel() for p in schnet.parameters()) == 225_921  # as documented
    assert sum(p.numel() for p in painn.parameters()) == 576_513
    for m in (schnet, painn):
        assert m.cutoff == 5.0 and m.num_interactions == 3 and m.species == SPECIES
        assert m.receptive_field == 15.0
        rebuilt = build(type(m).__name__.lower(), **m.hparams)
        assert rebuilt.hparams == m.hparams
    with pytest.raises(InputError, match="radial basis"):
        build("schnet", species=SPECIES, radial_basis="fourier")
    with pytest.raises(InputError, match="cutoff envelope"):
        build("painn", species=SPECIES, cutoff_fn="step")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_cuda_matches_cpu(name):
    model = small_model(name)
    g = crystal(seed=7)
    ref = evaluate(model, g)
    out = evaluate(model.cuda(), g.to(device="cuda"))
    torch.testing.assert_close(out[K.FORCES].cpu(), ref[K.FORCES])
