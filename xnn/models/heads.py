"""Multi-head models: one shared body, one readout per head, each head with its own
reference energies (E0s), scale and shift, and a name.

A model that can carry heads subclasses :class:`Heads` (the equivariant model does). Its
``head_names`` are empty while it has one readout; :meth:`Heads.multihead` returns a copy
with named heads, each initialised as a copy of the model's readout, so that every head
predicts, untrained, what the model predicted. Which head predicts a structure:

- in training, the structure's ``head`` field (:data:`xnn.data.keys.HEAD`, an index into
  ``head_names``; a batch may mix heads);
- otherwise the model's selected head, the first (``default``) unless
  :func:`select_head` chose another (``XnnCalculator(..., head=NAME)``, ``xnn eval --head``,
  ``xnn md model.head=NAME``).

Models that cannot carry heads (classical terms, the external wrappers, schnet, painn) are
refused in one line by :func:`make_multihead` and :func:`select_head`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence

from torch import Tensor

from xnn.data import keys as K
from xnn.errors import InputError

#: the head of new data (the first, selected by default) and of replay data
DEFAULT_HEAD = "default"
REPLAY_HEAD = "replay"

_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def check_head_names(names: Sequence[str], what: str = "heads") -> list[str]:
    """``names`` as a list after checking them: at least one, distinct, each made of letters,
    digits, ``_`` and ``-``.

    Raises:
        InputError: one line naming the offending entry.
    """
    if isinstance(names, str) or not isinstance(names, Sequence) or not names:
        raise InputError(f"{what}: give a non-empty list of head names, got {names!r}")
    out = []
    for name in names:
        if not isinstance(name, str) or not _NAME.match(name):
            raise InputError(f"{what}: head name {name!r} must be made of letters, digits, "
                             "'_' and '-'")
        if name in out:
            raise InputError(f"{what}: head {name!r} is listed twice in {list(names)}")
        out.append(name)
    return out


class Heads:
    """Mixin of models that can carry several named readout heads (see the module docstring).

    Subclasses implement :attr:`head_names`, :meth:`multihead` and
    :meth:`set_head_statistics`; ``active_head`` is the index of the head that predicts
    structures without a ``head`` field.
    """

    active_head: int = 0

    @property
    def head_names(self) -> tuple[str, ...]:
        """Names of the heads, in index order; ``()`` for a model with one readout."""
        raise NotImplementedError

    def multihead(self, names: Sequence[str]):
        """A new model with the heads ``names``: the body's weights copied, each head a copy
        of the head of the same name if this model has one, else of its selected readout."""
        raise NotImplementedError

    def set_head_statistics(self, name: str, e0: Mapping[int, float] | None = None,
                            scale: float | None = None, shift: float | None = None) -> None:
        """Set the reference energies ``{Z: eV}``, scale or shift of head ``name``."""
        raise NotImplementedError

    def head_index(self, name: str) -> int:
        """Index of head ``name``.

        Raises:
            InputError: an unknown name (one line listing the model's heads).
        """
        names = list(self.head_names)
        if name not in names:
            listed = names or "none: it has a single readout"
            raise InputError(f"head={name!r}: the model has no head of that name; its heads "
                             f"are {listed}")
        return names.index(name)

    @property
    def selected_head(self) -> str | None:
        """Name of the head that predicts structures without a ``head`` field."""
        names = self.head_names
        return names[self.active_head] if names else None

    def with_head(self, name: str):
        """A shallow copy of the model (sharing its weights) whose selected head is ``name``.

        Raises:
            InputError: an unknown name (listing the heads).
        """
        index = self.head_index(name)
        out = copy.copy(self)
        out.active_head = index
        return out

    def atom_heads(self, graph, n_atoms: int) -> Tensor | None:
        """``[n_atoms]`` head index of the first ``n_atoms`` atoms of ``graph`` from its
        ``head`` field, or ``None`` without one (every atom: the selected head)."""
        heads = graph.get(K.HEAD)
        if heads is None:
            return None
        return heads.index_select(0, graph.batch[:n_atoms])


def head_names(model) -> tuple[str, ...]:
    """The heads of ``model`` (``()`` for a model with one readout or without heads)."""
    return tuple(model.head_names) if isinstance(model, Heads) else ()


def select_head(model, name: str | None, who: str = "head"):
    """``model`` predicting with head ``name`` (a shallow copy sharing its weights; ``None``:
    ``model`` itself, predicting with its default head).

    Raises:
        InputError: the model has no heads, or none of that name (one line listing them).
    """
    if name is None:
        return model
    if not head_names(model):
        raise InputError(f"{who}={name!r}: {type(model).__name__} has a single readout (no "
                         "heads); multi-head models come from xnn train with "
                         "finetune.heads=true")
    return model.with_head(name)


def make_multihead(model, names: Sequence[str], who: str = "finetune.heads"):
    """A copy of ``model`` with the heads ``names`` (:meth:`Heads.multihead`).

    Raises:
        InputError: a model that cannot carry heads, or invalid names (one line each).
    """
    names = check_head_names(names, who)
    if not isinstance(model, Heads):
        raise InputError(f"{who}: {type(model).__name__} cannot carry several readout heads "
                         "(the equivariant model can); fine-tune it with one head "
                         "(finetune.heads=false)")
    return model.multihead(names)


__all__ = ["DEFAULT_HEAD", "REPLAY_HEAD", "Heads", "check_head_names", "head_names",
           "make_multihead", "select_head"]
