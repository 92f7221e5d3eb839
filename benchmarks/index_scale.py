"""Start-up cost of a lazy dataset: the first open (index pass) and the second (stored index).

A synthetic set of ``--n`` periodic Cu/Au structures of 4 to 48 atoms (labels in a
single-point calculator: energy, forces, stress) is written as extxyz, ASE-LMDB and ASE
SQLite (``--work DIR`` keeps it for later runs). For each format, a fresh process opens it
the way training does (:func:`xnn.data.sources.read_structures`: atom counts, label counts
and species of every structure) with ``--workers`` processes for the first pass, twice:

* ``first_s``: no index stored (any index beside the file or in the cache is removed first);
* ``second_s``: the index the first open wrote is read back;
* ``bytes_per_structure``: what the opened source holds a structure for the run (atom
  counts, atom offsets, byte offsets or row ids, label counts) and the float32 sampling
  weight of ``data.samples_per_epoch`` (:func:`held_bytes`).

``*_cpu_s`` is the CPU time of the process and its workers (user + system), a better
measure than the wall time on a shared machine; ``load`` is the 1-minute load average.

``--shards K`` also writes the set as ``K`` ASE-LMDB shards and opens them as one glob
(``folder/*.aselmdb``, as OMat24 ships), first and second start alike (one index a shard).

``--per-row K`` also times the first pass's work per ASE-LMDB row (``per_row`` in the JSON,
microseconds a row over the first ``K`` rows, in one process). A row is one zlib-compressed
JSON text (``ase.io.jsonio``: ``numbers``, ``positions``, ``cell``, ``pbc``, then the
calculator results, ``key_value_pairs`` and ``data``): the atom count is read from its first
bytes, but the labels follow the positions, so the pass decompresses and decodes every
record whole. ``read_us``: fetch and decompress; ``decode_us``: the JSON decoded;
``atoms_us``: the row read as an ``ase.Atoms`` with its calculator (``source.atoms``, the
pass's read before); ``record_us``: the row read as the pass reads it now
(:class:`~xnn.data.sources.asedb._RecordAtoms`); ``pass_us``: the whole pass
(``count_range``: read, structure checks, label counts).

Usage::

    python benchmarks/index_scale.py --n 20000 --work /tmp/idx20k --json index_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUFFIX = {"extxyz": "xyz", "aselmdb": "aselmdb", "db": "db"}
KEYS = {"energy_key": "energy", "forces_key": "forces", "stress_key": "stress",
        "virial_key": "virial"}


def synthetic_frames(n: int, seed: int = 0):
    """``n`` Cu/Au fcc cells (4-48 atoms), rattled, with calculator labels."""
    from ase.build import bulk
    from ase.calculators.singlepoint import SinglePointCalculator

    rng = np.random.default_rng(seed)
    reps = [(1, 1, 1), (1, 1, 2), (1, 2, 2), (2, 2, 2), (2, 2, 3)]
    for _ in range(n):
        a = bulk("Cu", "fcc", a=3.6, cubic=True) * reps[int(rng.integers(len(reps)))]
        a.numbers[rng.random(len(a)) < 0.4] = 79
        a.positions += rng.normal(scale=0.05, size=a.positions.shape)
        a.calc = SinglePointCalculator(a, energy=float(rng.normal(-3.5 * len(a))),
                                       forces=rng.normal(size=(len(a), 3)),
                                       stress=rng.normal(size=6) * 1e-2)
        yield a


def write_set(work: Path, n: int, fmt: str) -> Path:
    """The set as ``work/set_<n>.<suffix>`` (written once)."""
    import ase.io
    from ase.db import connect

    path = work / f"set_{n}.{SUFFIX[fmt]}"
    if path.exists():
        return path
    tmp = path.with_name("tmp_" + path.name)
    if fmt == "extxyz":
        ase.io.write(tmp, list(synthetic_frames(n)), format="extxyz")
    else:
        db = connect(str(tmp), type=fmt)
        with db:
            for a in synthetic_frames(n):
                db.write(a)
        del db
    os.replace(tmp, path)
    return path


def write_shards(work: Path, n: int, k: int) -> Path:
    """The set as ``k`` ASE-LMDB shards of about ``n / k`` rows, in the folder
    ``work/shards_<n>_<k>`` (written once); open it as ``folder/*.aselmdb``."""
    from ase.db import connect

    folder = work / f"shards_{n}_{k}"
    if folder.exists():
        return folder
    tmp = work / f"tmp_shards_{n}_{k}"
    tmp.mkdir(parents=True, exist_ok=True)
    frames, per = synthetic_frames(n), -(-n // k)
    for s in range(k):
        db = connect(str(tmp / f"data.{s:04d}.aselmdb"), type="aselmdb")
        with db:
            for _ in range(min(per, n - s * per)):
                db.write(next(frames))
        del db
    os.replace(tmp, folder)
    return folder


def _cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children (workers)."""
    import resource

    return sum(getattr(resource.getrusage(who), f) for who in (
        resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN) for f in ("ru_utime", "ru_stime"))


def open_once(path: str, workers: int) -> dict:
    """One open as training does it (the ``--case`` entry)."""
    from xnn.data.sources import read_structures

    t0, c0 = time.perf_counter(), _cpu_s()
    ds = read_structures(path, workers=workers)
    counts = ds.label_counts()
    species = ds.species()
    seconds, cpu_s = time.perf_counter() - t0, _cpu_s() - c0
    return {"seconds": seconds, "cpu_s": cpu_s,
            "load": os.getloadavg()[0], "structures": len(ds),
            "atoms": int(np.asarray(ds.n_atoms).sum()), "labels": counts.sum(0).tolist(),
            "species": species, "bytes_per_structure": held_bytes(ds) / len(ds)}


def held_bytes(ds) -> int:
    """Bytes of the per-structure arrays an open source holds for the run (atom counts,
    atom offsets, byte offsets or row ids, label counts), plus the sampling weights the
    planner keeps for ``data.samples_per_epoch`` (:func:`~xnn.training.sampling.
    structure_weights`)."""
    from xnn.training.sampling import structure_weights

    parts = [getattr(s, name, None) for s in [ds, *getattr(ds, "datasets", [])]  # shards
             for name in ("n_atoms", "_atom_ptr", "offsets", "ids", "_label_counts")]
    held = sum(a.nbytes for a in parts if isinstance(a, np.ndarray))
    return held + structure_weights(ds).nbytes


def per_row(path: str, k: int) -> dict:
    """Microseconds a row of the first pass's parts over the first ``k`` rows of an
    ASE-LMDB file (the ``--row-case`` entry)."""
    import zlib

    from ase.io.jsonio import decode

    from xnn.data.sources import open_source

    src = open_source(path)
    k = min(k, len(src))
    ids = src.ids[:k].tolist()

    def timed(fn, items) -> tuple[float, list]:
        t0 = time.process_time()
        out = [fn(x) for x in items]
        return (time.process_time() - t0) / len(items) * 1e6, out

    with src._handle().env.begin() as txn:
        read_us, texts = timed(lambda i: zlib.decompress(txn.get(str(i).encode())), ids)
    decode_us, _ = timed(lambda t: decode(t.decode("utf-8")), texts)
    atoms_us, _ = timed(src.atoms, range(k))
    record_us, _ = timed(src._counted_atoms, range(k))
    c0 = time.process_time()
    src.count_range(0, k)
    return {"rows": k, "read_us": read_us, "decode_us": decode_us, "atoms_us": atoms_us,
            "record_us": record_us, "pass_us": (time.process_time() - c0) / k * 1e6,
            "record_bytes": sum(map(len, texts)) / k, "load": os.getloadavg()[0]}


def _case(path: Path, workers: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", str(path), str(workers)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--formats", nargs="*", default=["extxyz", "aselmdb", "db"])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--work", default=None, help="folder for the data (kept)")
    ap.add_argument("--write-only", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--shards", type=int, default=0,
                    help="also open the set as this many ASE-LMDB shards (a glob)")
    ap.add_argument("--per-row", type=int, default=0,
                    help="time the first pass's parts over this many ASE-LMDB rows")
    ap.add_argument("--case", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--row-case", nargs=2, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        print(json.dumps(open_once(a.case[0], int(a.case[1]))))
        return
    if a.row_case:
        print(json.dumps(per_row(a.row_case[0], int(a.row_case[1]))))
        return
    work = Path(a.work or "/tmp/xnn_index_scale")
    work.mkdir(parents=True, exist_ok=True)
    rows, breakdown = [], None
    for fmt in a.formats:
        path = write_set(work, a.n, fmt)
        if a.write_only:
            continue
        if fmt == "aselmdb" and a.per_row:
            out = subprocess.run([sys.executable, __file__, "--row-case", str(path),
                                  str(a.per_row)], capture_output=True, text=True, check=True)
            breakdown = json.loads(out.stdout.strip().splitlines()[-1])
            print("aselmdb per row (us): " + "  ".join(
                f"{k} {v:.1f}" for k, v in breakdown.items() if k.endswith("_us")), flush=True)
        from xnn.data.sources.index import index_paths

        for workers in a.workers:
            for p in index_paths(path, fmt, KEYS):
                p.unlink(missing_ok=True)
            first, second = _case(path, workers), _case(path, workers)
            assert first["labels"] == second["labels"] and first["species"] == second["species"]
            row = {"format": fmt, "n": a.n, "workers": workers, "first_s": first["seconds"],
                   "first_cpu_s": first["cpu_s"], "second_s": second["seconds"],
                   "second_cpu_s": second["cpu_s"], "load": first["load"],
                   "mib": path.stat().st_size / 2**20,
                   "bytes_per_structure": second["bytes_per_structure"]}
            rows.append(row)
            print(f"{fmt:8s} workers={workers} first {row['first_s']:7.2f} s "
                  f"({row['first_cpu_s']:.2f} CPU s)  second {row['second_s']:6.3f} s  "
                  f"(load {row['load']:.1f}), {row['bytes_per_structure']:.1f} B/structure "
                  "held", flush=True)
    if a.shards and not a.write_only:
        folder = write_shards(work, a.n, a.shards)
        for p in folder.glob(".*.xnn-index.npz"):
            p.unlink()
        for workers in a.workers:
            first, second = (_case(folder / "*.aselmdb", workers),
                             _case(folder / "*.aselmdb", workers))
            row = {"format": f"aselmdb, {a.shards} shards", "n": a.n, "workers": workers,
                   "first_s": first["seconds"], "first_cpu_s": first["cpu_s"],
                   "second_s": second["seconds"], "second_cpu_s": second["cpu_s"],
                   "load": first["load"]}
            rows.append(row)
            print(f"{a.shards} shards workers={workers} first {row['first_s']:7.2f} s "
                  f"({row['first_cpu_s']:.2f} CPU s)  second {row['second_s']:6.3f} s "
                  f"({row['second_cpu_s']:.2f} CPU s)  (load {row['load']:.1f})", flush=True)
            for p in folder.glob(".*.xnn-index.npz"):
                p.unlink()
    if a.json:
        with open(a.json, "w") as f:
            out = {"benchmark": "index_scale", "cpu_count": os.cpu_count(), "rows": rows}
            if breakdown is not None:
                out["per_row"] = breakdown
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
