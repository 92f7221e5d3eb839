"""Exponential moving average of a model's floating-point parameters and buffers."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class EMA:
    """``shadow ← d * shadow + (1 - d) * value`` after every optimizer step.

    The decay warms up, ``d = min(decay, (1 + n) / (10 + n))`` after ``n`` earlier updates,
    so that the average does not lag far behind the weights in short runs.

    Args:
        model: the trained model (its floating-point parameters are averaged; buffers such
            as scale/shift/E0 are copied, they are not trained).
        decay: in ``[0, 1)``.
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = float(decay)
        self.shadow = {k: v.detach().clone() for k, v in model.named_parameters()}
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        names = list(self.shadow)
        params = dict(model.named_parameters())
        shadow = [self.shadow[k] for k in names]
        current = [params[k].detach() for k in names]
        d = min(self.decay, (1.0 + self.updates) / (10.0 + self.updates))
        torch._foreach_lerp_(shadow, current, 1.0 - d)
        self.updates += 1

    @contextmanager
    def applied(self, model: nn.Module):
        """Temporarily load the averaged weights into ``model``."""
        params = dict(model.named_parameters())
        saved = {k: p.detach().clone() for k, p in params.items()}
        with torch.no_grad():
            for k, v in self.shadow.items():
                params[k].copy_(v)
        try:
            yield model
        finally:
            with torch.no_grad():
                for k, v in saved.items():
                    params[k].copy_(v)


    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "shadow": {k: v.clone() for k, v in self.shadow.items()}}

    def load_state_dict(self, state: dict) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise ValueError("EMA state does not match the model's parameters")
        self.decay = float(state["decay"])
        self.updates = int(state["updates"])
        for k, v in state["shadow"].items():
            self.shadow[k].copy_(v)
