"""Multi-process execution: launch detection, the dp × dd mesh, and spatial domain decomposition.

The only package (with the CLI that launches it) that imports ``torch.distributed``.
"""

from xnn.distributed.manager import DistributedManager, LaunchInfo, detect_launch
from xnn.distributed.mesh import ParallelDims

__all__ = ["DistributedManager", "LaunchInfo", "ParallelDims", "detect_launch",
           "DomainDecomposed", "DecomposedPotential", "DistributedCalculator",
           "validate_decomposition"]


def __getattr__(name):  # lazy: the domain-decomposition code is heavier
    if name == "DomainDecomposed":
        from xnn.distributed.domain.decomposed import DomainDecomposed

        return DomainDecomposed
    if name == "DistributedCalculator":
        from xnn.distributed.calculator import DistributedCalculator

        return DistributedCalculator
    if name == "DecomposedPotential":
        from xnn.distributed.potential import DecomposedPotential

        return DecomposedPotential
    if name == "validate_decomposition":
        from xnn.distributed.validate import validate_decomposition

        return validate_decomposition
    raise AttributeError(f"module 'xnn.distributed' has no attribute {name!r}")
