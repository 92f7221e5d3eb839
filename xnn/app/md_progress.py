"""What ``xnn md`` and ``xnn relax`` show while they run and when they end.

While running (``output.progress``, rank 0): on a terminal a tqdm bar; elsewhere (a batch
job, output redirected to a file) one line every ``output.progress_every_s`` seconds of wall
clock, the first after at most :data:`FIRST_LINE_S` seconds, with the step, the latest
thermo values and the speed. The lines are decided on rank 0's clock and print values the
run computed anyway, so they add no collective and no step of work.

At the end: one summary line (speed, ns/day, mean temperature and pressure of the thermo
rows, or converged systems and the largest force) and ``summary.json`` with the same
figures and the decomposition of the run (:meth:`~xnn.dynamics.parallel.SerialRun.
decomposition`: one rank in one process).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

from xnn._files import atomic_write

#: seconds of wall clock after which the first progress line comes at the latest
FIRST_LINE_S = 10.0


def wall_clock() -> float:
    """Seconds of a monotonic clock (the progress lines' and the summary's)."""
    return time.monotonic()


def on_terminal() -> bool:
    """Whether progress goes to a terminal (stderr, where tqdm draws)."""
    return sys.stderr.isatty()


def duration(seconds: float) -> str:
    """``"3.2 s"``, ``"4m05s"``, ``"2h03m"``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


def ns_per_day(steps: int, timestep_fs: float, seconds: float) -> float:
    """Simulated nanoseconds per day of wall clock."""
    return steps * timestep_fs * 1e-6 * 86400.0 / seconds if seconds > 0 else math.nan


class Progress:
    """The progress of one run: a tqdm bar on a terminal, else a line every ``every_s``
    seconds of wall clock; nothing when ``output.progress`` is off or not ``enabled``
    (ranks other than 0).

    Args:
        cfg_out: the run's ``output`` section (``progress``, ``progress_every_s``).
        total: the step the run ends at. initial: the step it starts from.
        command: ``"md"`` or ``"relax"`` (lines start with ``xnn COMMAND:``).
        desc: the bar's label. timestep_fs: MD's time step (lines then give ns/day).
    """

    def __init__(self, cfg_out, total: int, initial: int, command: str, desc: str,
                 enabled: bool = True, timestep_fs: float | None = None):
        self.command, self.total, self.every = command, total, cfg_out.progress_every_s
        self.timestep = timestep_fs
        show = bool(cfg_out.progress and enabled)
        self.bar, self.lines = None, show and not on_terminal()
        if show and not self.lines:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=min(initial, total), desc=desc, unit="step",
                            dynamic_ncols=True, mininterval=0.5)
        self.last, self.last_step = wall_clock(), initial
        self.next = self.last + min(FIRST_LINE_S, self.every)

    def update(self, step: int, postfix: Callable[[], dict], line: Callable[[], str]) -> None:
        """After step ``step``: the bar moves (``postfix()``: its figures), or a line
        ``line()`` is printed when its time has come."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(postfix(), refresh=False)
        elif self.lines and wall_clock() >= self.next:
            now = wall_clock()
            seconds = max(now - self.last, 1e-9)
            rate = (step - self.last_step) / seconds  # since the last line
            left = (self.total - step) / rate if rate > 0 else math.nan
            eta = f", {duration(left)} left" if math.isfinite(left) else ""
            ns = ("" if self.timestep is None else
                  f", {ns_per_day(step - self.last_step, self.timestep, seconds):.3g} ns/day")
            print(f"xnn {self.command}: step {step}/{self.total} "
                  f"({100.0 * step / max(self.total, 1):.0f}%), {line()}, "
                  f"{rate:.3g} steps/s{ns}{eta}", flush=True)
            self.last, self.last_step, self.next = now, step, now + self.every

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ThermoMeans:
    """Running means over a run's thermo rows of each system's temperature and pressure
    (pressure: periodic systems only)."""

    def __init__(self):
        self.rows = 0
        self.t_sum: list[float] = []
        self.p_sum: list[float] = []
        self.latest: dict[str, list[float]] = {}
        self.std_max: list[float] = []  # a committee's largest force spread per system

    def add(self, values: dict) -> None:
        """One row: ``values`` of :func:`~xnn.dynamics.thermo.observables` (``[n_systems]``)."""
        t = values["temperature_K"].tolist()
        p = values["pressure_GPa"].tolist()
        if not self.rows:
            self.t_sum, self.p_sum = [0.0] * len(t), [0.0] * len(p)
        self.t_sum = [a + b for a, b in zip(self.t_sum, t)]
        self.p_sum = [a + b for a, b in zip(self.p_sum, p)]
        self.rows += 1
        self.latest = {"T": t, "epot": values["epot_eV"].tolist()}
        if "max_force_std_eV_A" in values:
            u = values["max_force_std_eV_A"].tolist()
            self.std_max = [max(a, b) for a, b in zip(self.std_max, u)] if self.std_max else u

    def temperature(self) -> list[float]:
        """``[n_systems]`` mean temperatures (K)."""
        return [s / self.rows for s in self.t_sum] if self.rows else []

    def pressure(self) -> list[float]:
        """``[n_systems]`` mean pressures (GPa); NaN for systems without a periodic cell."""
        return [s / self.rows for s in self.p_sum] if self.rows else []


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def md_summary(cfg, means: ThermoMeans, n_atoms: int, start: int, end: int,
               loop_s: float, wall_s: float) -> dict:
    """The figures of an ``xnn md`` run for ``summary.json`` (steps ``start`` to ``end``
    in ``loop_s`` seconds of integration, ``wall_s`` in all)."""
    done = end - start
    t, p = means.temperature(), means.pressure()
    return {
        "command": "md", "ensemble": cfg.ensemble, "timestep_fs": cfg.timestep,
        "n_systems": len(t) or None, "n_atoms": n_atoms, "start_step": start, "step": end,
        "steps_run": done, "wall_s": wall_s, "loop_s": loop_s,
        "steps_per_s": done / loop_s if loop_s > 0 else None,
        "ns_per_day": ns_per_day(done, cfg.timestep, loop_s) if loop_s > 0 else None,
        "atom_steps_per_s": n_atoms * done / loop_s if loop_s > 0 else None,
        "thermo_rows": means.rows,
        "mean_temperature_K": _none_if_nan(_mean(t)),
        "mean_pressure_GPa": _none_if_nan(_mean(p)),
        "mean_temperature_K_per_system": [_none_if_nan(v) for v in t],
        "mean_pressure_GPa_per_system": [_none_if_nan(v) for v in p],
        **({"max_force_std_eV_A": max(means.std_max),
            "max_force_std_eV_A_per_system": means.std_max} if means.std_max else {}),
    }


def md_summary_line(s: dict) -> str:
    """The last line of ``xnn md`` from :func:`md_summary`'s figures."""
    speed = ""
    if s["steps_run"] and s["steps_per_s"] is not None:
        speed = (f": {s['steps_per_s']:.3g} steps/s, {s['ns_per_day']:.3g} ns/day, "
                 f"{s['atom_steps_per_s']:.3g} atom-steps/s")
    thermo = ""
    if s["mean_temperature_K"] is not None:
        n = s["n_systems"] or 1
        over = f" ({n} systems)" if n > 1 else ""
        pressure = ("" if s["mean_pressure_GPa"] is None
                    else f", mean P {s['mean_pressure_GPa']:.4g} GPa")
        rows = s["thermo_rows"]
        thermo = (f"; mean T {s['mean_temperature_K']:.4g} K{pressure} over {rows} thermo "
                  f"row{'s' if rows != 1 else ''}{over}")
    return (f"xnn md: steps {s['start_step']}-{s['step']} in {duration(s['loop_s'])}"
            f"{speed}{thermo}; wall time {duration(s['wall_s'])}")


def relax_summary(cfg, fmax: list[float], n_atoms: int, start: int, end: int,
                  loop_s: float, wall_s: float) -> dict:
    """The figures of an ``xnn relax`` run for ``summary.json`` (``fmax``: each system's
    largest force at the end, eV/Å)."""
    done = end - start
    ok = [f < cfg.fmax for f in fmax]
    return {
        "command": "relax", "n_systems": len(fmax), "n_atoms": n_atoms, "start_step": start,
        "step": end, "steps_run": done, "wall_s": wall_s, "loop_s": loop_s,
        "steps_per_s": done / loop_s if loop_s > 0 else None,
        "fmax_eV_A": cfg.fmax, "max_steps": cfg.max_steps,
        "converged": sum(ok), "converged_per_system": ok,
        "max_force_eV_A": max(fmax) if fmax else None,
        "max_force_eV_A_per_system": fmax,
    }


def relax_summary_line(s: dict) -> str:
    """The last line of ``xnn relax`` from :func:`relax_summary`'s figures."""
    n, ok = s["n_systems"], s["converged"]
    left = "" if ok == n else f"; {n - ok} not converged within max_steps={s['max_steps']}"
    speed = f", {s['steps_per_s']:.3g} steps/s" if s["steps_run"] and s["steps_per_s"] else ""
    return (f"xnn relax: {ok} of {n} systems converged to fmax={s['fmax_eV_A']:g} eV/Å "
            f"(largest force {s['max_force_eV_A']:.3g} eV/Å at step {s['step']}){left}; "
            f"steps {s['start_step']}-{s['step']} in {duration(s['loop_s'])}{speed}; "
            f"wall time {duration(s['wall_s'])}")


def _none_if_nan(v: float) -> float | None:
    return None if not math.isfinite(v) else v


def write_summary(path: Path, par, figures: dict) -> dict | None:
    """Write ``summary.json`` (rank 0): ``figures`` and the run's decomposition
    (:meth:`~xnn.dynamics.parallel.SerialRun.decomposition`). Collective; returns what was
    written on rank 0, ``None`` elsewhere."""
    split = par.decomposition()
    if split is None:
        return None
    out = {**figures, **split}
    text = json.dumps(out, indent=1) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return out
