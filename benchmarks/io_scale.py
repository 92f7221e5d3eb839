"""The cost of one checkpoint and one trajectory frame of a decomposed run: gathered to rank
0 against sharded (every rank writes its own atoms).

For each ``--sizes`` atom count and each ``--ranks`` count, freshly spawned gloo ranks each
hold a block of the atoms (ids, positions, velocities, masses, numbers, forces, fp64: what
an MD state's owned graph holds) and write, as ``xnn md`` does:

* ``checkpoint`` ``gathered``: :func:`xnn.distributed.domain.state.gather` of every atom and
  its forces to rank 0 in id order, then :func:`xnn.io.md_checkpoint.save_checkpoint`;
* ``checkpoint`` ``sharded``: each rank :func:`~xnn.io.sharded_checkpoint.write_shard`, the
  shard counts all-gathered, then rank 0's index (:func:`~xnn.io.sharded_checkpoint.
  write_index`);
* ``frame`` ``gathered``: the gather, then one frame of :class:`~xnn.io.trajectory.
  HDF5TrajectoryWriter` on rank 0; ``frame`` ``sharded``: one frame of :class:`~xnn.io.
  sharded_trajectory.ShardedTrajectoryWriter` on every rank.

Figures per row (plain names, for the step-cost model of issue 47): ``total_s`` (wall time
from a barrier to the end of the write on the slowest rank), ``gather_s`` (rank 0's time in
the gather; 0 sharded), ``write_s`` (the slowest rank's time writing its file; per rank in
``write_s_per_rank``), ``bytes_per_rank`` and ``bytes_per_atom`` (files written over atoms),
``rank0_peak_bytes`` (rank 0's peak resident set during the operation less its resident set
before: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``). Files go to
``--dir`` (a local disk here; a parallel file system changes ``write_s``).

Usage::

    python benchmarks/io_scale.py --json benchmarks/results/io_scale_cpu.json
    python benchmarks/io_scale.py --sizes 100000 --ranks 1 2 --dir /tmp/io
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def owned_state(n_atoms: int, rank: int, size: int):
    """Rank ``rank``'s block of ``n_atoms`` argon-like atoms (a cube of 18 Å³ per atom)."""
    from xnn.data import keys as K
    from xnn.data.graph import AtomicGraph
    from xnn.dynamics.state import MDState

    lo, hi = rank * n_atoms // size, (rank + 1) * n_atoms // size
    n, side = hi - lo, (18.0 * n_atoms) ** (1 / 3)
    g = torch.Generator().manual_seed(rank)
    graph = AtomicGraph({
        K.POSITIONS: torch.rand(n, 3, generator=g, dtype=torch.float64) * side,
        K.VELOCITIES: torch.randn(n, 3, generator=g, dtype=torch.float64) * 1e-3,
        K.MASSES: torch.full((n,), 39.948, dtype=torch.float64),
        K.NUMBERS: torch.full((n,), 18, dtype=torch.long),
        K.ATOM_ID: torch.arange(lo, hi, dtype=torch.long),
        K.BATCH: torch.zeros(n, dtype=torch.long),
        K.CELL: torch.eye(3, dtype=torch.float64)[None] * side,
        K.PBC: torch.ones(1, 3, dtype=torch.bool)}, validate=False)
    e = torch.zeros(1, dtype=torch.float64)
    return MDState(graph, torch.randn(n, 3, generator=g, dtype=torch.float64), e,
                   torch.zeros(1, 3, 3, dtype=torch.float64), 1000, {}, None, True)


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> int:
    """Reset the peak resident set (Linux); returns the resident set now (bytes)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


def _files_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def checkpoint(state, out: Path, fmt: str) -> dict:
    """One checkpoint of ``state`` in ``fmt``: this rank's figures."""
    import torch.distributed as dist

    from xnn.data import keys as K
    from xnn.distributed.domain.state import gather
    from xnn.io import md_checkpoint as ckpt
    from xnn.io import sharded_checkpoint as shards

    rank, path, gather_s, mine = dist.get_rank(), out / "checkpoint.pt", 0.0, []
    dist.barrier()
    t0 = time.perf_counter()
    if fmt == "gathered":
        full, extra = gather(state.graph, None, {K.FORCES: state.forces})
        gather_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if rank == 0:
            ckpt.save_checkpoint(path, state.replace(graph=full, forces=extra[K.FORCES]),
                                 {"kind": "md"})
            mine = [path]
    else:
        t1 = time.perf_counter()
        generation = "step-000000001000-bench"
        payload = shards.shard_payload(state, {})
        shards.write_shard(path, generation, rank, payload)
        mine = [shards.sharded_path(path) / generation / shards.shard_name(rank)]
    write_s = time.perf_counter() - t1
    if fmt == "sharded":
        ids = state.graph.atom_id
        counts = [[0, 0, 0]] * dist.get_world_size()
        dist.all_gather_object(counts, [ids.numel(), int(ids.min()), int(ids.max())])
        if rank == 0:
            t2 = time.perf_counter()
            index = shards.index_payload(state, {"kind": "md"}, generation, counts,
                                         None, shards.empty_shard(payload))
            shards.write_index(path, index)
            write_s += time.perf_counter() - t2
            mine.append(shards.sharded_path(path) / shards.INDEX)
    dist.barrier()
    return {"total_s": time.perf_counter() - t0, "gather_s": gather_s, "write_s": write_s,
            "bytes": _files_bytes(mine)}


def frame(state, out: Path, fmt: str) -> dict:
    """One trajectory frame of ``state`` in ``fmt``: this rank's figures."""
    import torch.distributed as dist

    from xnn.data import keys as K
    from xnn.distributed.domain.state import gather
    from xnn.io.sharded_trajectory import ShardedTrajectoryWriter, shard_file
    from xnn.io.trajectory import HDF5TrajectoryWriter

    rank, gather_s, mine = dist.get_rank(), 0.0, []
    results = {K.FORCES: state.forces, K.ENERGY: state.energy}
    dist.barrier()
    t0 = time.perf_counter()
    if fmt == "gathered":
        full, extra = gather(state.graph, None, {K.FORCES: state.forces})
        gather_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if rank == 0:
            w = HDF5TrajectoryWriter(out / "trajectory.h5")
            w.write(full, state.step, {K.FORCES: extra[K.FORCES], K.ENERGY: state.energy})
            w.close()
            mine = [out / "trajectory.h5"]
    else:
        t1 = time.perf_counter()
        w = ShardedTrajectoryWriter(out / "trajectory.d", rank, dist.get_world_size())
        w.write(state.graph, state.step, results)
        w.close()
        mine = [shard_file(out / "trajectory.d", rank)]
    write_s = time.perf_counter() - t1
    dist.barrier()
    return {"total_s": time.perf_counter() - t0, "gather_s": gather_s, "write_s": write_s,
            "bytes": _files_bytes(mine)}


def run_point(manager, n_atoms: int, base: str) -> dict:
    """This rank's figures of every (kind, format) at ``n_atoms``."""
    import h5py  # noqa: F401 - imported before the timings (both formats use it)
    import torch.distributed as dist

    import xnn.io.md_checkpoint  # noqa: F401
    import xnn.io.sharded_trajectory  # noqa: F401

    rank, size = manager.rank, manager.world_size
    state = owned_state(n_atoms, rank, size)
    out = Path(base) / f"n{n_atoms}_p{size}"
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    dist.barrier()
    rows = []
    for kind, fn in (("checkpoint", checkpoint), ("frame", frame)):
        for fmt in ("sharded", "gathered"):
            folder = out / f"{kind}_{fmt}"
            if rank == 0:
                folder.mkdir(exist_ok=True)
            dist.barrier()
            before = _reset_peak()
            r = fn(state, folder, fmt)
            rows.append({"kind": kind, "format": fmt, **r,
                         "peak_bytes": max(0, _status("VmHWM") - before)})
    dist.barrier()
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    return {"rank": rank, "rows": rows}


def _rank_entry(rank, world, port, out_dir, n_atoms, base):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from benchmarks.common import write_rank_json
    from xnn.distributed import DistributedManager

    manager = DistributedManager.initialize(device="cpu")
    try:
        write_rank_json(out_dir, rank, lambda: run_point(manager, n_atoms, base))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def combine(n_atoms: int, ranks: list[dict]) -> list[dict]:
    """One row per (kind, format) from the ranks' figures."""
    bad = [r for r in ranks if "error" in r]
    if bad:
        return [{"n_atoms": n_atoms, "ranks": len(ranks), "error": bad[0]["error"]}]
    out = []
    for i, row in enumerate(ranks[0]["rows"]):
        per = [r["rows"][i] for r in ranks]
        nbytes = [p["bytes"] for p in per]
        out.append({"n_atoms": n_atoms, "ranks": len(ranks), "kind": row["kind"],
                    "format": row["format"],
                    "total_s": max(p["total_s"] for p in per),
                    "gather_s": per[0]["gather_s"],
                    "write_s": max(p["write_s"] for p in per),
                    "write_s_per_rank": [p["write_s"] for p in per],
                    "bytes_per_rank": nbytes,
                    "bytes_per_atom": sum(nbytes) / n_atoms,
                    "rank0_peak_bytes": per[0]["peak_bytes"]})
    return out


def main(argv=None) -> int:
    from benchmarks.common import spawn_json_ranks, write_json

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dir", default=None, help="where files are written (default: a "
                   "temporary folder)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="xnn_io_scale_")
    rows = []
    for n in args.sizes:
        for world in args.ranks:
            got = combine(n, spawn_json_ranks(_rank_entry, world, (n, base), args.timeout))
            for r in got:
                print(json.dumps({k: v for k, v in r.items()
                                  if k not in ("write_s_per_rank", "bytes_per_rank")}),
                      flush=True)
            rows.extend(got)
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        write_json(args.json, {"benchmark": "io_scale", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
