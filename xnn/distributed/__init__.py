"""Multi-process execution: launch detection, the dp × dd mesh, and spatial domain decomposition.

The only package (with the CLI that launches it) that imports ``torch.distributed``.

* :class:`DistributedManager` — torchrun / SLURM / single process; NCCL on GPU, gloo on CPU.
* :class:`ParallelDims` — the ``("dp", "dd")`` device mesh, ``dp * dd == world_size``.
* :class:`DomainDecomposed` — one system split into boxes over the ranks of a group; energy,
  forces (by autograd through the halo exchange) and stress, exact to round-off.
* :class:`DomainPotential` — a :class:`xnn.models.Potential` on each rank's owned atoms
  (scatter, migration between MD steps, gather by atom id).
* :class:`DistributedCalculator` — the same as an ASE calculator.
* :func:`validate_decomposition` — one process vs decomposed (also ``xnn validate``).

Example (``torchrun --nproc-per-node 4 script.py``)::

    manager = DistributedManager.initialize()
    dd = DomainDecomposed(model, manager, skin=0.5, mode="sync")
    out = dd(graph if manager.is_main else None)   # forces sorted by atom id, on every rank
"""

from xnn.distributed.manager import DistributedManager, LaunchInfo, detect_launch
from xnn.distributed.mesh import ParallelDims

__all__ = ["DistributedManager", "LaunchInfo", "ParallelDims", "detect_launch",
           "DomainDecomposed", "DomainPotential", "DomainState", "DistributedCalculator",
           "validate_decomposition"]

_LAZY = {
    "DomainDecomposed": "xnn.distributed.domain.decomposed",
    "DomainPotential": "xnn.distributed.domain.potential",
    "DomainState": "xnn.distributed.domain.state",
    "DistributedCalculator": "xnn.distributed.calculator",
    "validate_decomposition": "xnn.distributed.validate",
}


def __getattr__(name):  # lazy: the domain-decomposition code is heavier
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xnn.distributed' has no attribute {name!r}")
