"""Wrappers of models from other packages (optional extras), behind xnn's model interface.

* :class:`~xnn.models.external.mace.MACEWrapper` (``xnn.models.build("mace", model=...)``):
  a mace-torch model, given as a module or a ``.model`` file.
* :class:`~xnn.models.external.sevenn.SevenNetWrapper` (``xnn.models.build("sevenn",
  checkpoint="7net-0")``): a SevenNet checkpoint, e.g. a pretrained potential shipped with
  the ``sevenn`` wheel.

Both map an xnn graph (with edges) to per-atom energies; forces and stress come from
:func:`xnn.models.derivatives.compute_properties`, never from the wrapped package. The extras
are imported only when a wrapper is built (``pip install "xnn[mace]"`` / ``"xnn[sevenn]"`` or
``bash scripts/install_extras.sh``).
"""

from __future__ import annotations

__all__ = ["MACEWrapper", "SevenNetWrapper"]


def __getattr__(name):  # lazy: importing xnn.models.external needs neither extra
    if name == "MACEWrapper":
        from xnn.models.external.mace import MACEWrapper

        return MACEWrapper
    if name == "SevenNetWrapper":
        from xnn.models.external.sevenn import SevenNetWrapper

        return SevenNetWrapper
    raise AttributeError(f"module 'xnn.models.external' has no attribute {name!r}")
