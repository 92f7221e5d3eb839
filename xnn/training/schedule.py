"""Optimizers and learning-rate schedules (linear warm-up, then cosine or plateau decay).

The schedule sets ``lr = base_lr * warmup(step) * decay`` on every optimizer step, with

* ``warmup(step) = min(1, (step + 1) / warmup_steps)``;
* cosine: ``decay = m + (1 - m) * (1 + cos(π min(t, T) / T)) / 2`` with ``t`` the steps after
  warm-up, ``T = total_steps - warmup_steps`` and ``m = min_lr_factor``;
* plateau: ``decay`` is multiplied by ``factor`` (down to ``min_lr_factor``) when the
  validation metric has not improved for ``patience`` epochs;
* none: ``decay = 1``.

Its whole state is a few numbers, saved in checkpoints.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xnn.errors import InputError


def build_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float,
                    amsgrad: bool = False, groups: list[dict] | None = None):
    """Adam or AdamW (optionally AMSGrad) over the trainable parameters of ``model``, or
    over parameter ``groups`` (each with an ``lr_factor``: :func:`xnn.training.finetune.
    param_groups`)."""
    params = groups if groups else [p for p in model.parameters() if p.requires_grad]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, amsgrad=amsgrad)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, amsgrad=amsgrad)
    raise InputError(f"unknown optimizer {name!r}; choose one of ['adam', 'adamw']")


class LRSchedule:
    """Warm-up + cosine/plateau/none learning-rate schedule.

    Args:
        optimizer: its param groups' ``lr`` are set by :meth:`apply` (times a group's
            ``lr_factor`` where it has one).
        name: ``"none"``, ``"cosine"`` or ``"plateau"``.
        base_lr: peak learning rate.
        warmup_steps: linear warm-up length.
        total_steps: cosine horizon (steps, warm-up included).
        min_lr_factor: cosine end / plateau floor as a fraction of ``base_lr``.
        factor: plateau reduction factor.
        patience: plateau patience (epochs).
    """

    def __init__(self, optimizer, name: str, base_lr: float, warmup_steps: int = 0,
                 total_steps: int | None = None, min_lr_factor: float = 0.01,
                 factor: float = 0.5, patience: int = 5):
        if name not in ("none", "cosine", "plateau"):
            raise InputError(f"unknown schedule {name!r}; choose one of ['none', 'cosine', "
                             "'plateau']")
        self.optimizer = optimizer
        self.name = name
        self.base_lr = float(base_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.min_lr_factor = float(min_lr_factor)
        self.factor = float(factor)
        self.patience = int(patience)
        self.plateau_scale = 1.0
        self.best = math.inf
        self.bad_epochs = 0

    def lr_at(self, step: int) -> float:
        """Learning rate used for optimizer step number ``step`` (0-based)."""
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        decay = 1.0
        if self.name == "cosine" and self.total_steps:
            span = max(self.total_steps - self.warmup_steps, 1)
            t = min(max(step - self.warmup_steps, 0), span)
            m = self.min_lr_factor
            decay = m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * t / span))
        elif self.name == "plateau":
            decay = self.plateau_scale
        return self.base_lr * warm * decay

    def apply(self, step: int) -> float:
        lr = self.lr_at(step)
        for group in self.optimizer.param_groups:  # lr_factor: fine-tuning's per-part factor
            group["lr"] = lr * group.get("lr_factor", 1.0)
        return lr

    def epoch_end(self, metric: float | None) -> None:
        """Feed the validation metric (plateau schedule only)."""
        if self.name != "plateau" or metric is None or not math.isfinite(metric):
            return
        if metric < self.best:
            self.best = metric
            self.bad_epochs = 0
            return
        self.bad_epochs += 1
        if self.bad_epochs > self.patience:
            self.plateau_scale = max(self.plateau_scale * self.factor, self.min_lr_factor)
            self.bad_epochs = 0

    def state_dict(self) -> dict:
        return {"name": self.name, "plateau_scale": self.plateau_scale, "best": self.best,
                "bad_epochs": self.bad_epochs, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        self.plateau_scale = float(state["plateau_scale"])
        self.best = float(state["best"])
        self.bad_epochs = int(state["bad_epochs"])
