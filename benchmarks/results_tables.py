"""Render the tables of ``benchmarks/results/README.md`` from the JSON files beside it.

Every table in that README sits between ``<!-- table: NAME -->`` and ``<!-- /table -->``
and is written by this script, so a figure in the README is the figure in its file. Each
row names its file; under each table the files are listed with the command that made them,
the device and the date the file records (and the commit, where the file records one).

    python benchmarks/results_tables.py          # rewrite the README's tables
    python benchmarks/results_tables.py --check  # exit 1 if the README differs from the JSONs

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

BLOCK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->\n.*?<!-- /table -->", re.S)


# --------------------------------------------------------------------------- loading
def load(name: str) -> dict:
    """The JSON file ``name`` of the results folder.

    Raises:
        FileNotFoundError: a table names a file the folder does not have.
    """
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is named by a table of {README.name} but missing")
    return json.loads(path.read_text())


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


# --------------------------------------------------------------------------- tables
@dataclass(frozen=True)
class Table:
    """One table of the README.

    Attributes:
        name: the marker name in the README.
        header: column titles; the last column is always ``file``.
        files: the files the table reads, in order (their commands: :data:`COMMANDS`).
        rows: ``rows(file, data)`` -> the table rows of that file (without the file column).
        device: the device of a file, when the file does not record it.
    """

    name: str
    header: tuple[str, ...]
    files: tuple[str, ...]
    rows: Callable[[str, dict], list[list[str]]]
    device: Callable[[str, dict], str] = lambda name, data: device_of(data)


def render(table: Table) -> str:
    """The markdown of ``table``: header, rows, then each file with its command."""
    lines = [
        "| " + " | ".join((*table.header, "file")) + " |",
        "|" + "---|" * (len(table.header) + 1),
    ]
    notes = []
    for name in table.files:
        command = COMMANDS[name]
        data = load(name) if name.endswith(".json") else {"text": (RESULTS / name).read_text()}
        for row in table.rows(name, data):
            lines.append("| " + " | ".join((*row, rows.code(name))) + " |")
        where = f"{table.device(name, data)}, {date_of(data)}"
        commit = commit_of(data)
        if commit:
            where += f", commit {commit}"
        notes.append(f"- {rows.code(name)}: {rows.code(command)} ({where})")
    return "\n".join([*lines, *notes])


# --------------------------------------------------------------------------- the tables
TABLES = [
    Table("bad_inputs", ("clear", "ok-accepted", "traceback", "silent", "hang", "misleading",
                         "refused-valid", "all"),
          ("bad_inputs_cpu.json",), rows.bad_inputs),
    Table("gpu_suite", ("passed", "skipped", "wall"),
          ("gpu_suite_h100.txt",),
          rows.gpu_suite, lambda name, data: "one NVIDIA H100, cold Triton cache"),
    Table("neighbors", ("atoms", "xnn auto", "xnn torch", "peer", "peer time", "auto / peer",
                        "ASE"),
          ("neighbors_h200.json", "neighbors_cpu.json"), rows.neighbors),
    Table("neighbors_paired", ("device", "atoms", "rounds", "xnn auto", "peer", "peer time",
                               "ratio median (min)"),
          ("neighbors_paired_h100.json", "neighbors_paired_h200.json",
           "neighbors_paired_cpu.json"),
          rows.neighbors_paired),
    Table("neighbors_after_torch_op", ("atoms", "torch threads", "vesin alone",
                                       "after positions.sum()", "slowdown"),
          ("neighbors_after_torch_op_cpu16.json", "neighbors_after_torch_op_cpu.json"),
          rows.after_torch_op, rows.after_torch_op_device),
    Table("models", ("model", "parameters", "atoms", "atom-steps/s", "peak per atom",
                     "speed / MACE"),
          ("models_h200.json",), rows.models),
    Table("bench_equivariant", ("model", "parameters", "atoms", "energy + forces", "atom-steps/s",
                                "peak per atom", "speed / MACE"),
          ("bench_equivariant_h200.json",),
          rows.bench_equivariant),
    Table("md", ("case", "atoms", "xnn atom-steps/s", "peer", "peer atom-steps/s", "xnn / peer"),
          ("md_h200.json", "md_mace_compiled_h200.json", "md_cpu.json"), rows.md),
    Table("md_batched", ("model", "batched", "single cell", "batched per atom-step",
                         "single per atom-step", "batched / single"),
          ("md_batched_cpu.json",), rows.md_batched),
    Table("md_compiled", ("case", "atoms", "kernels", "eager step", "compiled step",
                          "compiled / eager", "recompiles", "first step"),
          ("md_compiled_h200.json", "md_compiled_cpu.json"),
          rows.md_compiled),
    Table("peers", ("model", "atoms", "xnn", "xnn atom-steps/s", "peer", "peer atom-steps/s",
                    "xnn / peer"),
          ("peers_h200.json", "peers_nvalchemi_h200.json"), rows.peers),
    Table("calculator", ("model", "atoms", "xnn per call", "peer", "peer per call", "xnn / peer"),
          ("calculator_cpu.json",), rows.calculator),
    Table("kernel_backends", ("model", "atoms", "reference", "backend", "backend time",
                              "backend / reference", "max force diff (eV/Å)"),
          ("kernel_backends_h200.json",),
          rows.kernel_backends),
    Table("triton_tp", ("dtype", "forward kernel", "2D tiles", "3D tile", "2D / 3D"),
          ("triton_tp_h200.json",), rows.triton_tp,
          lambda name, data: "one NVIDIA H200, torch 2.11"),
    Table("triton_mlp", ("N", "rows", "scale", "precision", "fused forward", "torch forward",
                         "speed-up", "fused fwd+bwd", "torch fwd+bwd", "speed-up"),
          ("triton_mlp_h200.json",), rows.triton_mlp),
    Table("triton_mlp_sweep", ("N", "rows", "precision", "part", "tilings", "fastest",
                               "time", "default then", "time", "default / fastest"),
          ("triton_mlp_sweep_h200.json",),
          rows.triton_mlp_sweep),
    Table("training", ("model", "parameters", "GPUs", "step", "structures/s"),
          ("training_h200.json",), rows.training),
    Table("training_compile", ("model", "eager structures/s", "compiled structures/s",
                               "compiled / eager", "first compiled call",
                               "gradient diff compiled vs eager", "eager vs eager"),
          ("training_compile_h200.json",), rows.training_compile),
    Table("training_vs_mace", ("xnn per epoch", "xnn structures/s", "mace_run_train per epoch",
                               "MACE structures/s", "xnn / MACE"),
          ("training_vs_mace_h200.json",),
          rows.training_vs_mace),
    Table("training_ddp", ("run (final code)", "step", "model", "DDP efficiency"),
          ("training_ddp_h200x2.json",), rows.training_ddp,
          lambda name, data: "2 NVIDIA H200, NCCL, torch 2.11"),
    Table("accuracy_vs_mace", ("test error", "epochs", "seed", "xnn", "MACE", "xnn / MACE"),
          ("accuracy_vs_mace_h200.json", "accuracy_vs_mace_cpu.json"),
          rows.accuracy),
    Table("activation_memory", ("model", "kept for 2nd backward", "plain / ckpt",
                                "peak saved tensors", "plain / ckpt", "allocator peak plain / ckpt",
                                "step time ckpt / plain"),
          ("activation_memory_cpu.json",),
          rows.activation_memory, lambda name, data: "CPU, fp64, 500 atoms"),
    Table("dd", ("model (mode)", "scaling", "atoms", "GPUs", "1 GPU", "N GPUs", "speed-up",
                 "efficiency", "halo fraction", "peak per GPU"),
          ("dd_equivariant_h200x2.json", "dd_equivariant_h200x4.json", "dd_painn_h200x4.json",
           "dd_sevenn_h200x2.json"), rows.dd),
    Table("dd_find_max", ("model", "GPUs", "bytes per atom", "predicted largest", "checked: fits",
                          "2 GPUs / 1 GPU"),
          ("dd_find_max_h200x2.json",),
          rows.dd_find_max),
    Table("dd_halo_graph", ("model", "atoms", "ranks", "1 rank", "halo", "graph", "halo / graph",
                            "halo fraction", "auto picks"),
          ("dd_halo_graph_gloo2.json", "dd_halo_graph_gloo4.json"),
          rows.dd_halo_graph),
    Table("dd_md", ("model", "layout", "ranks", "atoms", "held per rank (x N/P)",
                    "peak over baseline", "vs 1 rank", "step", "atom-steps/s", "speed-up"),
          ("dd_md_cpu16.json", "dd_md_replicated_cpu16.json", "dd_md_cpu.json",
           "dd_md_compiled_cpu.json", "dd_md_h200.json", "dd_md_equivariant_h200.json"),
          rows.dd_md),
    Table("cp_training", ("model", "checkpointing", "atoms", "dd", "peak per rank", "x dd = 1",
                          "step", "atoms held per rank"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          rows.cp_training),
    Table("cp_training_largest", ("model", "dd", "peak per 1k atoms (fit)",
                                  "largest in 80 GB per rank", "x dd = 1"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          rows.cp_largest),
    Table("long_range", ("ions", "mesh", "xnn pme", "torch-pme", "xnn / torch-pme",
                         "max force diff (eV/Å)"),
          ("long_range_h200.json", "long_range_cpu.json"), rows.long_range),
    Table("long_range_dd", ("ions", "ranks", "mesh (replicated)", "slowest rank",
                            "speed-up vs 1 rank", "peak RSS per rank"),
          ("long_range_dd_cpu16.json",),
          rows.long_range_dd),
    Table("validate", ("model", "ranks", "atoms", "mode", "worst relative error", "tolerance",
                       "one process", "decomposed"),
          ("validate_lj_h200x2.json", "validate_painn_h200x2.json",
           "validate_equivariant_h200x2.json", "validate_sevenn_h200x2.json",
           "validate_equivariant_h200x4.json"), rows.validate, rows.nccl_device),
]


def tables() -> dict[str, str]:
    """``{name: markdown}`` of every table, rendered from the JSON files."""
    return {t.name: render(t) for t in TABLES}


def files_named() -> set[str]:
    """Every results file that a table reads."""
    return {name for t in TABLES for name in t.files}


def rewrite(text: str, rendered: dict[str, str]) -> str:
    """``text`` with every table block replaced by its rendering.

    Raises:
        KeyError: a block names a table this script does not know.
    """
    def block(match: re.Match) -> str:
        name = match["name"]
        return f"<!-- table: {name} -->\n{rendered[name]}\n<!-- /table -->"

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the README's tables, or with ``--check`` report whether they are current."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the README is not current")
    args = p.parse_args(argv)
    text = README.read_text()
    new = rewrite(text, tables())
    if args.check:
        if new != text:
            print("benchmarks/results/README.md differs from its JSON files; run "
                  "python benchmarks/results_tables.py")
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
