"""Host cost of the pieces of a data-parallel gradient all-reduce (no model step around them).

Under ``torchrun --nproc-per-node 2`` on GPUs: the median host time (ms) of one call of
the reducer's ``all_reduce_grads`` on SchNet's gradients (226k parameters, 32 tensors), of a
bare ``all_reduce`` of one flat buffer, and of the concatenation, split and copy it needs
when the buffer is made per step; also forward + backward with gradients set to ``None``
(autograd takes the new gradient) against zeroed in place (autograd adds into it). Each
call starts after a barrier and a synchronisation; the time is the host's until the call
returns (the kernels run on afterwards).

Usage::

    torchrun --nproc-per-node 2 benchmarks/ddp_collective_costs.py --json costs.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_json  # noqa: E402
from xnn.data.datasets import collate  # noqa: E402
from xnn.data.emt import write_emt  # noqa: E402
from xnn.data.sources import read_structures
from xnn.distributed.entries import parallelize_train  # noqa: E402
from xnn.distributed.manager import DistributedManager  # noqa: E402
from xnn.models import build  # noqa: E402
from xnn.models.derivatives import compute_properties  # noqa: E402
from xnn.neighbors.datasets import WithEdges  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeat", type=int, default=100)
    args = p.parse_args(argv)
    manager = DistributedManager.initialize(device=args.device)
    dev = manager.device if manager.is_distributed else torch.device(args.device)
    red = parallelize_train(manager).reducer
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        write_emt(Path(tmp) / "cu.xyz", 16, ["Cu"], seed=0)
        ds = WithEdges(read_structures(Path(tmp) / "cu.xyz"), 5.0)
        graphs = [ds[i] for i in range(8)]
    torch.manual_seed(0)
    model = build("schnet", species=[29], cutoff=5.0, num_features=128, num_filters=128,
                  num_interactions=3).to(dev)
    params = [q for q in model.parameters() if q.requires_grad]
    batch = collate(graphs).to(dev, torch.float32)

    def host_ms(fn, n=args.repeat):
        times = []
        for _ in range(n):
            sync()
            red.barrier()
            sync()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            sync()
        return round(float(np.median(times)) * 1e3, 4)

    for q in params:
        q.grad = torch.randn_like(q)
    grads = [q.grad for q in params]
    extra = torch.zeros(2, dtype=torch.float64, device=dev)
    sizes = [g.numel() for g in grads] + [2]
    flat = torch.cat([g.reshape(-1) for g in grads] + [extra.float()])
    res: dict = {"parameter_tensors": len(params), "parameters": sum(sizes) - 2}
    res["all_reduce_grads"] = host_ms(lambda: red.all_reduce_grads(params, extra))
    res["bare_all_reduce"] = host_ms(lambda: dist.all_reduce(flat))
    res["cat"] = host_ms(lambda: torch.cat([g.reshape(-1) for g in grads] + [extra.float()]))
    res["split_view_copy"] = host_ms(lambda: torch._foreach_copy_(
        grads, [v.view_as(g) for v, g in zip(flat.split(sizes), grads)]))
    res["barrier"] = host_ms(red.barrier)

    def step(set_to_none):
        def f():
            model.zero_grad(set_to_none=set_to_none)
            out = compute_properties(model, batch, forces=True, stress=True, training=True)
            sum(out[k].square().sum() for k in ("energy", "forces", "stress")).backward()
        return f

    step(True)()
    for k in range(2):  # interleaved, twice
        res[f"forward_backward_grads_none_{k}"] = host_ms(step(True), 40)
        res[f"forward_backward_grads_zeroed_{k}"] = host_ms(step(False), 40)
    per_rank = red.gather_objects(res)
    if red.is_main:
        print(per_rank)
        if args.json:
            write_json(args.json, {"ms_host_per_call": per_rank}, device=str(dev))
    manager.cleanup()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
