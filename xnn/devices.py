"""The device a command or adapter runs on: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, checked
against this machine (a neutral low module: the ASE calculator, the torch-sim and LAMMPS
adapters and every command import it)."""

from __future__ import annotations

import torch

from xnn.errors import InputError


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` → CUDA when available, else CPU; anything else is passed to ``torch.device``
    and must exist on this machine (one-line :class:`InputError` otherwise)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message lists devices xnn does not run on
        raise InputError(f"invalid device {device!r}: use cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise InputError(f"device {str(device)!r} requested but no CUDA GPU is available; "
                             "use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= n:
            raise InputError(f"device {str(device)!r} requested but this machine has {n} CUDA "
                             f"GPU(s) (cuda:0 to cuda:{n - 1})")
    return dev


__all__ = ["resolve_device"]
