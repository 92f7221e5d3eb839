"""Training committees: K members trained in one run equal K models trained alone (same seeds,
same bootstrap weights), bootstrap resamples, calibration, ``xnn train committee.size=K`` and
``xnn eval`` of a committee."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.models import SMALL
from helpers.training import CUTOFF, counts, labelled_structures, specs, train_small

from xnn import Calculator
from xnn.data import keys as K
from xnn.models import build
from xnn.models.committee import Committee
from xnn.training.committee import (
    bootstrap_weights,
    calibration_factor,
    fit_calibration,
)
from xnn.training.ema import EMA
from xnn.training.trainer import Trainer

SEEDS = [5, 6, 7]
#: three optimizer steps: the structures of each global batch
STEPS = [[0, 1], [2, 3], [3, 0, 1]]


def spec(name: str) -> dict:
    return {"name": name, "species": [29], "cutoff": CUTOFF, "num_interactions": 2,
            **SMALL[name]}


def alone(name: str, seed: int) -> torch.nn.Module:
    hp = spec(name)
    torch.manual_seed(seed)
    return build(hp.pop("name"), **hp).double()


def adam_trainer(model, clip: float) -> Trainer:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return Trainer(model, specs(), opt, ema=EMA(model, 0.9), dtype=torch.float64,
                   grad_clip=clip)


def run_steps(trainer: Trainer, graphs: list) -> list[float]:
    losses = []
    for step, idx in enumerate(STEPS):
        batch = [graphs[i] for i in idx]
        losses.append(trainer.train_step(batch, step, counts=counts(batch)))
    return losses


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


@pytest.mark.parametrize("name", ["schnet", pytest.param("equivariant",
                                                           marks=pytest.mark.slow)])
def test_committee_equals_members_trained_alone_with_bootstrap(name):
    """The must-show: 3 Adam steps (per-member clipping that bites, EMA) of a committee with
    bootstrap weights equal, to 1e-10 in fp64, each member trained alone with the structure
    weights times its bootstrap counts; the members differ."""
    graphs = labelled_structures()  # periodic, slab, molecule, periodic; weights 1.5/1/0.7
    boot = bootstrap_weights(len(graphs), len(SEEDS), seed=11)
    assert (boot == 0).any() and (boot.sum(0) == len(graphs)).all()  # a real resample
    committee = Committee(spec(name), size=3, seeds=SEEDS).double()
    trainer = adam_trainer(committee, clip=0.05)
    with_boot = [g.replace({K.MEMBER_WEIGHT: torch.tensor(boot[i:i + 1])})
                 for i, g in enumerate(graphs)]
    losses = run_steps(trainer, with_boot)
    member_losses = []
    for k, seed in enumerate(SEEDS):
        model = alone(name, seed)
        single = adam_trainer(model, clip=0.05)
        weighted = [g.replace({K.WEIGHT: g[K.WEIGHT] * float(boot[i, k])})
                    for i, g in enumerate(graphs)]
        member_losses.append(run_steps(single, weighted))
        mine = committee.members[k]
        ref, got = flat(model.parameters()), flat(mine.parameters())
        assert float((got - ref).abs().max()) <= 1e-10 * float(ref.abs().max()), k
        shadow = [trainer.ema.shadow[f"members.{k}.{n}"] for n, _ in model.named_parameters()]
        assert torch.allclose(flat(shadow), flat(single.ema.shadow.values()), rtol=0,
                              atol=1e-10)
    np.testing.assert_allclose(losses, np.sum(member_losses, 0), rtol=1e-10)
    w = [flat(m.parameters()) for m in committee.members]
    assert float((w[0] - w[1]).abs().max()) > 1e-2 and float((w[1] - w[2]).abs().max()) > 1e-2


def test_clipping_is_per_member():
    """A member whose gradient is clipped does not shrink another member's step: clipping
    the committee as one vector would (the step equals the members' alone, above)."""
    graphs = labelled_structures()
    committee = Committee(spec("schnet"), size=2, seeds=[0, 1]).double()
    trainer = adam_trainer(committee, clip=1e-3)
    trainer.optimizer = torch.optim.SGD(committee.parameters(), lr=1.0)
    before = [flat(m.parameters()).clone() for m in committee.members]
    trainer.train_step(graphs[:2], 0, counts=counts(graphs[:2]))
    for m, b in zip(committee.members, before):  # SGD: each member's step has norm = clip
        assert float((flat(m.parameters()) - b).norm()) == pytest.approx(1e-3, rel=1e-4)


def test_bootstrap_weights_are_seeded_resamples():
    a, b = bootstrap_weights(50, 4, seed=3), bootstrap_weights(50, 4, seed=3)
    assert np.array_equal(a, b) and a.shape == (50, 4)
    assert (a.sum(0) == 50).all() and np.all(a == np.round(a))
    assert not np.array_equal(a[:, 0], a[:, 1])
    assert not np.array_equal(a, bootstrap_weights(50, 4, seed=4))
    # about 1/e of the structures are left out of each resample
    assert 0.2 < float((a == 0).mean()) < 0.5


def test_calibration_factor_matches_mean_squared_error():
    rng = np.random.default_rng(0)
    std = rng.uniform(0.01, 0.1, 20000)
    err = np.abs(rng.normal(0.0, 2.5 * std))  # errors 2.5 times the predicted spread
    c = calibration_factor(err, std)
    assert np.mean(err ** 2) == pytest.approx(np.mean((c * std) ** 2), rel=1e-12)
    assert c == pytest.approx(2.5, rel=0.03)
    rows = np.stack([err, std], -1)
    assert fit_calibration({"forces_uncertainty": rows}) == {"forces": c}
    assert calibration_factor(np.zeros(0), np.zeros(0)) is None


# --------------------------------------------------------------------------- xnn train / eval
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from xnn.data.emt import write_emt

    d = tmp_path_factory.mktemp("committee")
    write_emt(d / "train.xyz", 9, ["Cu"], seed=0)
    write_emt(d / "val.xyz", 6, ["Cu"], seed=1)
    out = {"data": d}
    out["committee"] = train_small(d / "committee", d, "committee.size=2", "committee.seeds=[3, 4]")
    for seed in (3, 4):
        train_small(d / f"single{seed}", d, f"seed={seed}", "logging.plots=false")
    return out


def test_train_committee_equals_single_runs_of_its_seeds(runs):
    from xnn.models.serialization import load_model

    d = runs["data"]
    committee = load_model(d / "committee" / "model.pt")
    assert isinstance(committee, Committee) and committee.seeds == [3, 4]
    for k, seed in enumerate((3, 4)):
        single = load_model(d / f"single{seed}" / "model.pt")
        ref, got = flat(single.parameters()), flat(committee.members[k].parameters())
        assert float((got - ref).abs().max()) <= 1e-10 * float(ref.abs().max()), seed
    w = [flat(m.parameters()) for m in committee.members]
    assert float((w[0] - w[1]).abs().max()) > 1e-2


def test_train_committee_calibrates_on_validation(runs):
    from xnn.models.serialization import load_model

    d = runs["data"]
    summary = json.loads((d / "committee" / "summary.json").read_text())
    record = summary["committee"]
    model = load_model(d / "committee" / "model.pt")
    assert record["size"] == 2 and record["calibrated_on"] == "val"
    assert record["calibration"] == model.calibration
    assert all(c > 0 and c != 1.0 for c in model.calibration.values())
    for prop in ("energy", "forces", "stress"):  # calibrated: RMS std = RMS error on val
        u = record["val_uncertainty"][prop]
        assert u["std_rms"] == pytest.approx(u["error_rms"], rel=1e-9)
    assert (d / "committee" / "calibration_val.png").stat().st_size > 1000
    assert str(d / "committee" / "calibration_val.png") in summary["plots"]


def test_eval_committee_reports_uncertainty_and_plots(runs, capsys):
    from xnn.cli.main import main

    d = runs["data"]
    model = d / "committee" / "model.pt"
    assert main(["eval", str(model), str(d / "val.xyz"), "--device", "cpu",
                 "--json", str(d / "eval.json"), "--plot", str(d / "parity_val.png")]) == 0
    printed = capsys.readouterr().out
    assert "calibration plot:" in printed and "uncertainty" in printed
    metrics = json.loads((d / "eval.json").read_text())
    summary = json.loads((d / "committee" / "summary.json").read_text())["committee"]
    for prop in ("energy", "forces", "stress"):
        assert metrics[f"{prop}_calibration"] == summary["calibration"][prop]
        # the data it was calibrated on: the calibrated spread matches the error
        assert metrics[f"{prop}_uncertainty_ratio"] == pytest.approx(1.0, rel=1e-8)
        assert metrics[f"{prop}_std_rms"] == pytest.approx(
            summary["val_uncertainty"][prop]["std_rms"], rel=1e-8)
    assert (d / "calibration_val.png").stat().st_size > 1000


def test_metrics_csv_has_the_validation_spread_and_the_plot_shows_it(runs):
    """``metrics.csv`` of a committee run: per epoch the mean validation force std (as the
    committee predicts it), the factor calibrating it on the validation set and the
    calibrated mean; equal to the final model evaluated here (one epoch: the model of the
    last row) and to the calibration ``xnn train`` stored. A single run has none."""
    import csv

    import ase.io

    from xnn.models.serialization import load_model
    from xnn.plotting import learning_figure
    from xnn.training.committee import calibration_factor

    d = runs["data"]
    with open(d / "committee" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    cols = ("val_forces_std_mean", "val_forces_calibration", "val_forces_std_calibrated_mean")
    assert set(cols) <= set(rows[0]) and len(rows) == 1
    header = list(rows[0])
    assert header.index("val_forces_mae") < header.index("val_forces_std_mean")
    last = {k: float(rows[-1][k]) for k in cols}
    # the final committee, uncalibrated, on the validation structures
    model = load_model(d / "committee" / "model.pt")
    stored = model.calibration["forces"]
    model.set_calibration({"forces": 1.0})
    calc = Calculator(model)
    err, std = [], []
    for atoms in ase.io.read(d / "val.xyz", ":"):
        ref = atoms.get_forces()
        atoms.calc = calc
        err.append(np.linalg.norm(atoms.get_forces() - ref, axis=1))
        std.append(calc.results["forces_std"])
    err, std = np.concatenate(err), np.concatenate(std)
    assert last["val_forces_std_mean"] == pytest.approx(1000 * std.mean(), rel=1e-9)
    c = calibration_factor(err, std)
    assert last["val_forces_calibration"] == pytest.approx(c, rel=1e-9)
    assert last["val_forces_calibration"] == pytest.approx(stored, rel=1e-9)
    assert last["val_forces_std_calibrated_mean"] == pytest.approx(1000 * c * std.mean(),
                                                                  rel=1e-9)
    with open(d / "single3" / "metrics.csv", newline="") as fh:
        assert not set(cols) & set(next(csv.DictReader(fh)))
    history = [{k: float(v) for k, v in r.items() if v} for r in rows]
    labels = learning_figure(history).axes[2].get_legend_handles_labels()[1]
    assert labels == ["train", "validation", "validation mean force std",
                      "validation mean force std, calibrated"]


def test_resumed_committee_equals_the_uninterrupted_run(runs):
    """Stopped after 2 of its 3 steps (mid-epoch) and resumed: the same committee, the same
    calibration (bootstrap weights and member seeds are functions of the config)."""
    from xnn.models.serialization import load_model

    d = runs["data"]
    args = ("committee.size=2", "committee.seeds=[3, 4]", "logging.plots=false")
    train_small(d / "resumed", d, *args, "max_steps=2")
    train_small(d / "resumed", d, *args, "max_steps=3", "resume=auto")
    ref = load_model(d / "committee" / "model.pt")
    got = load_model(d / "resumed" / "model.pt")
    a, b = flat(ref.parameters()), flat(got.parameters())
    assert float((a - b).abs().max()) <= 1e-10 * float(a.abs().max())
    for prop, c in ref.calibration.items():
        assert got.calibration[prop] == pytest.approx(c, rel=1e-9)


@pytest.mark.parametrize("args, message", [
    (["committee.size=2", "committee.seeds=[1]"], "must be committee.size=2 distinct seeds"),
    (["committee.size=2", "committee.seeds=[1, 1]"], "must be committee.size=2 distinct"),
    (["committee.bootstrap=true"], "needs committee.size >= 2"),
    (["committee.size=0"], "committee.size=0 must be >= 1"),
    (["committee.size=2", "parallel.dd=2"], "trains data-parallel only"),
    (["committee.size=2", "compile=true"], "trains eager"),
    (["committee.size=2", "pretrained=model.pt"], "give its model file as pretrained="),
])
def test_committee_config_refusals(args, message):
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.train import TrainConfig

    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, ["data.datasets.0.path=x.xyz", *args])


@pytest.mark.slow
def test_finetune_a_committee_from_its_model_file(runs):
    """``pretrained=committee.pt`` (without committee.size) trains the committee on: every
    member moves, and the calibration is fitted again."""
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.models.serialization import load_model

    d = runs["data"]
    start = d / "committee" / "model.pt"
    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={d / 'train.xyz'}", f"data.val.0.path={d / 'val.xyz'}",
        f"output_dir={d / 'finetuned'}", "data.batch_size=3", "model.cutoff=3.0",
        "max_steps=2", "precision=fp64", "logging.progress_bar=false", "device=cpu",
        "logging.plots=false", f"pretrained={start}"])
    summary = train(cfg)
    before, after = load_model(start), load_model(d / "finetuned" / "model.pt")
    assert isinstance(after, Committee) and summary["committee"]["calibrated_on"] == "val"
    for a, b in zip(before.members, after.members):
        assert float((flat(a.parameters()) - flat(b.parameters())).abs().max()) > 1e-6


def test_bootstrap_weights_ride_on_the_training_structures(tmp_path):
    """``committee.bootstrap=true``: every training structure carries its row of the seeded
    resample (validation structures none), and a batch collates them ``[n_systems, K]``."""
    from xnn.app.train_data import build_splits
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.data.datasets import collate
    from xnn.data.emt import write_emt

    write_emt(tmp_path / "cu.xyz", 10, ["Cu"], seed=0)
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={tmp_path / 'cu.xyz'}",
                                          "data.val_fraction=0.2", "committee.size=3",
                                          "committee.bootstrap=true", "seed=5"])
    splits = build_splits(cfg.data, cfg.loss, 3.0, cfg.seed, bootstrap=(3, cfg.seed))
    expected = bootstrap_weights(len(splits.train), 3, seed=5)
    rows = [splits.train[i][K.MEMBER_WEIGHT] for i in range(len(splits.train))]
    assert np.array_equal(torch.cat(rows).numpy(), expected)
    assert K.MEMBER_WEIGHT not in splits.val[0]
    batch = collate([splits.train[0], splits.train[1]])
    assert batch[K.MEMBER_WEIGHT].shape == (2, 3)
