"""Memory tools of training: activation checkpointing switch, CPU offload of the tensors
autograd keeps for backward, and a CUDA allocator profile of the first steps.

* ``model.activation_checkpointing``: a hyperparameter of the native models (SchNet, PaiNN,
  equivariant; see :meth:`xnn.models.blocks.NativeModel.checkpointed`), set on the model
  by :func:`set_activation_checkpointing`.
* ``memory.offload_activations``: :meth:`MemoryTools.context` wraps each training step's
  forward and backward in ``torch.autograd.graph.save_on_cpu``: every tensor saved for
  backward outside checkpointed blocks (with checkpointing: the blocks' inputs) is copied
  to host memory (pinned on CUDA) and back when backward needs it.
* ``memory.profile_prefix``: :class:`MemoryProfile` records the CUDA caching allocator's
  history during the first steps and writes ``PREFIX_rank{r}.pickle``, to be opened at
  https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from xnn.errors import InputError


def set_activation_checkpointing(model: nn.Module, enabled: bool, name: str = "",
                                compile: bool | str = False) -> None:
    """Switch activation checkpointing of a native model (also in its ``hparams``, so that
    checkpoints and model files record it).

    Raises:
        InputError: ``enabled`` with ``compile`` (the compiled graph is traced without it).
        InputError: ``enabled`` for a model without checkpointing (classical potentials keep
            no learned activations; external wrappers such as mace or sevenn have none here).
    """
    if enabled and compile:
        raise InputError("model.activation_checkpointing=true does not work with compile=true "
                         "(the compiled graph is traced without checkpoints); set one of them "
                         "to false")
    hparams = getattr(model, "hparams", None)
    supported = isinstance(hparams, dict) and "activation_checkpointing" in hparams
    if not supported:
        if enabled:
            raise InputError(f"model {name or type(model).__name__!r} has no activation "
                             "checkpointing (only schnet, painn and equivariant have); set "
                             "model.activation_checkpointing=false")
        return
    model.activation_checkpointing = bool(enabled)
    hparams["activation_checkpointing"] = bool(enabled)


def build_memory_tools(offload_activations: bool, profile_prefix: str | None,
                       profile_steps: int, profile_max_entries: int, device, rank: int,
                       compile: bool | str = False) -> MemoryTools | None:
    """The :class:`MemoryTools` of a run (``None`` when neither offload nor a profile is set).

    Raises:
        InputError: a profile on a non-CUDA device, or offload with compiled training.
    """
    if compile and offload_activations:
        raise InputError("memory.offload_activations=true does not work with compile=true "
                         "(compiled kernels keep their own saved tensors); set one of them "
                         "to false")
    profile = None
    if profile_prefix is not None:
        profile = MemoryProfile(profile_prefix, rank, device, profile_steps, profile_max_entries)
    if not offload_activations and profile is None:
        return None
    return MemoryTools(offload_activations, device, profile)


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


class MemoryTools:
    """What :class:`~xnn.training.trainer.Trainer` wraps around each step's forward and
    backward: CPU offload of saved tensors and the allocator profile.

    Args:
        offload_activations: keep tensors saved for backward in host memory.
        device: the training device (pinned host memory on CUDA).
        profile: a :class:`MemoryProfile`, or ``None``.
    """

    def __init__(self, offload_activations: bool = False,
                 device: torch.device | str = "cpu", profile: MemoryProfile | None = None):
        self.offload_activations = bool(offload_activations)
        self.device = torch.device(device)
        self.profile = profile

    @contextlib.contextmanager
    def context(self):
        """Around one training step's forward and backward."""
        if self.profile is not None:
            self.profile.start()
        offload = (torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")
                   if self.offload_activations else contextlib.nullcontext())
        with offload:
            yield
        if self.profile is not None:
            self.profile.step_done()

    def close(self) -> None:
        """End of training: write a profile that fewer steps than asked for left open."""
        if self.profile is not None:
            self.profile.stop()
