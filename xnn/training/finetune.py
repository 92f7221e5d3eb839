"""Fine-tuning a pretrained model: frozen parts, per-part learning rates and the data of
multi-head fine-tuning.

A model names its parts (:meth:`xnn.models.base.AtomisticModel.parts`: ``{part: parameter
name prefixes}``, e.g. ``embedding``, ``interactions``, ``interactions.0``, ``readout``).
:func:`freeze` sets ``requires_grad=False`` on the parameters of the named parts (the
optimizer never sees them, so they stay bitwise as loaded); :func:`param_groups` splits the
trainable parameters into optimizer groups carrying an ``lr_factor`` that the schedule
multiplies its learning rate by (:class:`xnn.training.schedule.LRSchedule`).

Multi-head fine-tuning (:mod:`xnn.models.heads`): :class:`WithHead` gives every structure of
a dataset the index of the head that trains on it (the ``head`` field), and
:func:`new_head_e0` the reference energies of a head of new data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from xnn.data import keys as K
from xnn.data.datasets import View
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError
from xnn.models.base import as_model


def part_parameters(model: nn.Module, part: str, what: str = "finetune") -> list[str]:
    """Names of the parameters of ``part`` (in ``named_parameters`` order).

    Raises:
        InputError: ``part`` is not one of the model's parts (one line listing them), or it
            holds no parameter.
    """
    parts = as_model(model, "the fine-tuned model").parts()
    if part not in parts:
        raise InputError(f"{what}: the model has no part {part!r}; its parts are "
                         f"{sorted(parts)}")
    prefixes = parts[part]
    names = [n for n, _ in model.named_parameters()
             if any(n == p or n.startswith(p + ".") for p in prefixes)]
    if not names:
        raise InputError(f"{what}: part {part!r} of the model holds no parameter")
    return names


def freeze(model: nn.Module, parts: list[str]) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``parts``; returns their names.

    Raises:
        InputError: an unknown part (listing the model's parts), or nothing left to train.
    """
    names = {n for part in parts for n in part_parameters(model, part, "finetune.freeze")}
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(False)
    if parts and not any(p.requires_grad for p in model.parameters()):
        raise InputError(f"finetune.freeze={parts} freezes every parameter of the model: "
                         "nothing is left to train")
    return sorted(names)


def param_groups(model: nn.Module, factors: dict[str, float]) -> list[dict]:
    """Optimizer parameter groups of the trainable parameters: one per part of ``factors``
    (``{"params": [...], "lr_factor": f, "part": name}``) and one of the rest (factor 1).

    A parameter in several listed parts (``interactions`` and ``interactions.0``) takes the
    factor of the part with the fewest parameters (the most specific). Groups without a
    trainable parameter (a frozen part) are left out.

    Raises:
        InputError: an unknown part (listing the model's parts).
    """
    owner: dict[str, str] = {}
    sizes = {part: part_parameters(model, part, "finetune.lr") for part in factors}
    for part in sorted(factors, key=lambda p: -len(sizes[p])):  # specific parts win
        owner.update(dict.fromkeys(sizes[part], part))
    groups: dict[str, list] = {part: [] for part in factors}
    rest = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (groups[owner[name]] if name in owner else rest).append(p)
    out = [{"params": rest, "lr_factor": 1.0, "part": "rest"}] if rest else []
    out += [{"params": ps, "lr_factor": float(factors[part]), "part": part}
            for part, ps in groups.items() if ps]
    return out


def describe(model: nn.Module, frozen: list[str], factors: dict[str, float]) -> str:
    """One log line: how many parameters are frozen and the per-part learning-rate factors."""
    params = dict(model.named_parameters())
    n_frozen = sum(params[n].numel() for n in frozen)
    total = sum(p.numel() for p in params.values())
    line = f"fine-tuning: {n_frozen:,} of {total:,} parameters frozen"
    if factors:
        line += "; lr factors " + ", ".join(f"{k} ×{v:g}" for k, v in factors.items())
    return line


class WithHead(View):
    """The structures of ``dataset``, each with ``head [1]`` = ``index`` (the head that
    predicts them, :data:`xnn.data.keys.HEAD`); sizes, labels, origins, weights and stored
    statistics are those of ``dataset`` (a :class:`~xnn.data.datasets.View`: none of its
    structures is read to make it)."""

    def __init__(self, dataset, index: int):
        super().__init__(dataset)
        self.index = int(index)

    def __getitem__(self, index: int) -> AtomicGraph:
        graph = self.dataset[index]
        return graph.replace({K.HEAD: torch.full((graph.n_systems,), self.index,
                                                 dtype=torch.long, device=graph.device)})


def new_head_e0(model: nn.Module, structures: list[AtomicGraph],
                species: Sequence[int]) -> dict[int, float]:
    """Reference energies ``{Z: eV}`` of a head of new data: the model's own E0s plus the
    least-squares per-element fit (:func:`xnn.models.statistics.fit_e0`) of its energy
    error on ``structures`` (labels minus its predictions), so that the head, untrained,
    already absorbs a per-element offset between the new data's reference and the
    pretrained one (another DFT code or functional).

    Args:
        model: the pretrained model, predicting with the head (energies only, no gradient).
        structures: the head's training structures (with ``energy`` labels; those without
            are skipped).
        species: the elements to fit.
    """
    from xnn.models import statistics as S
    from xnn.models.potential import Potential

    ref = next(model.parameters())
    pot = Potential(model)
    residual = []
    with torch.no_grad():
        for g in structures:
            g = g.without_edges().to(device=ref.device, dtype=ref.dtype)
            pred = pot(g, forces=False, stress=False)[K.ENERGY]
            residual.append(g.replace({K.ENERGY: (g[K.ENERGY] - pred).double()}))
    delta = S.fit_e0(residual, species)
    own = as_model(model, "the fine-tuned model").e0 or {}
    return {int(z): float(own.get(int(z), 0.0)) + delta[int(z)] for z in species}


__all__ = ["part_parameters", "freeze", "param_groups", "describe", "WithHead",
           "new_head_e0"]
