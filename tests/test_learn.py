"""``xnn learn``: the active-learning loop (issue 46, item 4).

The descriptor's invariances, farthest-point selection against a brute-force greedy, content
hashes, the labeller's trust rule and config checks; then the loop as a command (real
subprocesses): killed with SIGKILL during labelling and during training and run again, it
ends with the uninterrupted run's dataset, and no structure is labelled twice (a counting
labeller logs every calculation by structure hash).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from xnn.app import learn_label as ll
from xnn.app import learn_select as ls
from xnn.config.learn import LabelConfig, LearnConfig
from xnn.config.loader import ConfigError, load_config
from xnn.errors import InputError, TrustError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "learn" / "loop.yaml"
#: a small loop: one acquisition round (round 0) and the final training (round 1)
EPOCHS = 4
FAST = ["rounds=1", "train.committee=2", f"train.config.max_epochs={EPOCHS}", "explore.starts=2",
        "explore.sample_every=10", "explore.stages.0.steps=40", "explore.stages.1.steps=40",
        "select.threshold=0.0", "select.ceiling=null", "select.budget=4", "test=null",
        "label.calculator=helpers.labellers:counting_emt", "label.trust=true"]


def _fcc(seed: int, n: int = 12) -> list:
    """``n`` EMT-labelled rattled FCC Cu cells (32 atoms)."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
        a.positions += rng.normal(0.0, 0.03, size=a.positions.shape)
        a.calc = EMT()
        res = {"energy": a.get_potential_energy(), "forces": a.get_forces(),
               "stress": a.get_stress(voigt=False)}
        a.calc = SinglePointCalculator(a, **res)
        out.append(a)
    return out


# ------------------------------------------------------------------------------ descriptor
def test_descriptor_invariances():
    """Translation, rotation, permutation and supercell leave the descriptor unchanged; a
    displacement changes it."""
    from ase.build import bulk

    a = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    a.numbers[[1, 5]] = 79
    a.positions += np.random.default_rng(0).normal(0.0, 0.05, size=a.positions.shape)
    pairs = ls.element_pairs(a.numbers)
    assert pairs == [(29, 29), (29, 79), (79, 79)]
    d0 = ls.descriptor(a, pairs, 5.0, 20)
    b = a.copy()
    b.positions += [0.3, -1.2, 2.0]
    b.rotate(37, "z", rotate_cell=True)
    b.rotate(11, "x", rotate_cell=True)
    perm = np.random.default_rng(1).permutation(len(b))
    b = b[perm]
    np.testing.assert_allclose(ls.descriptor(b, pairs, 5.0, 20), d0, atol=1e-12)
    np.testing.assert_allclose(ls.descriptor(a.repeat((2, 1, 1)), pairs, 5.0, 20), d0,
                               atol=1e-12)
    c = a.copy()
    c.positions[0] += [0.4, 0.0, 0.0]
    assert np.linalg.norm(ls.descriptor(c, pairs, 5.0, 20) - d0) > 1e-3


def _greedy(cand, scores, ref, threshold, budget, ceiling=np.inf):
    """Farthest-point sampling written directly from its definition (brute force), among the
    candidates scored in ``(threshold, ceiling]``."""
    chosen, out = [], []
    low = -np.inf if threshold is None else threshold
    eligible = [i for i in range(len(cand)) if low < scores[i] <= ceiling]
    while eligible and len(out) < budget:
        def far(i):
            pts = [*ref, *(cand[j] for j in chosen)]
            return min((float(np.linalg.norm(cand[i] - p)) for p in pts), default=np.inf)
        best = max(eligible, key=lambda i: (far(i), scores[i], -i))
        out.append((best, far(best)))
        chosen.append(best)
        eligible.remove(best)
    return out


def test_farthest_point_selection_equals_brute_force():
    rng = np.random.default_rng(3)
    cand, ref = rng.normal(size=(40, 5)), rng.normal(size=(7, 5))
    scores = rng.uniform(0.0, 0.2, size=40)
    for threshold, budget, reference in ((0.05, 10, ref), (0.0, 40, ref), (0.15, 5, ref[:0]),
                                         (0.3, 5, ref)):
        picks = ls.farthest_point_selection(cand, scores, reference, threshold, budget)
        want = _greedy(cand, scores, reference, threshold, budget)
        assert [p.index for p in picks] == [i for i, _ in want]
        np.testing.assert_allclose([p.distance for p in picks], [d for _, d in want])
        assert all(p.score > threshold for p in picks)
    # a ceiling: candidates scored above it are not eligible (an upper trust level)
    for threshold, ceiling, budget in ((0.05, 0.15, 6), (None, 0.1, 40), (0.0, 0.01, 5)):
        picks = ls.farthest_point_selection(cand, scores, ref, threshold, budget, ceiling)
        want = _greedy(cand, scores, ref, threshold, budget, ceiling)
        assert [p.index for p in picks] == [i for i, _ in want]
        assert all(p.score <= ceiling for p in picks)
    assert not ls.eligible(0.3, 0.1, 0.2) and ls.eligible(0.2, 0.1, 0.2)
    # a candidate equal to a training structure is picked last
    cand2 = np.vstack([ref[0], ref[0] + 1.0])
    picks = ls.farthest_point_selection(cand2, np.array([1.0, 0.5]), ref, 0.0, 2)
    assert [p.index for p in picks] == [1, 0] and picks[1].distance == 0.0


# ------------------------------------------------------------------------ labels and trust
def test_structure_hash_is_content():
    a = _fcc(0, 1)[0]
    b = a.copy()
    assert ll.structure_hash(a) == ll.structure_hash(b)
    b.positions[3, 1] = np.nextafter(b.positions[3, 1], np.inf)
    assert ll.structure_hash(a) != ll.structure_hash(b)
    c = a.copy()
    c.numbers[0] = 79
    assert ll.structure_hash(a) != ll.structure_hash(c)


def test_user_labeller_needs_trust(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    cfg = LabelConfig(calculator="helpers.labellers:counting_emt")
    with pytest.raises(TrustError, match="label.trust=true"):
        ll.labeller_factory(cfg)
    factory = ll.labeller_factory(LabelConfig(calculator="helpers.labellers:counting_emt",
                                              trust=True))
    assert type(factory()).__name__ == "CountingEMT"
    with pytest.raises(ConfigError, match="package.module:factory"):
        LabelConfig(calculator="vasp")


def test_label_one_matches_emt():
    from ase.calculators.emt import EMT

    a = _fcc(1, 1)[0]
    want_e, want_f = a.get_potential_energy(), a.get_forces()
    a.calc = None
    out = ll.label_one(a, EMT(), stress=True)
    assert out.get_potential_energy() == want_e
    np.testing.assert_array_equal(out.get_forces(), want_f)
    assert out.get_stress().shape == (6,)


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="set by the loop"):
        load_config(LearnConfig, EXAMPLE, ["train.config.output_dir=x"])
    with pytest.raises(ConfigError, match="initial is empty"):
        load_config(LearnConfig, EXAMPLE, ["initial="])
    with pytest.raises(ConfigError, match="not an option of a nvt stage"):
        load_config(LearnConfig, EXAMPLE, ["explore.stages.0.fmax=0.1"])
    cfg = load_config(LearnConfig, EXAMPLE, ["train.config.optim.lr=-1"])
    from xnn.app.learn_train import train_config

    with pytest.raises(ConfigError, match="optim.lr"):
        train_config(cfg, ["x.xyz"], tmp_path)
    # one spelling of the committee: train.committee (train.members refused, naming it)
    with pytest.raises(ConfigError, match="train.members=3 was replaced: write train.committee: 3"):
        load_config(LearnConfig, EXAMPLE, ["train.members=3"])
    with pytest.raises(ConfigError, match="train.committee"):
        load_config(LearnConfig, EXAMPLE, ["train.committee=1"])
    with pytest.raises(ConfigError, match="train.mode=scratch"):
        load_config(LearnConfig, EXAMPLE, ["train.bootstrap=true", "train.mode=finetune"])
    with pytest.raises(ConfigError, match="select.ceiling"):
        load_config(LearnConfig, EXAMPLE, ["select.ceiling=0"])
    assert load_config(LearnConfig, EXAMPLE, ["select.ceiling=1.5"]).select.ceiling == 1.5
    cfg = load_config(LearnConfig, EXAMPLE, ["train.config.committee={size: 4}"])
    with pytest.raises(ConfigError, match="committee.size: the loop sets it"):
        train_config(cfg, ["x.xyz"], tmp_path)
    boot = train_config(load_config(LearnConfig, EXAMPLE, ["train.committee=4", "seed=5",
                                                           "train.bootstrap=true"]),
                        ["x.xyz"], tmp_path)
    assert (boot.committee.size, boot.committee.bootstrap, boot.seed) == (4, True, 5)
    assert boot.committee.seeds is None  # xnn train's default: member k seeded seed + k
    # a train YAML, the inline keys on top, the loop's data, folder and seed last
    cfg = load_config(LearnConfig, EXAMPLE, [f"train.file={ROOT / 'examples' / 'train_emt.yaml'}",
                                             "train.config=null", "train.config.max_epochs=2"])
    tc = train_config(cfg, ["a.xyz", "b.xyz"], tmp_path / "m1", pretrained="p.pt")
    assert tc.model.name == "schnet" and tc.model.hyperparameters == {}  # kept: pretrained
    assert tc.committee.size == 1  # a pretrained committee file is trained on as it is
    assert tc.max_epochs == 2 and tc.loss.stress.weight == 10.0  # train_emt.yaml's
    assert [d.path for d in tc.data.datasets] == ["a.xyz", "b.xyz"]
    assert (tc.output_dir, tc.seed, tc.pretrained) == (str(tmp_path / "m1"), 0, "p.pt")
    scratch = train_config(cfg, ["a.xyz"], tmp_path / "m0")
    assert scratch.model.hyperparameters["num_features"] == 32 and scratch.pretrained is None
    assert (scratch.committee.size, scratch.committee.bootstrap) == (3, False)


def test_open_loop_continues_only_the_same_settings(tmp_path):
    from xnn.app.learn import open_loop

    out = tmp_path / "loop"
    base = [f"initial={tmp_path / 'x.xyz'}", f"output={out}"]
    loop = open_loop(load_config(LearnConfig, EXAMPLE, base))
    assert not loop.continued and (out / "settings.yaml").is_file()
    again = open_loop(load_config(LearnConfig, EXAMPLE, [*base, "rounds=7"]))
    assert again.continued  # more rounds: the same loop
    with pytest.raises(InputError, match="other settings"):
        open_loop(load_config(LearnConfig, EXAMPLE, [*base, "select.budget=3"]))
    # a loop saved before a key existed (select.ceiling) continues with it at its default
    # (null), and only then
    saved = out / "settings.yaml"
    saved.write_text(saved.read_text().replace("  ceiling: 1.0\n", ""))
    assert "ceiling" not in saved.read_text()
    assert open_loop(load_config(LearnConfig, EXAMPLE, [*base, "select.ceiling=null"])).continued
    with pytest.raises(InputError, match="other settings"):  # the example's 1.0 is another
        open_loop(load_config(LearnConfig, EXAMPLE, base))
    with pytest.raises(InputError, match="resume=true"):
        open_loop(load_config(LearnConfig, EXAMPLE, [*base, "resume=false"]))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "file").write_text("x")
    with pytest.raises(InputError, match="not a learning loop"):
        open_loop(load_config(LearnConfig, EXAMPLE, [*base, f"output={tmp_path / 'other'}"]))


# ---------------------------------------------------------------------- the loop, killed
def _env(log: Path, hold_at: int = 0) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
            "XNN_TEST_LABEL_LOG": str(log), "XNN_TEST_LABEL_HOLD_AT": str(hold_at)}


def _cmd(initial: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "xnn", "learn", str(EXAMPLE), f"initial={initial}",
            f"output={out}", *FAST]


def _run(initial: Path, out: Path, log: Path) -> None:
    done = subprocess.run(_cmd(initial, out), env=_env(log), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _kill_when(initial: Path, out: Path, log: Path, ready, hold_at: int = 0) -> None:
    """Start the loop, SIGKILL it as soon as ``ready()`` holds (``hold_at``: the labeller's
    call of that number waits to be killed)."""
    proc = subprocess.Popen(_cmd(initial, out), env=_env(log, hold_at),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while proc.poll() is None and not ready():
            time.sleep(0.02)
        assert proc.poll() is None, "the loop ended before it could be killed: " + \
            proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def _calls(log: Path) -> tuple[list[str], list[str]]:
    lines = log.read_text().split() if log.is_file() else []
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    return [h for k, h in pairs if k == "start"], [h for k, h in pairs if k == "end"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    import ase.io

    d = tmp_path_factory.mktemp("learn")
    initial = d / "initial.xyz"
    ase.io.write(initial, _fcc(0), format="extxyz")
    out, log = d / "full", d / "full.log"
    _run(initial, out, log)
    return initial, out, log


def _same_dataset(out: Path, full: Path) -> None:
    for name in ("candidates.extxyz", "selected.extxyz", "labelled.extxyz"):
        assert (out / "round_000" / name).read_bytes() == \
            (full / "round_000" / name).read_bytes(), name
    assert (out / "learning_curve.csv").read_text() == (full / "learning_curve.csv").read_text()


def test_uninterrupted_loop_files(uninterrupted):
    import yaml

    _, out, log = uninterrupted
    starts, ends = _calls(log)
    assert len(ends) == 4 and sorted(starts) == sorted(ends) and len(set(ends)) == 4
    labelled = ll.read_frames(out / "round_000" / "labelled.extxyz")
    selected = ll.read_frames(out / "round_000" / "selected.extxyz")
    assert [ll.structure_hash(a) for a in selected] == ends
    assert [a.info["learn_hash"] for a in labelled] == ends
    for s in selected:
        assert s.info["score"] > 0 and "distance" in s.info and "learn_source" in s.info
    events = [json.loads(line) for line in (out / "journal.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("selected") == 4 and kinds.count("labelled") == 4
    assert kinds.count("round_done") == 2 and kinds[-1] == "finished"
    rows = (out / "learning_curve.csv").read_text().splitlines()
    assert rows[1].startswith("0,12,") and rows[2].startswith("1,16,")
    assert (out / "learning_curve.png").stat().st_size > 0
    for r in ("round_000", "round_001"):
        assert (out / r / "model.pt").is_file() and (out / r / "summary.json").is_file()
        # the committee: one xnn train run of committee.size=2, its model file the round's
        assert (out / r / "model.pt").read_bytes() == (out / r / "train" / "model.pt").read_bytes()
        assert yaml.safe_load((out / r / "train" / "config.yaml").read_text())["committee"][
            "size"] == 2
    # scores are calibrated spreads; the raw ones are logged beside them
    import torch

    from xnn.app.learn_train import load_committee, score

    model = load_committee(out / "round_000" / "model.pt", torch.device("cpu"))
    factor = model.calibration["forces"]
    row = json.loads((out / "round_000" / "summary.json").read_text())
    assert row["forces_calibration"] == factor and factor != 1.0  # fitted on validation
    candidates = ll.read_frames(out / "round_000" / "candidates.extxyz")
    np.testing.assert_allclose([a.info["score"] for a in candidates[:5]],
                               score(model, candidates[:5]), rtol=1e-9)
    for a in (*candidates, *selected):
        assert a.info["score_raw"] == pytest.approx(a.info["score"] / factor, rel=1e-12)


def test_kill_during_labelling_resumes_without_relabelling(uninterrupted, tmp_path):
    initial, full, _ = uninterrupted
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    _kill_when(initial, out, log, lambda: len(_calls(log)[0]) >= 3, hold_at=3)
    starts, ends = _calls(log)
    assert len(ends) == 2 and len(starts) == 3  # killed in the third calculation
    assert len(list((out / "labels").glob("*.extxyz"))) == 2
    _run(initial, out, log)
    starts, ends = _calls(log)
    assert len(ends) == 4 and len(set(ends)) == 4  # each structure's label computed once
    assert len(starts) == 5 and starts.count(starts[2]) == 2  # only the killed one again
    _same_dataset(out, full)
    kinds = [json.loads(x)["event"] for x in (out / "journal.jsonl").read_text().splitlines()]
    assert "resume" in kinds and kinds.count("label_skipped") == 2


def test_kill_during_training_resumes_from_checkpoint(uninterrupted, tmp_path):
    initial, full, _ = uninterrupted
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    run = out / "round_000" / "train"  # the committee's one xnn train run
    _kill_when(initial, out, log, lambda: (run / "checkpoints" / "last.pt").is_file())
    assert not (run / "summary.json").is_file() and not log.is_file()
    _run(initial, out, log)
    starts, ends = _calls(log)
    assert len(ends) == 4 and sorted(starts) == sorted(ends) and len(set(ends)) == 4
    _same_dataset(out, full)
    metrics = (run / "metrics.csv").read_text().splitlines()
    assert len(metrics) == 1 + EPOCHS  # resumed: every epoch once


def test_kill_during_exploration_resumes_the_campaign(uninterrupted, tmp_path):
    initial, full, _ = uninterrupted
    out, log = tmp_path / "killed", tmp_path / "killed.log"
    explore = out / "round_000" / "explore"
    _kill_when(initial, out, log, lambda: (explore / "checkpoint.pt").is_file())
    assert not (explore / "summary.json").is_file() and not log.is_file()
    _run(initial, out, log)
    starts, ends = _calls(log)
    assert len(ends) == 4 and sorted(starts) == sorted(ends)
    _same_dataset(out, full)


def test_finetune_mode_trains_on_from_the_previous_committee(uninterrupted, tmp_path):
    """train.mode=finetune: round 1's one run goes on training round 0's committee file."""
    import torch
    import yaml

    from xnn.app.learn import run_learn
    from xnn.app.learn_train import load_committee

    initial = uninterrupted[0]
    cfg = load_config(LearnConfig, EXAMPLE, [f"initial={initial}", f"output={tmp_path / 'ft'}",
                                             "train.mode=finetune", "label.calculator=emt",
                                             *FAST[:-2]])
    out = run_learn(cfg)
    used = yaml.safe_load((out / "round_001" / "train" / "config.yaml").read_text())
    assert used["pretrained"] == str(out / "round_000" / "model.pt")
    assert used["seed"] == 0 and used["committee"]["size"] == 1  # the file's committee
    assert used["data"]["datasets"][1]["path"] == str(out / "round_000" / "labelled.extxyz")
    first = yaml.safe_load((out / "round_000" / "train" / "config.yaml").read_text())
    assert first["pretrained"] is None and first["committee"]["size"] == 2
    m0, m1 = (load_committee(out / f"round_{r:03d}" / "model.pt", torch.device("cpu"))
              for r in range(2))
    assert m1.committee_size == 2
    w0, w1 = m0.state_dict(), m1.state_dict()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # trained on
    # continued with one more round: round 1, which only trained, now acquires; round 2 trains
    before = (out / "round_001" / "model.pt").read_bytes()
    run_learn(dataclasses.replace(cfg, rounds=2))
    rows = [json.loads((out / f"round_{r:03d}" / "summary.json").read_text()) for r in range(3)]
    assert [r["n_train"] for r in rows] == [12, 16, 20]
    assert rows[1]["n_selected"] == 4 and rows[2]["n_selected"] is None
    assert (out / "round_001" / "model.pt").read_bytes() == before  # not trained again
    assert len((out / "learning_curve.csv").read_text().splitlines()) == 4


# ------------------------------------------------------------------ committee and scores
def _schnet(seed: int):
    import torch

    from xnn.models import build

    torch.manual_seed(seed)
    return build("schnet", cutoff=4.0, species=[29], num_features=8, num_filters=8,
                 num_interactions=2, num_basis=8)


def test_score_is_the_calibrated_spread_of_the_members_evaluated_alone(tmp_path):
    """A committee file of two members with a forces factor of 3 scores a frame by 3 times
    the largest per-atom std of the two members' forces, each evaluated alone (what
    ``select.threshold`` is compared with); the raw score divides the factor out."""
    import torch

    from xnn.app import learn_explore as lx
    from xnn.app import learn_train as lt
    from xnn.io.calculator import Calculator
    from xnn.models.committee import Committee
    from xnn.models.serialization import save_model

    paths = [tmp_path / f"m{k}.pt" for k in range(2)]
    members = [_schnet(k) for k in range(2)]
    for m, p in zip(members, paths, strict=True):
        save_model(m, p)
    save_model(Committee(members, calibration={"forces": 3.0}), tmp_path / "committee.pt")
    model = lt.load_committee(tmp_path / "committee.pt", torch.device("cpu"))
    assert model.committee_size == 2 and lt.forces_factor(model) == 3.0
    frames = _fcc(2, 3)
    forces = []
    for p in paths:
        calc = Calculator(str(p), device="cpu")
        forces.append(np.stack([calc.get_forces(a) for a in frames]))
    mean = (forces[0] + forces[1]) / 2
    std = np.sqrt(((forces[0] - mean) ** 2 + (forces[1] - mean) ** 2).sum(-1) / 2)
    np.testing.assert_allclose(lt.score(model, frames), 3.0 * std.max(axis=1), rtol=1e-9,
                               atol=1e-12)
    scored = lx.with_scores([a.copy() for a in frames], model)
    np.testing.assert_allclose([a.info["score_raw"] for a in scored], std.max(axis=1),
                               rtol=1e-9, atol=1e-12)


def test_selection_without_threshold_takes_every_candidate():
    """select.threshold: null makes every candidate eligible (the budget and farthest-point
    order decide), as a threshold below every score does."""
    rng = np.random.default_rng(5)
    cand, ref = rng.normal(size=(30, 4)), rng.normal(size=(5, 4))
    scores = rng.uniform(0.0, 1.0, size=30)
    free = ls.farthest_point_selection(cand, scores, ref, None, 8)
    low = ls.farthest_point_selection(cand, scores, ref, -1.0, 8)
    assert [p.index for p in free] == [p.index for p in low] and len(free) == 8
    assert [p.index for p in free] == [i for i, _ in _greedy(cand, scores, ref, -1.0, 8)]
    assert ls.eligible(0.0, None) and not ls.eligible(0.1, 0.1) and ls.eligible(0.2, 0.1)
