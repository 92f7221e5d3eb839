"""Multi-head fine-tuning (``finetune.heads``): one shared body, one readout with its own
E0s, scale and shift per head; each structure's energy from its head; ``head=`` selects
the head at evaluation (calculator, ``xnn eval --head``, ``xnn md model.head``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ase.io import read, write

from xnn.config.loader import ConfigError, load_config
from xnn.config.train import TrainConfig
from xnn.data import keys as K
from xnn.data.ase_io import from_ase
from xnn.data.emt import generate_emt
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.io.calculator import Calculator
from xnn.models import build
from xnn.models.heads import make_multihead, select_head
from xnn.models.potential import Potential
from xnn.models.serialization import load_model, save_model

#: the new data's reference differs from the pretraining one by this, per atom (eV)
SHIFT = 0.5
TINY = ("model.hyperparameters={channels: 8, l_max: 1, hidden_l_max: 0, num_interactions: 2, "
        "correlation: 2, num_bessel: 4, radial_mlp: [8], readout_hidden: 4}")
COMMON = ["model.name=equivariant", "model.cutoff=3.0", "data.batch_size=4",
          "data.val_fraction=0.25", "logging.plots=false", "logging.progress_bar=false",
          "ema.enabled=false", "precision=fp64", "loss.energy.weight=10.0",
          "loss.forces.weight=1.0"]


def tiny_equivariant(species=(29,)):
    torch.manual_seed(0)
    model = build("equivariant", species=list(species), cutoff=3.0, channels=8, l_max=1,
                  hidden_l_max=0, num_interactions=2, correlation=2, num_bessel=4,
                  radial_mlp=[8], readout_hidden=4).double()
    model.set_statistics(e0={29: -0.3, 79: -0.2}, scale=0.8, shift=0.05)
    return model


def graphs(n=3, seed=0):
    return [from_ase(a, dtype=torch.float64) for a in generate_emt(n, ["Cu"], seed)]


def _write(path, atoms, shift=0.0):
    for a in atoms:
        calc = a.calc
        calc.results["energy"] = calc.results["energy"] + shift * len(a)
    write(path, atoms)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Pretraining, replay (its reference) and new data (shifted by SHIFT eV/atom)."""
    d = tmp_path_factory.mktemp("mh")
    _write(d / "pre.xyz", generate_emt(24, ["Cu"], 0))
    _write(d / "replay.xyz", generate_emt(20, ["Cu"], 1))
    _write(d / "new.xyz", generate_emt(20, ["Cu"], 2), SHIFT)
    return d


@pytest.fixture(scope="module")
def pretrained(data, tmp_path_factory):
    from xnn.app.train import train

    out = tmp_path_factory.mktemp("pre") / "run"
    train(load_config(TrainConfig, None, [
        *COMMON, TINY, f"data.datasets.0.path={data / 'pre.xyz'}", f"output_dir={out}",
        "max_epochs=15", "optim.lr=0.01"]))
    return out / "model.pt"


def _finetune(out, data, pretrained, *extra) -> dict:
    from xnn.app.train import train

    cfg = load_config(TrainConfig, None, [
        *COMMON, f"data.datasets.0.path={data / 'new.xyz'}",
        f"data.replay.0.path={data / 'replay.xyz'}", f"output_dir={out}",
        f"pretrained={pretrained}", "max_epochs=4", "optim.lr=0.005", *extra])
    train(cfg)
    return json.loads((out / "summary.json").read_text())


def _energy_mae(model, head, frames) -> float:
    """Energy MAE (meV/atom) of ``model``'s head ``head`` on labelled ASE ``frames``."""
    calc = Calculator(model, device="cpu", head=head)
    return float(np.mean([abs(calc.get_potential_energy(a.copy()) - a.get_potential_energy())
                          / len(a) for a in frames])) * 1000


# --------------------------------------------------------------------------- the model
def test_untrained_replay_head_is_the_pretrained_model_bitwise():
    """(b) Every head of a fresh multi-head copy predicts exactly what the model did:
    energies, forces and stress bitwise, through the calculator's ``head=``."""
    from ase.build import bulk

    model = tiny_equivariant()
    multi = make_multihead(model, ["default", "replay"])
    atoms = bulk("Cu", cubic=True).repeat(2)
    atoms.rattle(0.05, seed=1)
    ref = Calculator(model, device="cpu")
    for head in ("replay", "default", None):
        calc = Calculator(multi, device="cpu", head=head)
        for prop in ("energy", "forces", "stress", "energies"):
            a, b = ref.get_property(prop, atoms.copy()), calc.get_property(prop, atoms.copy())
            assert np.array_equal(a, b), (head, prop)
    assert multi.selected_head == "default"  # the calculator chose on a copy


def test_each_structure_takes_its_heads_energy():
    """A batch mixing heads gives every structure the energy of its own head, and the
    gradient of a structure's energy reaches only its head's readout."""
    model = make_multihead(tiny_equivariant(), ["default", "replay"])
    model.set_head_statistics("replay", e0={29: 1.7}, shift=-0.2)
    with torch.no_grad():  # make the readouts differ too
        model.readout_heads[1].readouts[0].weight.mul_(1.5)
    gs = graphs(4)
    pot = Potential(model)
    alone = {h: [float(Potential(model.with_head(h))(g, forces=False)[K.ENERGY])
                 for g in gs] for h in ("default", "replay")}
    assert all(abs(a - b) > 1e-3 for a, b in zip(alone["default"], alone["replay"]))
    heads = [0, 1, 1, 0]
    batch = AtomicGraph.concat([g.replace({K.HEAD: torch.tensor([h])})
                                for g, h in zip(gs, heads)])
    got = pot(batch, forces=False)[K.ENERGY]
    want = [alone[("default", "replay")[h]][k] for k, h in enumerate(heads)]
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-12, atol=1e-10)
    one = AtomicGraph.concat([gs[0].replace({K.HEAD: torch.tensor([1])})])
    model.zero_grad()
    model(pot.neighbors(one)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or not g.any() for n, g in grads.items()
               if n.startswith("readout_heads.0."))
    assert any(g is not None and g.any() for n, g in grads.items()
               if n.startswith("readout_heads.1."))


def test_save_and_load_keep_the_heads(tmp_path):
    """(c) The model file keeps every head, its name and its weights: each head predicts
    bitwise as before the round trip; the loaded model selects the first head."""
    model = make_multihead(tiny_equivariant(), ["new", "replay"])
    model.set_head_statistics("new", e0={29: 0.4})
    save_model(model, tmp_path / "m.pt")
    loaded = load_model(tmp_path / "m.pt")
    assert loaded.head_names == ("new", "replay")
    assert loaded.selected_head == "new"
    assert loaded.e0[29] == pytest.approx(0.4)
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)
    g = graphs(1)[0]
    for head in ("new", "replay"):
        a = Potential(model.with_head(head))(g)
        b = Potential(loaded.double().with_head(head))(g)
        assert torch.equal(a[K.ENERGY], b[K.ENERGY]) and torch.equal(a[K.FORCES], b[K.FORCES])


def test_unknown_head_is_refused_listing_the_heads(tmp_path):
    """(d) An unknown head name is refused in one line that lists the heads; a model
    without heads refuses any head name, and a model that cannot have heads refuses
    multi-head fine-tuning."""
    model = make_multihead(tiny_equivariant(), ["default", "replay"])
    with pytest.raises(InputError, match=r"head='dft'.*its heads are \['default', 'replay'\]"):
        Calculator(model, device="cpu", head="dft")
    with pytest.raises(InputError, match="single readout"):
        select_head(tiny_equivariant(), "replay")
    schnet = build("schnet", species=[29], cutoff=3.0)
    with pytest.raises(InputError, match="cannot carry several readout heads"):
        make_multihead(schnet, ["default", "replay"])
    with pytest.raises(InputError, match="single readout"):
        Calculator(schnet, device="cpu", head="default")
    with pytest.raises(InputError, match="listed twice"):
        make_multihead(tiny_equivariant(), ["a", "a"])
    save_model(model, tmp_path / "m.pt")
    from xnn.app.md_setup import load_model as md_load
    from xnn.config.model import ModelConfig

    chosen = md_load(ModelConfig(file=str(tmp_path / "m.pt"), head="replay"),
                     torch.device("cpu"), torch.float64)
    assert chosen.selected_head == "replay"
    with pytest.raises(InputError, match=r"its heads are \['default', 'replay'\]"):
        md_load(ModelConfig(file=str(tmp_path / "m.pt"), head="x"), torch.device("cpu"),
                torch.float64)


def test_head_settings_are_checked_by_the_config(data):
    base = [*COMMON, f"data.datasets.0.path={data / 'new.xyz'}"]
    with pytest.raises(ConfigError, match="data.datasets.0.head names a readout head"):
        load_config(TrainConfig, None, [*base, "data.datasets.0.head=x", "pretrained=m.pt"])
    with pytest.raises(ConfigError, match="finetune.heads=true adds readout heads"):
        load_config(TrainConfig, None, [*base, "finetune.heads=true"])
    with pytest.raises(ConfigError, match="model.head is a setting of xnn md"):
        load_config(TrainConfig, None, [*base, "model.head=replay"])
    # multi-head runs decompose and compile (tests/test_cp_training.py, _compiled_training)
    for extra in ("parallel.dd=2", "compile=true"):
        cfg = load_config(TrainConfig, None, [*base, "finetune.heads=true", "pretrained=m.pt",
                                              extra])
        assert cfg.finetune.heads and (cfg.compile or cfg.parallel.dd == 2)


# --------------------------------------------------------------------------- training
def test_two_heads_fit_two_references_that_one_head_cannot(tmp_path, data, pretrained):
    """(a) New data whose energies are shifted by SHIFT eV/atom from the replay data's
    (another DFT reference): with two heads both validation errors stay low; a single
    head cannot fit both references (measured, asserted with a margin). The model file
    keeps both heads, and on the replay structures the replay head is the one to ask."""
    multi = _finetune(tmp_path / "multi", data, pretrained, "finetune.heads=true")
    single = _finetune(tmp_path / "single", data, pretrained)
    m, s = multi["metrics"], single["metrics"]
    worst_multi = max(m["val_energy_mae"], m["val_replay_energy_mae"])
    worst_single = max(s["val_energy_mae"], s["val_replay_energy_mae"])
    print(f"energy MAE (meV/atom) new/replay: two heads {m['val_energy_mae']:.4f}/"
          f"{m['val_replay_energy_mae']:.4f}, one head {s['val_energy_mae']:.4f}/"
          f"{s['val_replay_energy_mae']:.4f}")
    assert worst_single > 0.1 * SHIFT
    assert worst_multi < 0.25 * worst_single
    model = load_model(tmp_path / "multi" / "model.pt")
    assert model.head_names == ("default", "replay")
    # the replay head keeps the pretrained E0s, the new head took the shift into its own
    e0_pre = load_model(pretrained).e0[29]
    assert model.with_head("replay").e0[29] == e0_pre
    assert model.e0[29] - e0_pre == pytest.approx(SHIFT, abs=0.1)
    frames = read(data / "replay.xyz", ":")
    errors = {head: _energy_mae(model, head, frames) for head in ("default", "replay")}
    assert errors["replay"] < 0.25 * errors["default"]


def test_heads_are_named_parts():
    """``readout`` covers every head, ``readout.K`` layer K of every head, ``head.NAME`` one
    head; freezing ``head.replay`` leaves the other head and the body trainable."""
    from xnn.training.finetune import freeze, part_parameters

    model = make_multihead(tiny_equivariant(), ["default", "replay"])
    every = {n for n, _ in model.named_parameters()}
    readout = set(part_parameters(model, "readout"))
    assert readout == set(part_parameters(model, "head.default")) | set(
        part_parameters(model, "head.replay"))
    assert {*part_parameters(model, "embedding"), *part_parameters(model, "interactions"),
            *readout} == every
    layer0 = set(part_parameters(model, "readout.0"))
    assert {n.split(".")[1] for n in layer0} == {"0", "1"}  # both heads
    frozen = set(freeze(model, ["head.replay"]))
    assert frozen == set(part_parameters(model, "head.replay"))
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == frozen


@pytest.mark.slow
def test_sevenn_heads(tmp_path):
    """SevenNet-0 with two heads: the untrained ``replay`` head is SevenNet-0 bitwise (one
    thread: SevenNet's CPU scatter sums are not ordered with several), a batch mixing heads
    gives each structure its head's energy, and the model file keeps the heads."""
    pytest.importorskip("sevenn")
    from ase.build import bulk

    from xnn.models.external.sevenn import SevenNetWrapper

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = SevenNetWrapper("7net-0")
        multi = make_multihead(model, ["default", "replay"])
        atoms = bulk("Cu", cubic=True)
        atoms.rattle(0.05, seed=1)
        ref = Calculator(model, device="cpu", dtype=torch.float32)
        calc = Calculator(multi, device="cpu", dtype=torch.float32, head="replay")
        for prop in ("energy", "forces", "stress"):
            assert np.array_equal(ref.get_property(prop, atoms.copy()),
                                  calc.get_property(prop, atoms.copy())), prop
        multi.set_head_statistics("default", e0={29: 0.25})
        save_model(multi, tmp_path / "m.pt")
        loaded = load_model(tmp_path / "m.pt")
        assert loaded.head_names == ("default", "replay") and loaded.e0[29] == 0.25
        assert {"head.default", "head.replay", "readout"} <= set(loaded.parts())
        g = from_ase(atoms, dtype=torch.float32)
        batch = AtomicGraph.concat([g.replace({K.HEAD: torch.tensor([h])}) for h in (0, 1)])
        e = Potential(loaded)(batch, forces=False)[K.ENERGY]
        e_ref = ref.get_potential_energy(atoms.copy())
        np.testing.assert_allclose(e.numpy(), [e_ref + 0.25 * len(atoms), e_ref], rtol=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_multihead_run_resumes_bitwise(tmp_path, data, pretrained):
    """A multi-head run (heads named per entry) stopped after one epoch and resumed ends
    bitwise where the uninterrupted run does (the heads are rebuilt, then restored)."""
    named = ["finetune.heads=true", "data.datasets.0.head=pbe", "max_epochs=2"]
    _finetune(tmp_path / "full", data, pretrained, *named)
    _finetune(tmp_path / "part", data, pretrained, *named[:2], "max_epochs=1")
    _finetune(tmp_path / "part", data, pretrained, *named, "resume=auto")
    full = load_model(tmp_path / "full" / "model.pt")
    part = load_model(tmp_path / "part" / "model.pt")
    assert full.head_names == part.head_names == ("pbe", "replay")
    a, b = full.state_dict(), part.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rank_finetune(rank, world, data, pretrained, out, dd=1):
    """The multi-head fine-tuning on ``world`` ranks: data parallel, or ``dd`` ranks
    decomposing each structure (context parallel)."""
    from xnn.app.train import train
    from xnn.distributed.entries import parallelize_train
    from xnn.distributed.manager import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    plan = parallelize_train(manager, world // dd, dd)
    cfg = load_config(TrainConfig, None, [
        *COMMON, f"data.datasets.0.path={data / 'new.xyz'}",
        f"data.replay.0.path={data / 'replay.xyz'}", f"output_dir={out}",
        f"pretrained={pretrained}", "max_epochs=2", "optim.lr=0.005", "device=cpu",
        "finetune.heads=true", f"parallel.dp={world // dd}", f"parallel.dd={dd}"])
    return train(cfg, parallel=plan)["metrics"]


@pytest.mark.distributed
@pytest.mark.parametrize("dd", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_ranks_train_the_heads_as_one_process(tmp_path, data, pretrained, dd):
    """On 2 gloo ranks, data parallel (dd=1: batches mixing heads shared between the ranks)
    or context parallel (dd=2: each structure decomposed over both ranks, its head with its
    atoms), every head ends as in the one-process run (fp64, 1e-10 relative)."""
    from dist_helpers import spawn

    one = _finetune(tmp_path / "one", data, pretrained, "finetune.heads=true", "max_epochs=2")
    torch.set_num_threads(1)
    results = spawn(_rank_finetune, 2, args=(data, pretrained, tmp_path / "two", dd),
                    timeout_s=600)
    a = load_model(tmp_path / "one" / "model.pt").state_dict()
    b = load_model(tmp_path / "two" / "model.pt").state_dict()
    assert any(k.startswith("readout_heads.1.") for k in a)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-10, atol=1e-12)
    for r in results:
        assert r["val_replay_energy_mae"] == pytest.approx(
            one["metrics"]["val_replay_energy_mae"], rel=1e-8)


def test_md_with_the_replay_head_is_md_with_the_pretrained_model(tmp_path, capsys):
    """``xnn md model.head=replay`` of an untrained two-head file runs the pretrained
    model's trajectory bitwise (thermo.csv), ``model.head=default`` after an E0 change
    another one; an unknown head stops the command with one line listing the heads."""
    from ase.build import bulk

    from xnn.cli.main import main

    model = tiny_equivariant()
    multi = make_multihead(model, ["default", "replay"])
    multi.set_head_statistics("default", e0={29: 0.7})
    save_model(model, tmp_path / "pre.pt")
    save_model(multi, tmp_path / "multi.pt")
    atoms = bulk("Cu", cubic=True).repeat(2)
    atoms.rattle(0.05, seed=3)
    write(tmp_path / "cu.xyz", atoms)

    def md(name, model_file, *extra):
        rc = main(["md", f"structure={tmp_path / 'cu.xyz'}", f"model.file={model_file}",
                   f"output.dir={tmp_path / name}", "ensemble=nve", "steps=4",
                   "temperature=300", "output.plot=false", "output.progress=false", *extra])
        assert rc == 0
        return (tmp_path / name / "thermo.csv").read_text()

    pre = md("pre", tmp_path / "pre.pt")
    assert md("replay", tmp_path / "multi.pt", "model.head=replay") == pre
    assert md("default", tmp_path / "multi.pt") != pre
    assert main(["md", f"structure={tmp_path / 'cu.xyz'}",
                 f"model.file={tmp_path / 'multi.pt'}", f"output.dir={tmp_path / 'x'}",
                 "model.head=dft", "steps=1"]) != 0
    assert "its heads are ['default', 'replay']" in capsys.readouterr().err


def test_eval_cli_head(tmp_path, data, capsys):
    """``xnn eval --head``: each head's errors; an unknown head is one line listing them."""
    from xnn.cli.main import main

    multi = make_multihead(tiny_equivariant(), ["default", "replay"])
    multi.set_head_statistics("default", e0={29: -0.3 + SHIFT})
    save_model(multi, tmp_path / "m.pt")
    mae = {}
    for head in ("default", "replay"):
        out = tmp_path / f"{head}.json"
        assert main(["eval", str(tmp_path / "m.pt"), str(data / "new.xyz"), "--head", head,
                     "--json", str(out), "--plot", str(tmp_path / f"{head}.png")]) == 0
        mae[head] = json.loads(out.read_text())["energy_mae"]
    frames = read(data / "new.xyz", ":")
    for head in ("default", "replay"):  # the errors of that head's predictions
        assert mae[head] == pytest.approx(_energy_mae(multi, head, frames), rel=1e-9)
    assert abs(mae["default"] - mae["replay"]) > 1.0
    assert main(["eval", str(tmp_path / "m.pt"), str(data / "new.xyz"), "--head", "x"]) != 0
    assert "its heads are ['default', 'replay']" in capsys.readouterr().err
