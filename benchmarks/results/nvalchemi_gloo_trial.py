"""nvalchemi-toolkit 0.2.0 DomainParallel NVE of LJ argon on gloo/CPU (a trial, see README).

Run: torchrun --nproc-per-node 2 nvalchemi_gloo_trial.py (in a venv with nvalchemi-toolkit).
"""
import sys
import traceback

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
world = dist.get_world_size()
try:
    from ase.build import bulk
    from nvalchemi.data.atomic_data import AtomicData
    from nvalchemi.data.batch import Batch
    from nvalchemi.distributed.config import DomainConfig
    from nvalchemi.distributed.domain_parallel import DomainParallel
    from nvalchemi.dynamics.integrators.nve import NVE
    from nvalchemi.models.lj import LennardJonesModelWrapper
    from torch.distributed.device_mesh import init_device_mesh
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((8, 8, 8))
    gen = torch.Generator().manual_seed(0)
    atoms.set_velocities(torch.randn(len(atoms), 3, generator=gen).numpy() * 0.01)
    model = LennardJonesModelWrapper(epsilon=0.0104, sigma=3.405, cutoff=6.0)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("domain",))
    cfg = DomainConfig(cutoff=6.0, skin=1.0, mesh=mesh)
    data = AtomicData.from_atoms(atoms, dtype=torch.float64)
    batch = Batch.from_data_list([data]) if rank == 0 else None
    dyn = DomainParallel(NVE(model, dt=2.0, n_steps=10), cfg)
    owned = dyn.partition(batch)
    print(rank, "partitioned", getattr(owned, "num_nodes", owned), flush=True)
    out = dyn.run(owned, n_steps=10)
    print(rank, "ran", flush=True)
except Exception:
    traceback.print_exc()
    sys.exit(1)
finally:
    dist.destroy_process_group()
