"""Rows of the tables of ``benchmarks/results/README.md``: one function per kind of results
file, ``rows(name, data) -> [[cell, ...], ...]`` (the file column is added by
:func:`benchmarks.results_tables.render`), and the number formats they share."""

from __future__ import annotations

import re


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
    """Bytes as MiB (4 significant digits, whole MiB above 1000)."""
    if n_bytes is None:
        return "-"
    value = n_bytes / 2**20
    return f"{value:,.0f} MiB" if value >= 1000 else f"{value:.4g} MiB"


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


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


# tests --------------------------------------------------------------------------------
BAD_INPUT_OUTCOMES = ("clear", "ok-accepted", "traceback", "silent", "hang", "misleading",
                      "refused-valid")


def tests(name: str, data: dict) -> list[list[str]]:
    """The bad-input sweep's outcomes, or the GPU suite's pytest summary (a text file)."""
    if "text" in data:
        last = re.findall(r"=+ (\d+) passed, (\d+) skipped.* in ([\d.]+)s", data["text"])[-1]
        return [["`pytest -m gpu`",
                 f"{last[0]} passed, {last[1]} skipped, {float(last[2]):.0f} s"]]
    out = data["total"]
    counts = ", ".join(f"{out[k]} {k}" for k in BAD_INPUT_OUTCOMES)
    return [["bad-input sweep (issue 42)", f"{counts}, of {data['cases']}"]]


# neighbor lists -------------------------------------------------------------------------
def neighbors(name: str, data: dict) -> list[list[str]]:
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


def neighbors_paired(name: str, data: dict) -> list[list[str]]:
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


def after_torch_op(name: str, data: dict) -> list[list[str]]:
    return [[count(r["n_atoms"]), str(r["torch_threads"]), ms(r["alone_median_s"]),
             ms(r["after_torch_sum_median_s"]), ratio(r["slowdown"])] for r in data["rows"]]


def after_torch_op_device(name: str, data: dict) -> str:
    """The machine of an ``--after-torch-op`` file (its JSON records none)."""
    return "CPU of the H100 host (16 cores)" if "cpu16" in name else "CPU (2 cores)"


# models -------------------------------------------------------------------------------
def models(name: str, data: dict) -> list[list[str]]:
    """Rows of ``models.py`` files, or of ``bench_equivariant.py`` files (matched size)."""
    if "runs" in next(iter(data["models"].values())):
        return bench_equivariant(name, data)
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


def bench_equivariant(name: str, data: dict) -> list[list[str]]:
    mace = {r["n_atoms"]: r for r in data["models"]["mace"]["runs"]}
    rows = []
    for model, m in data["models"].items():
        for r in m["runs"]:
            peer = mace.get(r["n_atoms"])
            speed = None if model == "mace" or peer is None else (
                r["atom_steps_per_s"] / peer["atom_steps_per_s"])
            rows.append([model, count(m["parameters"]), count(r["n_atoms"]),
                         rate(r["atom_steps_per_s"]), kib(r["peak_bytes_per_atom"]),
                         ratio(speed)])
    return rows


# MD ----------------------------------------------------------------------------------
def md(name: str, data: dict) -> list[list[str]]:
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


def md_batched(name: str, data: dict) -> list[list[str]]:
    return [[r["model"], f"{r['n_systems']} x {r['atoms_per_system']}", count(r["single_n_atoms"]),
             f"{r['batched_us_per_atom_step']:.3g} us", f"{r['single_us_per_atom_step']:.3g} us",
             num(r["batched_over_single"])] for r in data["results"]]


def md_compiled(name: str, data: dict) -> list[list[str]]:
    return [[r["case"].removeprefix("compiled_step_"), count(r["n_atoms"]),
             r.get("kernel_backend", "reference"), ms(r["eager_s_per_step"]),
             ms(r["compiled_s_per_step"]), ratio(r["speedup"]), str(r["recompiles_timed"]),
             sec(r["first_compiled_step_s"])] for r in data["results"]]


def peers(name: str, data: dict) -> list[list[str]]:
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


def calculator(name: str, data: dict) -> list[list[str]]:
    rows = []
    for r in data["results"]:
        (ours, peer) = ("xnn", next(k for k in r["s_per_call"] if k != "xnn"))
        rows.append([r["case"], count(r["n_atoms"]), ms(r["s_per_call"][ours]), peer,
                     ms(r["s_per_call"][peer]),
                     ratio(r["s_per_call"][ours] / r["s_per_call"][peer])])
    return rows


# kernels -------------------------------------------------------------------------------
def kernel_backends(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model in ("equivariant", "mace"):
        for r in data[model]:
            for backend in data["backends"][1:]:
                rows.append([model, count(r["n_atoms"]), ms(r["reference_median_s"]), backend,
                             ms(r[f"{backend}_median_s"]),
                             ratio(r[f"{backend}_over_reference_time"]),
                             sci(r[f"{backend}_max_abs_force_diff_eV_per_A"])])
    return rows


def triton_tp(name: str, data: dict) -> list[list[str]]:
    rows = []
    for dtype, d in data.items():
        for kernel, key in (("per-edge output", "fwd_s"), ("fused convolution", "conv_fwd_s")):
            rows.append([dtype.removeprefix("torch."), kernel, ms(d["old2d"][key]),
                         ms(d["new3d"][key]), ratio(d["old2d"][key] / d["new3d"][key])])
        rows.append([dtype.removeprefix("torch."), "index_add alone", "-", ms(d["index_add_s"]),
            "-"])
    return rows


def triton_mlp(name: str, data: dict) -> list[list[str]]:
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


def triton_mlp_sweep(name: str, data: dict) -> list[list[str]]:
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
def training(name: str, data: dict) -> list[list[str]]:
    """Rows of ``training.py`` files: per step, compiled against eager, or against MACE."""
    if "mace_s_per_epoch" in data.get("epoch_time", {}):
        t = data["epoch_time"]
        return [["equivariant", count(data["models"]["equivariant"]["parameters"]),
                 "eager, per epoch", sec(t["xnn_equivariant_s_per_epoch"]),
                 rate(t["xnn_equivariant_structures_per_s"]), "mace_run_train",
                 sec(t["mace_s_per_epoch"]), rate(t["mace_structures_per_s"]),
                 ratio(t["speedup_xnn_vs_mace"])]]
    if "compiled" in data:
        rows = []
        for model, c in data["compiled"]["models"].items():
            e = data["eager"]["models"][model]
            rows.append([model, count(c["parameters"]),
                         f"compiled, per step (first call {sec(c['first_compiled_call_s'])}; "
                         f"gradient diff {sci(c['compiled_vs_eager_grad_rel_diff'])}, eager vs "
                         f"eager {sci(c['eager_vs_eager_grad_rel_diff'])})",
                         ms(c["step_s"]), rate(c["structures_per_s"]), "eager", ms(e["step_s"]),
                         rate(e["structures_per_s"]),
                         ratio(c["structures_per_s"] / e["structures_per_s"])])
        return rows
    gpus = f"{data['world_size']} GPU" + ("s" if data["world_size"] > 1 else "")
    return [[model, count(m["parameters"]), f"eager, {gpus}, per step", ms(m["step_s"]),
             rate(m["structures_per_s"]), "-", "-", "-", "-"]
            for model, m in data["models"].items()]


def data_start(name: str, data: dict) -> list[list[str]]:
    """Rows of ``index_scale.py`` (opening a source: first start without an index, then with
    it) and ``plan_scale.py`` (one epoch's plan at the largest size, list planner against
    ``BatchPlan``; peak memory of the plan, CPU seconds)."""
    if data["benchmark"] == "index_scale":
        before = {(b["format"], b["n"]): b for b in data["before"]}
        return [["open a source", f"{r['format']}, {r['workers']} workers", count(r["n"]),
                 f"{sec(before[(r['format'], r['n'])]['first_s'])} "
                 f"({sec(before[(r['format'], r['n'])]['first_cpu_s'])} CPU)",
                 f"{sec(r['first_s'])} ({sec(r['first_cpu_s'])} CPU), then "
                 f"{sec(r['second_s'])}"]
                for r in data["rows"] if (r["format"], r["n"]) in before]
    n = max(r["n"] for r in data["rows"])
    at = {(r["mode"], r["ranks"], r["impl"]): r for r in data["rows"] if r["n"] == n}
    what = {"split": "split and subsets", "draws": "samples_per_epoch draws"}
    rows = []
    for mode, ranks, _ in sorted(k for k in at if k[2] == "after"):
        b, a = at[(mode, ranks, "before")], at[(mode, ranks, "after")]
        guess = " (extrapolated)"
        rows.append(["before the plan" if mode in what else f"plan an epoch ({mode})",
                     what.get(mode, f"{ranks} ranks"), count(n),
                     f"{mib(b['peak_mib'] * 2**20)}{guess * b['extrapolated']}, "
                     f"{sec(b['cpu_s'])} CPU",
                     f"{mib(a['peak_mib'] * 2**20)}{guess * a['extrapolated']}, "
                     f"{sec(a['cpu_s'])} CPU"])
    return rows


def data_scale(name: str, data: dict) -> list[list[str]]:
    """Rows of ``data_scale.py``: one per format and number of loader workers."""
    names = {"memory": "in-memory", "hdf5": "HDF5", "aselmdb": "ASE-LMDB",
             "prepared": "prepared", "ready": "a built batch (receive ceiling)"}
    rows = []
    for r in data["results"]:
        workers = r["peak_rss"]["workers"]
        sent = " (a tensor a field)" if r.get("transfer") == "fields" else ""
        rows.append([str(r["workers"]), names.get(r["format"], r["format"]) + sent,
                     rate(r["structures_per_s"]), rate(r["atoms_per_s"]),
                     sec(r["first_batch_s"]),
                     f"{mib(r['peak_rss']['main'])} + {mib(max(workers))}" if workers
                     else mib(r["peak_rss"]["main"]),
                     num(r.get("loader_over_step"), 2)])
    return rows


def training_ddp(name: str, data: dict) -> list[list[str]]:
    rows = []
    for run, eff in data["ddp_efficiency"].items():
        what = data["runs"][run]["what"].split(";")[0].split("(")[0].strip()
        if not what.startswith("final code"):
            continue  # the runs of the code before the change the file measured
        for model, value in eff.items():
            mode = "compiled" if "compiled" in run else "eager"
            if "ddp_first" in run:
                mode += ", data-parallel step always first"
            rows.append([run, mode, model, pct(value)])
    return rows


def accuracy(name: str, data: dict) -> list[list[str]]:
    """Test errors as ``xnn vs MACE (xnn / MACE)``, one column per quantity."""
    x, m = data["xnn"]["test"], data["mace"]["test"]
    cells = [f"{num(x[key])} vs {num(m[key])} ({ratio(x[key] / m[key])})"
             for key in ("energy_mae_meV_per_atom", "forces_mae_meV_per_A",
                         "stress_mae_meV_per_A3")]
    return [[str(data["settings"]["epochs"]), str(data["data"]["seed"]), *cells]]


def activation_memory(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, m in data["models"].items():
        r = m["ratio_plain_over_ckpt"]
        rows.append([model, mib(m["plain"]["kept_after_forces"]), ratio(r["kept_after_forces"]),
                     mib(m["plain"]["peak_saved"]), ratio(r["peak_saved"]),
                     ratio(r["peak_allocated"]), ratio(r["step_time"])])
    return rows


# domain decomposition ------------------------------------------------------------------
def dd(name: str, data: dict) -> list[list[str]]:
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


def dd_find_max(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, res in data["results"].items():
        big = res["largest"]
        for label, key in (("1 GPU", "single"), (f"{data['world_size']} GPUs", "decomposed")):
            b = big[key]
            rows.append([model, label, kib(b["bytes_per_atom"]), count(b["predicted_max"]),
                         count(b["checked_atoms"]), "-" if key == "single" else
                         ratio(big["ratio_verified"])])
    return rows


def dd_halo_graph(name: str, data: dict) -> list[list[str]]:
    rows = []
    for model, res in data["results"].items():
        for p in res["points"]:
            halo, graph = p["by_mode"]["halo"], p["by_mode"]["graph"]
            rows.append([model, count(p["n_atoms"]), str(p["ranks"]), ms(p["single"]["time_s"]),
                         ms(halo["time_s"]), ms(graph["time_s"]),
                         ratio(halo["time_s"] / graph["time_s"]),
                         num(halo["halo_fraction_max"]), p["auto"]["mode"]])
    return rows


def dd_md(name: str, data: dict) -> list[list[str]]:
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



def lammps(name: str, data: dict) -> list[list[str]]:
    """Rows of ``lammps.py`` files: ``xnn lammps`` on N ranks against ``xnn md``."""
    rows = []
    for r in data["rows"]:
        lmp, md = r["lammps"], r.get("xnn_md") or {}
        ranks = str(r["ranks"]) + (f" ({lmp['mode']})" if r["ranks"] > 1 and lmp.get("mode")
                                   else "")
        if "error" in lmp:
            rows.append([r["model"], count(r["n_atoms"]), ranks, "-", lmp["error"][:40],
                         "-", "-", "-", "-"])
            continue
        peak = max(lmp["peak_rss_bytes_per_rank"] or [0]) or None
        rows.append([r["model"], count(lmp["n_atoms"]), ranks,
                     f"{count(int(lmp['owned_per_rank']['max']))} + "
                     f"{count(int(lmp['ghost_per_rank']['max']))}",
                     ms(lmp["s_per_step"]), ms(md.get("s_per_step")),
                     "-" if "lammps_over_xnn_md" not in r else
                     f"{ratio(r['lammps_over_xnn_md'])} "
                     f"({ratio(r.get('lammps_over_xnn_md_cpu_time'))})",
                     f"{ratio(r.get('speedup_vs_1_rank'))} "
                     f"({ratio(r.get('cpu_time_speedup_vs_1_rank'))})",
                     mib(peak)])
    return rows

def lammps_breakdown(name: str, data: dict) -> list[list[str]]:
    """Rows of ``lammps_breakdown.py`` files: where a one-rank LAMMPS-driven step goes."""
    rows = []
    for r in data["rows"]:
        parts = r["parts_s_per_step"]
        rows.append([r["model"], count(r["n_atoms"]), count(r["n_ghost"]),
                     ms(r["lammps_s_per_step"]), ms(r["potential_alone_s_per_step"]),
                     ratio(r["ratio_lammps_to_potential"]), ms(parts["graph"]),
                     ms(parts["coincident"]), ms(parts["potential"]),
                     ms(parts["lammps_and_rest"])])
    return rows


def cp_training(name: str, data: dict) -> list[list[str]]:
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


def cp_largest(name: str, data: dict) -> list[list[str]]:
    big = data["largest_trainable"]
    one = big["dd1"]["largest_atoms"]
    return [[data["args"]["model"], key.removeprefix("dd"), f"{v['gb_per_1k_atoms']:.3g} GB",
             count(v["largest_atoms"]), ratio(v["largest_atoms"] / one)]
            for key, v in big.items()
            if key.startswith("dd") and isinstance(v, dict) and "_" not in key]  # no ckpt fit


def long_range(name: str, data: dict) -> list[list[str]]:
    return [[count(r["n_atoms"]), f"{r['mesh'][0]}³", ms(r["xnn_s"]), ms(r["torchpme_s"]),
             ratio(r["ratio"]), sci(r["forces_max_abs_diff"])] for r in data["results"]]


def long_range_dd(name: str, data: dict) -> list[list[str]]:
    one = {r["n_atoms"]: r["max_rank_s"] for r in data["dd"]["results"] if r["ranks"] == 1}
    rows = []
    for r in data["dd"]["results"]:
        peak = max(p["peak_rss_MiB"] for p in r["per_rank"])
        rows.append([count(r["n_atoms"]), str(r["ranks"]), f"{r['per_rank'][0]['mesh'][0]}³",
                     sec(r["max_rank_s"]), ratio(one[r["n_atoms"]] / r["max_rank_s"]),
                     f"{peak:.4g} MiB"])
    return rows


def validate(name: str, data: dict) -> list[list[str]]:
    worst = max(v["max_rel"] for v in data["report"].values())
    return [[name.removeprefix("validate_").split("_")[0], str(data["world_size"]),
             count(data["n_atoms"]), data["mode"], sci(worst), sci(data["tol"]),
             sec(data["seconds_single"]), sec(data["seconds_decomposed"])]]


def nccl_device(name: str, data: dict) -> str:
    return f"{data['world_size']} NVIDIA H200, NCCL, fp64"


def scaling_model(name: str, data: dict) -> list[list[str]]:
    """Rows of ``scaling_model.py``: the step-cost model's prediction against each measured
    multi-rank point (calibrated on the 1-rank rows of the same file)."""
    return [[r["source"], str(r["ranks"]), count(r["n_atoms"]), ms(r["predicted_s"]),
             ms(r["measured_s"]), f"{100 * r['error']:+.1f} %"] for r in data["validation"]]


def io_scale(name: str, data: dict) -> list[list[str]]:
    """Rows of ``io_scale.py``: one checkpoint or frame per size and rank count, gathered
    on rank 0 against sharded (every rank writes its atoms)."""
    at = {(r["kind"], r["n_atoms"], r["ranks"], r["format"]): r for r in data["rows"]
          if "error" not in r}
    rows = []
    for kind, n, ranks, fmt in sorted(at):
        if fmt != "gathered" or (kind, n, ranks, "sharded") not in at:
            continue
        g, s = at[(kind, n, ranks, "gathered")], at[(kind, n, ranks, "sharded")]
        rows.append([kind, count(n), str(ranks),
                     f"{sec(g['total_s'])} (gather {sec(g['gather_s'])})", sec(s["total_s"]),
                     mib(g["rank0_peak_bytes"]), mib(s["rank0_peak_bytes"]),
                     f"{g['bytes_per_atom']:.0f}", f"{s['bytes_per_atom']:.0f}"])
    return rows


def ghost_plan(name: str, data: dict) -> list[list[str]]:
    """Rows of ``ghost_plan_scale.py``: per system and mode, its strong-scaling rows at the
    largest size planned (ranks folded): the largest ghost shell against the mean owned
    atoms, peers, edges, and whether the counts are exact or sampled."""
    strong = [r for r in data["rows"] if r["scaling"] == "strong"]
    out = []
    for system in ("fcc", "slab", "cylinder", "liquid"):
        for mode in ("halo", "sync", "graph"):
            these = [r for r in strong if r["system"] == system and r["mode"] == mode]
            if not these:
                continue
            n = max(r["n_atoms"] for r in these)
            for r in sorted((r for r in these if r["n_atoms"] == n), key=lambda r: r["n_ranks"]):
                out.append([system, mode, count(n), str(r["n_ranks"]),
                            num(r["ghost_max"] / r["owned_mean"]), str(r["peers_max"]),
                            count(r["edges_max"]),
                            _exactness(r["method"]), sec(r["seconds"])])
    return out


def _exactness(method: str) -> str:
    """``exact``, ``exact, edges sampled`` or ``sampled`` (ghosts too) from a plan's method."""
    if "sampled" not in method:
        return "exact"
    return "exact, edges sampled" if "sampled: edges" in method else "sampled"


def balance_scale(name: str, data: dict) -> list[list[str]]:
    """Rows of ``balance_scale.py``: per system and mode at 512 GPUs, 250k atoms per GPU,
    equal-width boxes -> balanced (``parallel.balance: shift``): the fullest rank's owned
    and held atoms against the mean, and the predicted step and efficiency."""
    out = []
    by = {(r["system"], r["mode"], r["balance"]): r for r in data["rows"]}
    for system, mode, _ in [k for k in by if k[2] == "none"]:
        a, b = by[(system, mode, "none")], by[(system, mode, "shift")]
        out.append([system, mode, "x".join(map(str, a["grid"])),
                    f"{a['owned_max_over_mean']:.3f} → {b['owned_max_over_mean']:.3f}",
                    f"{a['held_max_over_mean']:.3f} → {b['held_max_over_mean']:.3f}",
                    f"{sec(a['step_s'])} → {sec(b['step_s'])}",
                    f"{pct(a['efficiency'])} → {pct(b['efficiency'])}"])
    return out


def dd_components(name: str, data: dict) -> list[list[str]]:
    """Rows of ``dd_components.py``: one decomposed MD step's parts on the slowest rank
    (evaluation, point-to-point exchanges, all-reduces) per model, size, lattice scale and
    rank count."""
    out = []
    for r in data["rows"]:
        if "error" in r:
            continue
        slow = max(r["per_rank"], key=lambda q: q["step_s"])
        part = slow["seconds_per_step"]
        out.append([r["model"], count(r["n_atoms"]), f"{r['scale']:g}", str(r["ranks"]),
                    ms(r["step_s"]), ms(part["evaluate"]), ms(part["p2p"]),
                    ms(part["all_reduce"])])
    return out
