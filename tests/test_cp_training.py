"""Context-parallel training (dp × dd on gloo ranks, fp64) == one process on the same batch.

Each dd group takes one share of the global batch and decomposes each of its structures over
its ranks (:mod:`xnn.distributed.cp_train`); the loss and every weight gradient of a step,
and the weights after three steps, must equal one process's. One spawn per world size, many
cases inside (tests/dist_helpers.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from dist_helpers import spawn
from helpers import rel as _rel
from helpers.training import CUTOFF, with_heads
from helpers.training import counts as _counts
from helpers.training import grads as _grads
from helpers.training import labelled as _labelled
from helpers.training import labelled_molecule as molecule
from helpers.training import labelled_structures as structures
from helpers.training import steps as _steps
from helpers.training import train_model as _model
from helpers.training import trainer as _trainer
from helpers.training import weights as _weights

from xnn.errors import InputError
from xnn.models import Potential

pytestmark = pytest.mark.distributed


def _recording(base):
    """A DomainPredictor recording each evaluation's decomposition and model input size."""
    from xnn.distributed.cp_train import DomainPredictor

    class Recording(DomainPredictor):
        log: list

        def __call__(self, piece, *args, **kw):
            out = super().__call__(piece, *args, **kw)
            self.log.append({**self.last_stats, "model_atoms": max(self.seen)})
            self.seen.clear()
            return out

    base.__class__ = Recording
    base.log, base.seen = [], []
    base.model.register_forward_pre_hook(lambda m, args: base.seen.append(args[0].n_atoms))
    return base


# ---------------------------------------------------------------------------- rank cases
def _cp_case(manager, dims, name, batches_idx=((0, 1, 2, 3), (3, 1, 0, 2), (2, 0, 3, 1)),
             data=None):
    """dp × dd training steps vs one process (computed on world rank 0)."""
    from xnn.distributed.cp_train import DomainPredictor
    from xnn.distributed.entries import parallelize_train

    data = structures() if data is None else data
    plan = parallelize_train(manager, dims[0], dims[1])
    model = _model(name)
    predictor = plan.predictor(model, "cpu", torch.float64)
    assert type(predictor) is DomainPredictor
    predictor = _recording(predictor)
    trainer = _trainer(model, plan.reducer, predictor)
    n_atoms = np.array([g.n_atoms for g in data])
    shares = [[data[i] for i in plan.sharding(b, n_atoms)] for b in batches_idx]
    counts = [_counts([data[i] for i in b]) for b in batches_idx]
    losses, first, weights = _steps(trainer, shares, counts)
    out = {"log": predictor.log, "n_share": [len(s) for s in shares]}
    if torch.distributed.get_rank() == 0:
        ref = _trainer(_model(name.replace("+ckpt", "")))  # one process, no checkpointing
        ref_losses, ref_first, ref_weights = _steps(
            ref, [[data[i] for i in b] for b in batches_idx], counts)
        out.update(loss=abs(losses[0] - ref_losses[0]) / abs(ref_losses[0]),
                   grad=_rel(first, ref_first), weights=_rel(weights, ref_weights),
                   moved=_rel(weights, _weights(_model(name))))
    return out


def _accumulation_case(manager):
    """dp=2 dd=2, two micro-batches in one step == one batch of both (and one process)."""
    from xnn.distributed.entries import parallelize_train

    data = structures()
    plan = parallelize_train(manager, 2, 2)
    n_atoms = np.array([g.n_atoms for g in data])
    micro = [[data[i] for i in plan.sharding(b, n_atoms)] for b in ([0, 1], [2, 3])]
    model = _model("schnet")
    trainer = _trainer(model, plan.reducer, plan.predictor(model, "cpu", torch.float64))
    loss = trainer.train_step(micro, 0, counts=_counts(data))
    out = {}
    if torch.distributed.get_rank() == 0:
        ref = _trainer(_model("schnet"))
        ref_loss = ref.train_step(data, 0, counts=_counts(data))
        out = {"loss": abs(loss - ref_loss) / abs(ref_loss),
               "weights": _rel(_weights(model), _weights(ref.model))}
    return out


def _whole_structure_case(manager):
    """dp=1 dd=4 on a 256-atom cluster: no rank's model sees the whole structure."""
    from xnn.distributed.entries import parallelize_train

    big = molecule(5, reps=(4, 4, 4))
    plan = parallelize_train(manager, 1, 4)
    model = _model("schnet")
    predictor = _recording(plan.predictor(model, "cpu", torch.float64))
    trainer = _trainer(model, plan.reducer, predictor)
    trainer.train_step([big], 0, counts=_counts([big]))
    grads = _grads(model)
    out = {"log": predictor.log, "n": big.n_atoms}
    if torch.distributed.get_rank() == 0:
        ref = _trainer(_model("schnet"))
        ref.train_step([big], 0, counts=_counts([big]))
        out["grad"] = _rel(grads, _grads(ref.model))
    return out


def nacl(seed):
    """64 rattled ions of NaCl in a sheared cell, per-atom charges from the data (about +-1,
    neutral), edges at the PME real-space cutoff."""
    from ase.build import bulk

    from xnn.neighbors import with_edges

    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.1, seed=seed)
    cell = atoms.cell.array.copy()
    cell[1] += 0.2 * cell[0]
    atoms.set_cell(cell, scale_atoms=True)
    g = _labelled(atoms, seed).without_edges()
    q = np.where(atoms.numbers == 11, 1.0, -1.0)
    q *= 1.0 + 0.2 * np.random.default_rng(seed).random(len(q))
    g = g.replace(charges=torch.tensor(q - q.mean()))
    return with_edges(g, 5.0)


def ionic_model(predicted=False):
    """A trainable SchNet + a fixed PME term on the data's charges; ``predicted``: PME on
    neutralised charges of a trainable 1-layer SchNet (cutoff 3.5 Å) instead."""
    from xnn.models import Sum, build

    def schnet(cutoff, layers, noise=0.1):
        m = build("schnet", species=[11, 17], cutoff=cutoff, num_interactions=layers,
                  num_features=8, num_filters=8, num_basis=8).double()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(noise * torch.randn_like(p))
        return m

    torch.manual_seed(0)
    mlip = schnet(CUTOFF, 2)
    if not predicted:
        return Sum([mlip, build("pme", cutoff=5.0, accuracy=1e-5)], trainable=[True, False])
    charges = schnet(3.5, 1, noise=0.3)
    charges.set_statistics(scale=20.0)  # a few tenths of e
    return Sum([mlip, build("pme", cutoff=5.0, accuracy=1e-5, charge_model=charges,
                            neutral=True)])


def _ionic_case(manager, predicted=False):
    """dp=2 dd=2 training of SchNet + PME (decomposed mesh) vs one process."""
    from xnn.distributed.entries import parallelize_train

    data = [nacl(7), nacl(8), nacl(9), nacl(10)]
    plan = parallelize_train(manager, 2, 2)
    model = ionic_model(predicted)
    predictor = _recording(plan.predictor(model, "cpu", torch.float64))
    trainer = _trainer(model, plan.reducer, predictor)
    batches_idx = ((0, 1, 2, 3), (3, 1, 0, 2))
    n_atoms = np.array([g.n_atoms for g in data])
    shares = [[data[i] for i in plan.sharding(b, n_atoms)] for b in batches_idx]
    counts = [_counts([data[i] for i in b]) for b in batches_idx]
    losses, first, weights = _steps(trainer, shares, counts)
    out = {"log": predictor.log, "n_share": [len(s) for s in shares]}
    if torch.distributed.get_rank() == 0:
        ref = _trainer(ionic_model(predicted))
        ref_losses, ref_first, ref_weights = _steps(
            ref, [[data[i] for i in b] for b in batches_idx], counts)
        pme_only = Potential(ionic_model(predicted).terms[1])(data[0])
        out.update(loss=abs(losses[0] - ref_losses[0]) / abs(ref_losses[0]),
                   grad=_rel(first, ref_first), weights=_rel(weights, ref_weights),
                   moved=_rel(weights, _weights(ionic_model(predicted))),
                   pme_energy=float(pme_only["energy"][0]))
        if predicted:  # the charge model's own gradients, alone
            n_q = sum(p.numel() for p in model.terms[1].parameters())
            out["charge_grad"] = _rel(first[-n_q:], ref_first[-n_q:])
            out["charge_grad_norm"] = float(ref_first[-n_q:].abs().max())
    return out


def _compile_refused(manager):
    from xnn.distributed.entries import parallelize_train

    try:
        parallelize_train(manager, 2, 2, compile=True)
    except InputError as e:
        return str(e)
    return None


def _emt_cfg(data, out, *extra):
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig

    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", f"model.cutoff={CUTOFF}",
        "model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 2, "
        "num_basis: 8}", "data.max_atoms_per_batch=40", "data.val_fraction=0.25",
        "max_epochs=2", "precision=fp64", "logging.plots=false", "logging.progress_bar=false",
        "loss.stress.weight=1.0", "optim.lr=1e-2", "device=cpu", *extra])


def _app_case(manager, tmp):
    """``xnn train`` on dp=2 dd=2: outputs, rank-0 checkpoints, exact resume, and the same
    weights as one process."""
    from xnn.app.train import train
    from xnn.distributed.entries import parallelize_train
    from xnn.training.checkpoint import load_checkpoint

    rank = torch.distributed.get_rank()
    data = Path(tmp) / "cu.xyz"
    if rank == 0:
        from xnn.data.emt import write_emt

        write_emt(data, 14, ["Cu"], seed=3)
    torch.distributed.barrier()
    plan = parallelize_train(manager, 2, 2)
    bs = ("data.max_atoms_per_batch=null", "data.batch_size=4")
    full = train(_emt_cfg(data, Path(tmp) / "full", *bs), parallel=plan)
    train(_emt_cfg(data, Path(tmp) / "half", *bs, "max_steps=2"), parallel=plan)
    resumed = train(_emt_cfg(data, Path(tmp) / "half", *bs, "resume=auto"), parallel=plan)
    # data.max_atoms_per_batch is one dd group's budget: two shares of <= 40 atoms a step
    budget = train(_emt_cfg(data, Path(tmp) / "budget", "max_epochs=1"), parallel=plan)
    out = {"steps": full["steps"], "resumed_steps": resumed["steps"],
           "budget_steps": budget["steps"], "tmp": str(tmp)}
    try:
        train(_emt_cfg(data, Path(tmp) / "refused", "data.max_atoms_per_batch=1"),
              parallel=plan)
    except InputError as e:
        out["refused"] = str(e)
    if rank == 0:
        from xnn.training.reducer import LocalReducer

        single = train(_emt_cfg(data, Path(tmp) / "single", *bs), LocalReducer())
        sd = {n: load_checkpoint(Path(tmp) / n / "checkpoints/last.pt")["model"]["state_dict"]
              for n in ("full", "half", "single")}
        out["resume"] = max(float((sd["full"][k] - sd["half"][k]).abs().max())
                            for k in sd["full"])
        out["single"] = max(float((sd["full"][k] - sd["single"][k]).abs().max())
                            for k in sd["full"])
        out["single_steps"] = single["steps"]
        out["files"] = sorted(p.name for p in (Path(tmp) / "full").iterdir())
        out["val"] = (full["metrics"]["val_forces_mae"], single["metrics"]["val_forces_mae"])
    return out


# "+ckpt": activation checkpointing under decomposition vs a plain single-process model
FAST = [((2, 2), "schnet"), ((2, 2), "painn"), ((2, 2), "equivariant"),
        ((2, 2), "equivariant+ckpt")]
GRID = {2: [((1, 2), m) for m in ("schnet", "painn", "equivariant")],
        4: [((1, 4), m) for m in ("schnet", "painn", "equivariant")],
        8: [((2, 4), m) for m in ("schnet", "painn", "equivariant")]}


def fast_worker(rank, world, tmp):
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    out = {f"{d[0]}x{d[1]}-{m}": _cp_case(manager, d, m) for d, m in FAST}
    out["accumulation"] = _accumulation_case(manager)
    out["whole"] = _whole_structure_case(manager)
    out["compile"] = _compile_refused(manager)
    out["ionic"] = _ionic_case(manager)
    out["ionic-q"] = _ionic_case(manager, predicted=True)
    out["app"] = _app_case(manager, tmp)
    return out


#: the head of each structure of :func:`structures` in the multi-head case
HEADS = (0, 1, 1, 0)


def heads_worker(rank, world):
    """Multi-head training (two readouts, each structure its own) on dp=1 dd=2; rank 0 also
    gives the one-process loss with every structure's head swapped (the heads differ)."""
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    data = with_heads(structures(), HEADS)
    out = _cp_case(manager, (1, 2), "equivariant+heads", data=data)
    if rank == 0:
        counts = _counts(data)
        step = _trainer(_model("equivariant+heads")).train_step
        swapped = with_heads(structures(), [1 - h for h in HEADS])
        loss, other = step(data, 0, counts=counts), step(swapped, 0, counts=counts)
        out["swapped"] = abs(other - loss) / abs(loss)
    return {"1x2-equivariant+heads": out}


def grid_worker(rank, world):
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    return {f"{d[0]}x{d[1]}-{m}": _cp_case(manager, d, m) for d, m in GRID[world]}


# ---------------------------------------------------------------------------- checks
def _check_case(results, key, dd):
    r0 = results[0][key]
    assert r0["loss"] <= 1e-10, (key, r0)
    assert r0["grad"] <= 1e-10, (key, r0)
    assert r0["weights"] <= 1e-9, (key, r0)
    assert r0["moved"] > 1e-4  # the steps changed the weights
    for rank, res in enumerate(results):
        log = res[key]["log"]
        assert log, (key, rank)
        for entry in log:  # ghosts on every rank, owned atoms only a part of the structure
            assert entry["n_ghost"] > 0, (key, rank, entry)
            assert 0 < entry["n_owned"] < entry["n_total"], (key, rank, entry)
    # every rank of a dd group took the same share
    for g in range(len(results) // dd):
        shares = {tuple(results[g * dd + r][key]["n_share"]) for r in range(dd)}
        assert len(shares) == 1


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return spawn(fast_worker, 4, args=(str(tmp_path_factory.mktemp("cp")),), timeout_s=900)


@pytest.mark.parametrize("dims,model", FAST)
def test_cp_step_matches_one_process(fast, dims, model):
    _check_case(fast, f"{dims[0]}x{dims[1]}-{model}", dims[1])


def test_training_through_the_decomposed_pme_mesh(fast):
    """SchNet + fixed PME with the data's charges, dp=2 dd=2: the mesh of each structure is
    summed over its dd group; loss, gradients and weights equal one process."""
    _check_case(fast, "ionic", 2)
    assert fast[0]["ionic"]["pme_energy"] < -50.0  # the electrostatics dominate the energy


def test_training_predicted_charges_under_decomposition(fast):
    """SchNet + PME on neutralised charges of a trained SchNet, dp=2 dd=2: ghosts' charges
    are computed locally (halo 5 + 3.5 Å); the charge model's gradients equal one process."""
    _check_case(fast, "ionic-q", 2)
    r0 = fast[0]["ionic-q"]
    assert r0["charge_grad"] <= 1e-10 and r0["charge_grad_norm"] > 1e-6, r0


def test_structures_cover_periodic_slab_molecule():
    pbc = [tuple(bool(x) for x in g.pbc[0]) for g in structures()]
    assert (True, True, True) in pbc and (True, True, False) in pbc
    assert (False, False, False) in pbc


def test_no_rank_evaluates_the_whole_structure(fast):
    for res in fast:
        w = res["whole"]
        (entry,) = w["log"]
        assert entry["n_total"] == w["n"] == 256
        assert entry["model_atoms"] < 0.75 * w["n"]  # owned + ghosts, not the structure
    assert sum(res["whole"]["log"][0]["n_owned"] for res in fast) == 256
    assert fast[0]["whole"]["grad"] <= 1e-10


def test_accumulated_micro_batches_match_one_batch_distributed(fast):
    assert fast[0]["accumulation"]["loss"] <= 1e-12
    assert fast[0]["accumulation"]["weights"] <= 1e-12


def test_compile_with_dd_is_refused(fast):
    for res in fast:
        assert res["compile"] is not None and "compile=false" in res["compile"]


def test_train_app_dp2_dd2(fast):
    app = fast[0]["app"]
    assert {"model.pt", "summary.json", "checkpoints", "metrics.csv"} <= set(app["files"])
    assert app["steps"] == app["resumed_steps"] == app["single_steps"]
    assert app["resume"] <= 1e-12  # resume exact
    assert app["single"] <= 1e-9  # the same training as one process
    assert app["val"][0] == pytest.approx(app["val"][1], rel=1e-8)
    assert all(r["app"]["steps"] == app["steps"] for r in fast)
    assert all("max_atoms_per_batch=1" in r["app"]["refused"] for r in fast)
    assert len({r["app"]["budget_steps"] for r in fast}) == 1 and app["budget_steps"] > 0
    assert not (Path(app["tmp"]) / "refused").exists()  # refused before any file is written


def test_multihead_cp_step_matches_one_process():
    """Multi-head training (``finetune.heads``) on dp=1 dd=2: each structure's ``head``
    travels with its scattered atoms, so loss, gradients and weights after three steps equal
    one process's (fp64, 1e-10); with the heads swapped the loss differs (the heads are
    used, not the default one for every atom)."""
    results = spawn(heads_worker, 2, timeout_s=900)
    _check_case(results, "1x2-equivariant+heads", 2)
    r0 = results[0]["1x2-equivariant+heads"]
    assert r0["swapped"] > 1e-3, r0


@pytest.mark.slow
def test_cp_grid_matches_one_process():
    for world, cases in GRID.items():
        results = spawn(grid_worker, world, timeout_s=1800)
        for dims, model in cases:
            _check_case(results, f"{dims[0]}x{dims[1]}-{model}", dims[1])


# ---------------------------------------------------------------------------- one process
def test_accumulation_is_exact_single_process():
    """Micro-batches [[a, b], [c], [d]] in one step: the update of one batch [a, b, c, d]."""
    data = structures()
    counts = _counts(data)
    split = _trainer(_model("painn"))
    split.train_step([data[:2], data[2:3], data[3:]], 0, counts=counts)
    one = _trainer(_model("painn"))
    one.train_step(data, 0, counts=counts)
    assert _rel(_weights(split.model), _weights(one.model)) <= 1e-12
    assert _rel(_weights(one.model), _weights(_model("painn"))) > 1e-4


def test_accumulate_grad_batches_in_the_loop(tmp_path):
    """batch_size=2 with accumulate_grad_batches=2 trains exactly as batch_size=4."""
    from xnn.app.train import train
    from xnn.data.emt import write_emt
    from xnn.training.checkpoint import load_checkpoint

    data = tmp_path / "cu.xyz"
    write_emt(data, 12, ["Cu"], seed=4)

    def run(name, *extra):
        cfg = _emt_cfg(data, tmp_path / name, "data.max_atoms_per_batch=null", "max_epochs=1",
                       *extra)
        summary = train(cfg)
        return summary, load_checkpoint(tmp_path / name / "checkpoints/last.pt")

    s2, a = run("acc", "data.batch_size=2", "accumulate_grad_batches=2")
    s4, b = run("big", "data.batch_size=4")
    assert s2["steps"] == s4["steps"] == 3  # 9 training structures: 4 + 4 + 1
    sa, sb = a["model"]["state_dict"], b["model"]["state_dict"]
    # Adam (the only optimizer of the config) divides by sqrt(v): the last bits of the
    # summation order of tiny gradients are amplified to ~1e-11 over three steps (the SGD
    # tests above are exact to 1e-12)
    assert max(float((sa[k] - sb[k]).abs().max()) for k in sa) <= 1e-10


def test_max_atoms_budget_per_group_refuses_large_structures():
    from xnn.data.datasets import make_batches

    n_atoms = np.array([10, 30, 20, 25, 5])
    batches = make_batches(n_atoms, max_atoms=40, groups=2)
    # shares of <= 40 atoms, two per global batch: [10, 30] + [20], [25, 5]
    assert batches == [[0, 1, 2], [3, 4]]
    from xnn.distributed.cp_train import BatchSharding

    assert [BatchSharding(r, 2, 2)(batches[0], n_atoms, 40) for r in (0, 1)] == [[0, 1], [2]]
    assert [BatchSharding(r, 2, 2)(batches[1], n_atoms, 40) for r in (0, 1)] == [[3, 4], []]
    with pytest.raises(InputError, match=r"structure 1 has 30 atoms.*max_atoms_per_batch=25"):
        make_batches(n_atoms, max_atoms=25, groups=1)
    # without groups (dd = 1) a large structure forms its own batch, as before
    assert [1] in make_batches(n_atoms, max_atoms=25)


def test_dd_ranks_read_structures_without_the_whole_neighbor_list():
    from xnn.data.datasets import InMemoryDataset
    from xnn.distributed.cp_train import BatchSharding
    from xnn.neighbors.datasets import WithEdges

    ds = WithEdges(InMemoryDataset([molecule(2).without_edges()]), CUTOFF)
    (raw,) = BatchSharding(0, 2, 2, without_edges=True).load(ds, [0])
    (full,) = BatchSharding(0, 2).load(ds, [0])
    assert "edge_index" not in raw and "edge_index" in full
    assert torch.equal(raw.forces, full.forces) and torch.equal(raw.energy, full.energy)


def test_parallel_config_checks():
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.train import TrainConfig
    from xnn.distributed.entries import parallelize_train

    with pytest.raises(ConfigError, match="compile=true does not support parallel.dd=2"):
        load_config(TrainConfig, None, ["compile=true", "parallel.dd=2"])
    with pytest.raises(InputError, match="does not match the world size 1"):
        parallelize_train(None, 1, 2)
