"""Multi-process execution: launch detection, the dp × dd mesh, and spatial domain decomposition.

The only package (with the CLI that launches it) that imports ``torch.distributed``.

* :class:`DistributedManager` — torchrun / SLURM / single process; NCCL on GPU, gloo on CPU.
* :class:`ParallelDims` — the ``("dp", "dd")`` device mesh, ``dp * dd == world_size``.
* :func:`parallelize` — the one constructor of a decomposition (modes of
  :data:`~xnn.distributed.modes.MODES`: spatial boxes with halo or per-layer sync, graph
  index blocks, or auto).
* :class:`DecomposedPotential` — what it returns: a :class:`xnn.models.Potential` on each
  rank's owned atoms (scatter, migration between MD steps, gather by atom id, single points),
  energy, forces (by autograd through the exchanges) and stress, exact to round-off.
* :class:`DistributedCalculator` — the same as an ASE calculator.
* :func:`validate_decomposition` — one process vs decomposed (also ``xnn validate``).

Example (``torchrun --nproc-per-node 4 script.py``)::

    manager = DistributedManager.initialize()
    pot = parallelize(model, manager, mode="spatial", skin=0.5)
    out = pot.single_point(graph if manager.is_main else None)   # sorted by atom id
"""

from xnn.distributed.manager import DistributedManager, LaunchInfo, detect_launch
from xnn.distributed.mesh import ParallelDims
from xnn.distributed.parallelize import parallelize

__all__ = ["DistributedManager", "LaunchInfo", "ParallelDims", "detect_launch",
           "parallelize", "DecomposedPotential", "DomainState", "DistributedCalculator",
           "validate_decomposition"]

_LAZY = {
    "DecomposedPotential": "xnn.distributed.potential",
    "DomainState": "xnn.distributed.domain.state",
    "DistributedCalculator": "xnn.distributed.calculator",
    "validate_decomposition": "xnn.distributed.validate",
}


def __getattr__(name):  # lazy: the domain-decomposition code is heavier
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xnn.distributed' has no attribute {name!r}")
