"""Memory tools of training: activation checkpointing switch, CPU offload of the tensors
autograd keeps for backward, and a CUDA allocator profile of the first steps.

* ``model.activation_checkpointing``: a hyperparameter of the native models (SchNet, PaiNN,
  equivariant; see :meth:`xnn.models.blocks.NativeModel.checkpointed`), set on the model
  by :func:`set_activation_checkpointing`.
* ``memory.offload_activations``: :meth:`MemoryTools.context` wraps each training step's
  forward and backward in ``torch.autograd.graph.save_on_cpu``: every tensor saved for
  backward outside checkpointed blocks (with checkpointing: the blocks' inputs) is copied
  to host memory (pinned on CUDA) and back when backward needs it.
* ``memory.profile_prefix``: a :class:`StepProfile` (:class:`xnn.io.memory_profile.
  MemoryProfile`, in the I/O layer: it writes the file) records the CUDA caching allocator's
  history during the first steps and writes ``PREFIX_rank{r}.pickle``, to be opened at
  https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

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
    from xnn.training.committee import committee_size

    if committee_size(model) > 1:  # each member
        for member in model.members:
            set_activation_checkpointing(member, enabled, name, compile)
        return
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


def build_memory_tools(offload_activations: bool, profile: StepProfile | None, device,
                       compile: bool | str = False) -> MemoryTools | None:
    """The :class:`MemoryTools` of a run (``None`` when neither offload nor a profile is set).

    Raises:
        InputError: offload with compiled training.
    """
    if compile and offload_activations:
        raise InputError("memory.offload_activations=true does not work with compile=true "
                         "(compiled kernels keep their own saved tensors); set one of them "
                         "to false")
    if not offload_activations and profile is None:
        return None
    return MemoryTools(offload_activations, device, profile)


class StepProfile(Protocol):
    """A profile of the first training steps that :class:`MemoryTools` drives
    (:class:`xnn.io.memory_profile.MemoryProfile`, which writes the file)."""

    def start(self) -> None: ...

    def step_done(self) -> None: ...

    def stop(self) -> None: ...


class MemoryTools:
    """What :class:`~xnn.training.trainer.Trainer` wraps around each step's forward and
    backward: CPU offload of saved tensors and the allocator profile.

    Args:
        offload_activations: keep tensors saved for backward in host memory.
        device: the training device (pinned host memory on CUDA).
        profile: a :class:`StepProfile` (:class:`xnn.io.memory_profile.MemoryProfile`), or
            ``None``.
    """

    def __init__(self, offload_activations: bool = False,
                 device: torch.device | str = "cpu", profile: StepProfile | None = None):
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
