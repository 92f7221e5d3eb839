"""The CUDA allocator profile of the first training steps (``memory.profile_prefix``),
written per rank as ``PREFIX_rank{r}.pickle`` (open it at https://pytorch.org/memory_viz).
:class:`~xnn.training.memory.MemoryTools` drives it as a
:class:`~xnn.training.memory.StepProfile`; it lives in the I/O layer because it writes the
file."""

from __future__ import annotations

from pathlib import Path

import torch

from xnn.errors import InputError


class MemoryProfile:
    """CUDA allocator history of the first ``steps`` training steps, written per rank.

    Args:
        prefix: output path prefix; rank ``r`` writes ``{prefix}_rank{r}.pickle``.
        rank: this process's rank.
        device: the training device (must be CUDA).
        steps: training steps to record.
        max_entries: allocation events kept (the oldest are dropped beyond this).
    Raises:
        InputError: ``device`` is not CUDA.
    """

    def __init__(self, prefix: str, rank: int, device: torch.device, steps: int = 3,
                 max_entries: int = 100000):
        device = torch.device(device)
        if device.type != "cuda":
            raise InputError(f"memory.profile_prefix needs a CUDA device (it records the CUDA "
                             f"allocator), but training runs on {device.type}; unset "
                             "memory.profile_prefix or train with device=cuda")
        self.path = Path(f"{prefix}_rank{rank}.pickle")
        self.steps, self.max_entries = int(steps), int(max_entries)
        self.done = 0
        self.recording = False

    def start(self) -> None:
        """Begin recording (once; later calls do nothing)."""
        if self.recording or self.done >= self.steps:
            return
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        self.recording = True

    def step_done(self) -> None:
        """Count a training step; after the last one to record, write the snapshot."""
        if not self.recording:
            return
        self.done += 1
        if self.done >= self.steps:
            self.stop()

    def stop(self) -> None:
        """Write the snapshot (if recording) and stop recording."""
        if not self.recording:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
        self.done = self.steps
