"""xnn: machine-learned interatomic potentials in PyTorch.

Units everywhere: energy eV, length Å, mass amu, time fs, temperature K, stress eV/Å³ (ASE sign).
"""

from xnn._version import __version__
from xnn.data import AtomicGraph

__all__ = ["AtomicGraph", "Calculator", "save_model", "load_model", "__version__"]


_SUBPACKAGES = (
    "units", "errors", "data", "neighbors", "models", "training", "dynamics", "distributed",
    "config", "io", "app", "testing", "plotting",
)


def __getattr__(name):  # lazy: keep `import xnn` light
    if name == "Calculator":
        from xnn.io.calculator import Calculator

        return Calculator
    if name in ("save_model", "load_model"):
        from xnn.models import serialization

        return getattr(serialization, name)
    if name in _SUBPACKAGES:
        import importlib

        return importlib.import_module(f"xnn.{name}")
    raise AttributeError(f"module 'xnn' has no attribute {name!r}")
