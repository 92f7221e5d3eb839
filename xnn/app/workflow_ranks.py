"""``xnn run`` under torchrun: the systems of a campaign shared among the ranks.

Each system is run by exactly one rank (:func:`share`: in id order, each system goes to the
rank with the fewest atoms so far), in that rank's own batches of ``slots`` systems. A rank
appends its rows to ``ranks/gGGG_results_RRRRR.csv``, checkpoints to
``ranks/gGGG_checkpoint_RRRRR.pt`` and writes the trajectories and final structures of its
systems (one file per system, so no two ranks write one file). Rank 0 writes
``checkpoint.pt``, a manifest naming the number of ranks and the generation ``GGG`` of the
files, once every rank has checkpointed, and when every system is done merges the rows into
``results.csv`` in the order of a single process (system id, then stage), gathers
``final.xyz`` and writes ``summary.json``. The ranks meet once per batch step (an agreement
on errors and one all-reduce of counts), so rank 0 reports the whole campaign's progress and
no rank waits long in a collective. A system's random numbers are keyed by its id, so its
rows do not depend on the number of ranks.

Resumed on the number of ranks that wrote it, each rank continues from its own checkpoint
(bitwise on CPU). Resumed on another number (or a one-process campaign under torchrun, or
the reverse), the campaign starts a new generation of files (:func:`hand_over`): every rank
reads every old checkpoint and takes the in-flight systems and the queue of its new share,
rank 0 copies the finished rows into ``ranks/gGGG_done.csv``, and the new manifest, written
once every new checkpoint exists, is what makes the new generation the campaign's; until
then a kill leaves the old generation whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from xnn.app import workflow_files as wf
from xnn.distributed import collectives as C
from xnn.dynamics import slots


@dataclass(frozen=True)
class Ranks:
    """This process's place in a campaign and the files of its generation.

    Attributes:
        rank, world_size: this process's rank and the number of ranks.
        folder: the run folder the campaign writes to.
        generation: the generation of the files under ``ranks/``; ``None`` for one
            process's files (``results.csv``, ``checkpoint.pt``).
    """

    rank: int
    world_size: int
    folder: Path
    generation: int | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def _name(self, kind: str, rank: int | None, ext: str) -> str:
        r = self.rank if rank is None else rank
        return f"g{self.generation:03d}_{kind}_{r:05d}.{ext}"

    def results(self, rank: int | None = None) -> Path:
        """The results table rank ``rank`` (default: this one) appends to."""
        if self.generation is None:
            return self.folder / "results.csv"
        return self.folder / "ranks" / self._name("results", rank, "csv")

    def checkpoint(self, rank: int | None = None, resume: str | None = None) -> Path:
        """Rank ``rank``'s checkpoint: in the run folder, or beside the checkpoint.pt
        ``resume`` a campaign was resumed from."""
        if self.generation is None:
            return Path(resume) if resume is not None else self.folder / "checkpoint.pt"
        folder = self.folder if resume is None else Path(resume).parent
        return folder / "ranks" / self._name("checkpoint", rank, "pt")

    def done(self) -> Path | None:
        """The rows of earlier generations (``None`` for one process's files and the first
        generation of a campaign started on ranks)."""
        if not self.generation:
            return None
        return self.folder / "ranks" / f"g{self.generation:03d}_done.csv"

    def parts(self) -> list[Path]:
        """The tables merged into ``results.csv`` when the campaign completes."""
        done = self.done()
        return ([done] if done is not None else []) + [self.results(r)
                                                       for r in range(self.world_size)]


def plan(rank: int, world_size: int, folder: Path, resume: str | None) -> tuple[Ranks, Ranks
                                                                                 | None]:
    """``(ranks, old)``: this process's files, and those of the campaign it takes over from
    (``None`` unless ``resume`` was written on another number of ranks)."""
    if resume is None:
        return Ranks(rank, world_size, folder, None if world_size == 1 else 0), None
    payload = wf.read_checkpoint(resume)
    written = wf.checkpoint_ranks(payload)
    generation = payload.get("generation") if payload["format"] == wf.MANIFEST else None
    if written == world_size:
        return Ranks(rank, world_size, folder, generation), None
    new = 1 if generation is None else generation + 1  # 0: a campaign started on ranks
    return Ranks(rank, world_size, folder, new), Ranks(0, written, folder, generation)


def share(sizes: list[int], world_size: int, rank: int) -> list[int]:
    """The ids of the systems rank ``rank`` runs, in id order: each system, in id order, goes
    to the rank with the fewest atoms so far (the lowest such rank), so every rank computes
    the same split and the ranks' atom counts differ by at most one system's.

    Args:
        sizes: ``[n_systems]`` atom counts.
    """
    load = [0] * world_size
    mine = []
    for i, n in enumerate(sizes):
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += int(n)
        if r == rank:
            mine.append(i)
    return mine


@dataclass
class Handover:
    """What a rank takes over from a campaign written on another number of ranks.

    Attributes:
        pools: per stage, ``(state, ids, wall)`` of its in-flight systems (or ``None``).
        queue: the ids of its systems not started yet, in id order.
        trajectories: the checkpointed size of each in-flight system's trajectory.
        iteration: the campaign's batch step (the largest of the old ranks').
        tables: the old campaign's results tables, each with its checkpointed size in bytes
            (``None``: the whole file), whose rows are the finished stages.
    """

    pools: list
    queue: list[int]
    trajectories: dict[int, int]
    iteration: int
    tables: list[tuple[Path, int | None]]
    guards: dict[str, list] = field(default_factory=dict)  # SystemGuards state


def hand_over(old: Ranks, resume: str, mine: list[int], sizes: list[int], device,
              check) -> Handover:
    """Take over this rank's share ``mine`` from every checkpoint of the campaign ``old``.

    Args:
        resume: the old campaign's ``checkpoint.pt``.
        sizes: ``[n_systems]`` atom counts (the old ranks' shares are recomputed).
        check: ``check(path, meta, n_pools)`` refuses a checkpoint written with other
            settings.
    """
    own = set(mine)
    parts: list[list] = []
    queue, trajectories, iteration, guards = [], {}, 0, {}
    tables: list[tuple[Path, int | None]] = [] if old.done() is None else [(old.done(), None)]
    for k in range(old.world_size):
        path = old.checkpoint(k, resume)
        pools, meta = wf.load_campaign(path, device)
        check(path, meta, len(pools))
        tables.append((old.results(k), int(meta["results_bytes"])))
        queue += [i for i in share(sizes, old.world_size, k)[meta["next_input"]:] if i in own]
        trajectories.update({int(i): n for i, n in meta["trajectories"].items()
                             if int(i) in own})
        iteration = max(iteration, int(meta["iteration"]))
        guards.update({i: v for i, v in meta.get("guards", {}).items() if int(i) in own})
        parts = parts or [[] for _ in pools]
        for p, saved in enumerate(pools):
            if saved is None:
                continue
            state, ids, _ = saved
            keep = [j for j, i in enumerate(ids) if i in own]
            if keep:
                parts[p].append((slots.select(state, keep), [ids[j] for j in keep],
                                 [meta["wall"][str(ids[j])] for j in keep]))
    return Handover([_joined(p) for p in parts], sorted(queue), trajectories, iteration,
                    tables, guards)


def _joined(parts: list) -> tuple | None:
    """One pool from the in-flight systems of several old ranks."""
    if not parts:
        return None
    state = slots.concat([s for s, _, _ in parts], step=max(s.step for s, _, _ in parts))
    return state, [i for _, ids, _ in parts for i in ids], [w for _, _, ws in parts for w in ws]


def all_sum(values: list[int], device) -> list[int]:
    """``values`` summed over the ranks (themselves in one process: no tensor, no sync).

    Args:
        device: where the ranks' collectives run (``cuda:LOCAL_RANK`` under NCCL).
    """
    if not C.is_active():
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    return [int(v) for v in C.all_reduce_(t).tolist()]


def all_max(value: int, device) -> int:
    """The largest ``value`` of any rank."""
    if not C.is_active():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    return int(C.all_reduce_max(t).item())
