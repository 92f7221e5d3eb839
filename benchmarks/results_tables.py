"""Render the tables of ``benchmarks/results/README.md`` from the JSON files beside it.

Every table in that README is the block of ``|`` lines under a line ending in
``<!-- table: NAME -->`` and is written by this script, so a figure in the README is the
figure in its file. Each row names its file; the ``files`` table, in ``FILES.md`` beside
it, gives each file's device, date (and commit, where the file records one) and the command
that made it. Rows of one file that share their key columns are folded into one row whose
other cells list the values in order, ``a / b / c``.

    python benchmarks/results_tables.py          # rewrite the README's tables
    python benchmarks/results_tables.py --check  # exit 1 if the README differs from the JSONs
                                                 # or has grown past MAX_LINES

``tests/test_results_tables.py`` runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

try:
    from benchmarks import results_rows as rows
    from benchmarks.results_commands import COMMANDS
except ImportError:  # run as `python benchmarks/results_tables.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import results_rows as rows
    from benchmarks.results_commands import COMMANDS

RESULTS = Path(__file__).resolve().parent / "results"
README = RESULTS / "README.md"
FILES = RESULTS / "FILES.md"  # the ``files`` table: each file's device, date and command

BLOCK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->\n(?:\|[^\n]*(?:\n|$))*")
MAX_LINES = 340  # issue 43 asked for a README of about 300 lines at most; the files table
#                   (a row per file) lives in FILES.md since session 32: fold tables before
#                   raising this


# --------------------------------------------------------------------------- loading
def load(name: str) -> dict:
    """The file ``name`` of the results folder: its JSON, or ``{"text": ...}`` if not JSON.

    Raises:
        FileNotFoundError: a table names a file the folder does not have.
    """
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is named by a table of {README.name} but missing")
    if name.endswith(".json"):
        return json.loads(path.read_text())
    return {"text": path.read_text()}


def device_of(data: dict) -> str:
    """The device a file records (its ``machine`` entry), or ``-``."""
    machine = data.get("machine") or {}
    if not machine and isinstance(data.get("eager"), dict):
        machine = data["eager"].get("machine", {})
    meta = data.get("meta") or {}
    if not machine and meta.get("cpus"):
        return f"CPU ({meta['cpus']} cores), torch {meta.get('torch', '?')}"
    if not machine:
        return "-"
    name = machine.get("device_name", "-")
    if "cuda" not in str(machine.get("device", "")):
        name = f"CPU ({machine.get('cpu_count', '?')} cores)"
    return f"{name}, torch {machine.get('torch_version', '?')}"


def date_of(data: dict) -> str:
    """The date (day) a file records, or ``-``."""
    machine = data.get("machine") or (data.get("eager") or {}).get("machine") or {}
    meta = data.get("meta") or {}
    date = machine.get("date") or meta.get("date") or data.get("date") or "-"
    return str(date)[:10]


def commit_of(data: dict) -> str | None:
    """The commit a file records, if any."""
    for where in (data.get("machine") or {}, data.get("meta") or {}):
        if where.get("commit"):
            return str(where["commit"])[:9]
    return None


# devices of files that do not record theirs
FIXED_DEVICES = {
    "gpu_suite_h100.txt": "one NVIDIA H100, cold Triton cache",
    "index_scale_cpu.json": "CPU (2 cores, shared), 20k structures",
    "plan_scale_cpu.json": "CPU (2 cores, shared)",
    "io_scale_cpu.json": "CPU (2 cores, shared), local disk",
    "ghost_plan_scale_cpu.json": "CPU (2 cores, shared), one thread",
    "balance_scale_cpu.json": "CPU (model only; equivariant H200 calibration)",
    "triton_tp_h200.json": "one NVIDIA H200, torch 2.11",
    "training_ddp_h200x2.json": "2 NVIDIA H200, NCCL, torch 2.11",
    "activation_memory_cpu.json": "CPU, fp64, 500 atoms",
    "scaling_model_cpu.json": "CPU (model only; predicts the measured runs named)",
}


def device(name: str, data: dict) -> str:
    """The device of results file ``name`` (recorded in ``data`` or known by name)."""
    if name in FIXED_DEVICES:
        return FIXED_DEVICES[name]
    if name.startswith("validate_"):
        return rows.nccl_device(name, data)
    if name.startswith("neighbors_after_torch_op_"):
        return rows.after_torch_op_device(name, data)
    return device_of(data)


# --------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """One table of the README.

    Attributes:
        name: the marker name in the README.
        header: column titles; the last column is always ``file``.
        files: the files the table reads, in order (their commands: :data:`COMMANDS`).
        rows: ``rows(file, data)`` -> the table rows of that file (without the file column).
        fold: the key columns: rows of one file with equal cells there become one row
            (see :func:`fold`); ``None`` keeps every row.
    """

    name: str
    header: tuple[str, ...]
    files: tuple[str, ...]
    rows: Callable[[str, dict], list[list[str]]]
    fold: tuple[int, ...] | None = None


def fold(body: list[list[str]], key: tuple[int, ...]) -> list[list[str]]:
    """``body`` with the rows that share the cells of columns ``key`` merged, in order.

    A merged cell is the one value its rows share, or their values in row order joined by
    `` / `` (so ``atoms 864 / 10,976`` and ``time 5.1 ms / 7.7 ms`` read pairwise).
    """
    groups: dict[tuple[str, ...], list[list[str]]] = {}
    for row in body:
        groups.setdefault(tuple(row[i] for i in key), []).append(row)
    return [[group[0][i] if i in key or len({r[i] for r in group}) == 1
             else " / ".join(r[i] for r in group) for i in range(len(group[0]))]
            for group in groups.values()]


def line(cells: tuple[str, ...] | list[str]) -> str:
    """One markdown table line."""
    return "| " + " | ".join(cells) + " |"


def render(table: Table) -> str:
    """The markdown of ``table``: header and rows, each row ending with its file."""
    lines = [line((*table.header, "file")), "|" + "---|" * (len(table.header) + 1)]
    for name in table.files:
        body = table.rows(name, load(name))
        if table.fold is not None:
            body = fold(body, table.fold)
        lines += [line((*row, rows.code(name))) for row in body]
    return "\n".join(lines)


def render_files() -> str:
    """The markdown of the ``files`` table: each file's device, date and command."""
    lines = [line(("file", "device", "date", "command")), "|---|---|---|---|"]
    for name in files_in_order():
        data = load(name)
        date = date_of(data)
        commit = commit_of(data)
        if commit:
            date += f", {commit}"
        lines.append(line((rows.code(name), device(name, data), date,
                           rows.code(COMMANDS[name]))))
    return "\n".join(lines)


# --------------------------------------------------------------------------- the tables
TABLES = [
    Table("tests", ("run", "result"), ("bad_inputs_cpu.json", "gpu_suite_h100.txt"), rows.tests),
    Table("neighbors", ("atoms", "xnn auto", "xnn torch", "peer", "peer time", "auto / peer",
                        "ASE"),
          ("neighbors_h200.json", "neighbors_cpu.json"), rows.neighbors, fold=(3,)),
    Table("neighbors_paired", ("device", "atoms", "rounds", "xnn auto", "peer", "peer time",
                               "ratio median (min)"),
          ("neighbors_paired_h100.json", "neighbors_paired_h200.json",
           "neighbors_paired_cpu.json"),
          rows.neighbors_paired, fold=(0, 4)),
    Table("neighbors_after_torch_op", ("atoms", "torch threads", "vesin alone",
                                       "after positions.sum()", "slowdown"),
          ("neighbors_after_torch_op_cpu16.json", "neighbors_after_torch_op_cpu.json"),
          rows.after_torch_op, fold=(1,)),
    Table("models", ("model", "parameters", "atoms", "atom-steps/s", "peak per atom",
                     "speed / MACE"),
          ("models_h200.json", "bench_equivariant_h200.json"), rows.models, fold=(0, 1)),
    Table("md", ("case", "atoms", "xnn atom-steps/s", "peer", "peer atom-steps/s", "xnn / peer"),
          ("md_h200.json", "md_mace_compiled_h200.json", "md_cpu.json"), rows.md, fold=(0,)),
    Table("md_batched", ("model", "batched", "single cell", "batched per atom-step",
                         "single per atom-step", "batched / single"),
          ("md_batched_cpu.json",), rows.md_batched, fold=(1, 2)),
    Table("md_compiled", ("case", "atoms", "kernels", "eager step", "compiled step",
                          "compiled / eager", "recompiles", "first step"),
          ("md_compiled_h200.json", "md_compiled_cpu.json"),
          rows.md_compiled),
    Table("peers", ("model", "atoms", "xnn", "xnn atom-steps/s", "peer", "peer atom-steps/s",
                    "xnn / peer"),
          ("peers_h200.json", "peers_nvalchemi_h200.json"), rows.peers, fold=(0, 1, 4)),
    Table("calculator", ("model", "atoms", "xnn per call", "peer", "peer per call", "xnn / peer"),
          ("calculator_cpu.json",), rows.calculator, fold=(0, 3)),
    Table("kernel_backends", ("model", "atoms", "reference", "backend", "backend time",
                              "backend / reference", "max force diff (eV/Å)"),
          ("kernel_backends_h200.json",),
          rows.kernel_backends),
    Table("triton_tp", ("dtype", "forward kernel", "2D tiles", "3D tile", "2D / 3D"),
          ("triton_tp_h200.json",), rows.triton_tp, fold=(0,)),
    Table("triton_mlp", ("N", "rows", "scale", "precision", "fused forward", "torch forward",
                         "speed-up", "fused fwd+bwd", "torch fwd+bwd", "speed-up"),
          ("triton_mlp_h200.json",), rows.triton_mlp, fold=(0, 1, 2)),
    Table("triton_mlp_sweep", ("N", "rows", "precision", "part", "tilings", "fastest",
                               "time", "default then", "time", "default / fastest"),
          ("triton_mlp_sweep_h200.json",),
          rows.triton_mlp_sweep),
    Table("training", ("model", "parameters", "run", "time", "structures/s", "against",
                       "its time", "its structures/s", "xnn / it"),
          ("training_h200.json", "training_compile_h200.json", "training_vs_mace_h200.json"),
          rows.training, fold=(2,)),
    Table("training_ddp", ("runs (final code)", "step", "model", "DDP efficiency"),
          ("training_ddp_h200x2.json",), rows.training_ddp, fold=(1, 2)),
    Table("ghost_plan", ("system", "mode", "atoms", "ranks", "ghost max / owned mean",
                         "peers", "edges max", "counts", "time"),
          ("ghost_plan_scale_cpu.json",), rows.ghost_plan, fold=(0, 1, 2)),
    Table("balance", ("system", "mode", "grid", "owned max / mean", "held max / mean",
                      "step", "efficiency"),
          ("balance_scale_cpu.json",), rows.balance_scale, fold=(0, 2)),
    Table("data_start", ("what", "case", "structures", "before", "after"),
          ("index_scale_cpu.json", "plan_scale_cpu.json"), rows.data_start, fold=(0,)),
    Table("data_scale", ("workers", "format", "structures/s", "atoms/s", "first batch",
                         "peak RSS main + largest worker", "loader / step"),
          ("data_scale_h200.json", "data_scale_h100.json", "data_scale_cpu.json"),
          rows.data_scale, fold=(0,)),
    Table("accuracy_vs_mace", ("epochs", "seed", "energy MAE (meV/atom)", "forces MAE (meV/Å)",
                               "stress MAE (meV/Å³)"),
          ("accuracy_vs_mace_h200.json", "accuracy_vs_mace_cpu.json"), rows.accuracy),
    Table("activation_memory", ("model", "kept for 2nd backward", "plain / ckpt",
                                "peak saved tensors", "plain / ckpt", "allocator peak plain / ckpt",
                                "step time ckpt / plain"),
          ("activation_memory_cpu.json",), rows.activation_memory, fold=()),
    Table("dd", ("model (mode)", "scaling", "atoms", "GPUs", "1 GPU", "N GPUs", "speed-up",
                 "efficiency", "halo fraction", "peak per GPU"),
          ("dd_equivariant_h200x2.json", "dd_equivariant_h200x4.json", "dd_painn_h200x4.json",
           "dd_sevenn_h200x2.json"), rows.dd, fold=(0,)),
    Table("dd_find_max", ("model", "GPUs", "bytes per atom", "predicted largest", "checked: fits",
                          "2 GPUs / 1 GPU"),
          ("dd_find_max_h200x2.json",), rows.dd_find_max, fold=(0,)),
    Table("dd_halo_graph", ("model", "atoms", "ranks", "1 rank", "halo", "graph", "halo / graph",
                            "halo fraction", "auto picks"),
          ("dd_halo_graph_gloo2.json", "dd_halo_graph_gloo4.json"),
          rows.dd_halo_graph, fold=(0, 2)),
    Table("dd_md", ("model", "layout", "ranks", "atoms", "held per rank (x N/P)",
                    "peak over baseline", "vs 1 rank", "step", "atom-steps/s", "speed-up"),
          ("dd_md_cpu16.json", "dd_md_replicated_cpu16.json", "dd_md_cpu.json",
           "dd_md_compiled_cpu.json", "dd_md_h200.json", "dd_md_equivariant_h200.json"),
          rows.dd_md, fold=(0, 1)),
    Table("io_scale", ("output", "atoms", "ranks", "gathered", "sharded",
                       "rank-0 peak gathered", "sharded", "bytes/atom gathered", "sharded"),
          ("io_scale_cpu.json",), rows.io_scale, fold=(0, 1)),
    Table("lammps", ("model", "atoms", "ranks (mode)", "owned + ghosts per rank",
                     "LAMMPS step", "xnn md step", "LAMMPS / xnn md (CPU time)",
                     "speed-up (CPU time)",
                     "peak RSS per rank"),
          ("lammps_cpu.json", "lammps_cpu16.json", "lammps_h100.json"),
          rows.lammps, fold=(0, 1)),
    Table("lammps_breakdown", ("model", "atoms", "ghosts", "LAMMPS step", "Potential alone",
                               "LAMMPS / Potential", "graph", "closest-pair check",
                               "potential call", "LAMMPS and rest"),
          ("lammps_breakdown_h100.json",), rows.lammps_breakdown, fold=(0,)),
    Table("dd_components", ("model", "atoms", "lattice scale", "ranks", "step", "evaluate",
                            "exchanges", "all-reduces"),
          ("dd_components_cpu16x2.json", "dd_components_cpu16.json",
           "dd_components_h100.json"), rows.dd_components, fold=(0,)),
    Table("scaling_model", ("measured run (model, scaling)", "ranks", "atoms", "predicted",
                            "measured", "error"),
          ("scaling_model_cpu.json",), rows.scaling_model, fold=(0,)),
    Table("cp_training", ("model", "checkpointing", "atoms", "dd", "peak per rank", "x dd = 1",
                          "step", "atoms held per rank"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          rows.cp_training, fold=(0, 1, 2)),
    Table("cp_training_largest", ("model", "dd", "peak per 1k atoms (fit)",
                                  "largest in 80 GB per rank", "x dd = 1"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          rows.cp_largest, fold=(0,)),
    Table("long_range", ("ions", "mesh", "xnn pme", "torch-pme", "xnn / torch-pme",
                         "max force diff (eV/Å)"),
          ("long_range_h200.json", "long_range_cpu.json"), rows.long_range, fold=()),
    Table("long_range_dd", ("ions", "ranks", "mesh (replicated)", "slowest rank",
                            "speed-up vs 1 rank", "peak RSS per rank"),
          ("long_range_dd_cpu16.json",),
          rows.long_range_dd, fold=(0, 2)),
    Table("validate", ("model", "ranks", "atoms", "mode", "worst relative error", "tolerance",
                       "one process", "decomposed"),
          ("validate_lj_h200x2.json", "validate_painn_h200x2.json",
           "validate_equivariant_h200x2.json", "validate_sevenn_h200x2.json",
           "validate_equivariant_h200x4.json"), rows.validate),
]


def files_in_order() -> list[str]:
    """Every results file that a table reads, in the order the tables first read them."""
    return list(dict.fromkeys(name for t in TABLES for name in t.files))


def files_named() -> set[str]:
    """Every results file that a table reads."""
    return set(files_in_order())


def tables() -> dict[str, str]:
    """``{name: markdown}`` of every table (the ``files`` table last), from the files."""
    return {**{t.name: render(t) for t in TABLES}, "files": render_files()}


def documents() -> list[Path]:
    """The markdown files whose table blocks this script writes: README.md, FILES.md."""
    return [README, FILES]


def rewrite(text: str, rendered: dict[str, str]) -> str:
    """``text`` with every table block replaced by its rendering.

    Raises:
        KeyError: a block names a table this script does not know.
    """
    def block(match: re.Match) -> str:
        name = match["name"]
        return f"<!-- table: {name} -->\n{rendered[name]}\n"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the tables of README.md and FILES.md, or with ``--check`` report whether they
    are current."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the README is not current")
    args = p.parse_args(argv)
    rendered = tables()
    status = 0
    for doc in documents():
        text = doc.read_text()
        new = rewrite(text, rendered)
        if not args.check:
            doc.write_text(new)
        elif new != text:
            print(f"benchmarks/results/{doc.name} differs from its JSON files; run "
                  "python benchmarks/results_tables.py")
            status = 1
    lines = len(README.read_text().splitlines())
    if args.check and lines >= MAX_LINES:
        print(f"benchmarks/results/README.md has {lines} lines; keep it "
              f"under {MAX_LINES} (fold rows, merge tables, shorten the prose)")
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
