"""``run_workflow(config)``: the application behind ``xnn run workflow.yaml``.

Every selected frame of the structure file is a system (id = its position in the selection)
that goes through the stages in order, batched with in-flight refill
(:mod:`xnn.app.workflow_campaign`); under torchrun the systems are shared among the ranks
(:mod:`xnn.app.workflow_ranks`). The random numbers of a system are keyed by its id, so its
trajectory does not depend on its slot, its neighbours in the batch or its rank.

A checkpoint is written after every batch step in which a system finished a stage, and
every ``output.checkpoint_every`` steps; ``resume=DIR/checkpoint.pt`` continues a killed
campaign bitwise (CPU) on the same number of ranks, and on another number to rounding,
without running any system's stage again.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from xnn.app import workflow_files as wf
from xnn.app import workflow_ranks as wr
from xnn.app.md_common import DTYPES
from xnn.app.md_setup import check_species, check_uncertainty, load_potential, load_structure
from xnn.app.workflow_campaign import Campaign, check_settings, fingerprint
from xnn.app.workflow_guard import GUARD
from xnn.config.loader import load_config
from xnn.config.workflow import WorkflowConfig
from xnn.distributed import collectives as C
from xnn.errors import InputError


def read_systems(cfg: WorkflowConfig, potential, device, dtype) -> list:
    """One single-system graph per selected frame, atom ids ``0..n-1`` in each."""
    from xnn.data import keys as K
    from xnn.data.graph import AtomicGraph

    graph = load_structure(cfg.structure, cfg.index, device, dtype)
    check_species(potential.model, graph)
    ptr = graph.ptr.tolist()
    out = []
    for s in range(graph.n_systems):  # slices: linear in the number of atoms
        lo, hi = ptr[s], ptr[s + 1]
        fields = {k: v[lo:hi] if K.scope_of(k) == K.ATOM else v[s:s + 1]
                  for k, v in graph.fields.items() if K.scope_of(k) in (K.ATOM, K.SYSTEM)}
        fields[K.BATCH] = torch.zeros(hi - lo, dtype=torch.long, device=device)
        fields[K.ATOM_ID] = torch.arange(hi - lo, device=device)
        out.append(AtomicGraph(fields, validate=False))
    check_systems(cfg, out)
    return out


def check_systems(cfg: WorkflowConfig, systems: list) -> None:
    """Refuse, before anything runs, a system that a stage cannot take: a cell stage
    (``npt``, ``relax_cell``) needs a cell periodic along all axes, ``npt`` no fixed atoms."""
    from xnn.data import keys as K

    for i, stage in enumerate(cfg.stages):
        cell = stage.type == "npt" or bool(stage.relax_cell)
        for sid, g in enumerate(systems):
            if cell and not bool(g.pbc.all()):
                raise InputError(f"stages.{i} ({stage.name}) changes the cell, but system "
                                 f"{sid} of {cfg.structure} is not periodic along all axes; "
                                 "select periodic frames only (index=...)")
            if stage.type == "npt" and K.FIXED in g and bool(g[K.FIXED].any()):
                raise InputError(f"stages.{i} ({stage.name}) is npt, but system {sid} has "
                                 "fixed atoms (a barostat cannot move them)")


def summary(cfg: WorkflowConfig, folder: Path, n_systems: int, wall: float) -> dict:
    """``summary.json``: per stage the systems done, converged and failed, mean steps."""
    rows = wf.read_results(folder / "results.csv")
    stages = []
    for i, st in enumerate(cfg.stages):
        mine = [r for r in rows if int(r["stage_index"]) == i]
        steps = [int(r["steps"]) for r in mine]
        stages.append({"name": st.name, "type": st.type, "systems": len(mine),
                       "converged": sum(r["converged"] == "True" for r in mine),
                       "failed": sum(r["status"] == "failed" for r in mine),
                       "mean_steps": sum(steps) / len(steps) if steps else 0.0})
    failed = sorted({int(r["id"]) for r in rows if r["status"] == "failed"})
    uncertain = sorted({int(r["id"]) for r in rows if r["status"] == "failed"
                        and GUARD in r["reason"]})
    warned = sorted({int(r["id"]) for r in rows if r["status"] == "ok"
                     and r["reason"].startswith("warned")})
    atom_steps = sum(int(r["steps"]) * int(r["n_atoms"]) for r in rows)
    return {"command": "run", "systems": n_systems, "slots": cfg.slots, "stages": stages,
            "failed_ids": failed, "completed": n_systems - len(failed),
            "uncertain_ids": uncertain, "warned_ids": warned,
            "wall_s": round(wall, 3), "atom_steps": atom_steps,
            "atom_steps_per_s": round(atom_steps / wall, 1) if wall > 0 else None,
            "results": "results.csv", "final": "final.xyz"}


def run_workflow(config: WorkflowConfig | str | Path, overrides: Sequence[str] = ()) -> Path:
    """Run every selected structure through the workflow's stages, batched with refill.

    Launched on several ranks (torchrun, srun), the systems are shared among the ranks
    (:mod:`xnn.app.workflow_ranks`): each runs its share in batches of ``slots``, and the
    folder's files are those of one process.

    Args:
        config: a :class:`WorkflowConfig` or a YAML path (then ``overrides``: ``key=value``).
    Returns:
        the run folder (``results.csv``, ``summary.json``, ``final.xyz``, trajectories).
    """
    from xnn.app.md_common import launched_on_several_ranks, run_distributed

    if launched_on_several_ranks():
        return run_distributed(WorkflowConfig, config, overrides, _run_workflow)
    return _run_workflow(config, overrides, None)


def _run_workflow(config, overrides: Sequence[str], manager) -> Path:
    from xnn.devices import resolve_device
    from xnn.io.run_folder import plan_run_folder

    cfg = config if isinstance(config, WorkflowConfig) else load_config(
        WorkflowConfig, config, overrides)
    folder = plan_run_folder(cfg.output.dir, wf.RUN_FILES, resume=cfg.resume,
                             overwrite=cfg.output.overwrite, key="output.dir",
                             overwrite_key="output.overwrite",
                             resume_hint=f"resume={Path(cfg.output.dir) / 'checkpoint.pt'}")
    device = manager.device if manager is not None else resolve_device(cfg.model.device)
    with C.guarded(None, "reading the model, the structures and the checkpoint"):
        ranks, old = wr.plan(0 if manager is None else manager.rank,
                             1 if manager is None else manager.world_size, folder.work,
                             cfg.resume)
        potential = load_potential(cfg.model, device, DTYPES[cfg.model.dtype])
        check_uncertainty(cfg, potential.model)
        campaign, hand = _campaign(cfg, ranks, old, potential, device)
    with C.guarded(None, "creating the output folder"):
        if not cfg.resume and ranks.main:
            _create(cfg, folder, ranks.generation is not None)
    with C.guarded(None, "creating this rank's files"):
        if hand is not None:
            campaign.take_over(hand)
        elif not cfg.resume:
            campaign.fresh()
    if cfg.resume and _complete(campaign, device):
        _log(ranks, f"xnn run: checkpoint {cfg.resume}: every one of the {campaign.n_systems} "
             "systems has finished its stages: the campaign is already complete, nothing was "
             "run (results.csv, final.xyz and summary.json are in place)")
        return folder.final
    _log(ranks, f"xnn run: {campaign.n_systems} systems through "
         f"{' -> '.join(s.name for s in cfg.stages)}, {cfg.slots} slots"
         f"{'' if ranks.world_size == 1 else f' on each of {ranks.world_size} ranks'}, on "
         f"{device}" + (f" (resumed at batch step {campaign.iteration})" if cfg.resume else ""))
    t0 = time.perf_counter()
    _run_loop(cfg, campaign, device, ranks.generation is not None and (
        hand is not None or not cfg.resume))
    with C.guarded(None, "writing results.csv, final.xyz and summary.json"):
        if ranks.main:
            info = _finish(cfg, folder, ranks, campaign.n_systems, time.perf_counter() - t0)
    if ranks.main and info["failed_ids"]:
        stopped = len(info["uncertain_ids"])
        print(f"xnn run: {len(info['failed_ids'])} of {campaign.n_systems} systems failed "
              "(status=failed in results.csv" + (f"; {stopped} stopped by "
              f"safety.max_force_uncertainty, their frames in uncertain.xyz" if stopped else "")
              + ")")
    return folder.final


def _campaign(cfg: WorkflowConfig, ranks: wr.Ranks, old: wr.Ranks | None, potential,
              device) -> tuple[Campaign, wr.Handover | None]:
    """This rank's campaign (resumed from its checkpoint when ``cfg.resume`` was written on
    this number of ranks), and what it takes over from one written on another number."""
    systems = read_systems(cfg, potential, device, DTYPES[cfg.model.dtype])
    sizes = [g.n_atoms for g in systems]
    mine = wr.share(sizes, ranks.world_size, ranks.rank)
    if old is None:
        campaign = Campaign(cfg, {i: systems[i] for i in mine}, len(systems), potential, ranks)
        if cfg.resume:
            campaign.resume(cfg.resume, device)
        return campaign, None
    check = functools.partial(check_settings, cfg, len(systems))
    hand = wr.hand_over(old, cfg.resume, mine, sizes, device, check)
    return Campaign(cfg, {i: systems[i] for i in hand.queue}, len(systems), potential,
                    ranks), hand


def _complete(campaign: Campaign, device) -> bool:
    """Whether no system of the campaign is in flight or queued on any rank (collective)."""
    counts = campaign.counts(device)
    return counts["in_flight"] + counts["queued"] == 0


def _create(cfg: WorkflowConfig, folder, ranks: bool) -> None:
    """The run folder (rank 0), its ``config.yaml`` and the shared subfolders (``ranks/``
    for a campaign on ranks)."""
    from xnn._files import atomic_write
    from xnn.config.loader import save_config

    folder.create()
    atomic_write(folder.work / "config.yaml", lambda tmp: save_config(cfg, tmp))
    for name in ("trajectories", "final", *(("ranks",) if ranks else ())):
        (folder.work / name).mkdir(exist_ok=True)


def _run_loop(cfg: WorkflowConfig, campaign: Campaign, device, new_files: bool) -> None:
    """The campaign's loop, with rank 0's progress bar; rank 0 writes the manifest
    ``checkpoint.pt`` of ``new_files`` (a new generation under ``ranks/``) once every rank
    has checkpointed in them."""
    from tqdm import tqdm

    ranks = campaign.ranks
    started = None
    if new_files and ranks.main:
        started = functools.partial(wf.save_manifest, ranks.folder / "checkpoint.pt",
                                    ranks.world_size, ranks.generation,
                                    fingerprint(cfg, campaign.n_systems))
    first = campaign.counts(device)
    bar = tqdm(total=campaign.n_systems * len(cfg.stages), initial=first["done"], desc="run",
               unit="stage", dynamic_ncols=True, mininterval=0.5,
               disable=None if cfg.output.progress and ranks.main else True)
    try:
        campaign.run(bar, device, started)
    finally:
        bar.close()


def _finish(cfg: WorkflowConfig, folder, ranks: wr.Ranks, n_systems: int, wall: float) -> dict:
    """Rank 0, every rank done: ``results.csv`` (every rank's rows, by id and stage),
    ``final.xyz``, ``summary.json``; the folder committed."""
    from xnn._files import atomic_write

    work = folder.work
    wf.merge_results(ranks.parts(), work / "results.csv")
    wf.gather_final(work, n_systems)
    wf.gather_final(work, n_systems, "uncertain")
    info = summary(cfg, work, n_systems, wall)
    atomic_write(work / "summary.json", lambda tmp: tmp.write_text(json.dumps(info, indent=2)
                                                                    + "\n"))
    folder.commit()
    return info


def _log(ranks: wr.Ranks, line: str) -> None:
    if ranks.main:
        print(line, flush=True)
