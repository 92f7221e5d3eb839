"""Launch detection, ParallelDims validation, and a 4-rank dp × dd mesh on gloo."""

import pytest
import torch

from xnn.distributed import DistributedManager, ParallelDims, detect_launch
from xnn.errors import InputError

try:
    from dist_helpers import spawn
except ImportError:  # tests/ is a package
    from tests.dist_helpers import spawn


def test_detect_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
           "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    info = detect_launch(env)
    assert (info.method, info.rank, info.world_size, info.local_rank) == ("ENV", 3, 8, 1)
    assert (info.master_addr, info.master_port) == ("n1", 29500)


def test_detect_slurm_and_forced():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "SLURM_JOB_ID": "1234"}
    info = detect_launch(env)
    assert (info.method, info.rank, info.world_size, info.local_rank) == ("SLURM", 5, 8, 1)
    assert info.master_addr == "10.0.0.7" and info.master_port == 15000 + 1234
    assert detect_launch({**env, "XNN_DISTRIBUTED_INIT_METHOD": "none"}).method == "NONE"
    with pytest.raises(InputError, match="RANK"):
        detect_launch({"XNN_DISTRIBUTED_INIT_METHOD": "ENV"})
    with pytest.raises(InputError, match="not one of"):
        detect_launch({"XNN_DISTRIBUTED_INIT_METHOD": "MPI"})
    with pytest.raises(InputError, match="rank 9"):
        detect_launch({"RANK": "9", "WORLD_SIZE": "4"})


def test_single_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "XNN_DISTRIBUTED_INIT_METHOD"):
        monkeypatch.delenv(k, raising=False)
    m = DistributedManager.initialize(device="cpu")
    assert (m.rank, m.world_size, m.local_rank) == (0, 1, 0)
    assert m.is_main and not m.is_distributed
    assert not torch.distributed.is_initialized()
    m.barrier()
    dims = m.mesh(dp=1, dd=1)
    assert dims.dd_group is None and dims.dp_rank == 0 and dims.dd_rank == 0
    m.cleanup()


def test_parallel_dims_validation():
    assert ParallelDims(dp=-1, dd=4, world_size=8).dp == 2
    with pytest.raises(InputError, match="does not match the world size 8"):
        ParallelDims(dp=3, dd=2, world_size=8)
    with pytest.raises(InputError, match="does not divide"):
        ParallelDims(dp=-1, dd=3, world_size=8)
    with pytest.raises(InputError, match="positive integer"):
        ParallelDims(dp=0, dd=2, world_size=2)


def _mesh_worker(rank, world_size):
    m = DistributedManager.initialize(backend="gloo", timeout_s=60)
    dims = m.mesh(dp=2, dd=2)
    t = torch.tensor([float(rank)])
    torch.distributed.all_reduce(t, group=dims.dd_group)
    u = torch.tensor([float(rank)])
    torch.distributed.all_reduce(u, group=dims.dp_group)
    m.barrier()
    return dict(rank=m.rank, world=m.world_size, main=m.is_main, dp_rank=dims.dp_rank,
                dd_rank=dims.dd_rank, dd_sum=t.item(), dp_sum=u.item())


@pytest.mark.distributed
def test_mesh_four_ranks():
    res = spawn(_mesh_worker, 4, timeout_s=120)
    for r, out in enumerate(res):
        assert out["rank"] == r and out["world"] == 4 and out["main"] == (r == 0)
        assert (out["dp_rank"], out["dd_rank"]) == divmod(r, 2)
        # dd groups: {0,1}, {2,3}; dp groups: {0,2}, {1,3}
        assert out["dd_sum"] == {0: 1, 1: 1, 2: 5, 3: 5}[r]
        assert out["dp_sum"] == {0: 2, 1: 4, 2: 2, 3: 4}[r]
