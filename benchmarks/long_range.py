"""PME time per evaluation (energy + forces): xnn's ``pme`` against torch-pme's
``PMECalculator`` called directly, same parameters, same neighbor list, same run.

Usage (from the repository root)::

    python benchmarks/long_range.py --quick   # writes benchmarks/results/long_range_cpu.json
    python benchmarks/long_range.py --json long_range_cuda.json --device cuda

Systems: rattled rock-salt NaCl (a = 5.64 Å, charges +-1) of about 10k, 100k (and 1M on
CUDA) ions; ``cutoff`` 6 Å, ``accuracy`` 1e-4, 4 interpolation nodes (smearing and mesh
spacing from xnn's formulas, passed unchanged to torch-pme). The neighbor list is built
once, outside the timings. Both sides compute the edge distances from positions (so that
forces include the real-space part) and one backward for the forces; no stress. Reported:
median wall time per evaluation and the ratio xnn / torch-pme (goal <= 1.1).

``--dd 1,2,4``: the same system decomposed over that many gloo ranks on this host (one
thread each; :class:`~xnn.distributed.DomainPotential`: real space through the halo, the
PME mesh all-reduced, replicated FFT): per-rank median time of one evaluation (energy,
forces, stress), owned / ghost atoms, the mesh's size and peak resident memory per rank::

    python benchmarks/long_range.py --json /tmp/long_range_dd.json \
        --sizes 10000 --dd 1,2 --no-direct
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from ase.build import bulk

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import time_fn, write_json  # noqa: E402
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.models import registry  # noqa: E402
from xnn.models.derivatives import compute_properties  # noqa: E402
from xnn.models.long_range import COULOMB_CONSTANT  # noqa: E402
from xnn.neighbors.api import with_edges  # noqa: E402

CUTOFF, ACCURACY, NODES = 6.0, 1e-4, 4


def nacl(n_target: int, device, dtype) -> AtomicGraph:
    reps = max(1, round((n_target / 8) ** (1 / 3)))
    atoms = bulk("NaCl", "rocksalt", a=5.64, cubic=True).repeat(reps)
    atoms.rattle(0.05, seed=0)
    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell[:], atoms.pbc,
                                dtype=dtype, device=device)
    return with_edges(g, CUTOFF)


def torchpme_fn(model, g: AtomicGraph):
    from torchpme import CoulombPotential, PMECalculator

    calc = PMECalculator(CoulombPotential(smearing=model.smearing, prefactor=COULOMB_CONSTANT),
                         mesh_spacing=model.mesh_spacing, interpolation_nodes=NODES,
                         full_neighbor_list=True).to(device=g.device, dtype=g.dtype)
    q = torch.where(g.numbers == 11, 1.0, -1.0).to(g.dtype)[:, None]
    pairs = torch.stack([g.edge_index[1], g.edge_index[0]], 1)
    cell = g.cell[0]

    def run():
        pos = g.positions.detach().requires_grad_(True)
        ei = g.edge_index
        vec = pos[ei[0]] - pos[ei[1]] + g.shifts.to(g.dtype) @ cell
        pot = calc(q, cell, pos, pairs, vec.norm(dim=-1))
        energy = (q * pot).sum()
        (grad,) = torch.autograd.grad(energy, pos)
        return energy.detach(), -grad

    return run


def bench(n: int, device: str, dtype, repeat: int) -> dict:
    g = nacl(n, device, dtype)
    model = registry.build("pme", cutoff=CUTOFF, accuracy=ACCURACY, interpolation_nodes=NODES,
                           charges={"Na": 1.0, "Cl": -1.0}).to(device=device, dtype=dtype)
    ref = torchpme_fn(model, g)

    def ours():
        return compute_properties(model, g, forces=True, stress=False)

    e_ref, f_ref = ref()
    out = ours()
    de = float((out["energy"].sum() - e_ref).abs() / e_ref.abs())
    df = float((out["forces"] - f_ref).abs().max())
    t_ours = time_fn(ours, repeat=repeat, warmup=1, device=device)
    t_ref = time_fn(ref, repeat=repeat, warmup=1, device=device)
    from torchpme.lib.kvectors import get_ns_mesh

    mesh = get_ns_mesh(g.cell[0], model.mesh_spacing).tolist()
    row = {"n_atoms": g.n_atoms, "n_edges": g.n_edges, "mesh": mesh,
           "smearing_A": model.smearing, "mesh_spacing_A": model.mesh_spacing,
           "xnn_s": t_ours["median_s"], "torchpme_s": t_ref["median_s"],
           "ratio": t_ours["median_s"] / t_ref["median_s"],
           "energy_rel_diff": de, "forces_max_abs_diff": df}
    print(row, flush=True)
    return row


def _dd_rank(rank: int, world: int, n: int, repeat: int) -> dict:
    """One gloo rank: decomposed PME (energy, forces, stress) of the ``n``-ion system."""
    import resource
    import time

    from xnn.distributed import DistributedManager, DomainPotential

    manager = DistributedManager.initialize(backend="gloo", timeout_s=600)
    g = nacl(n, "cpu", torch.float64).without_edges()
    model = registry.build("pme", cutoff=CUTOFF, accuracy=ACCURACY, interpolation_nodes=NODES,
                           charges={"Na": 1.0, "Cl": -1.0})
    pot = DomainPotential(model, manager)
    owned = pot.scatter(g if rank == 0 else None)
    times = []
    for _ in range(repeat + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        out = pot(owned, forces=True, stress=True)
        times.append(time.perf_counter() - t0)
    from torchpme.lib.kvectors import get_ns_mesh

    mesh = get_ns_mesh(g.cell[0], model.mesh_spacing).tolist()
    st = pot.stats()
    return {"rank": rank, "median_s": sorted(times[1:])[len(times[1:]) // 2],
            "n_owned": st["n_owned"], "n_ghost": st["n_ghost"], "mesh": mesh,
            "mesh_MiB": 8 * mesh[0] * mesh[1] * mesh[2] / 2**20,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "energy": float(out["energy"])}


def bench_dd(n: int, worlds: list[int], repeat: int) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_helpers import spawn  # one set of gloo ranks per rank count

    rows = []
    for world in worlds:
        ranks = spawn(_dd_rank, world, (n, repeat), timeout_s=3600)
        row = {"n_atoms": nacl(n, "cpu", torch.float64).n_atoms, "ranks": world,
               "per_rank": ranks, "max_rank_s": max(r["median_s"] for r in ranks)}
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None,
                   help="default: benchmarks/results/<benchmark>_<device>.json")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="10k only (CPU smoke run)")
    p.add_argument("--sizes", type=int, nargs="*", help="override the system sizes")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dd", default=None, help="also decomposed over these gloo rank counts, "
                   "e.g. 1,2,4 (CPU)")
    p.add_argument("--no-direct", action="store_true", help="skip the xnn vs torch-pme part")
    args = p.parse_args()
    if args.json is None:  # the current file of this benchmark and device
        from benchmarks.common import results_path
        args.json = results_path("long_range_dd" if args.dd else "long_range", args.device, 1)
    sizes = args.sizes or ([10_000] if args.quick else
                           [10_000, 100_000] + ([1_000_000] if args.device == "cuda" else []))
    dtype = getattr(torch, args.dtype)
    rows = [] if args.no_direct else [bench(n, args.device, dtype, args.repeat) for n in sizes]
    payload = {"benchmark": "long_range_pme", "device": args.device, "dtype": args.dtype,
               "cutoff_A": CUTOFF, "accuracy": ACCURACY, "interpolation_nodes": NODES,
               "threads": torch.get_num_threads(), "results": rows}
    if args.dd:
        worlds = [int(w) for w in args.dd.split(",")]
        payload["dd"] = {"backend": "gloo", "threads_per_rank": 1, "dtype": "float64",
                         "results": [r for n in sizes for r in bench_dd(n, worlds,
                                                                         args.repeat)]}
    write_json(args.json, payload, device=args.device)


if __name__ == "__main__":
    main()
