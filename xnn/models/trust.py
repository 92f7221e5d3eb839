"""Trust comes only from the caller: no file can grant it, and no file names a file to load.

Some formats are pickles, and loading one runs code from the file: mace-torch ``.model``
files, SevenNet checkpoint files, xnn model files of an earlier version that hold a pickled
MACE module, and ``torch.export`` programs. Each loader asks :func:`require` before it
unpickles; the one rule is:

* in a call of the user's (``build("mace", model=PATH, trust=True)``, the user's own config
  built by :func:`xnn.models.build`), the ``trust`` argument of that call decides, and so does
  a caller-wide grant (:func:`granted`: ``model.trust_file=true`` of a config);
* while xnn turns data read from a file into a model (:func:`reading`: a model file's payload
  and hyperparameters, a training checkpoint's ``model.hparams``), that data is data: a
  ``trust`` it carries counts for nothing and is refused (:func:`check_data`), and a file it
  names (a ``model_file`` term, a MACE ``model=PATH``, a SevenNet checkpoint file) is loaded
  only if the caller trusted the outer file (:func:`require_reference`, :func:`require`).
  The caller's trust (``xnn.load_model(path, trust=True)``, ``--trust-file``,
  ``model.trust_file=true``) holds for every load nested in it.

A refusal is one :class:`~xnn.errors.TrustError` line (a ``ModelFileError``) naming the file
the caller gave and how the caller grants trust. Names of SevenNet checkpoints shipped by ``sevenn``
(``7net-0``) are not files and need no trust.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from xnn.errors import TrustError

CALLER_FLAGS = ("trust=True in Python, --trust-file (xnn eval, xnn validate, xnn export) or "
                "model.trust_file=true (xnn md, relax, run, train)")
PICKLE = "is a pickle, and loading it runs code from the file"


@dataclass(frozen=True)
class _Reading:
    """The file the caller named (the outermost of nested loads) and the caller's trust."""

    path: str
    trust: bool


_READING: ContextVar[_Reading | None] = ContextVar("xnn_reading_file", default=None)
_GRANTED: ContextVar[bool] = ContextVar("xnn_trust_granted", default=False)


@contextmanager
def reading(path: str | os.PathLike | None, trust: bool) -> Iterator[None]:
    """Inside: data read from ``path`` is being turned into a model.

    Args:
        path: the file; ``None``: hyperparameters of a file named by an enclosing block.
        trust: the caller's trust in the file (``True`` only if the caller said so, or a
            :func:`granted` block encloses this one). A block nested in another keeps the
            outer file and the outer caller's trust: data cannot change either.
    """
    outer = _READING.get()
    if outer is None:
        name = "hyperparameters read from a file" if path is None else str(path)
        outer = _Reading(name, trust is True or _GRANTED.get())
    token = _READING.set(outer)
    try:
        yield
    finally:
        _READING.reset(token)


@contextmanager
def granted(trust: bool) -> Iterator[None]:
    """Inside (when ``trust``): the caller trusts every file its call names (a config's
    ``model.trust_file=true``), as if each load passed ``trust=True``."""
    token = _GRANTED.set(_GRANTED.get() or trust is True)
    try:
        yield
    finally:
        _GRANTED.reset(token)


def refusal(path: str, asks: str) -> str:
    """The one line that refuses a file ``path`` whose data ``asks`` for something."""
    return (f"{path}: this file asks to {asks}, which can run code from a file; a file "
            f"cannot grant trust: if you trust {path}, load it with {CALLER_FLAGS}")


def require(what: str, trust: bool, hint: str, reason: str = PICKLE) -> None:
    """Allow unpickling ``what`` only when the caller trusts it (see the module doc).

    Args:
        what: the file, e.g. ``"MACE model file x.model"``.
        trust: the ``trust`` argument of the loader (the caller's, outside :func:`reading`;
            ignored inside it, where the caller of the outer load decides).
        hint: how a direct caller of this loader grants trust (for the refusal).
        reason: why loading ``what`` can run code.
    Raises:
        TrustError: one line, refused.
    """
    inside = _READING.get()
    if inside is not None:
        if not inside.trust:
            raise TrustError(refusal(inside.path, f"unpickle {what}"))
        return
    if trust is not True and not _GRANTED.get():
        raise TrustError(f"{what} {reason}: if you trust it, {hint}")


def require_reference(what: str) -> None:
    """Allow loading ``what``, a file named by data (a ``model_file`` term), only outside
    :func:`reading` (the user named it) or when the caller trusted the outer file.

    Raises:
        TrustError: one line, refused.
    """
    inside = _READING.get()
    if inside is not None and not inside.trust:
        raise TrustError(refusal(inside.path, f"load {what} it names"))


def check_data(hyperparameters: object) -> None:
    """Refuse hyperparameters read from a file (inside :func:`reading`) that carry ``trust``
    anywhere, unless the caller trusted the file.

    Raises:
        TrustError: one line, refused.
    """
    inside = _READING.get()
    if inside is None or inside.trust:
        return
    where = _key_path(hyperparameters, "trust")
    if where is not None:
        raise TrustError(refusal(inside.path, f"be trusted (its hyperparameters set "
                                                  f"{where})"))


def _key_path(value: object, key: str, prefix: str = "") -> str | None:
    """The dotted path of the first ``key`` in nested mappings and lists (``None``: absent)."""
    if isinstance(value, Mapping):
        if key in value:
            return f"{prefix}{key}"
        items = ((f"{prefix}{k}.", v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{prefix}{i}.", v) for i, v in enumerate(value))
    else:
        return None
    for sub, v in items:
        found = _key_path(v, key, sub)
        if found is not None:
            return found
    return None
