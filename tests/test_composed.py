"""``Sum``: terms add up (energies, forces, stress), per-term cutoff filtering is exact, save /
load, delta learning with frozen terms, ``xnn md`` with a model file plus D3."""

from __future__ import annotations

import csv

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk, molecule

from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.errors import InputError
from xnn.models import AtomisticModel, Potential, Sum, build
from xnn.models.serialization import load_model, save_model

# one entry per term kind: add a new term (e.g. ewald) here and to COMBOS
TERMS = {
    "lj": {"name": "lj", "sigma": 2.3, "epsilon": 0.05, "cutoff": 6.0},
    "morse": {"name": "morse", "D": 0.3, "alpha": 1.3, "r0": 2.6, "cutoff": 4.5},
    "d3": {"name": "d3", "functional": "pbe", "cutoff": 7.5, "cn_cutoff": 5.0},
}
COMBOS = [("lj", "morse"), ("lj", "d3"), ("morse", "d3", "lj")]


def structures():
    cu = bulk("Cu", "fcc", a=3.6, cubic=True)
    cu.rattle(0.05, seed=0)
    mol = molecule("CH3CH2OH")
    mol.rattle(0.02, seed=1)
    slab = bulk("Cu", "fcc", a=3.6, cubic=True) * (1, 1, 2)
    slab.rattle(0.05, seed=2)
    slab.pbc = (True, True, False)
    return from_ase([cu, mol, slab], dtype=torch.float64)


def assert_rel(a, b, rel=1e-12, what=""):
    a, b = a.detach().numpy(), b.detach().numpy()
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)
    assert err <= rel, f"{what}: {err:.2e}"


@pytest.mark.parametrize("combo", COMBOS)
def test_sum_equals_terms_one_by_one(combo):
    graph = structures()
    alone = [Potential(build(**TERMS[k]))(graph) for k in combo]
    model = Sum([dict(TERMS[k]) for k in combo])
    assert model.cutoff == max(TERMS[k]["cutoff"] for k in combo)
    for skin in (0.0, 0.7):  # a Verlet skin adds edges beyond every cutoff
        out = Potential(model, skin=skin)(graph)
        for key in (K.ENERGY, K.ENERGIES, K.FORCES, K.STRESS, K.VIRIAL):
            assert_rel(out[key], sum(r[key] for r in alone), what=f"{combo} {key} skin={skin}")


class EdgeCounter(AtomisticModel):
    """Counts every edge it is given (it ignores its own cutoff, unlike a real model)."""

    def __init__(self, cutoff: float):
        super().__init__()
        self.cutoff = cutoff

    def forward(self, graph):
        i = graph.edge_index[1]
        ones = torch.ones(i.shape[0], dtype=graph.positions.dtype)
        return torch.zeros(graph.n_atoms, dtype=graph.positions.dtype).index_add(0, i, ones)


def test_each_term_gets_only_edges_within_its_cutoff():
    graph = structures()
    counter = EdgeCounter(3.0)
    own = Potential(counter)(graph, forces=False, stress=False)[K.ENERGIES]
    model = Sum([counter, build(**TERMS["lj"])])
    lj = Potential(build(**TERMS["lj"]))(graph, forces=False, stress=False)[K.ENERGIES]
    both = Potential(model, skin=0.5)(graph, forces=False, stress=False)[K.ENERGIES]
    assert own.sum() > 0 and torch.equal(both - lj, own)


def test_save_load_round_trip_and_frozen_terms(tmp_path):
    torch.manual_seed(0)
    specs = [dict(TERMS["d3"]), {"name": "schnet", "species": [1, 6, 8, 29], "cutoff": 4.0,
                                 "num_features": 8, "num_filters": 8, "num_interactions": 2,
                                 "num_basis": 8, "trainable": False},
             {"name": "schnet", "species": [1, 6, 8, 29], "cutoff": 3.0, "num_features": 8,
              "num_filters": 8, "num_interactions": 1, "num_basis": 8}]
    model = Sum(specs).double()
    assert model.trainable == [True, False, True] and model.num_interactions == 2
    assert model.species == [1, 6, 8, 29]
    assert not any(p.requires_grad for p in model.terms[1].parameters())
    assert all(p.requires_grad for p in model.terms[2].parameters())
    graph = structures()
    ref = Potential(model)(graph)
    save_model(model, tmp_path / "sum.pt")
    back = load_model(tmp_path / "sum.pt")
    assert back.trainable == [True, False, True]
    assert not any(p.requires_grad for p in back.terms[1].parameters())
    out = Potential(back)(graph)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert torch.equal(out[key], ref[key]), key
    # a model file as a term (stored by value when the sum is saved)
    save_model(build(**TERMS["lj"]), tmp_path / "lj.pt")
    from_file = Sum([{"model_file": str(tmp_path / "lj.pt")}, dict(TERMS["morse"])])
    direct = Sum([dict(TERMS["lj"]), dict(TERMS["morse"])])
    assert torch.equal(Potential(from_file)(graph)[K.FORCES], Potential(direct)(graph)[K.FORCES])


def test_bad_terms():
    with pytest.raises(InputError, match="non-empty"):
        Sum([])
    with pytest.raises(InputError, match="exactly one"):
        Sum([{"sigma": 1.0}])
    with pytest.raises(InputError, match="no hyperparameter"):
        Sum([{"name": "d3", "bogus": 1}])
    with pytest.raises(InputError, match="trainable has 1 flags"):
        Sum([dict(TERMS["lj"]), dict(TERMS["d3"])], trainable=[True])


def test_delta_learning_trains_only_the_free_term(tmp_path):
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.data.emt import write_emt
    from xnn.training.checkpoint import load_checkpoint

    write_emt(tmp_path / "cu.xyz", 12, ["Cu"], seed=0)
    torch.manual_seed(1)
    fixed = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8)
    save_model(fixed, tmp_path / "fixed.pt")
    terms = (f"[{{name: d3, functional: pbe, cn_cutoff: 3.0}}, "
             f"{{model_file: {tmp_path / 'fixed.pt'}, trainable: false}}, "
             "{name: schnet, num_features: 8, num_filters: 8, num_interactions: 1, "
             "num_basis: 8}]")
    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={tmp_path / 'cu.xyz'}", f"output_dir={tmp_path / 'run'}",
        "model.name=sum", "model.cutoff=3.0", f"model.hyperparameters.terms={terms}",
        "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=4", "optim.lr=2e-2",
        "logging.plots=false", "logging.progress_bar=false"])
    train(cfg)
    model = load_model(tmp_path / "run" / "model.pt")
    assert isinstance(model, Sum) and model.trainable == [True, False, True]
    assert model.terms[0].cutoff == 3.0  # model.cutoff reached the term that set none
    for k, v in fixed.state_dict().items():
        assert torch.equal(model.terms[1].state_dict()[k].to(v.dtype), v), k
    hist = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["progress"]["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    trained = model.terms[2].state_dict()
    fresh = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8).state_dict()
    assert any(not torch.equal(trained[k].to(v.dtype), v) for k, v in fresh.items()
               if v.is_floating_point() and v.numel() > 1)


def test_xnn_md_with_a_model_file_plus_d3(tmp_path):
    from xnn.cli.main import main

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * (2, 2, 2)
    atoms.rattle(0.02, seed=0)
    ase.io.write(tmp_path / "cu.xyz", atoms)
    save_model(build(**TERMS["lj"]), tmp_path / "lj.pt")
    out = tmp_path / "md"
    rc = main(["md", f"structure={tmp_path / 'cu.xyz'}", f"output.dir={out}",
               "model.name=sum",
               f"model.hyperparameters={{terms: [{{model_file: {tmp_path / 'lj.pt'}}}, "
               "{name: d3, functional: pbe, cutoff: 7.5, cn_cutoff: 5.0}]}",
               "ensemble=nve", "steps=3", "temperature=50", "output.plot=false",
               "output.progress=false", "output.log_every=1"])
    assert rc == 0
    rows = list(csv.DictReader(open(out / "thermo.csv")))
    graph = from_ase([ase.io.read(tmp_path / "cu.xyz")], dtype=torch.float64)
    expected = sum(float(Potential(build(**TERMS[k]))(graph, stress=False)[K.ENERGY][0])
                   for k in ("lj", "d3"))
    d3_only = float(Potential(build(**TERMS["d3"]))(graph, stress=False)[K.ENERGY][0])
    assert abs(d3_only) > 0.1
    assert float(rows[0]["epot_eV"]) == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("coulomb", ["ewald", "pme"])
def test_lj_plus_coulomb_is_additive(coulomb):
    """LJ + Ewald/PME on rock salt: energies, forces and stress are the sums of the terms'."""
    nacl = bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    nacl.rattle(0.1, seed=3)
    nacl.set_cell(nacl.cell.array @ np.array([[1.0, 0.03, 0.0], [0.0, 1.0, 0.02],
                                              [0.0, 0.0, 0.98]]), scale_atoms=True)
    graph = from_ase([nacl], dtype=torch.float64)
    lj = {"name": "lj", "sigma": 2.6, "epsilon": 0.01, "cutoff": 6.0}
    coul = {"name": coulomb, "cutoff": 5.0, "accuracy": 1e-7,
            "charges": {"Na": 1.0, "Cl": -1.0}}
    if coulomb == "pme":
        coul["interpolation_nodes"] = 5
    alone = [Potential(build(**t))(graph) for t in (lj, coul)]
    out = Potential(Sum([dict(lj), dict(coul)]), skin=0.5)(graph)
    assert abs(float(alone[1][K.ENERGY])) > 1.0  # the Coulomb term is not negligible
    for key in (K.ENERGY, K.ENERGIES, K.FORCES, K.STRESS, K.VIRIAL):
        assert_rel(out[key], alone[0][key] + alone[1][key], what=f"lj+{coulomb} {key}")


def test_delta_learning_statistics_are_those_of_the_residual():
    """E0, shift and scale of a sum with a fixed d3 term are fitted to labels minus d3: with
    labels = d3 + 0.5 eV/atom, E0 is 0.5 eV, the shift 0 and the residual forces vanish."""
    from xnn.app.train_model import data_statistics
    from xnn.config.train import ModelConfig

    d3 = {"name": "d3", "functional": "pbe", "cutoff": 5.0, "cn_cutoff": 3.0}
    pot = Potential(build(**d3))
    graphs = []
    for k, reps in enumerate([(1, 1, 1), (2, 1, 1), (1, 2, 2)]):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True) * reps
        atoms.rattle(0.1, seed=k)
        g = from_ase([atoms], dtype=torch.float64)
        out = pot(g, stress=False)
        graphs.append(g.replace(energy=out[K.ENERGY] + 0.5 * g.n_atoms, forces=out[K.FORCES]))
    assert max(float(g.forces.abs().max()) for g in graphs) > 1e-3  # d3 forces are not 0
    terms = [dict(d3, trainable=False),
             {"name": "schnet", "num_features": 8, "num_filters": 8, "num_basis": 8}]
    cfg = ModelConfig(name="sum", cutoff=5.0, hyperparameters={"terms": terms})
    stats = data_statistics(cfg, [29], graphs)
    assert stats["e0"][29] == pytest.approx(0.5, abs=1e-10)
    assert stats["shift"] == pytest.approx(0.0, abs=1e-10)
    assert stats["scale"] == 1.0  # residual force RMS below 1e-8: no scaling
    plain = data_statistics(ModelConfig(name="sum", cutoff=5.0, hyperparameters={
        "terms": [dict(d3), terms[1]]}), [29], graphs)
    assert abs(plain["e0"][29] - 0.5) > 1e-3  # a trainable d3 leaves the labels as they are


def test_sum_with_an_external_wrapper_saves_and_loads(tmp_path):
    """MACE + D3 (frozen): saved term by term as plain data (no hparams for the wrapper),
    loaded with the same energies, forces and stress and the same trainable flags."""
    from xnn.models.external._optional import MissingExtraError, import_extra

    try:
        import_extra("mace", "mace.modules")
    except MissingExtraError as err:
        pytest.skip(str(err))
    from helpers import mace_model as _mace_model
    from helpers import si_cu_molecule as _molecule
    from helpers import si_cu_periodic as _periodic
    model = Sum([build("mace", model=_mace_model(4)),
                 {"name": "d3", "functional": "pbe", "cutoff": 5.0, "cn_cutoff": 3.0,
                  "trainable": False}])
    graph = from_ase([_periodic(), _molecule()], dtype=torch.float64)
    ref = Potential(model)(graph)
    path = save_model(model, tmp_path / "mace_d3.pt")
    assert torch.load(path, weights_only=True)["kind"] == "xnn-sum-terms"
    back = load_model(path)
    assert back.trainable == [True, False] and type(back.terms[0]) is type(model.terms[0])
    out = Potential(back)(graph)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        assert torch.equal(out[key], ref[key]), key
    with pytest.raises(InputError, match="xnn.save_model"):
        model.hparams  # noqa: B018 - what checkpoints read: refused with what to do
