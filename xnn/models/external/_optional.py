"""Import optional packages (mace-torch, sevenn) without letting them change xnn's process.

``import mace`` sets ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which would make every later
``torch.load`` unpickle arbitrary objects) and other variables. The imports here run inside
:func:`preserved_environ`, so ``os.environ`` is the same before and after.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

from xnn.errors import XnnError

INSTALL_HINT = {
    "mace": 'pip install "xnn[mace]" (or: bash scripts/install_extras.sh .venv/bin/python)',
    "sevenn": 'pip install "xnn[sevenn]" (or: bash scripts/install_extras.sh .venv/bin/python)',
}


class MissingExtraError(XnnError, ImportError):
    """An optional package needed by an external-model wrapper is not installed."""


@contextmanager
def preserved_environ() -> Iterator[None]:
    """Restore ``os.environ`` exactly (added keys removed, changed keys reset) on exit."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in list(os.environ):
            if key not in saved:
                del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


def import_extra(extra: str, *modules: str) -> list[ModuleType]:
    """Import ``modules`` of the optional ``extra`` with the environment preserved.

    Args:
        extra: ``"mace"`` or ``"sevenn"`` (selects the install hint).
        modules: dotted module names.
    Returns:
        the imported modules, in order.
    Raises:
        MissingExtraError: a module (or one of its dependencies) is missing.
    """
    out = []
    with preserved_environ():
        for name in modules:
            try:
                out.append(importlib.import_module(name))
            except ImportError as err:
                raise MissingExtraError(
                    f"the {extra!r} model wrapper needs {name!r}, which cannot be imported "
                    f"({err}); install it with: {INSTALL_HINT[extra]}"
                ) from None
    return out
