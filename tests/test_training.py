"""Training: loss normalisation, splits/batches, schedules, EMA, exact resume, bad input, eval."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data import keys as K
from xnn.data.datasets import make_batches, shard_batch, split_indices
from xnn.data.emt import write_emt
from xnn.errors import DataFileError, InputError
from xnn.training.checkpoint import load_checkpoint
from xnn.training.losses import TermSpec, elementwise, local_counts, loss_terms, residuals

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("emt")
    write_emt(d / "cu.xyz", 12, ["Cu"], seed=0)
    return d / "cu.xyz"


def tiny(out, data, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", "model.cutoff=3.0", TINY,
        "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=2", "logging.plots=false",
        "logging.progress_bar=false", "loss.stress.weight=1.0", *extra,
    ])


def run_train(cfg):
    from xnn.app.train import train

    return train(cfg)


# --------------------------------------------------------------------------- losses
def _fake_batch(n_sys=4, seed=0):
    from xnn.data.graph import AtomicGraph

    g = torch.Generator().manual_seed(seed)
    counts = [2, 3, 1, 4][:n_sys]
    n = sum(counts)
    batch = torch.repeat_interleave(torch.arange(n_sys), torch.tensor(counts))
    graph = AtomicGraph.from_arrays(
        torch.rand(n, 3, generator=g) * 5, torch.full((n,), 29), cell=torch.eye(3).repeat(
            n_sys, 1, 1) * 5, pbc=[True] * 3, batch=batch,
        extra={K.ENERGY: torch.randn(n_sys, generator=g), K.FORCES: torch.randn(n, 3, generator=g),
               K.STRESS: torch.randn(n_sys, 3, 3, generator=g),
               K.WEIGHT: torch.tensor([1.0, 2.0, 1.0, 0.5][:n_sys])},
    )
    stress = graph.stress.clone()
    stress[2] = float("nan")  # one structure without stress label
    graph = graph.replace(stress=stress)
    pred = {K.ENERGY: torch.randn(n_sys, generator=g, dtype=torch.float64),
            K.FORCES: torch.randn(n, 3, generator=g, dtype=torch.float64),
            K.STRESS: torch.randn(n_sys, 3, 3, generator=g, dtype=torch.float64)}
    return graph, pred


@pytest.mark.parametrize("kind", ["mse", "mae", "huber"])
def test_loss_matches_reference_and_split(kind):
    graph, pred = _fake_batch()
    specs = {p: TermSpec(w, kind, 0.3) for p, w in (("energy", 1.0), ("forces", 2.0),
                                                    ("stress", 0.5))}
    counts = local_counts(graph)
    assert counts.tolist() == [4.0, 30.0, 27.0]
    loss, terms = loss_terms(residuals(pred, graph), specs, counts)
    # reference written independently with torch.nn.functional
    fn = {"mse": lambda d: torch.nn.functional.mse_loss(d, torch.zeros_like(d), reduction="none"),
          "mae": lambda d: torch.nn.functional.l1_loss(d, torch.zeros_like(d), reduction="none"),
          "huber": lambda d: torch.nn.functional.huber_loss(d, torch.zeros_like(d),
                                                            reduction="none", delta=0.3)}[kind]
    n = graph.n_atoms_per_system.double()
    w = graph.weight.double()
    e = (fn((pred[K.ENERGY] - graph.energy) / n) * w).sum() / 4
    f = (fn(pred[K.FORCES] - graph.forces) * w[graph.batch][:, None]).sum() / 30
    keep = [0, 1, 3]
    s = (fn(pred[K.STRESS][keep] - graph.stress[keep]) * w[keep][:, None, None]).sum() / 27
    assert torch.allclose(loss, e + 2 * f + 0.5 * s, rtol=1e-12)
    # split over "ranks" with global counts: shares add up to the global loss
    shares = []
    for part in ([0, 3], [1, 2]):
        sub = graph.select_systems(part)
        sub_pred = {K.ENERGY: pred[K.ENERGY][part], K.STRESS: pred[K.STRESS][part],
                    K.FORCES: torch.cat([pred[K.FORCES][graph.batch == p] for p in part])}
        shares.append(loss_terms(residuals(sub_pred, sub), specs, counts)[0])
    assert torch.allclose(shares[0] + shares[1], loss, rtol=1e-12)


def test_elementwise_huber_is_continuous():
    d = torch.tensor([-0.2, -0.1 - 1e-9, 0.0, 0.1 + 1e-9, 0.5], dtype=torch.float64)
    out = elementwise("huber", d, 0.1)
    assert torch.allclose(out, torch.tensor([0.015, 0.005, 0.0, 0.005, 0.045],
                                            dtype=torch.float64), atol=1e-9)


# --------------------------------------------------------------------------- data plumbing
def test_split_adding_zero_test_fraction_keeps_split():
    tr, va, te = split_indices(50, 0.2, 0.0, seed=3)
    tr2, va2, te2 = split_indices(50, 0.2, 0.1, seed=3)
    assert len(te) == 0 and len(te2) == 5 and np.array_equal(va, va2)
    assert set(tr2) | set(te2) == set(tr) and not set(tr2) & set(te2)
    assert sorted(np.concatenate([tr2, va2, te2]).tolist()) == list(range(50))
    assert not np.array_equal(va, split_indices(50, 0.2, 0.0, seed=4)[1])


def test_batches_and_shards():
    n_atoms = np.array([5, 1, 7, 3, 3, 2, 8, 1])
    batches = make_batches(n_atoms, max_atoms=10, shuffle=True, seed=1, epoch=2)
    assert sorted(sum(batches, [])) == list(range(8))
    assert all(n_atoms[b].sum() <= 10 or len(b) == 1 for b in batches)
    assert batches == make_batches(n_atoms, max_atoms=10, shuffle=True, seed=1, epoch=2)
    assert batches != make_batches(n_atoms, max_atoms=10, shuffle=True, seed=1, epoch=3)
    assert [len(b) for b in make_batches(n_atoms, batch_size=3)] == [3, 3, 2]
    for world in (2, 3):
        shards = [shard_batch(list(range(8)), n_atoms, r, world) for r in range(world)]
        assert sorted(sum(shards, [])) == list(range(8))
        loads = [n_atoms[s].sum() for s in shards]
        assert max(loads) - min(loads) <= n_atoms.max()


# --------------------------------------------------------------------------- schedule / EMA
def test_schedule_and_ema():
    from xnn.training.ema import EMA
    from xnn.training.schedule import LRSchedule

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=1.0)
    s = LRSchedule(opt, "cosine", 1.0, warmup_steps=4, total_steps=14, min_lr_factor=0.1)
    assert s.lr_at(0) == pytest.approx(0.25) and s.lr_at(3) == pytest.approx(1.0)
    assert s.lr_at(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert s.lr_at(14) == pytest.approx(0.1) and s.lr_at(100) == pytest.approx(0.1)
    pl = LRSchedule(opt, "plateau", 1.0, factor=0.5, patience=1, min_lr_factor=0.2)
    for metric in (1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0):
        pl.epoch_end(metric)
    assert pl.lr_at(100) == pytest.approx(0.25 if pl.plateau_scale > 0.2 else 0.2)
    model = torch.nn.Linear(2, 1)
    ema = EMA(model, 0.9)
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)  # warm-up: d = min(0.9, 1/10)
    assert torch.allclose(ema.shadow["weight"], 0.1 * w0 + 0.9 * (w0 + 1.0))
    ema.updates = 100
    ema.update(model)  # d = 0.9
    assert torch.allclose(ema.shadow["weight"], 0.9 * (w0 + 0.9) + 0.1 * (w0 + 1.0))
    with ema.applied(model):
        assert torch.equal(model.weight, ema.shadow["weight"])
    assert torch.equal(model.weight, w0 + 1.0)


# --------------------------------------------------------------------------- runs
def _state(path):
    p = load_checkpoint(path)
    return p["model"]["state_dict"], p["ema"]["shadow"], p["optimizer"], p["progress"]


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)  # process-global: set by deterministic=true


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])])
def test_resume_is_bitwise(tmp_path, data, device, restore_determinism):
    # CUDA's index_add/scatter use atomics: bitwise only with deterministic kernels
    common = ("precision=fp64", "schedule.name=cosine", "schedule.warmup_steps=2",
              "schedule.total_steps=9", "max_epochs=5", f"device={device}",
              f"deterministic={device == 'cuda'}")
    run_train(tiny(tmp_path / "full", data, *common, "max_steps=7"))
    run_train(tiny(tmp_path / "part", data, *common, "max_steps=4"))
    mid = load_checkpoint(tmp_path / "part" / "checkpoints" / "last.pt")["progress"]
    assert (mid["step"], mid["epoch"], mid["batch_in_epoch"]) == (4, 1, 1)  # 3 steps / epoch
    run_train(tiny(tmp_path / "part", data, *common, "max_steps=7", "resume=auto"))
    a = _state(tmp_path / "full/checkpoints/last.pt")
    b = _state(tmp_path / "part/checkpoints/last.pt")
    assert a[3]["step"] == b[3]["step"] == 7
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    for k, st in a[2]["state"].items():
        assert torch.equal(st["exp_avg_sq"], b[2]["state"][k]["exp_avg_sq"])
    assert a[3]["history"][-1]["val_loss"] == b[3]["history"][-1]["val_loss"]
    # a different run (other seed) is not bitwise equal: the comparison can fail
    run_train(tiny(tmp_path / "other", data, *common, "max_steps=7", "seed=1"))
    c = _state(tmp_path / "other/checkpoints/last.pt")
    assert not all(torch.equal(a[0][k], c[0][k]) for k in a[0])


def test_training_learns_and_eval_agrees(tmp_path, data, capsys):
    from xnn.models import Potential
    from xnn.models.serialization import load_model

    out = tmp_path / "run"
    summary = run_train(tiny(out, data, "max_epochs=8", "optim.lr=2e-2", "ema.decay=0.5",
                             "logging.plots=true", "data.test_fraction=0.25"))
    hist = load_checkpoint(out / "checkpoints/last.pt")["progress"]["history"]
    assert min(h["train_loss"] for h in hist[-3:]) < 0.5 * hist[0]["train_loss"]
    assert min(h["val_forces_mae"] for h in hist[-3:]) < 0.7 * hist[0]["val_forces_mae"]
    for f in ("model.pt", "summary.json", "metrics.csv", "config.yaml", "learning_curves.png",
              "parity_test.png", "checkpoints/best.pt"):
        assert (out / f).is_file(), f
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 9
    # independent MAE of the saved model on the whole file vs `xnn eval`
    model = load_model(out / "model.pt")
    pot = Potential(model)
    from xnn.data.sources import read_structures

    ds = read_structures(data)
    e_err, f_err = [], []
    for i in range(len(ds)):
        g = ds[i].to(dtype=torch.float32)
        r = pot(g, stress=False)
        e_err.append(abs(float(r[K.ENERGY][0] - g.energy[0])) / g.n_atoms)
        f_err.append((r[K.FORCES] - g.forces).abs().flatten())
    from xnn.cli.main import main

    assert main(["eval", str(out / "model.pt"), str(data), "--json", str(tmp_path / "m.json"),
                 "--device", "cpu"]) == 0
    stdout = capsys.readouterr().out
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["energy_mae"] == pytest.approx(1000 * np.mean(e_err), rel=1e-4)
    assert m["forces_mae"] == pytest.approx(1000 * float(torch.cat(f_err).mean()), rel=1e-4)
    assert m["forces_mae_Cu"] == pytest.approx(m["forces_mae"])
    assert "meV/atom" in stdout and (out / f"parity_{data.stem}.png").is_file()
    assert summary["metrics"]["test_forces_mae"] > 0
    # validation_only with the trained model reproduces the validation metrics of the run
    vo = run_train(tiny(out, data, f"pretrained={out / 'model.pt'}", "validation_only=true",
                        "data.test_fraction=0.25"))
    assert vo["metrics"]["val_forces_mae"] == pytest.approx(
        summary["metrics"]["val_forces_mae"], rel=1e-5)
    assert json.loads((out / "summary.json").read_text())["stopped_by"] == "max_epochs"
    assert (out / "validation_summary.json").is_file()


# --------------------------------------------------------------------------- bad input
def test_bad_inputs(tmp_path, data):
    from ase import Atoms
    from ase.io import write

    with pytest.raises(DataFileError, match="does not exist"):
        run_train(tiny(tmp_path / "a", tmp_path / "missing.xyz"))
    nof = tmp_path / "noforces.xyz"
    atoms = [Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]], cell=[6, 6, 6], pbc=True,
                   info={"energy": -1.0 - i}) for i in range(4)]
    write(nof, atoms)
    with pytest.raises(DataFileError, match="no forces label.*loss.forces.weight"):
        run_train(tiny(tmp_path / "b", nof))
    au = tmp_path / "au.xyz"
    write_emt(au, 2, ["Cu", "Au"], seed=0)
    with pytest.raises(InputError, match="validation structures hold species \\['Au'\\]"):
        run_train(tiny(tmp_path / "c", data, f"data.val.0.path={au}"))
    # a folder holding a previous run is refused; overwrite=true replaces it
    run_train(tiny(tmp_path / "d", data, "max_steps=1"))
    with pytest.raises(InputError, match="previous run.*overwrite=true"):
        run_train(tiny(tmp_path / "d", data, "max_steps=1"))
    run_train(tiny(tmp_path / "d", data, "max_steps=1", "overwrite=true"))
    # resuming with another architecture
    other = ("model.hyperparameters={num_features: 4, num_filters: 8, num_interactions: 1, "
             "num_basis: 8}")
    with pytest.raises(InputError, match="another 'schnet' architecture.*num_features"):
        run_train(tiny(tmp_path / "d", data, other, "resume=auto", "max_steps=2"))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, data, monkeypatch):
    from xnn.training import prediction as T
    from xnn.training.trainer import NonFiniteLossError

    calls = {"n": 0}
    original = T.LocalPredictor._predict

    def poisoned(self, batch, forces, stress, training):
        out = original(self, batch, forces, stress, training)
        if training:
            calls["n"] += 1
            if calls["n"] == 5:  # second step of epoch 2
                out[K.ENERGY] = out[K.ENERGY] * float("nan")
        return out

    monkeypatch.setattr(T.LocalPredictor, "_predict", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match="nan.*last good checkpoint"):
        run_train(tiny(out, data, "max_epochs=3"))
    ck = load_checkpoint(out / "checkpoints/last.pt")
    assert ck["progress"]["step"] == 3 and ck["progress"]["epoch"] == 1
    assert all(torch.isfinite(v).all() for v in ck["model"]["state_dict"].values())


def test_splits_weights_overfit_and_hdf5(tmp_path, data):
    from xnn.app.train_data import build_splits
    from xnn.data.hdf5 import write_hdf5

    h5 = tmp_path / "second.h5"
    extra = tmp_path / "second.xyz"
    write_emt(extra, 8, ["Cu"], seed=5)
    from xnn.data.sources import read_structures

    src = read_structures(extra)
    write_hdf5(h5, (src[i] for i in range(len(src))))
    cfg = tiny(tmp_path, data, f"data.datasets.1={{path: {h5}, weight: 2.5}}",
               "data.test_fraction=0.25")
    s = build_splits(cfg.data, cfg.loss, 3.0, seed=0)
    # per file: 12 -> 6/3/3 and 8 -> 4/2/2; the HDF5 structures carry weight 2.5
    assert (len(s.train), len(s.val), len(s.test)) == (10, 5, 5)
    weights = [float(s.train[i].weight[0]) for i in range(len(s.train))]
    assert weights == [1.0] * 6 + [2.5] * 4
    assert s.train[7].n_edges > 0 and s.species == [29]
    # the same split without the test fraction keeps the validation set
    s0 = build_splits(tiny(tmp_path, data, f"data.datasets.1={{path: {h5}}}").data, cfg.loss,
                      3.0, seed=0)
    assert [torch.equal(s0.val[i].positions, s.val[i].positions) for i in range(5)] == [True] * 5
    ov = build_splits(tiny(tmp_path, data, "data.overfit=3").data, cfg.loss, 3.0, seed=0)
    assert len(ov.train) == len(ov.val) == 3
    assert torch.equal(ov.train[2].positions, ov.val[2].positions)


def test_dataset_label_counts_are_the_loss_normalisers(tmp_path, data):
    """The loop normalises the loss by counts read from the datasets' metadata (no
    collective): they must equal what the loss counts on the collated batch, with labels
    missing per structure (energy, stress) and per atom (forces), in memory and in HDF5."""
    from xnn.data.datasets import (
        ConcatDataset,
        HDF5Source,
        InMemoryDataset,
        Subset,
        collate,
    )
    from xnn.data.hdf5 import write_hdf5
    from xnn.data.sources import read_structures
    from xnn.neighbors.datasets import WithEdges

    graphs = [read_structures(data)[i] for i in range(8)]
    nan = float("nan")
    graphs[1] = graphs[1].replace(energy=torch.full_like(graphs[1].energy, nan))
    forces = graphs[2].forces.clone()
    forces[[0, 3]] = nan  # two atoms without forces
    graphs[2] = graphs[2].replace(forces=forces)
    graphs[4] = graphs[4].replace(stress=torch.full_like(graphs[4].stress, nan))
    graphs[5] = graphs[5].replace(forces=torch.full_like(graphs[5].forces, nan))
    write_hdf5(tmp_path / "part.h5", graphs[4:])
    mem = InMemoryDataset(graphs[:4])
    ds = ConcatDataset([mem, Subset(HDF5Source(tmp_path / "part.h5"), [3, 0, 2, 1])])
    order = [0, 1, 2, 3, 7, 4, 6, 5]  # graphs in the order of ds
    rng = np.random.default_rng(0)
    for _ in range(6):
        idx = rng.choice(len(ds), size=int(rng.integers(1, 6)), replace=False).tolist()
        ref = local_counts(collate([graphs[order[i]] for i in idx])).tolist()
        assert ds.batch_label_counts(idx) == ref

    class Plain:  # any dataset: len, getitem, n_atoms; counted by reading it once
        n_atoms = mem.n_atoms

        def __len__(self):
            return len(mem)

        def __getitem__(self, i):
            return mem[i]

    assert np.array_equal(WithEdges(Plain(), 3.0).label_counts(), mem.label_counts())
    masks = ds.label_masks()
    assert masks[K.ENERGY].tolist() == [True, False] + [True] * 6
    assert masks[K.FORCES].tolist() == [True, True, False, True, True, True, True, False]
    assert masks[K.STRESS].tolist() == [True] * 5 + [False, True, True]


def test_early_stopping_and_tensorboard(tmp_path, data):
    out = tmp_path / "es"
    summary = run_train(tiny(out, data, "max_epochs=6", "early_stopping.patience=0",
                             "early_stopping.min_delta=100.0", "logging.tensorboard=true",
                             "precision=bf16_mixed"))
    assert summary["stopped_by"] == "early_stopping" and summary["epochs"] == 2
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from xnn.errors import ModelFileError
    from xnn.io import train_checkpoint as W
    from xnn.training import checkpoint as C

    path = tmp_path / "last.pt"
    W.save_checkpoint({"progress": {"step": 1}, "w": torch.ones(3)}, path)

    def crash(obj, f):  # a write that dies half way
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(W.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        W.save_checkpoint({"progress": {"step": 2}}, path)
    monkeypatch.undo()
    back = C.load_checkpoint(path)
    assert back["progress"]["step"] == 1 and torch.equal(back["w"], torch.ones(3))
    assert list(tmp_path.iterdir()) == [path]
    path.write_bytes(b"garbage")
    with pytest.raises(ModelFileError, match="cannot read checkpoint"):
        C.load_checkpoint(path)


def test_cli_train_and_pretrained(tmp_path, data, capsys, monkeypatch):
    from xnn.cli.main import main
    from xnn.models.serialization import load_model

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "XNN_DISTRIBUTED_INIT_METHOD"):
        monkeypatch.delenv(k, raising=False)
    args = ["train", f"data.datasets.0.path={data}", "model.cutoff=3.0", TINY,
            "logging.plots=false", "device=cpu"]
    assert main(args + [f"output_dir={tmp_path / 'a'}", "max_steps=2"]) == 0
    assert "stopped by max_steps" in capsys.readouterr().out
    assert main(args + [f"output_dir={tmp_path / 'a'}", "max_steps=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "previous run" in err[0]
    assert main(["train", f"data.datasets.0.path={tmp_path / 'nope.xyz'}",
                 f"output_dir={tmp_path / 'b'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # fine-tuning starts from the pretrained weights (0 epochs: the saved model is unchanged)
    src = tmp_path / "a" / "model.pt"
    assert main(args + [f"output_dir={tmp_path / 'c'}", f"pretrained={src}",
                        "max_epochs=0"]) == 0
    a, b = load_model(src).state_dict(), load_model(tmp_path / "c" / "model.pt").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert "fine-tuning schnet" in capsys.readouterr().out


def test_amsgrad_option_reaches_the_optimizer():
    from xnn.training.schedule import build_optimizer

    model = torch.nn.Linear(2, 1)
    for name in ("adam", "adamw"):
        assert build_optimizer(model, name, 1e-3, 0.0, amsgrad=True).param_groups[0]["amsgrad"]
        assert not build_optimizer(model, name, 1e-3, 0.0).param_groups[0]["amsgrad"]


def test_energy_only_training_learns(tmp_path, data):
    """``loss.forces.weight=0 loss.stress.weight=0``: the energy alone is differentiated
    (this failed with 'element 0 of tensors does not require grad' when no force was asked)."""
    cfg = tiny(tmp_path / "e", data, "loss.forces.weight=0.0", "loss.stress.weight=0.0",
               "max_epochs=4", "ema.enabled=false", "optim.lr=0.01")
    run_train(cfg)
    rows = (tmp_path / "e" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    losses = [float(r.split(",")[header.index("train_loss")]) for r in rows[1:]]
    assert len(losses) == 4 and losses[-1] < losses[0], losses


def test_pretrained_external_wrapper_is_refused_before_training(tmp_path, data, monkeypatch):
    """A pretrained file holding an external model wrapper (no native hyperparameters) is
    refused at start with a clear message, not at the first checkpoint write."""
    import xnn.app.train as run_module

    class Wrapper(torch.nn.Module):  # like MACEWrapper / SevenNetWrapper: no `hparams`
        species = [29]

    monkeypatch.setattr(run_module, "load_pretrained", lambda path: Wrapper())
    cfg = tiny(tmp_path / "w", data, f"pretrained={data}")
    with pytest.raises(InputError, match="fine-tunes native xnn models and the SevenNet"):
        run_train(cfg)


def test_step_without_labels_is_refused_and_changes_nothing(data):
    """A global batch where no weighted property has a label raises (counts are read after the
    backward, with the loss: one device wait per step) and leaves the weights untouched."""
    from xnn.data.sources import read_structures
    from xnn.models import build
    from xnn.neighbors.datasets import WithEdges
    from xnn.training.trainer import Trainer

    ds = WithEdges(read_structures(data), 3.0)
    torch.manual_seed(0)
    model = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8).double()
    trainer = Trainer(model, {"energy": TermSpec(1.0)}, torch.optim.Adam(model.parameters()),
                      dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    unlabelled = [ds[i].replace(energy=torch.full_like(ds[i].energy, float("nan")))
                  for i in range(3)]
    with pytest.raises(ValueError, match="no loss term"):
        trainer.train_step(unlabelled, 0)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    trainer.train_step([ds[i] for i in range(3)], 0)  # with labels it trains
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
