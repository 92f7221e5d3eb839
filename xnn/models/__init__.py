"""Per-atom-energy models, the shared derivative wrapper, and the model registry."""

from xnn.models.base import AtomisticModel, SyncPoint, sum_per_system
from xnn.models.committee import Committee
from xnn.models.composed import Sum
from xnn.models.derivatives import compute_properties
from xnn.models.potential import Potential
from xnn.models.registry import available_models, build, model_class, register_model

__all__ = [
    "AtomisticModel",
    "SyncPoint",
    "sum_per_system",
    "compute_properties",
    "Potential",
    "Sum",
    "Committee",
    "build",
    "available_models",
    "model_class",
    "register_model",
]
