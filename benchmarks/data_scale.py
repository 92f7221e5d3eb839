"""Data loading at scale: how fast each dataset format feeds batches with edges to a model.

A synthetic set of ``--n`` periodic structures of mixed sizes (8 to 125 atoms, Cu and Au,
random labels) is written as xnn HDF5, as ASE-LMDB (``.aselmdb``, one row per structure,
labels in a single-point calculator as OMat24 stores them) and as a prepared dataset
(``xnn data prepare``, from the HDF5 file); the in-memory format holds every structure as a
graph (what reading an extxyz file gives). For each format and each number of
``torch.utils.data.DataLoader`` workers (``--workers``), a fresh process opens the data and
iterates ``--batches`` shuffled batches of ``--batch-size`` structures, each structure with
its neighbor list at ``--cutoff`` (built in the loader, as training does with
``data.cache_edges=false``), collated into one graph in the loader and sent to the main
process packed in one buffer (as the training loader sends a share, ``xnn.data.packed``):

* ``structures_per_s`` / ``atoms_per_s`` / ``s_per_batch``: after the first batch;
* ``first_batch_s``: from creating the loader's iterator to the first batch (worker start-up
  included); ``open_s``: opening the dataset (the in-memory format reads everything here);
* ``transfer``: how a batch crossed from a worker (``packed``: one buffer, the default;
  ``fields``: a tensor a field, ``--transfer fields``; null without workers);
* ``peak_rss``: the peak resident set (``VmHWM``) of the main process and of each worker;
  ``pss_end``: the proportional set size of all of them together at the end (shared pages
  counted once).

With ``--device cuda`` (or ``--step``), the training step time (forward, forces, double
backward, optimizer) of the equivariant model on the same batches is measured too, and each
row holds ``loader_over_step`` = loader time per batch / step time (the issue's goal: < 0.1
with 4 workers for the prepared format; a loader time above the step time stalls training).

ASE-LMDB is read lazily by a row lookup per structure (:class:`AseDbRows` here, or
``xnn.data.sources.open_source`` where it exists).

Writing the set takes most of the time (per 1,000 structures on a loaded 2-core CPU: HDF5
~1 s, ASE-LMDB ~4 s, prepared ~4 s); give ``--work DIR`` to write once and time again.

Usage::

    python benchmarks/data_scale.py --n 5000 --batches 40   # CPU: data_scale_cpu.json
    python benchmarks/data_scale.py --device cuda           # GPU: data_scale_h100.json (h200...)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import synchronize, write_json  # noqa: E402
from xnn.data import keys as K  # noqa: E402
from xnn.data.datasets import (  # noqa: E402
    InMemoryDataset,
    LabelledDataset,
    make_batches,
    normalize_labels,
)
from xnn.data.graph import AtomicGraph  # noqa: E402
from xnn.data.packed import Packed, pack  # noqa: E402
from xnn.data.sources import read_structures  # noqa: E402

FORMATS = ("memory", "hdf5", "aselmdb", "prepared")
SPACING = 2.3  # Å between lattice sites of the synthetic structures


# --------------------------------------------------------------------------- data
def synthetic(n: int, seed: int = 0):
    """``n`` one-system graphs: rattled simple-cubic boxes of 2-5 sites per axis (8-125
    atoms), Cu/Au, random energy, forces and stress labels (eV, eV/Å, eV/Å³)."""
    rng = np.random.default_rng(seed)
    for k in range(n):
        reps = rng.integers(2, 6, size=3)
        grid = np.stack(np.meshgrid(*[np.arange(r) for r in reps], indexing="ij"), -1)
        pos = grid.reshape(-1, 3) * SPACING + rng.normal(0, 0.1, (int(np.prod(reps)), 3))
        numbers = rng.choice([29, 79], size=len(pos))
        stress = rng.normal(0, 0.01, (3, 3))
        g = AtomicGraph.from_arrays(
            pos, numbers, cell=np.diag(reps * SPACING), pbc=[True] * 3,
            extra={K.ENERGY: np.array([-3.5 * len(pos) + rng.normal()]),
                   K.FORCES: rng.normal(0, 0.5, (len(pos), 3)),
                   K.STRESS: ((stress + stress.T) / 2).reshape(1, 3, 3)})
        yield normalize_labels(g).replace({K.SYSTEM_ID: torch.tensor([k])})


def write_aselmdb(path: Path, graphs) -> None:
    import ase.db
    from ase import Atoms
    from ase.calculators.singlepoint import SinglePointCalculator

    with ase.db.connect(str(path)) as db:
        for g in graphs:
            atoms = Atoms(g.numbers.numpy(), g.positions.numpy(), cell=g.cell[0].numpy(),
                          pbc=g.pbc[0].numpy())
            s = g.stress[0].numpy()
            atoms.calc = SinglePointCalculator(
                atoms, energy=float(g.energy[0]), forces=g.forces.numpy(),
                stress=np.array([s[0, 0], s[1, 1], s[2, 2], s[1, 2], s[0, 2], s[0, 1]]))
            db.write(atoms)


class AseDbRows(LabelledDataset):
    """An ASE database read lazily: structure ``i`` is row ``i + 1`` (ids in writing order);
    the connection is opened once per process."""

    def __init__(self, path: Path):
        import ase.db

        self.path, self.name = Path(path), Path(path).name
        self._db, self._pid = None, None
        with ase.db.connect(str(path)) as db:
            self.n_atoms = np.asarray([row.natoms for row in db.select(columns=["natoms"])],
                                      dtype=np.int64)

    def __getstate__(self):
        return {**self.__dict__, "_db": None, "_pid": None}

    def __len__(self) -> int:
        return len(self.n_atoms)

    def __getitem__(self, index: int) -> AtomicGraph:
        import ase.db

        from xnn.data.ase_io import from_ase

        if self._db is None or self._pid != os.getpid():
            self._db, self._pid = ase.db.connect(str(self.path)), os.getpid()
        atoms = self._db.get(id=int(index) + 1).toatoms()
        return normalize_labels(from_ase([atoms]))


def open_format(fmt: str, work: Path):
    if fmt == "memory":
        h5 = read_structures(work / "data.h5")
        return InMemoryDataset([h5[i] for i in range(len(h5))], name="memory")
    if fmt == "hdf5":
        return read_structures(work / "data.h5")
    if fmt in ("prepared", "ready"):
        return read_structures(work / "prepared")
    try:
        from xnn.data.sources import open_source  # the lazy readers, where they exist
    except ImportError:
        return AseDbRows(work / "data.aselmdb")
    return open_source(work / "data.aselmdb")


def prepare_inputs(work: Path, n: int, cutoff: float) -> dict:
    """Write the synthetic set in every format; seconds per writer."""
    from xnn.app.data import edge_counter
    from xnn.data.hdf5 import write_hdf5
    from xnn.data.prepared import write_prepared

    times = {}
    t0 = time.perf_counter()
    write_hdf5(work / "data.h5", synthetic(n))
    times["hdf5"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_aselmdb(work / "data.aselmdb", synthetic(n))
    times["aselmdb"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_prepared(read_structures(work / "data.h5"), work / "prepared", 4, cutoff,
                   count_edges=edge_counter(cutoff), overwrite=True)
    times["prepared"] = time.perf_counter() - t0
    return times


# --------------------------------------------------------------------------- loading
class Batches(torch.utils.data.Dataset):
    """Batch ``k``: the structures of ``batches[k]`` with their neighbor lists, read as the
    training loop reads a share (``BatchSharding.load`` of a ``WithEdges`` without cache:
    one batched read, one neighbor-list call, the coincident-atoms check)."""

    def __init__(self, dataset, batches: list[list[int]], cutoff: float,
                 packed: bool = True):
        from xnn.neighbors.datasets import WithEdges
        from xnn.training.sharding import BatchSharding

        self.batches, self.cutoff, self.packed = batches, cutoff, packed
        self.dataset = WithEdges(dataset, cutoff, cache=False)
        self.load = BatchSharding().load

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> Packed | dict[str, torch.Tensor]:
        graphs = self.load(self.dataset, list(self.batches[k]))
        # collated in the worker and packed as the training loader packs a share: one
        # tensor crosses to the main process, not one per field (xnn.data.packed);
        # ``--transfer fields``: the field dict (a tensor each, as before 2026-12-07)
        fields = AtomicGraph.concat(graphs).fields
        return pack(fields) if self.packed else fields


class Ready(Batches):
    """The receive ceiling (format ``ready``, not run by default): every item is a copy of
    one batch built before the workers start (prepared data, with edges), so the workers
    only copy (and pack) it and the main process's receiving is what is timed."""

    def __init__(self, dataset, batches: list[list[int]], cutoff: float,
                 packed: bool = True):
        super().__init__(dataset, batches, cutoff, packed=False)
        self.built = super().__getitem__(0)
        self.packed = packed

    def __getitem__(self, k: int) -> Packed | dict[str, torch.Tensor]:
        fields = {name: t.clone() for name, t in self.built.items()}
        return pack(fields) if self.packed else fields


def graphs_of(sent: Packed | dict[str, torch.Tensor]) -> list[AtomicGraph]:
    """The batch as the trainer takes it: a list of graphs (here one, of many systems)."""
    return [AtomicGraph(sent.unpack() if isinstance(sent, Packed) else sent, validate=False)]


def _status(pid: int, key: str) -> int | None:
    """A ``kB`` line of ``/proc/PID/status`` (or ``smaps_rollup`` for ``Pss``) in bytes."""
    name = "smaps_rollup" if key == "Pss" else "status"
    try:
        for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run_one(fmt: str, workers: int, work: Path, batch_size: int, n_batches: int,
            cutoff: float, packed: bool = True) -> dict:
    """One format with ``workers`` loader workers, in this (fresh) process."""
    packed = packed and workers > 0  # without workers training reads in its own process
    t0 = time.perf_counter()
    ds = open_format(fmt, work)
    open_s = time.perf_counter() - t0
    batches = make_batches(np.asarray(ds.n_atoms), batch_size=batch_size, shuffle=True,
                           seed=0)[: n_batches + 1]
    items = (Ready if fmt == "ready" else Batches)(ds, batches, cutoff, packed)
    loader = torch.utils.data.DataLoader(
        items, batch_size=None, shuffle=False, num_workers=workers,
        prefetch_factor=4 if workers else None)
    t0 = time.perf_counter()
    it = iter(loader)
    graphs_of(next(it))
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    atoms = 0
    pids = [os.getpid(), *[w.pid for w in getattr(it, "_workers", [])]]
    peaks, pss, probe = [], [], 0.0
    for sent in it:
        atoms += sum(g.n_atoms for g in graphs_of(sent))
        # the workers exit after the last batch: read them at each (time not counted)
        t2 = time.perf_counter()
        found = [_status(p, "VmHWM") for p in pids]
        if all(v is not None for v in found):
            peaks, pss = found, [_status(p, "Pss") for p in pids]
        probe += time.perf_counter() - t2
    elapsed = time.perf_counter() - t1 - probe
    del it
    structures = sum(len(b) for b in batches[1:])
    transfer = ("packed" if packed else "fields") if workers else None
    return {"format": fmt, "workers": workers, "transfer": transfer, "open_s": open_s,
            "first_batch_s": first,
            "batches": len(batches) - 1, "structures_per_s": structures / elapsed,
            "atoms_per_s": atoms / elapsed, "s_per_batch": elapsed / (len(batches) - 1),
            "peak_rss": {"main": peaks[0], "workers": peaks[1:]},
            "pss_end": sum(p for p in pss if p is not None)}


def step_time(work: Path, batch_size: int, n_steps: int, cutoff: float, device: str) -> dict:
    """Median training step of the equivariant model on batches of the prepared data."""
    from benchmarks.training import SPECS, model_hparams
    from xnn.models import build
    from xnn.training.reducer import LocalReducer
    from xnn.training.trainer import Trainer

    ds = read_structures(work / "prepared")
    stats = ds.manifest["statistics"]
    torch.manual_seed(0)
    model = build("equivariant", species=[29, 79], cutoff=cutoff,
                  avg_num_neighbors=stats["avg_num_neighbors"],
                  **model_hparams("equivariant", False)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    trainer = Trainer(model, SPECS, opt, reducer=LocalReducer(), device=torch.device(device),
                      dtype=torch.float32, grad_clip=10.0)
    batches = make_batches(np.asarray(ds.n_atoms), batch_size=batch_size, shuffle=True,
                           seed=0)[: n_steps + 2]
    data = Batches(ds, batches, cutoff)
    times = []
    for k in range(len(batches)):
        graphs = graphs_of(data[k])
        synchronize(device)
        t0 = time.perf_counter()
        trainer.train_step(graphs, k, counts=ds.batch_label_counts(batches[k]))
        synchronize(device)
        if k >= 2:
            times.append(time.perf_counter() - t0)
    return {"model": "equivariant", "hyperparameters": model_hparams("equivariant", False),
            "steps": len(times), "median_s": float(np.median(times))}


# --------------------------------------------------------------------------- main
def device_tag(device: str) -> str:
    """``cpu``, or the GPU's model as the results files name it (``h100``, ``h200``)."""
    if not device.startswith("cuda"):
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    found = [w for w in name.replace("-", " ").split() if w[:1] in "abhlv" and w[1:].isdigit()]
    return found[0] if found else "cuda"



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="output file (default benchmarks/results/"
                   "data_scale_cpu.json, or _h100.json etc. with --device cuda)")
    p.add_argument("--n", type=int, default=100_000, help="structures (default 100000)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--batches", type=int, default=200, help="timed batches per run")
    p.add_argument("--workers", default="0,2,4", help="loader workers to try")
    p.add_argument("--formats", default=",".join(FORMATS),
                   help="of " + ", ".join(FORMATS) + ", and ready: one batch built before "
                   "the workers start, copied as each item (the main process's receive "
                   "ceiling)")
    p.add_argument("--cutoff", type=float, default=5.0)
    p.add_argument("--device", default="cpu", help="device of the step timing")
    p.add_argument("--step", action="store_true", help="time the training step on CPU too")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--work", default=None, help="folder of the written data (default: temp); "
                   "a folder of an earlier run with the same --n and --cutoff is reused")
    p.add_argument("--note", default="", help="recorded in the file (the machine's load...)")
    p.add_argument("--transfer", choices=("packed", "fields"), default="packed",
                   help="how a batch crosses from a worker: one packed buffer (as training "
                   "sends it) or a tensor a field (before 2026-12-07)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # FORMAT,WORKERS: a child
    args = p.parse_args(argv)
    if args.one:
        fmt, workers = args.one.split(",")
        print(json.dumps(run_one(fmt, int(workers), Path(args.work), args.batch_size,
                                 args.batches, args.cutoff, args.transfer == "packed")))
        return 0
    tmp = None
    if args.work is None:
        tmp = tempfile.TemporaryDirectory(prefix="data_scale_")
        args.work = tmp.name
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    done = work / "written.json"  # a --work folder of an earlier run of this size: reused
    key = {"n": args.n, "cutoff": args.cutoff}
    if done.is_file() and json.loads(done.read_text())["key"] == key:
        write_s = json.loads(done.read_text())["write_s"]
        print(f"reusing the {args.n} structures in {work}", flush=True)
    else:
        print(f"writing {args.n} structures to {work}", flush=True)
        write_s = prepare_inputs(work, args.n, args.cutoff)
        done.write_text(json.dumps({"key": key, "write_s": write_s}))
    step = None
    if args.device.startswith("cuda") or args.step:
        step = step_time(work, args.batch_size, args.steps, args.cutoff, args.device)
        print(f"step: {step['median_s'] * 1e3:.1f} ms", flush=True)
    rows = []
    for fmt in args.formats.split(","):
        for w in (int(x) for x in args.workers.split(",")):
            cmd = [sys.executable, __file__, "--one", f"{fmt},{w}", "--work", str(work),
                   "--batch-size", str(args.batch_size), "--batches", str(args.batches),
                   "--cutoff", str(args.cutoff), "--transfer", args.transfer]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            if step is not None:
                row["loader_over_step"] = row["s_per_batch"] / step["median_s"]
            rows.append(row)
            print(f"{fmt:9s} {w} workers: {row['structures_per_s']:8.0f} structures/s, "
                  f"first batch {row['first_batch_s']:.2f} s, peak RSS main "
                  f"{row['peak_rss']['main'] / 2**20:.0f} MiB", flush=True)
    n_atoms = int(read_structures(work / "data.h5").n_atoms.sum())
    out = args.json or f"benchmarks/results/data_scale_{device_tag(args.device)}.json"
    write_json(out, {
        "benchmark": "data_scale", "n_structures": args.n, "n_atoms": n_atoms,
        "batch_size": args.batch_size, "cutoff": args.cutoff, "write_s": write_s,
        "step": step, "results": rows, "note": args.note,
        "command": " ".join(["python", "benchmarks/data_scale.py", *(argv or sys.argv[1:])]),
    }, device=args.device)
    print(f"wrote {out}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
