"""``ParallelDims``: the 2-D mesh of ranks with named axes ``dp`` (data) × ``dd`` (domain).

Rank ``r`` sits at ``(dp_rank, dd_rank) = divmod(r, dd)``: the ``dd`` ranks of one data-parallel
replica are consecutive (on one node when ``dd`` divides the GPUs per node), as in torchtitan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from xnn.errors import InputError

AXES = ("dp", "dd")


@dataclass
class ParallelDims:
    """Degrees of parallelism, checked against the world size.

    Args:
        dp: data-parallel degree (replicas), or -1 to infer it as ``world_size // dd``.
        dd: domain-decomposition degree (ranks per replica), or -1 to infer it.
        world_size: number of ranks in the job.

    Raises:
        InputError: if ``dp * dd != world_size`` or a degree is not a positive integer.
    """

    dp: int
    dd: int
    world_size: int
    mesh: object | None = field(default=None, repr=False)

    def __post_init__(self):
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise InputError(f"world_size must be a positive integer, got {self.world_size!r}")
        for name in AXES:
            v = getattr(self, name)
            if not isinstance(v, int) or (v < 1 and v != -1):
                raise InputError(f"parallel.{name} must be a positive integer or -1, got {v!r}")
        if self.dp == -1 and self.dd == -1:
            raise InputError("at most one of parallel.dp and parallel.dd may be -1 (inferred)")
        for name, other in (("dp", "dd"), ("dd", "dp")):
            if getattr(self, name) == -1:
                o = getattr(self, other)
                if self.world_size % o:
                    raise InputError(f"parallel.{other}={o} does not divide the world size "
                                     f"{self.world_size}")
                setattr(self, name, self.world_size // o)
        if self.dp * self.dd != self.world_size:
            raise InputError(f"parallel.dp * parallel.dd = {self.dp} * {self.dd} = "
                             f"{self.dp * self.dd} does not match the world size {self.world_size} "
                             "(number of launched ranks)")

    # ------------------------------------------------------------------ mesh
    def build_mesh(self, device_type: str = "cpu"):
        """Build the ``DeviceMesh`` with axes ``("dp", "dd")`` (``None`` in a single process).

        Requires ``torch.distributed`` to be initialised when ``world_size > 1``.
        """
        if not _initialized():
            if self.world_size > 1:
                raise InputError(f"a mesh of {self.world_size} ranks needs torch.distributed "
                                 "(launch with torchrun or srun)")
            self.mesh = None
            return None
        if dist.get_world_size() != self.world_size:
            raise InputError(f"ParallelDims expects {self.world_size} ranks but the job has "
                             f"{dist.get_world_size()}")
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device_type, (self.dp, self.dd), mesh_dim_names=AXES)
        return self.mesh

    def _group(self, axis: str):
        if self.mesh is None:
            if _initialized() and self.world_size > 1:
                raise RuntimeError("call ParallelDims.build_mesh() before using its groups")
            return None
        return self.mesh.get_group(axis)

    def _rank(self, axis: str) -> int:
        if self.mesh is None:
            r = dist.get_rank() if _initialized() else 0
            return divmod(r, self.dd)[0 if axis == "dp" else 1]
        return self.mesh.get_local_rank(axis)

    @property
    def dp_group(self):
        """Process group of this rank's data-parallel axis (``None`` in a single process)."""
        return self._group("dp")

    @property
    def dd_group(self):
        """Process group of this rank's domain-decomposition axis (``None`` in a single process)."""
        return self._group("dd")

    @property
    def dp_rank(self) -> int:
        return self._rank("dp")

    @property
    def dd_rank(self) -> int:
        return self._rank("dd")


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()
