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

RESULTS = Path(__file__).resolve().parent / "results"
README = RESULTS / "README.md"

BLOCK = re.compile(r"<!-- table: (?P<name>[a-z0-9_]+) -->\n.*?<!-- /table -->", re.S)


# --------------------------------------------------------------------------- formatting
def ms(seconds: float | None) -> str:
    """Seconds as milliseconds (3 significant digits), or ``-``."""
    if seconds is None:
        return "-"
    value = seconds * 1e3
    return f"{value:.3g} ms" if value < 1000 else f"{seconds:.3g} s"


def sec(seconds: float | None) -> str:
    """Seconds, 3 significant digits."""
    return "-" if seconds is None else f"{seconds:.3g} s"


def rate(per_s: float | None) -> str:
    """A throughput (atom-steps/s, structures/s) with 3 significant digits."""
    if per_s is None:
        return "-"
    if per_s >= 1e6:
        return f"{per_s / 1e6:.3g}M"
    if per_s >= 1e3:
        return f"{per_s / 1e3:.4g}k"
    return f"{per_s:.3g}"


def ratio(value: float | None) -> str:
    """A ratio, 3 significant digits, with an ``x``."""
    return "-" if value is None else f"{value:.3g}x"


def num(value: float | None, digits: int = 3) -> str:
    """A plain number with ``digits`` significant digits."""
    return "-" if value is None else f"{value:.{digits}g}"


def count(value: int | None) -> str:
    """An integer with thousands separators."""
    return "-" if value is None else f"{value:,}"


def gib(n_bytes: float | None) -> str:
    """Bytes as GiB (3 significant digits)."""
    return "-" if n_bytes is None else f"{n_bytes / 2**30:.3g} GiB"


def mib(n_bytes: float | None) -> str:
    """Bytes as MiB (4 significant digits)."""
    return "-" if n_bytes is None else f"{n_bytes / 2**20:.4g} MiB"


def kib(n_bytes: float | None) -> str:
    """Bytes as KiB (3 significant digits, whole KiB above 1000)."""
    if n_bytes is None:
        return "-"
    value = n_bytes / 2**10
    return f"{value:,.0f} KiB" if value >= 1000 else f"{value:.3g} KiB"


def sci(value: float | None) -> str:
    """A small error in scientific notation."""
    return "-" if value is None else f"{value:.1e}"


def code(text: str) -> str:
    """Backticks around ``text``."""
    return f"`{text}`"


# --------------------------------------------------------------------------- loading
def load(name: str) -> dict:
    """The JSON file ``name`` of the results folder."""
    return json.loads((RESULTS / name).read_text())


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
        data = load(name) if name.endswith(".json") else {}
        for row in table.rows(name, data):
            lines.append("| " + " | ".join((*row, code(name))) + " |")
        where = f"{table.device(name, data)}, {date_of(data)}"
        commit = commit_of(data)
        if commit:
            where += f", commit {commit}"
        notes.append(f"- {code(name)}: {code(command)} ({where})")
    return "\n".join([*lines, *notes])


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


# bad inputs -----------------------------------------------------------------------------
def _bad_inputs(name: str, data: dict) -> list[list[str]]:
    out = data["total"]
    return [[*(str(out[k]) for k in ("clear", "ok-accepted", "traceback", "silent", "hang",
                                      "misleading", "refused-valid")), str(data["good"])]]


# GPU suite ------------------------------------------------------------------------------
def _gpu_suite(name: str, data: dict) -> list[list[str]]:
    text = (RESULTS / name).read_text()
    last = re.findall(r"=+ (\d+) passed, (\d+) skipped.* in ([\d.]+)s", text)[-1]
    return [[last[0], last[1], f"{float(last[2]):.0f} s"]]


# neighbor lists -------------------------------------------------------------------------
def _neighbors(name: str, data: dict) -> list[list[str]]:
    by = {}
    for r in data["results"]:
        by.setdefault(r["n_atoms"], {})[r["method"]] = r
    rows = []
    for n, methods in sorted(by.items()):
        auto = methods.get("xnn:auto", {})
        ref_name = auto.get("reference", "vesin")
        ref = methods.get(ref_name, {})
        rows.append([count(n), ms(auto.get("median_s")), ms(methods.get("xnn:torch", {}).get(
            "median_s")), ref_name, ms(ref.get("median_s")), ratio(auto.get("ratio_vs_reference")),
            ms(methods.get("ase", {}).get("median_s"))])
    return rows


def _neighbors_paired(name: str, data: dict) -> list[list[str]]:
    rows = []
    for r in data.get("paired", []):
        rows.append([r["device"], count(r["n_atoms"]), str(r["rounds"]), ms(r["xnn_auto_median_s"]),
                     r["reference"], ms(r["reference_median_s"]),
                     f"{num(r['ratio_median'])} ({num(r['ratio_min'])})"])
    for r in data.get("batched", []):
        rows.append([r["device"], f"{r['n_systems']} x {r['atoms_per_system']}", str(r["rounds"]),
                     ms(r["xnn_auto_median_s"]), r["reference"], ms(r["reference_median_s"]),
                     f"{num(r['ratio_median'])} ({num(r['ratio_min'])})"])
    return rows


def _after_torch_op(name: str, data: dict) -> list[list[str]]:
    return [[count(r["n_atoms"]), str(r["torch_threads"]), ms(r["alone_median_s"]),
             ms(r["after_torch_sum_median_s"]), ratio(r["slowdown"])] for r in data["rows"]]


# models -------------------------------------------------------------------------------
def _models(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, m in data["models"].items():
        for n, s in m["sizes"].items():
            if s.get("status") != "ok":
                status = s.get("status", "-")[:40]
                rows.append([model, count(m["n_parameters"]), count(int(n)), status, "-", "-"])
                continue
            peak = s.get("peak_bytes") or s.get("process_peak_rss_bytes")
            rows.append([model, count(m["n_parameters"]), count(s["n_atoms"]),
                         rate(s["atom_steps_per_s"]), kib(peak / s["n_atoms"]) if peak else "-",
                         ratio(s.get("speed_vs_mace"))])
    return rows


def _bench_equivariant(name: str, data: dict) -> list[list[str]]:
    mace = {r["n_atoms"]: r for r in data["models"]["mace"]["runs"]}
    rows = []
    for model, m in data["models"].items():
        for r in m["runs"]:
            peer = mace.get(r["n_atoms"])
            speed = None if model == "mace" or peer is None else (
                r["atom_steps_per_s"] / peer["atom_steps_per_s"])
            rows.append([model, count(m["parameters"]), count(r["n_atoms"]), ms(r["median_s"]),
                         rate(r["atom_steps_per_s"]), kib(r["peak_bytes_per_atom"]), ratio(speed)])
    return rows


# MD ----------------------------------------------------------------------------------
def _md(name: str, data: dict) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        size = (f"{r['n_systems']} x {r['atoms_per_system']}" if "n_systems" in r
                else count(r["n_atoms"]))
        if "xnn" not in r:
            rows.append([r["case"], size, r.get("error", "-")[:40], "-", "-", "-"])
            continue
        xnn = r["xnn"]["atom_steps_per_s"]
        if "xnn_compiled" in r:
            rows.append([r["case"] + " (eager)", size, rate(xnn), "torch-sim",
                         rate(r["torch_sim"]["atom_steps_per_s"]),
                             ratio(r["speedup_vs_torch_sim"])])
            rows.append([r["case"] + " (compiled)", size,
                rate(r["xnn_compiled"]["atom_steps_per_s"]),
                         "torch-sim", rate(r["torch_sim"]["atom_steps_per_s"]),
                         ratio(r["speedup_compiled_vs_torch_sim"])])
        elif "torch_sim" in r:
            version = r["torch_sim"].get("version", "").strip("?")
            rows.append([r["case"], size, rate(xnn), f"torch-sim {version}".strip(),
                         rate(r["torch_sim"]["atom_steps_per_s"]),
                         ratio(r["speedup_vs_torch_sim"])])
        elif "ase_loop" in r:
            rows.append([r["case"], size, rate(xnn), "ASE VelocityVerlet loop",
                         rate(r["ase_loop"]["atom_steps_per_s"]), ratio(r["speedup_vs_ase"])])
        else:
            rows.append([r["case"], size, rate(xnn), "-", "-", "-"])
    return rows


def _md_batched(name: str, data: dict) -> list[list[str]]:
    return [[r["model"], f"{r['n_systems']} x {r['atoms_per_system']}", count(r["single_n_atoms"]),
             f"{r['batched_us_per_atom_step']:.3g} us", f"{r['single_us_per_atom_step']:.3g} us",
             num(r["batched_over_single"])] for r in data["results"]]


def _md_compiled(name: str, data: dict) -> list[list[str]]:
    return [[r["case"].removeprefix("compiled_step_"), count(r["n_atoms"]),
             r.get("kernel_backend", "reference"), ms(r["eager_s_per_step"]),
             ms(r["compiled_s_per_step"]), ratio(r["speedup"]), str(r["recompiles_timed"]),
             sec(r["first_compiled_step_s"])] for r in data["results"]]


def _peers(name: str, data: dict) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        size = (f"{r['n_systems']} x {r['atoms_per_system']}" if r["n_systems"] > 1
                else count(r["n_atoms"]))
        fw = r["frameworks"]
        for key, value in r["ratios_xnn_over_peer"].items():
            ours, peer = key.split("/")
            rows.append([r["model"], size, ours, rate(fw[ours]["atom_steps_per_s"]), peer,
                         rate(fw[peer]["atom_steps_per_s"]), ratio(value)])
        if not r["ratios_xnn_over_peer"]:
            for ours, f in fw.items():
                if "atom_steps_per_s" in f:
                    rows.append([r["model"], size, ours, rate(f["atom_steps_per_s"]),
                                 "-", "-", "-"])
    return rows


def _calculator(name: str, data: dict) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        (ours, peer) = ("xnn", next(k for k in r["s_per_call"] if k != "xnn"))
        rows.append([r["case"], count(r["n_atoms"]), ms(r["s_per_call"][ours]), peer,
                     ms(r["s_per_call"][peer]),
                     ratio(r["s_per_call"][ours] / r["s_per_call"][peer])])
    return rows


# kernels -------------------------------------------------------------------------------
def _kernel_backends(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model in ("equivariant", "mace"):
        for r in data[model]:
            for backend in data["backends"][1:]:
                rows.append([model, count(r["n_atoms"]), ms(r["reference_median_s"]), backend,
                             ms(r[f"{backend}_median_s"]),
                             ratio(r[f"{backend}_over_reference_time"]),
                             sci(r[f"{backend}_max_abs_force_diff_eV_per_A"])])
    return rows


def _triton_tp(name: str, data: dict) -> list[list[str]]:
    rows = []
    for dtype, d in data.items():
        for kernel, key in (("per-edge output", "fwd_s"), ("fused convolution", "conv_fwd_s")):
            rows.append([dtype.removeprefix("torch."), kernel, ms(d["old2d"][key]),
                         ms(d["new3d"][key]), ratio(d["old2d"][key] / d["new3d"][key])])
        rows.append([dtype.removeprefix("torch."), "index_add alone", "-", ms(d["index_add_s"]),
            "-"])
    return rows


def _triton_mlp(name: str, data: dict) -> list[list[str]]:
    rows = []
    for b in data["blocks"]:
        for scale, v in b["scales"].items():
            torch_ = v["torch"]
            for prec in ("ieee", "tf32x3"):
                if prec in v:
                    rows.append([str(b["N"]), count(b["rows"]), scale, prec,
                                 ms(v[prec]["forward_s"]), ms(torch_["forward_s"]),
                                 ratio(torch_["forward_s"] / v[prec]["forward_s"]),
                                 ms(v[prec]["forward_backward_s"]),
                                 ms(torch_["forward_backward_s"]),
                                 ratio(torch_["forward_backward_s"]
                                       / v[prec]["forward_backward_s"])])
    return rows


def _triton_mlp_sweep(name: str, data: dict) -> list[list[str]]:
    sweep = data["sweep"]
    d = sweep["defaults"]
    keys = ("block_p", "block_n", "num_warps", "num_stages")
    wanted = tuple(d[k.upper()] for k in keys)
    default = next(c for c in sweep["configs"] if tuple(c[k] for k in keys) == wanted)
    best = min(sweep["configs"], key=lambda c: c["time_s"])
    tiling = "({block_p}, {block_n}, {num_warps}, {num_stages})"
    return [[str(sweep["N"]), count(sweep["rows"]), best["precision"], best["part"],
             str(len(sweep["configs"])), tiling.format(**best), ms(best["time_s"]),
             tiling.format(**default), ms(default["time_s"]),
             ratio(default["time_s"] / best["time_s"])]]


# training ------------------------------------------------------------------------------
def _training(name: str, data: dict) -> list[list[str]]:
    return [[model, count(m["parameters"]), str(data["world_size"]), ms(m["step_s"]),
             rate(m["structures_per_s"])] for model, m in data["models"].items()]


def _training_compile(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, c in data["compiled"]["models"].items():
        e = data["eager"]["models"][model]
        rows.append([model, rate(e["structures_per_s"]), rate(c["structures_per_s"]),
                     ratio(c["structures_per_s"] / e["structures_per_s"]),
                     sec(c["first_compiled_call_s"]), sci(c["compiled_vs_eager_grad_rel_diff"]),
                     sci(c["eager_vs_eager_grad_rel_diff"])])
    return rows


def _training_vs_mace(name: str, data: dict) -> list[list[str]]:
    t = data["epoch_time"]
    return [[num(t["xnn_equivariant_s_per_epoch"]) + " s",
             rate(t["xnn_equivariant_structures_per_s"]),
             num(t["mace_s_per_epoch"]) + " s", rate(t["mace_structures_per_s"]),
             ratio(t["speedup_xnn_vs_mace"])]]


def _training_ddp(name: str, data: dict) -> list[list[str]]:
    rows = []
    for run, eff in data["ddp_efficiency"].items():
        what = data["runs"][run]["what"].split(";")[0].split("(")[0].strip()
        if not what.startswith("final code"):
            continue  # the runs of the code before the change the file measured
        for model, value in eff.items():
            mode = "compiled" if "compiled" in run else "eager"
            if "ddp_first" in run:
                mode += ", data-parallel step always first"
            rows.append([run, mode, model, _pct(value)])
    return rows


def _accuracy(name: str, data: dict) -> list[list[str]]:
    x, m = data["xnn"]["test"], data["mace"]["test"]
    rows = []
    for label, key in (("energy MAE (meV/atom)", "energy_mae_meV_per_atom"),
                       ("forces MAE (meV/Å)", "forces_mae_meV_per_A"),
                       ("stress MAE (meV/Å³)", "stress_mae_meV_per_A3")):
        rows.append([label, str(data["settings"]["epochs"]), str(data["data"]["seed"]), num(x[key]),
                     num(m[key]), ratio(x[key] / m[key])])
    return rows


def _activation_memory(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, m in data["models"].items():
        r = m["ratio_plain_over_ckpt"]
        rows.append([model, mib(m["plain"]["kept_after_forces"]), ratio(r["kept_after_forces"]),
                     mib(m["plain"]["peak_saved"]), ratio(r["peak_saved"]),
                     ratio(r["peak_allocated"]), ratio(r["step_time"])])
    return rows


# domain decomposition ------------------------------------------------------------------
def _dd(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, res in data["results"].items():
        for scaling in ("strong", "weak"):
            for p in res.get(scaling, []):
                s, d = p["single"], p.get("decomposed", {})
                if "speedup" not in p:
                    rows.append([f"{model} ({res['mode']})", scaling, count(p["n_atoms"]),
                                 str(p["ranks"]), s.get("error", "-")[:30], sec(d.get("time_s")),
                                 "-", "-", num(d.get("halo_fraction_max"), 2),
                                 f"- -> {gib(d.get('peak_memory_bytes_max'))}"])
                    continue
                rows.append([f"{model} ({res['mode']})", scaling, count(p["n_atoms"]),
                             str(p["ranks"]), sec(s["time_s"]), sec(d["time_s"]),
                             ratio(p["speedup"]), num(p["efficiency"]),
                             num(d["halo_fraction_max"], 2),
                             f"{gib(s.get('peak_memory_bytes'))} -> "
                             f"{gib(d['peak_memory_bytes_max'])}"])
    return rows


def _dd_find_max(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, res in data["results"].items():
        big = res["largest"]
        for label, key in (("1 GPU", "single"), (f"{data['world_size']} GPUs", "decomposed")):
            b = big[key]
            rows.append([model, label, kib(b["bytes_per_atom"]), count(b["predicted_max"]),
                         count(b["checked_atoms"]), "-" if key == "single" else
                         ratio(big["ratio_verified"])])
    return rows


def _dd_halo_graph(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, res in data["results"].items():
        for p in res["points"]:
            halo, graph = p["by_mode"]["halo"], p["by_mode"]["graph"]
            rows.append([model, count(p["n_atoms"]), str(p["ranks"]), ms(p["single"]["time_s"]),
                         ms(halo["time_s"]), ms(graph["time_s"]),
                         ratio(halo["time_s"] / graph["time_s"]),
                         num(halo["halo_fraction_max"]), p["auto"]["mode"]])
    return rows


def _dd_md(name: str, data: dict) -> list[list[str]]:
    ratios = {(r["layout"], r["ranks"], r["n_atoms"]): r for r in data["ratios"]}
    rows = []
    for r in data["rows"]:
        q = ratios.get((r["layout"], r["ranks"], r["n_atoms"]), {})
        rows.append([data["settings"]["model"], r["layout"], str(r["ranks"]), count(r["n_atoms"]),
                     f"{count(r['held_max'])} ({num(r['held_over_ideal'])})",
                     mib(r.get("peak_over_baseline_bytes_max") or r.get("peak_bytes_max")),
                     num(q.get("peak_over_baseline_vs_1_rank")), ms(r["step_s"]),
                     rate(r["atom_steps_per_s"]), ratio(q.get("speedup_vs_1_rank"))])
    return rows


def _cp_training(name: str, data: dict) -> list[list[str]]:
    base = {(r["n_atoms"], r["checkpointing"]): r for r in data["rows"] if r["dd"] == 1}
    rows = []
    for r in data["rows"]:
        b = base.get((r["n_atoms"], r["checkpointing"]))
        rows.append([data["args"]["model"], "yes" if r["checkpointing"] else "no",
                     count(r["n_atoms"]),
                     str(r["dd"]), f"{r['peak_mb_per_rank'] / 1024:.3g} GiB",
                     num(r["peak_mb_per_rank"] / b["peak_mb_per_rank"]) if b else "-",
                     sec(r["step_s"]), count(r["max_held_atoms"])])
    return rows


def _cp_largest(name: str, data: dict) -> list[list[str]]:
    big = data["largest_trainable"]
    one = big["dd1"]["largest_atoms"]
    return [[data["args"]["model"], key.removeprefix("dd"), f"{v['gb_per_1k_atoms']:.3g} GB",
             count(v["largest_atoms"]), ratio(v["largest_atoms"] / one)]
            for key, v in big.items()
            if key.startswith("dd") and isinstance(v, dict) and "_" not in key]  # no ckpt fit


def _long_range(name: str, data: dict) -> list[list[str]]:
    return [[count(r["n_atoms"]), f"{r['mesh'][0]}³", ms(r["xnn_s"]), ms(r["torchpme_s"]),
             ratio(r["ratio"]), sci(r["forces_max_abs_diff"])] for r in data["results"]]


def _long_range_dd(name: str, data: dict) -> list[list[str]]:
    one = {r["n_atoms"]: r["max_rank_s"] for r in data["dd"]["results"] if r["ranks"] == 1}
    rows = []
    for r in data["dd"]["results"]:
        peak = max(p["peak_rss_MiB"] for p in r["per_rank"])
        rows.append([count(r["n_atoms"]), str(r["ranks"]), f"{r['per_rank'][0]['mesh'][0]}³",
                     sec(r["max_rank_s"]), ratio(one[r["n_atoms"]] / r["max_rank_s"]),
                     f"{peak:.4g} MiB"])
    return rows


def _validate(name: str, data: dict) -> list[list[str]]:
    worst = max(v["max_rel"] for v in data["report"].values())
    return [[name.removeprefix("validate_").split("_")[0], str(data["world_size"]),
             count(data["n_atoms"]), data["mode"], sci(worst), sci(data["tol"]),
             sec(data["seconds_single"]), sec(data["seconds_decomposed"])]]


def _nccl_device(name: str, data: dict) -> str:
    return f"{data['world_size']} NVIDIA H200, NCCL, fp64"


# --------------------------------------------------------------------------- the tables
#: the command that made each file (the file records the device and date; output paths
#: are the scripts' defaults, written out)
COMMANDS = {
    "bad_inputs_cpu.json": ("python scripts/bad_input_sweep.py --json "
                            "benchmarks/results/bad_inputs_cpu.json"),
    "gpu_suite_h100.txt": "python3 -m pytest -m gpu (benchmarks/gpu_suite.sh, one H100)",
    "neighbors_h200.json": ("python benchmarks/neighbors.py --device cuda --json "
                            "benchmarks/results/neighbors_h200.json"),
    "neighbors_cpu.json": ("python benchmarks/neighbors.py --repeat 3 --json "
                           "benchmarks/results/neighbors_cpu.json"),
    "neighbors_paired_h100.json": ("python benchmarks/neighbors.py --paired-only --phases "
                                   "--devices cuda cpu --sizes 100000 1000000 --batched 64 108 "
                                   "--json benchmarks/results/neighbors_paired_h100.json "
                                   "(gpu_suite.sh 24a)"),
    "neighbors_paired_h200.json": ("python benchmarks/neighbors.py --paired-only --devices cuda "
                                   "cpu --sizes 100000 1000000 --phases --json "
                                   "benchmarks/results/neighbors_paired_h200.json (gpu_suite.sh "
                                   "23c)"),
    "neighbors_paired_cpu.json": ("python benchmarks/neighbors.py --paired-only --devices cpu "
                                  "--sizes 10000 100000 1000000 --paired-rounds 15 --phases "
                                  "--batched 64 108 --json "
                                  "benchmarks/results/neighbors_paired_cpu.json"),
    "neighbors_after_torch_op_cpu16.json": ("python benchmarks/neighbors.py --after-torch-op 30 "
                                            "--sizes 10000 100000 --json "
                                            "benchmarks/results/neighbors_after_torch_op_cpu16.json"),
    "neighbors_after_torch_op_cpu.json": ("python benchmarks/neighbors.py --after-torch-op 60 "
                                          "--json "
                                          "benchmarks/results/neighbors_after_torch_op_cpu.json"),
    "models_h200.json": ("python benchmarks/models.py --device cuda --dtype float32 --json "
                         "benchmarks/results/models_h200.json"),
    "bench_equivariant_h200.json": ("python benchmarks/bench_equivariant.py --device cuda "
                                    "--channels 128 --cutoff 6 --sizes 10976 --chunks auto "
                                    "--compile --json "
                                    "benchmarks/results/bench_equivariant_h200.json"),
    "md_h200.json": ("python benchmarks/md.py --device cuda --dtype float32 --json "
                     "benchmarks/results/md_h200.json"),
    "md_mace_compiled_h200.json": ("python benchmarks/md.py --device cuda --dtype float32 --only "
                                   "mace --compile --sizes 1000,10000 --json "
                                   "benchmarks/results/md_mace_compiled_h200.json"),
    "md_cpu.json": ("python benchmarks/md.py --steps 10 --eq-sizes 1000,10000 --mace-sizes 1000 "
                    "--json benchmarks/results/md_cpu.json"),
    "md_batched_cpu.json": ("python benchmarks/md_batched.py --blocks 5 --n-small 108 --json "
                            "benchmarks/results/md_batched_cpu.json"),
    "md_compiled_h200.json": ("python benchmarks/md_compiled.py --device cuda --dtype float32 "
                              "--models equivariant --ensembles nve --kernel-backends triton "
                              "--n-atoms 10000 --steps 20 --unfiltered --json "
                              "benchmarks/results/md_compiled_h200.json (gpu_suite.sh 11, "
                              "KB=triton)"),
    "md_compiled_cpu.json": ("python benchmarks/md_compiled.py --models equivariant --dtype "
                             "float32 --json benchmarks/results/md_compiled_cpu.json"),
    "peers_h200.json": ("python benchmarks/peers.py --device cuda --dtype float32 --sizes 10000 "
                        "--batched none --models mace --steps 9 --budget-s 90 --frameworks "
                        "xnn,torch_sim --cueq --mace-fusion split --variants "
                        "split+tf32x3,split+tf32x3+int32 --json "
                        "benchmarks/results/peers_h200.json (gpu_suite.sh 23a)"),
    "peers_nvalchemi_h200.json": ("python benchmarks/peers.py --device cuda --dtype float32 "
                                  "--sizes 10000 --batched none --models mace --steps 9 "
                                  "--budget-s 100 --frameworks xnn_step_graph,torch_sim,nvalchemi "
                                  "--cueq --json benchmarks/results/peers_nvalchemi_h200.json "
                                  "(gpu_suite.sh 13)"),
    "calculator_cpu.json": ("python benchmarks/calculator.py --json "
                            "benchmarks/results/calculator_cpu.json"),
    "kernel_backends_h200.json": ("python benchmarks/kernel_backends.py --device cuda --backends "
                                  "reference,triton --json "
                                  "benchmarks/results/kernel_backends_h200.json"),
    "triton_tp_h200.json": ("the old and new forward kernels timed in one process (commit "
                            "80007cf; benchmarks/triton_tp.py times the current kernels)"),
    "triton_mlp_h200.json": ("python benchmarks/triton_mlp.py --device cuda --json "
                             "benchmarks/results/triton_mlp_h200.json"),
    "triton_mlp_sweep_h200.json": ("python benchmarks/triton_mlp.py --device cuda --blocks 1 "
                                   "--scale off --sweep --sweep-precisions tf32x3 "
                                   "--sweep-budget-s 90 --repeat 10 --json "
                                   "benchmarks/results/triton_mlp_sweep_h200.json"),
    "training_h200.json": ("python benchmarks/training.py --device cuda --json "
                           "benchmarks/results/training_h200.json"),
    "training_compile_h200.json": ("python benchmarks/training.py --device cuda --no-mace --steps "
                                   "60 [--compile] --json "
                                   "benchmarks/results/training_compile_h200.json (two runs: "
                                   "eager, compiled)"),
    "training_vs_mace_h200.json": ("python benchmarks/training.py --device cuda --models "
                                   "equivariant --epochs 8 --json "
                                   "benchmarks/results/training_vs_mace_h200.json"),
    "training_ddp_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/training.py --device "
                                 "cuda --no-mace --steps 60 [--compile] --json "
                                 "benchmarks/results/training_ddp_h200x2.json (one run per row)"),
    "accuracy_vs_mace_h200.json": ("python benchmarks/accuracy_vs_mace.py --device cuda --epochs "
                                   "20 --json benchmarks/results/accuracy_vs_mace_h200.json"),
    "accuracy_vs_mace_cpu.json": ("python benchmarks/accuracy_vs_mace.py --seed 1 --json "
                                  "benchmarks/results/accuracy_vs_mace_cpu.json"),
    "activation_memory_cpu.json": ("python benchmarks/activation_memory.py --json "
                                   "benchmarks/results/activation_memory_cpu.json"),
    "dd_equivariant_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                                   "--models equivariant --sizes 1000000 --atoms-per-rank 250000 "
                                   "--scaling both --repeat 3 --timeout 190 --json "
                                   "benchmarks/results/dd_equivariant_h200x2.json"),
    "dd_equivariant_h200x4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --device cuda "
                                   "--models equivariant --sizes 1000000 --atoms-per-rank 250000 "
                                   "--scaling both --repeat 3 --timeout 380 --json "
                                   "benchmarks/results/dd_equivariant_h200x4.json"),
    "dd_painn_h200x4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --device cuda --models "
                             "painn --sizes 100000 --atoms-per-rank 100000 --scaling both "
                             "--repeat 3 --timeout 190 --json "
                             "benchmarks/results/dd_painn_h200x4.json"),
    "dd_sevenn_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                              "--models sevenn --sizes 20000,40000 --scaling strong --repeat 2 "
                              "--timeout 120 --json benchmarks/results/dd_sevenn_h200x2.json"),
    "dd_find_max_h200x2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --device cuda "
                                "--models equivariant --scaling none --find-max 250000 --timeout "
                                "120 --json benchmarks/results/dd_find_max_h200x2.json"),
    "dd_halo_graph_gloo2.json": ("torchrun --nproc-per-node 2 benchmarks/dd.py --quick --models "
                                 "painn --modes halo,graph --sizes 108,500,2048,4000,8000 "
                                 "--scaling none --dtype float64 --device cpu --repeat 3 --json "
                                 "benchmarks/results/dd_halo_graph_gloo2.json"),
    "dd_halo_graph_gloo4.json": ("torchrun --nproc-per-node 4 benchmarks/dd.py --quick --models "
                                 "painn --modes halo,graph --sizes 108,500,2048 --scaling none "
                                 "--dtype float64 --device cpu --repeat 3 --json "
                                 "benchmarks/results/dd_halo_graph_gloo4.json"),
    "dd_md_cpu16.json": ("python benchmarks/dd_md.py --sizes 1000000 --ranks 1,2,4,8 --layouts "
                         "domain --steps 3 --warmup 1 --timeout 400 --json "
                         "benchmarks/results/dd_md_cpu16.json"),
    "dd_md_replicated_cpu16.json": ("python benchmarks/dd_md.py --sizes 1000000 --ranks 8 "
                                    "--layouts replicated --replicated-max-atoms 2000000 --steps "
                                    "1 --warmup 0 --timeout 140 --json "
                                    "benchmarks/results/dd_md_replicated_cpu16.json"),
    "dd_md_cpu.json": ("python benchmarks/dd_md.py --sizes 256000 --ranks 1,2,4,8 --layouts "
                       "domain --steps 4 --warmup 1 --json benchmarks/results/dd_md_cpu.json"),
    "dd_md_compiled_cpu.json": ("python benchmarks/dd_md.py --compile --ranks 2 --sizes 2000 "
                                "--layouts domain --steps 30 --json "
                                "benchmarks/results/dd_md_compiled_cpu.json"),
    "dd_md_h200.json": ("python benchmarks/dd_md.py --device cuda --dtype float32 --sizes "
                        "32000,256000,1000000 --ranks 1 --layouts domain --steps 20 --warmup 5 "
                        "--json benchmarks/results/dd_md_h200.json"),
    "dd_md_equivariant_h200.json": ("python benchmarks/dd_md.py --device cuda --dtype float32 "
                                    "--model equivariant --sizes 32000,108000 --ranks 1 --layouts "
                                    "domain --steps 10 --json "
                                    "benchmarks/results/dd_md_equivariant_h200.json"),
    "cp_training_cpu16.json": ("python benchmarks/cp_training.py --model schnet --hparams "
                               "'{\"num_features\": 32, \"num_filters\": 32}' --atoms 20000,60000 "
                               "--dd 1,2,4 --cutoff 4 --steps 1 --threads 4 --json "
                               "benchmarks/results/cp_training_cpu16.json"),
    "cp_training_equivariant_cpu16.json": ("python benchmarks/cp_training.py --model equivariant "
                                           "--hparams '{\"channels\": 32}' --atoms 2000,4000 --dd "
                                           "1,4 --checkpointing --cutoff 4 --steps 1 --threads 4 "
                                           "--json "
                                           "benchmarks/results/cp_training_equivariant_cpu16.json"),
    "long_range_h200.json": ("python benchmarks/long_range.py --device cuda --json "
                             "benchmarks/results/long_range_h200.json"),
    "long_range_cpu.json": ("python benchmarks/long_range.py --quick --json "
                            "benchmarks/results/long_range_cpu.json"),
    "long_range_dd_cpu16.json": ("python benchmarks/long_range.py --sizes 10000 100000 --dd 1,2,4 "
                                 "--no-direct --json benchmarks/results/long_range_dd_cpu16.json"),
    "validate_lj_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                "lj:sigma=2.3,epsilon=0.4,cutoff=5.0 --structure cu_tri.xyz "
                                "--dtype float64 --device cuda --json "
                                "benchmarks/results/validate_lj_h200x2.json"),
    "validate_painn_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model painn "
                                   "--structure cu_tri.xyz --dtype float64 --device cuda --json "
                                   "benchmarks/results/validate_painn_h200x2.json"),
    "validate_equivariant_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                         "equivariant --structure cu_tri.xyz --dtype float64 "
                                         "--device cuda --json "
                                         "benchmarks/results/validate_equivariant_h200x2.json"),
    "validate_sevenn_h200x2.json": ("torchrun --nproc-per-node 2 -m xnn validate --model "
                                    "sevenn:checkpoint=7net-0 --structure cu_tri.xyz --dtype "
                                    "float64 --device cuda --json "
                                    "benchmarks/results/validate_sevenn_h200x2.json"),
    "validate_equivariant_h200x4.json": ("torchrun --nproc-per-node 4 -m xnn validate --model "
                                         "equivariant --structure cu_tri.xyz --dtype float64 "
                                         "--device cuda --json "
                                         "benchmarks/results/validate_equivariant_h200x4.json"),
}

TABLES = [
    Table("bad_inputs", ("clear", "ok-accepted", "traceback", "silent", "hang", "misleading",
                         "refused-valid", "all"),
          ("bad_inputs_cpu.json",), _bad_inputs),
    Table("gpu_suite", ("passed", "skipped", "wall"),
          ("gpu_suite_h100.txt",),
          _gpu_suite, lambda name, data: "one NVIDIA H100, cold Triton cache"),
    Table("neighbors", ("atoms", "xnn auto", "xnn torch", "peer", "peer time", "auto / peer",
                        "ASE"),
          ("neighbors_h200.json", "neighbors_cpu.json"), _neighbors),
    Table("neighbors_paired", ("device", "atoms", "rounds", "xnn auto", "peer", "peer time",
                               "ratio median (min)"),
          ("neighbors_paired_h100.json", "neighbors_paired_h200.json",
           "neighbors_paired_cpu.json"),
          _neighbors_paired),
    Table("neighbors_after_torch_op", ("atoms", "torch threads", "vesin alone",
                                       "after positions.sum()", "slowdown"),
          ("neighbors_after_torch_op_cpu16.json", "neighbors_after_torch_op_cpu.json"),
          _after_torch_op, lambda name, data: ("CPU of the H100 host (16 cores)" if "cpu16" in name
                                               else "CPU (2 cores)")),
    Table("models", ("model", "parameters", "atoms", "atom-steps/s", "peak per atom",
                     "speed / MACE"),
          ("models_h200.json",), _models),
    Table("bench_equivariant", ("model", "parameters", "atoms", "energy + forces", "atom-steps/s",
                                "peak per atom", "speed / MACE"),
          ("bench_equivariant_h200.json",),
          _bench_equivariant),
    Table("md", ("case", "atoms", "xnn atom-steps/s", "peer", "peer atom-steps/s", "xnn / peer"),
          ("md_h200.json", "md_mace_compiled_h200.json", "md_cpu.json"), _md),
    Table("md_batched", ("model", "batched", "single cell", "batched per atom-step",
                         "single per atom-step", "batched / single"),
          ("md_batched_cpu.json",), _md_batched),
    Table("md_compiled", ("case", "atoms", "kernels", "eager step", "compiled step",
                          "compiled / eager", "recompiles", "first step"),
          ("md_compiled_h200.json", "md_compiled_cpu.json"),
          _md_compiled),
    Table("peers", ("model", "atoms", "xnn", "xnn atom-steps/s", "peer", "peer atom-steps/s",
                    "xnn / peer"),
          ("peers_h200.json", "peers_nvalchemi_h200.json"), _peers),
    Table("calculator", ("model", "atoms", "xnn per call", "peer", "peer per call", "xnn / peer"),
          ("calculator_cpu.json",), _calculator),
    Table("kernel_backends", ("model", "atoms", "reference", "backend", "backend time",
                              "backend / reference", "max force diff (eV/Å)"),
          ("kernel_backends_h200.json",),
          _kernel_backends),
    Table("triton_tp", ("dtype", "forward kernel", "2D tiles", "3D tile", "2D / 3D"),
          ("triton_tp_h200.json",), _triton_tp,
          lambda name, data: "one NVIDIA H200, torch 2.11"),
    Table("triton_mlp", ("N", "rows", "scale", "precision", "fused forward", "torch forward",
                         "speed-up", "fused fwd+bwd", "torch fwd+bwd", "speed-up"),
          ("triton_mlp_h200.json",), _triton_mlp),
    Table("triton_mlp_sweep", ("N", "rows", "precision", "part", "tilings", "fastest",
                               "time", "default then", "time", "default / fastest"),
          ("triton_mlp_sweep_h200.json",),
          _triton_mlp_sweep),
    Table("training", ("model", "parameters", "GPUs", "step", "structures/s"),
          ("training_h200.json",), _training),
    Table("training_compile", ("model", "eager structures/s", "compiled structures/s",
                               "compiled / eager", "first compiled call",
                               "gradient diff compiled vs eager", "eager vs eager"),
          ("training_compile_h200.json",), _training_compile),
    Table("training_vs_mace", ("xnn per epoch", "xnn structures/s", "mace_run_train per epoch",
                               "MACE structures/s", "xnn / MACE"),
          ("training_vs_mace_h200.json",),
          _training_vs_mace),
    Table("training_ddp", ("run (final code)", "step", "model", "DDP efficiency"),
          ("training_ddp_h200x2.json",), _training_ddp,
          lambda name, data: "2 NVIDIA H200, NCCL, torch 2.11"),
    Table("accuracy_vs_mace", ("test error", "epochs", "seed", "xnn", "MACE", "xnn / MACE"),
          ("accuracy_vs_mace_h200.json", "accuracy_vs_mace_cpu.json"),
          _accuracy),
    Table("activation_memory", ("model", "kept for 2nd backward", "plain / ckpt",
                                "peak saved tensors", "plain / ckpt", "allocator peak plain / ckpt",
                                "step time ckpt / plain"),
          ("activation_memory_cpu.json",),
          _activation_memory, lambda name, data: "CPU, fp64, 500 atoms"),
    Table("dd", ("model (mode)", "scaling", "atoms", "GPUs", "1 GPU", "N GPUs", "speed-up",
                 "efficiency", "halo fraction", "peak per GPU"),
          ("dd_equivariant_h200x2.json", "dd_equivariant_h200x4.json", "dd_painn_h200x4.json",
           "dd_sevenn_h200x2.json"), _dd),
    Table("dd_find_max", ("model", "GPUs", "bytes per atom", "predicted largest", "checked: fits",
                          "2 GPUs / 1 GPU"),
          ("dd_find_max_h200x2.json",),
          _dd_find_max),
    Table("dd_halo_graph", ("model", "atoms", "ranks", "1 rank", "halo", "graph", "halo / graph",
                            "halo fraction", "auto picks"),
          ("dd_halo_graph_gloo2.json", "dd_halo_graph_gloo4.json"),
          _dd_halo_graph),
    Table("dd_md", ("model", "layout", "ranks", "atoms", "held per rank (x N/P)",
                    "peak over baseline", "vs 1 rank", "step", "atom-steps/s", "speed-up"),
          ("dd_md_cpu16.json", "dd_md_replicated_cpu16.json", "dd_md_cpu.json",
           "dd_md_compiled_cpu.json", "dd_md_h200.json", "dd_md_equivariant_h200.json"),
          _dd_md),
    Table("cp_training", ("model", "checkpointing", "atoms", "dd", "peak per rank", "x dd = 1",
                          "step", "atoms held per rank"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          _cp_training),
    Table("cp_training_largest", ("model", "dd", "peak per 1k atoms (fit)",
                                  "largest in 80 GB per rank", "x dd = 1"),
          ("cp_training_cpu16.json", "cp_training_equivariant_cpu16.json"),
          _cp_largest),
    Table("long_range", ("ions", "mesh", "xnn pme", "torch-pme", "xnn / torch-pme",
                         "max force diff (eV/Å)"),
          ("long_range_h200.json", "long_range_cpu.json"), _long_range),
    Table("long_range_dd", ("ions", "ranks", "mesh (replicated)", "slowest rank",
                            "speed-up vs 1 rank", "peak RSS per rank"),
          ("long_range_dd_cpu16.json",),
          _long_range_dd),
    Table("validate", ("model", "ranks", "atoms", "mode", "worst relative error", "tolerance",
                       "one process", "decomposed"),
          ("validate_lj_h200x2.json", "validate_painn_h200x2.json",
           "validate_equivariant_h200x2.json", "validate_sevenn_h200x2.json",
           "validate_equivariant_h200x4.json"), _validate, _nccl_device),
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
