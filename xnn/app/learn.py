"""``run_learn(config)``: the application behind ``xnn learn loop.yaml``, an active-learning
loop.

Round ``r`` (folder ``round_NNN``), from the initial data plus the labels of rounds ``< r``:

1. train the committee of K members in one ``xnn train`` run (:mod:`xnn.app.learn_train`)
   → ``train/``, ``model.pt`` (calibrated on the run's validation set);
2. evaluate the committee on the test set;
3. draw starts from the dataset → ``starts.extxyz``; explore them through the workflow
   stages (:mod:`xnn.app.learn_explore`) → ``explore/``;
4. score every sampled frame (largest per-atom calibrated committee force std, and the raw
   one) → ``candidates.extxyz``;
5. select, among candidates above the threshold (all with ``threshold: null``), up to
   ``budget`` by farthest-point sampling on a descriptor (:mod:`xnn.app.learn_select`) →
   ``selected.extxyz`` (score, score_raw, distance);
6. label them one by one (:mod:`xnn.app.learn_label`) → ``labels/<hash>.extxyz``, then
   ``labelled.extxyz``;
7. ``summary.json`` (the round is complete), ``learning_curve.csv/png``.

After ``rounds`` such rounds, round ``rounds`` trains on the final data and is evaluated.
Every step writes its file atomically and is skipped when the file is there, so running the
loop again after a kill continues where it stopped: training resumes from its checkpoints,
exploration from its campaign checkpoint, labelling skips every finished label (by content
hash). ``journal.jsonl`` records every decision.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from xnn.app import learn_explore as lx
from xnn.app import learn_label as ll
from xnn.app import learn_report as lr
from xnn.app import learn_select as ls
from xnn.app import learn_train as lt
from xnn.config.learn import LearnConfig
from xnn.errors import InputError


@dataclasses.dataclass
class Loop:
    """A loop's configuration, folder, journal and label store."""

    cfg: LearnConfig
    out: Path
    journal: ll.Journal
    store: ll.LabelStore
    continued: bool = False

    def round_dir(self, r: int) -> Path:
        return self.out / f"round_{r:03d}"

    def datasets(self, r: int) -> list[str]:
        """The training files of round ``r``: the initial data and the non-empty labels of
        the rounds before it."""
        files = [self.cfg.initial]
        for k in range(r):
            p = self.round_dir(k) / "labelled.extxyz"
            if p.stat().st_size > 0:
                files.append(str(p))
        return files


def _settings(cfg: LearnConfig) -> str:
    """The config as YAML without the keys a continued loop may change (rounds, resume)."""
    from xnn.config.loader import to_yaml

    return to_yaml(dataclasses.replace(cfg, rounds=0, resume=True))


def _same_settings(saved: Path, cfg: LearnConfig) -> bool:
    """Whether the loop saved in ``saved`` has the settings of ``cfg``: the same text, or
    the same once read back with today's defaults for keys it predates (a loop started before
    a key existed continues with that key at its default)."""
    from xnn.config.loader import ConfigError, load_config

    if saved.read_text() == _settings(cfg):
        return True
    try:
        return _settings(load_config(LearnConfig, saved)) == _settings(cfg)
    except ConfigError:
        return False


def open_loop(cfg: LearnConfig) -> Loop:
    """Create the loop's folder, or check that the loop found there has these settings.

    Raises:
        InputError: the folder holds a loop with other settings, or one and ``resume=false``.
    """
    from xnn._files import atomic_write_text

    out = Path(cfg.output)
    saved = out / "settings.yaml"
    if saved.is_file():
        if not cfg.resume:
            raise InputError(f"output {str(out)!r} holds a learning loop; run again with "
                             "resume=true to continue it, or choose another output")
        if not _same_settings(saved, cfg):
            raise InputError(f"output {str(out)!r} holds a learning loop with other settings "
                             f"({saved}); continue it with the same config (only rounds may "
                             "change), or choose another output")
    elif out.exists() and any(out.iterdir()):
        raise InputError(f"output {str(out)!r} exists and is not a learning loop; choose "
                         "another output")
    continued = saved.is_file()
    out.mkdir(parents=True, exist_ok=True)
    if not continued:
        atomic_write_text(saved, _settings(cfg))
    return Loop(cfg, out, ll.Journal(out / "journal.jsonl"), ll.LabelStore(out / "labels"),
                continued)


def run_learn(cfg: LearnConfig) -> Path:
    """Run (or continue) the active-learning loop of ``cfg``; returns its folder."""
    from xnn._files import require_file

    require_file(cfg.initial, "initial", InputError)
    if cfg.test:
        require_file(cfg.test, "test", InputError)
    lt.train_config(cfg, [cfg.initial], "check", 0)  # an invalid train config: refused now
    loop = open_loop(cfg)
    done = len(lr.read_summaries(loop.out))
    loop.journal.log("resume" if loop.continued else "start", rounds=cfg.rounds,
                     completed_rounds=done)
    for r in range(cfg.rounds + 1):
        if not complete(loop, r):
            run_round(loop, r)
    loop.journal.log("finished", rounds=cfg.rounds)
    return loop.out


def complete(loop: Loop, r: int) -> bool:
    """Whether round ``r`` is done: its summary is written, and unless it is the last round
    it acquired (a loop continued with more rounds goes on from its former last round, which
    only trained)."""
    path = loop.round_dir(r) / "summary.json"
    if not path.is_file():
        return False
    return r == loop.cfg.rounds or json.loads(path.read_text())["n_selected"] is not None


def run_round(loop: Loop, r: int) -> None:
    """One round (module docstring), each step skipped when its file is there."""
    from xnn.devices import resolve_device

    cfg, rd = loop.cfg, loop.round_dir(r)
    rd.mkdir(exist_ok=True)
    loop.journal.log("round_start", round=r)
    files = loop.datasets(r)
    dataset = [a for f in files for a in ll.read_frames(Path(f))]
    model_path = train_round(loop, r, files)
    model = lt.load_committee(model_path, resolve_device(cfg.explore.device))
    row = {"round": r, "n_train": len(dataset), "forces_calibration": lt.forces_factor(model),
           "n_candidates": None, "n_above": None,
           "n_selected": None, "uncertainty_mean_meV_A": None, "uncertainty_max_meV_A": None,
           "test_forces_mae_meV_A": None, "test_energy_mae_meV_atom": None}
    if cfg.test:
        row.update(lt.test_errors(model, ll.read_frames(Path(cfg.test))))
    if r < cfg.rounds:
        row.update(acquire(loop, r, dataset, model, model_path))
    lr.write_summary(rd / "summary.json", row)
    lr.write_learning_curve(loop.out)
    loop.journal.log("round_done", **row)


def train_round(loop: Loop, r: int, files: list[str]) -> Path:
    """The round's committee: one ``xnn train`` run in ``train/`` (fine-tuning: from the
    previous round's ``model.pt``), its model file copied to ``model.pt``."""
    from xnn._files import atomic_write_bytes

    cfg, rd = loop.cfg, loop.round_dir(r)
    path = rd / "model.pt"
    if path.is_file():
        return path
    pre = None
    if cfg.train.mode == "finetune" and r > 0:
        pre = str(loop.round_dir(r - 1) / "model.pt")
    trained = lt.train_committee(cfg, files, rd / "train", pre)
    atomic_write_bytes(path, trained.read_bytes())
    model = lt.load_committee(path, torch.device("cpu"))
    loop.journal.log("trained", round=r, committee=model.committee_size, mode=cfg.train.mode,
                     pretrained=pre, datasets=files, model=str(path),
                     calibration=dict(model.calibration))
    return path


def acquire(loop: Loop, r: int, dataset: list, model, model_path: Path) -> dict:
    """Steps 3-6 of a round: explore, score, select, label; returns the summary's counts."""
    cfg, rd = loop.cfg, loop.round_dir(r)
    starts = rd / "starts.extxyz"
    if not starts.is_file():
        ll.write_frames(starts, lx.draw_starts(cfg, dataset, r))
    lx.explore(cfg, starts, model_path, rd / "explore", r)
    cand_path = rd / "candidates.extxyz"
    if not cand_path.is_file():
        frames = lx.with_scores(lx.sampled_frames(rd / "explore"), model)
        ll.write_frames(cand_path, frames)
        loop.journal.log("scored", round=r, candidates=len(frames),
                         max_score=max((a.info["score"] for a in frames), default=None),
                         max_score_raw=max((a.info["score_raw"] for a in frames),
                                           default=None),
                         forces_calibration=lt.forces_factor(model))
    candidates = ll.read_frames(cand_path)
    sel_path = rd / "selected.extxyz"
    if not sel_path.is_file():
        ll.write_frames(sel_path, select(loop, r, dataset, candidates))
    selected = ll.read_frames(sel_path)
    for a in selected:
        a.info["learn_hash"] = ll.structure_hash(a)
    labelled = ll.label_all(selected, loop.store, cfg.label, loop.journal, r)
    for a, s in zip(labelled, selected, strict=True):
        a.info.update({"learn_round": r, "learn_hash": s.info["learn_hash"]})
    ll.write_frames(rd / "labelled.extxyz", labelled)
    scores = [a.info["score"] for a in candidates]
    return {"n_candidates": len(candidates),
            "n_above": int(sum(ls.eligible(s, cfg.select.threshold, cfg.select.ceiling)
                           for s in scores)),
            "n_selected": len(selected),
            "uncertainty_mean_meV_A": 1000.0 * float(sum(scores)) / len(scores) if scores else None,
            "uncertainty_max_meV_A": 1000.0 * float(max(scores)) if scores else None}


def select(loop: Loop, r: int, dataset: list, candidates: list) -> list:
    """The candidates chosen for labelling, each with ``score``, ``distance`` and
    ``learn_pick`` in its info; every pick and the counts are journalled."""
    import numpy as np

    sc = loop.cfg.select
    pairs = ls.element_pairs([z for a in (*dataset, *candidates) for z in a.numbers])
    ref = ls.descriptors(dataset, pairs, sc.r_max, sc.bins)
    desc = ls.descriptors(candidates, pairs, sc.r_max, sc.bins)
    scores = np.array([a.info["score"] for a in candidates])
    picks = ls.farthest_point_selection(desc, scores, ref, sc.threshold, sc.budget,
                                        ceiling=sc.ceiling)
    out = []
    for k, p in enumerate(picks):
        a = candidates[p.index].copy()
        a.info.update({"learn_pick": k, "candidate": p.index, "distance": p.distance})
        out.append(a)
        above = ("no threshold" if sc.threshold is None
                 else f"score {p.score:.4f} > threshold {sc.threshold} eV/Å")
        if sc.ceiling is not None:
            above += f", <= ceiling {sc.ceiling} eV/Å"
        loop.journal.log("selected", round=r, pick=k, candidate=p.index,
                         source=a.info.get("learn_source"), score=p.score,
                         score_raw=a.info["score_raw"], distance=p.distance,
                         why=f"{above}; farthest remaining candidate (descriptor distance "
                             f"{p.distance:.4f})")
    loop.journal.log("selection", round=r, candidates=len(candidates),
                     above_threshold=int(sum(ls.eligible(s, sc.threshold, sc.ceiling)
                                             for s in scores)),
                     selected=len(out), budget=sc.budget, threshold=sc.threshold,
                     ceiling=sc.ceiling,
                     above_ceiling=int(sum(sc.ceiling is not None and s > sc.ceiling
                                           for s in scores)))
    return out
