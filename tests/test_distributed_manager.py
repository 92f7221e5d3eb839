"""Launch detection, ParallelDims validation, single process (the 4-rank dp × dd mesh is
tested inside the shared 4-rank job of ``test_distributed_dd.py``)."""

import pytest
import torch

from xnn.distributed import DistributedManager, ParallelDims, detect_launch
from xnn.errors import InputError


def test_detect_torchrun():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
           "MASTER_PORT": "29500", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    info = detect_launch(env)
    assert (info.method, info.rank, info.world_size, info.local_rank) == ("ENV", 3, 8, 1)
    assert (info.master_addr, info.master_port) == ("n1", 29500)


def test_detect_slurm_and_forced():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7", "SLURM_JOB_ID": "1234",
           "SLURM_STEP_ID": "0"}
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


def test_more_ranks_than_gpus_is_refused_for_nccl(monkeypatch):
    """4 ranks on a 1-GPU node with the default (NCCL) backend: one clear line, not NCCL's
    'Duplicate GPU detected' after the rendezvous."""
    import torch

    from xnn.distributed import manager as M
    from xnn.errors import InputError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(InputError, match="4 ranks on this node share 1 CUDA GPU"):
        M._pick_device(None, 3, None)
    assert M._pick_device("cpu", 3, None).type == "cpu"  # gloo on CPU is fine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert M._pick_device(None, 0, None) == torch.device("cuda", 0)
