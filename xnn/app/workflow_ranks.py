"""``xnn run`` under torchrun: the systems of a campaign shared among the ranks.

Each system is run by exactly one rank (:func:`share`: in id order, each system goes to the
rank with the fewest atoms so far), in that rank's own batches of ``slots`` systems. A rank
appends its rows to ``ranks/results_RRRRR.csv``, checkpoints to ``ranks/checkpoint_RRRRR.pt``
and writes the trajectories and final structures of its systems (one file per system, so
no two ranks write one file). Rank 0 writes ``checkpoint.pt``, a manifest naming the number
of ranks, once every rank has checkpointed, and when every system is done merges the rows
into ``results.csv`` in the order of a single process (system id, then stage), gathers
``final.xyz`` and writes ``summary.json``. The ranks meet once per batch step (an agreement
on errors and one all-reduce of counts), so rank 0 reports the whole campaign's progress
and no rank waits long in a collective. A system's random numbers are keyed by its id, so
its rows do not depend on the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from xnn.app import workflow_files as wf
from xnn.distributed import collectives as C
from xnn.errors import InputError


@dataclass(frozen=True)
class Ranks:
    """This process's place in a campaign: its rank, the number of ranks and its files.

    Attributes:
        folder: the run folder the campaign writes to.
    """

    rank: int
    world_size: int
    folder: Path

    @property
    def main(self) -> bool:
        return self.rank == 0

    def results(self, rank: int | None = None) -> Path:
        """The results table rank ``rank`` (default: this one) appends to."""
        if self.world_size == 1:
            return self.folder / "results.csv"
        return self.folder / "ranks" / f"results_{self.rank if rank is None else rank:05d}.csv"

    def checkpoint(self, resume: str | None = None) -> Path:
        """This rank's checkpoint: in the run folder, or next to the manifest ``resume``."""
        folder = self.folder if resume is None else Path(resume).parent
        if self.world_size == 1:
            return Path(resume) if resume is not None else folder / "checkpoint.pt"
        return folder / "ranks" / f"checkpoint_{self.rank:05d}.pt"


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


def check_resume(path: str, ranks: Ranks) -> None:
    """Refuse to resume, on this number of ranks, a campaign written on another number."""
    written = wf.checkpoint_ranks(wf.read_checkpoint(path))
    if written != ranks.world_size:
        how = "in one process (xnn run ...)" if written == 1 else \
            f"on {written} ranks (torchrun --nproc-per-node {written} -m xnn run ...)"
        now = "one process" if ranks.world_size == 1 else f"{ranks.world_size} ranks"
        raise InputError(f"checkpoint {path} was written by a campaign on {written} "
                         f"rank{'s' if written != 1 else ''}, not {now}: resume it {how}")


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
