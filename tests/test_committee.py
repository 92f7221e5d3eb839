"""Committees: members equal the models alone (bitwise), means and spreads as documented, one
model file with its calibration, the ASE calculator's uncertainties, MD on the mean."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase.stress import full_3x3_to_voigt_6_stress
from helpers.models import SMALL
from helpers.structures import fcc, graph

import xnn
from xnn.data import keys as K
from xnn.errors import InputError, ModelFileError
from xnn.models import Potential, build
from xnn.models.committee import Committee
from xnn.models.derivatives import compute_properties
from xnn.models.serialization import load_model, save_model
from xnn.neighbors import with_edges

SEEDS = [5, 6, 7]


def spec(name: str) -> dict:
    return {"name": name, "species": [29], "cutoff": 3.0, "num_interactions": 2,
            **SMALL[name]}


def alone(name: str, seed: int) -> torch.nn.Module:
    """The member built alone: ``build`` right after ``torch.manual_seed(seed)``."""
    hp = spec(name)
    torch.manual_seed(seed)
    return build(hp.pop("name"), **hp).double()


def cu_graphs(cutoff=3.0):
    """Two rattled FCC Cu cells (one of 32 atoms, one of 4), batched, fp64, with edges."""
    from xnn.data.graph import AtomicGraph

    big, small = graph(fcc((2, 2, 2), rattle=0.1)), graph(fcc((1, 1, 1), rattle=0.1, seed=3))
    return with_edges(AtomicGraph.concat([big, small]), cutoff, backend="brute")


@pytest.mark.parametrize("name", ["schnet", "equivariant"])
def test_members_equal_models_alone_and_spread_as_documented(name):
    committee = Committee(spec(name), size=3, seeds=SEEDS).double()
    assert committee.committee_size == 3 and alone(name, 0).committee_size == 1
    g = cu_graphs()
    out = compute_properties(committee, g)
    for k, seed in enumerate(SEEDS):  # each member's results are those of the model alone
        ref = compute_properties(alone(name, seed), g)
        for key, members in [(K.ENERGY, K.ENERGY_MEMBERS), (K.ENERGIES, K.ENERGIES_MEMBERS),
                             (K.FORCES, K.FORCES_MEMBERS), (K.STRESS, K.STRESS_MEMBERS),
                             (K.VIRIAL, K.VIRIAL_MEMBERS)]:
            assert torch.equal(out[members][k], ref[key]), (key, k)
    f = out[K.FORCES_MEMBERS].numpy()
    assert np.abs(f[0] - f[1]).max() > 1e-3  # independent members
    # means and population spreads, computed here with numpy
    np.testing.assert_allclose(out[K.FORCES].numpy(), f.mean(0), rtol=0, atol=1e-14)
    per_atom = np.sqrt(((f - f.mean(0)) ** 2).sum(-1).mean(0))
    np.testing.assert_allclose(out[K.FORCES_STD].numpy(), per_atom, rtol=1e-12, atol=0)
    np.testing.assert_allclose(out[K.FORCES_STD].numpy(),
                               np.linalg.norm(f.std(0), axis=-1), rtol=1e-12)
    e = out[K.ENERGY_MEMBERS].numpy()
    assert out[K.ENERGY_STD].shape == (2,)
    np.testing.assert_allclose(out[K.ENERGY_STD].numpy(), e.std(0), rtol=1e-12)
    np.testing.assert_allclose(out[K.ENERGY].numpy(), e.mean(0), rtol=1e-14)
    s = out[K.STRESS_MEMBERS].numpy()
    np.testing.assert_allclose(out[K.STRESS_STD].numpy(), s.std(0), rtol=1e-12, atol=1e-300)
    # the model's own forward (used by whatever calls a model directly) is the mean energy
    assert torch.allclose(committee(g), out[K.ENERGIES], rtol=0, atol=1e-13)


def test_training_graph_reaches_every_member():
    committee = Committee(spec("schnet"), size=2, seeds=[0, 1]).double()
    out = compute_properties(committee, cu_graphs(), training=True)
    loss = out[K.FORCES_MEMBERS].square().sum() + out[K.ENERGY_MEMBERS].square().sum()
    loss.backward()
    for m in committee.members:
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        assert len(grads) > 3 and sum(float(g.abs().sum()) for g in grads) > 0
    # double backward equals each member's own
    torch.manual_seed(0)
    ref = alone("schnet", 1)
    ref_out = compute_properties(ref, cu_graphs(), training=True)
    (ref_out[K.FORCES].square().sum() + ref_out[K.ENERGY].square().sum()).backward()
    for (n, p), (_, q) in zip(committee.members[1].named_parameters(),
                              ref.named_parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n


def test_model_file_holds_members_and_calibration(tmp_path):
    committee = Committee(spec("equivariant"), size=3, seeds=SEEDS).double()
    g = cu_graphs()
    raw = compute_properties(committee, g)
    committee.set_calibration({"forces": 2.0, "energy": 0.5})
    assert committee.calibration == {"energy": 0.5, "forces": 2.0, "stress": 1.0}
    path = save_model(committee, tmp_path / "committee.pt")
    loaded = load_model(path)
    assert isinstance(loaded, Committee) and loaded.committee_size == 3
    assert loaded.calibration == committee.calibration and loaded.seeds == SEEDS
    out = compute_properties(loaded, g)
    assert torch.equal(out[K.FORCES_MEMBERS], raw[K.FORCES_MEMBERS])
    assert torch.equal(out[K.FORCES], raw[K.FORCES])
    assert torch.allclose(out[K.FORCES_STD], 2.0 * raw[K.FORCES_STD], rtol=1e-15, atol=0)
    assert torch.allclose(out[K.ENERGY_STD], 0.5 * raw[K.ENERGY_STD], rtol=1e-15, atol=0)
    assert torch.equal(out[K.STRESS_STD], raw[K.STRESS_STD])


def test_committee_of_given_models_and_bad_inputs(tmp_path):
    models = [alone("schnet", s) for s in SEEDS]
    committee = Committee(models)
    assert committee.seeds is None and committee.hparams["member"]["name"] == "schnet"
    loaded = load_model(save_model(committee, tmp_path / "c.pt"))
    g = cu_graphs()
    assert torch.equal(compute_properties(loaded, g)[K.FORCES_MEMBERS],
                       compute_properties(committee, g)[K.FORCES_MEMBERS])
    with pytest.raises(InputError, match="size=1 must be an integer >= 2"):
        Committee(spec("schnet"), size=1)
    with pytest.raises(InputError, match="at least 2 members"):
        Committee(models[:1])
    with pytest.raises(InputError, match="members are of one kind"):
        Committee([models[0], build("lj", sigma=2.3, epsilon=0.4, cutoff=3.0).double()])
    with pytest.raises(InputError, match="seeds=\\[1, 1\\] must be 2 distinct"):
        Committee(spec("schnet"), size=2, seeds=[1, 1])
    with pytest.raises(InputError, match="no property 'virial'"):
        Committee(spec("schnet"), calibration={"virial": 2.0})
    with pytest.raises(InputError, match="finite number > 0"):
        committee.set_calibration({"forces": 0.0})
    with pytest.raises(InputError, match="cannot itself be a committee"):
        Committee({"name": "committee", "member": spec("schnet")})
    bad = tmp_path / "bad.pt"
    payload = torch.load(tmp_path / "c.pt", weights_only=True)
    payload["hparams"]["calibration"] = {"forces": -1.0}
    torch.save(payload, bad)
    with pytest.raises(ModelFileError, match="finite number > 0"):
        load_model(bad)


def test_sync_points_named_per_member():
    committee = Committee(spec("equivariant"), size=2, seeds=[0, 1])
    names = [n for n, _ in committee.sync_points]
    assert names == ["members.0.sync.0", "members.1.sync.0"]
    point = torch.nn.Identity()
    committee.set_sync_point("members.1.sync.0", point)
    assert committee.members[1].sync[0] is point
    assert dict(committee.named_modules())["members.1.sync.0"] is point


def test_calculator_gives_calibrated_spread_and_members():
    committee = Committee(spec("schnet"), size=3, seeds=SEEDS,
                          calibration={"forces": 1.5, "stress": 3.0}).double()
    atoms = fcc((2, 2, 2), rattle=0.1)
    atoms.calc = xnn.Calculator(committee, device="cpu")
    forces = atoms.get_forces()
    res = atoms.calc.results
    assert atoms.calc.n_model_calls == 1
    g = with_edges(graph(atoms), 3.0, backend="brute")
    out = compute_properties(committee, g)
    np.testing.assert_allclose(forces, out[K.FORCES].numpy(), atol=1e-13, rtol=0)
    np.testing.assert_allclose(res["forces_std"], out[K.FORCES_STD].numpy(), rtol=1e-12)
    f = res["forces_members"]
    assert f.shape == (3, len(atoms), 3)
    np.testing.assert_allclose(res["forces_std"],
                               1.5 * np.sqrt(((f - f.mean(0)) ** 2).sum(-1).mean(0)),
                               rtol=1e-12)
    assert res["energy_members"].shape == (3,) and res["energies_members"].shape == (3, 32)
    assert res["energy_std"] == pytest.approx(float(np.std(res["energy_members"])), rel=1e-12)
    stress = res["stress_members"]
    assert stress.shape == (3, 6)
    np.testing.assert_allclose(res["stress_std"], 3.0 * stress.std(0), rtol=1e-12)
    np.testing.assert_allclose(res["stress_std"],
                               full_3x3_to_voigt_6_stress(out[K.STRESS_STD][0].numpy()),
                               rtol=1e-12)
    assert atoms.calc.get_property("forces_std").shape == (len(atoms),)
    # a single model's calculator has none of them
    single = fcc((1, 1, 1))
    single.calc = xnn.Calculator(alone("schnet", 0), device="cpu")
    single.get_forces()
    assert "forces_std" not in single.calc.results
    assert "forces_std" not in single.calc.implemented_properties


def test_md_runs_a_committee_on_its_mean():
    """A ``Potential`` (what MD, relax and the integrators call) evaluates the mean."""
    committee = Committee(spec("schnet"), size=2, seeds=[0, 1]).double()
    g = graph(fcc((2, 2, 2), rattle=0.1))
    out = Potential(committee, skin=0.5)(g)
    ref = compute_properties(committee, with_edges(g, 3.0, backend="brute"))
    for key in (K.ENERGY, K.FORCES, K.STRESS, K.FORCES_STD):
        torch.testing.assert_close(out[key], ref[key], rtol=1e-12, atol=1e-13)


def test_model_contracts_hold_for_the_mean():
    """The mean forces and stress are the derivatives of the mean energy (finite
    differences), batches equal systems alone, the ASE calculator equals the potential."""
    from xnn.testing import (
        check_ase_calculator,
        check_batch_consistency,
        check_forces_finite_difference,
        check_stress_finite_difference,
    )

    committee = Committee(spec("schnet"), size=2, seeds=[0, 1]).double()
    g = graph(fcc((1, 1, 1), rattle=0.15, seed=4))
    check_forces_finite_difference(committee, g)
    check_stress_finite_difference(committee, g)
    check_batch_consistency(committee, g)
    check_ase_calculator(committee)


def test_energy_only_and_members_without_derivatives():
    committee = Committee(spec("schnet"), size=3, seeds=SEEDS).double()
    g = cu_graphs()
    out = compute_properties(committee, g, forces=False, stress=False)
    assert set(out) == {K.ENERGY, K.ENERGIES, K.ENERGY_MEMBERS, K.ENERGIES_MEMBERS,
                        K.ENERGY_STD}
    full = compute_properties(committee, g)
    assert torch.equal(out[K.ENERGY_MEMBERS], full[K.ENERGY_MEMBERS])
    forces_only = compute_properties(committee, g, stress=False)
    assert torch.equal(forces_only[K.FORCES_MEMBERS], full[K.FORCES_MEMBERS])
    assert K.STRESS_STD not in forces_only
