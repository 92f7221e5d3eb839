"""Replay structures labelled by the pretrained model itself
(``finetune.replay_from_pretrained``): labels equal the model's own evaluation, the file is
deterministic, a resumed run reads it and never relabels, close contacts are redrawn or
refused, split.json records the replay structures, and replay keeps the held-back error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from xnn.app.evaluate import read_split_record
from xnn.config.loader import ConfigError, load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.data.sources import read_structures
from xnn.errors import DataFileError
from xnn.models.derivatives import compute_properties
from xnn.models.potential import Potential
from xnn.models.serialization import load_model

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
        "num_basis: 8}")
FILE = "replay_pretrained.xyz"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("rg")
    write_emt(d / "cu.xyz", 12, ["Cu"], seed=0)
    write_emt(d / "cu_new.xyz", 9, ["Cu"], seed=5)
    return d


def _config(out, train, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={train}", f"output_dir={out}", "model.cutoff=3.0",
        "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=2", "logging.plots=false",
        "logging.progress_bar=false", "ema.enabled=false", *extra])


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    from xnn.app.train import train

    out = tmp_path_factory.mktemp("pre") / "run"
    train(_config(out, data / "cu.xyz", "max_epochs=1", TINY))
    return out / "model.pt"


def _finetune(out, data, pretrained, *extra) -> TrainConfig:
    return _config(out, data / "cu_new.xyz", f"pretrained={pretrained}", "precision=fp64",
                   "finetune.replay_from_pretrained=6", *extra)


@pytest.fixture(scope="module")
def run(data, pretrained, tmp_path_factory):
    from xnn.app.train import train

    out = tmp_path_factory.mktemp("ft") / "run"
    summary = train(_finetune(out, data, pretrained))
    return out, summary


def test_labels_are_the_pretrained_models_own_evaluation(run, pretrained):
    """Every structure of replay_pretrained.xyz, read back, evaluated one at a time by the
    pretrained model in fp64, gives the file's labels to 1e-10."""
    out, _ = run
    ds = read_structures(str(out / FILE))
    assert len(ds) == 6
    potential = Potential(load_model(pretrained).double())
    for i in range(len(ds)):
        g = ds[i]
        res = potential(g, forces=True, stress=True)
        assert torch.allclose(res["energy"], g.energy, rtol=0, atol=1e-10)
        assert torch.allclose(res["forces"], g.forces, rtol=0, atol=1e-10)
        assert torch.allclose(res["stress"], g.stress, rtol=0, atol=1e-10)
    info = __import__("ase.io").io.read(str(out / FILE), index=0).info
    assert info["config_type"] == "replay" and info["replay_seed"] == 0


def test_structures_are_perturbed_training_structures(run, data):
    """Each replay structure is its recorded source (a training-split structure) moved by
    the recipe: same species, positions changed by about the rattle, never a val one."""
    import ase.io

    out, _ = run
    record = read_split_record(out)
    train_rows = record["train"]
    assert len(train_rows) == 1
    train_idx = train_rows[0]["indices"]
    source = ase.io.read(str(data / "cu_new.xyz"), index=":")
    for atoms in ase.io.read(str(out / FILE), index=":"):
        src = source[train_idx[atoms.info["replay_source"]]]
        assert (atoms.numbers == src.numbers).all()
        moved = np.linalg.norm(atoms.positions - src.positions, axis=1)
        assert 0 < np.median(moved) < 0.05 * 4 + 0.02 * 10


def test_split_json_records_the_replay_structures(run):
    out, _ = run
    record = read_split_record(out)
    files = {f["config_key"]: i for i, f in enumerate(record["files"])}
    k = files["finetune.replay_from_pretrained"]
    assert record["files"][k]["path"].endswith(FILE)
    rows_t = [r for r in record["replay_train"] if r["file"] == k]
    rows_v = [r for r in record["replay_val"] if r["file"] == k]
    got = sorted([*rows_t[0]["indices"], *(rows_v[0]["indices"] if rows_v else [])])
    assert got == list(range(6)) and record["replay_selection"] is None
    assert record["files"][k]["fingerprint"]


def test_the_file_is_deterministic_for_a_seed(run, data, pretrained):
    """The run's file is the recipe's text for its seed (made again here, byte for byte
    equal), and another seed gives other structures."""
    from xnn.app.train_replay_gen import replay_text
    from xnn.data.datasets import Subset

    out, summary = run
    record = read_split_record(out)
    train = Subset(read_structures(str(data / "cu_new.xyz")), record["train"][0]["indices"])
    model = load_model(pretrained)
    assert replay_text(model, train, 6, 0, 0.05, 0.02) == (out / FILE).read_text()
    assert replay_text(model, train, 6, 1, 0.05, 0.02) != (out / FILE).read_text()
    assert "val_replay_forces_mae" in summary["metrics"]


def test_resume_reads_the_file_and_never_relabels(data, pretrained, tmp_path):
    """A run stopped after one epoch and resumed keeps the file (bytes and mtime), trains as
    the uninterrupted run, and refuses a file of another N or a missing one."""
    import os

    from xnn.app.train import train

    full = tmp_path / "full"
    train(_finetune(full, data, pretrained))
    part = tmp_path / "part"
    train(_finetune(part, data, pretrained, "max_epochs=1"))
    stamp = os.stat(part / FILE).st_mtime_ns
    content = (part / FILE).read_bytes()
    resumed = train(_finetune(part, data, pretrained, "resume=auto"))
    assert os.stat(part / FILE).st_mtime_ns == stamp
    assert (part / FILE).read_bytes() == content == (full / FILE).read_bytes()
    a = json.loads((full / "summary.json").read_text())["metrics"]
    assert resumed["metrics"]["val_replay_forces_mae"] == a["val_replay_forces_mae"]
    with pytest.raises(DataFileError, match="finetune.replay_from_pretrained=7"):
        train(_finetune(part, data, pretrained, "resume=auto", "max_epochs=3",
                        "finetune.replay_from_pretrained=7"))
    (part / FILE).unlink()
    with pytest.raises(DataFileError, match="never relabels"):
        train(_finetune(part, data, pretrained, "resume=auto", "max_epochs=3"))


def test_close_contacts_are_redrawn_or_refused(pretrained, data):
    """A rattle that often brings atoms too close (plain draws of the recipe do) yields
    structures that all keep the distance limit; one that always does is refused naming the
    option."""
    from xnn.app.train_replay_gen import CLOSE, _graph, make_structures, perturb

    train = read_structures(str(data / "cu_new.xyz"))
    potential = Potential(load_model(pretrained).double())

    def closest(g, src):
        d0 = float(potential.min_pair_distance(train[src])[0])
        return float(potential.min_pair_distance(g)[0]) / (CLOSE * min(d0, 3.0))

    rng = np.random.default_rng(3)
    plain = []
    for src in range(len(train)):
        g = train[src]
        p, c = perturb(g.positions.double().numpy(), g.cell[0].double().numpy(),
                       g.pbc[0].numpy(), rng, 0.2, 0.0)
        plain.append(closest(_graph(g.numbers.numpy(), p, c, g.pbc[0].numpy()), src))
    assert min(plain) < 1.0  # without the check, some draws would be too close
    made = make_structures(potential, train, 9, 0, 0.2, 0.0)
    assert len(made) == 9 and all(closest(g, src) >= 1.0 for src, g in made)
    with pytest.raises(DataFileError, match="lower finetune.replay_rattle"):
        make_structures(potential, train, 2, 0, 3.0, 0.0)


def test_batched_labels_equal_single_evaluation(pretrained, data):
    """label_structures (batches of mixed structures) equals compute_properties one at a
    time, to 1e-10 in fp64."""
    from xnn.data.graph import AtomicGraph
    from xnn.models.potential import label_structures

    model = load_model(pretrained).double()
    potential = Potential(model)
    graphs = [read_structures(str(data / "cu_new.xyz"))[i] for i in range(5)]
    labels = label_structures(potential, graphs, 3)
    for g, lab in zip(graphs, labels):
        ref = compute_properties(model, potential.model_graph(AtomicGraph.concat([g])))
        assert torch.allclose(lab["energy"], ref["energy"][0], rtol=0, atol=1e-10)
        assert torch.allclose(lab["forces"], ref["forces"], rtol=0, atol=1e-10)
        assert torch.allclose(lab["stress"], ref["stress"][0], rtol=0, atol=1e-10)


def test_replay_from_pretrained_needs_a_pretrained_model(tmp_path, data):
    with pytest.raises(ConfigError, match="set pretrained=PATH"):
        _config(tmp_path, data / "cu.xyz", "finetune.replay_from_pretrained=4")
    with pytest.raises(ConfigError, match="replay_from_pretrained=-1"):
        _config(tmp_path, data / "cu.xyz", "finetune.replay_from_pretrained=-1")


def _with_pair_term(atoms_list) -> list:
    """The "new reference": EMT plus a Lennard-Jones pair term (labels as extxyz)."""
    from ase.calculators.emt import EMT
    from ase.calculators.lj import LennardJones
    from ase.calculators.mixing import SumCalculator

    out = []
    for a in atoms_list:
        b = a.copy()
        b.calc = SumCalculator([EMT(), LennardJones(sigma=2.3, epsilon=0.08, rc=3.0,
                                                    smooth=True)])
        e, f, s = b.get_potential_energy(), b.get_forces(), b.get_stress(voigt=False)
        b.calc = None
        b.info = {"energy": float(e), "stress": s}
        b.arrays["forces"] = f
        out.append(b)
    return out


@pytest.fixture(scope="module")
def converged(tmp_path_factory):
    """A model pretrained until its EMT force error is a fraction of the pair term's forces
    (the module's `pretrained` has seen one epoch), and held-back EMT structures."""
    from xnn.app.train import train

    d = tmp_path_factory.mktemp("conv")
    write_emt(d / "pre.xyz", 20, ["Cu"], seed=31)
    write_emt(d / "held.xyz", 8, ["Cu"], seed=37)
    train(_config(d / "run", d / "pre.xyz", TINY, "max_epochs=10", "optim.lr=0.005",
                  "data.batch_size=4"))
    return d / "run" / "model.pt", d / "held.xyz"


def test_replay_from_pretrained_keeps_the_held_back_error(converged, tmp_path):
    """Fine-tuned on a new reference (EMT + a pair term), the model keeps its force error on
    held-back pretraining-like data (EMT) closer to the pretrained model's with
    replay_from_pretrained than without, while the new-data error falls."""
    import ase.io

    from xnn.app.train import train
    from xnn.data.emt import generate_emt
    from xnn.neighbors.datasets import WithEdges

    new = tmp_path / "new.xyz"
    ase.io.write(str(new), _with_pair_term(generate_emt(12, ["Cu"], seed=21)),
                 format="extxyz")
    pretrained, held_file = converged
    held = WithEdges(read_structures(str(held_file)), 3.0)
    fresh = WithEdges(read_structures(str(new)), 3.0)

    def errors(model_file):
        model = load_model(model_file).double()
        return tuple(_force_mae(model, ds) for ds in (held, fresh))

    args = ("max_epochs=4", "optim.lr=0.005", "data.batch_size=6")
    train(_config(tmp_path / "plain", new, f"pretrained={pretrained}", *args))
    train(_config(tmp_path / "replay", new, f"pretrained={pretrained}", *args,
                  "finetune.replay_from_pretrained=24"))
    pre_held, pre_new = errors(pretrained)
    plain_held, plain_new = errors(tmp_path / "plain" / "model.pt")
    replay_held, replay_new = errors(tmp_path / "replay" / "model.pt")
    # measured: pretrained 42 meV/Å held back, 112 new; without replay 141 / 56, with
    # replay 66 / 68
    assert plain_new < pre_new and replay_new < pre_new
    assert abs(replay_held - pre_held) < abs(plain_held - pre_held)
    assert replay_held < plain_held


def _force_mae(model, ds) -> float:
    from xnn.data.graph import AtomicGraph

    total, count = 0.0, 0
    for i in range(len(ds)):
        g = AtomicGraph.concat([ds[i]])
        out = compute_properties(model, g, True, False)
        total += float((out["forces"] - g.forces).abs().sum())
        count += g.forces.numel()
    return total / count


def _rank_main(rank, world, data, pretrained, out):
    from xnn.app.train import train
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    reducer = parallelize_train(manager).reducer
    return train(_finetune(out, data, pretrained, "device=cpu"), reducer)


@pytest.mark.distributed
def test_two_ranks_train_on_rank_0s_replay(run, data, pretrained, tmp_path):
    """On 2 gloo ranks, rank 0 makes the structures and shares them: the file equals the
    one-process run's byte for byte and both ranks validate the same replay errors as it."""
    from dist_helpers import spawn

    out, summary = run
    torch.set_num_threads(1)
    results = spawn(_rank_main, 2, args=(data, pretrained, str(tmp_path / "ddp")),
                    timeout_s=600)
    assert (tmp_path / "ddp" / FILE).read_bytes() == (out / FILE).read_bytes()
    for r in results:
        for key in ("val_replay_energy_mae", "val_replay_forces_mae"):
            assert r["metrics"][key] == pytest.approx(summary["metrics"][key], rel=1e-6)


def test_split_record_locates_every_replay_training_structure(data):
    """With data.replay files and a replay_fraction, the recorded replay_train indices and
    replay_selection name, in order, exactly the replay structures the training set holds
    (after the new data)."""
    from xnn.app.train_data import build_splits

    cfg = _config("unused", data / "cu_new.xyz", "pretrained=x.pt",
                  f"data.replay.0.path={data / 'cu.xyz'}",
                  f"data.replay.1.path={data / 'cu_new.xyz'}", "finetune.replay_fraction=0.6")
    splits = build_splits(cfg.data, cfg.loss, 3.0, cfg.seed, replay=(1.0, 0.6))
    record = splits.membership
    keys = [f["config_key"] for f in record["files"]]
    assert keys == ["data.datasets.0", "data.replay.0", "data.replay.1"]
    pool = [(row["file"], i) for row in record["replay_train"] for i in row["indices"]]
    chosen = [pool[j] for j in record["replay_selection"]]
    n_new = sum(len(row["indices"]) for row in record["train"])
    assert len(chosen) == round(0.6 / 0.4 * n_new)
    assert len(splits.raw_train) == n_new + len(chosen)
    files = {k: read_structures(record["files"][k]["path"]) for k in (1, 2)}
    for j, (k, i) in enumerate(chosen):
        assert torch.equal(splits.raw_train[n_new + j].positions, files[k][i].positions)
    val = [(row["file"], i) for row in record["replay_val"] for i in row["indices"]]
    assert len(val) == len(splits.val_replay) and not set(val) & set(pool)
