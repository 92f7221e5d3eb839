"""Run under ``mpirun -np N python tests/helpers/lammps_worker.py SPEC.json``: LAMMPS cases
with an xnn model through ``XnnFixExternal``; rank 0 writes each case's results by atom id
to ``OUT/<case>.npz``.

SPEC: ``{"out": dir, "cases": [{"name", "model", "structure" (extxyz file), "mode",
"task": "point" | "nve" | "npt", "steps"}]}``. Point cases (but the traffic case) also
read ``compute stress/atom`` (and its sum). Every rank records how many atoms its model
evaluations held at most, against LAMMPS's owned + ghost atoms at that call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

torch.set_num_threads(1)

from ase.io import read  # noqa: E402

from xnn.interop.lammps import XnnFixExternal, require_lammps  # noqa: E402
from xnn.models.serialization import load_model  # noqa: E402


class Held(torch.nn.Module):
    """Records, per evaluation, the atoms of the graph the model is given."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def __call__(self, module, args):
        self.sizes.append(int(args[0].n_atoms))


class Traffic:
    """Counts the elements this rank receives through ``torch.distributed`` while the host
    layout builds (the ghost-owner lookup, the plan, the ghosts' fields): through
    collectives (all-gathers, all-to-all, all-reduces, broadcasts) and point to point; and
    point to point in each force call outside the builds (``calls``)."""

    COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_to_all_single", "all_reduce",
                   "broadcast")

    def __init__(self, layout):
        import torch.distributed as dist

        self.builds: list[dict] = []
        self.calls: list[int] = []
        self.active = False
        self.in_call = False
        self._original = {name: getattr(dist, name)
                          for name in (*self.COLLECTIVES, "batch_isend_irecv")}
        for name in self.COLLECTIVES:
            setattr(dist, name, self._counted(getattr(dist, name), name))
        batch = dist.batch_isend_irecv

        def counted_batch(ops):
            received = sum(op.tensor.numel() for op in ops if op.op is dist.irecv)
            if self.active:
                self.now["p2p"] += received
            elif self.in_call:
                self.calls[-1] += received
            return batch(ops)

        dist.batch_isend_irecv = counted_batch
        build = layout.build

        def counted_build(graph, pot, part=None):
            self.now = {"collective": 0, "p2p": 0}
            self.active = True
            try:
                dom = build(graph, pot, part)
            finally:
                self.active = False
            self.builds.append({**self.now, "n_ghost": dom.n_ghost,
                                "n_send": dom.plan.n_send,
                                "lookup_received": layout.lookup_received})
            return dom

        layout.build = counted_build

    def call(self, fn, *args) -> None:
        """Run the force callback ``fn(*args)``, counting its point-to-point elements."""
        self.calls.append(0)
        self.in_call = True
        try:
            fn(*args)
        finally:
            self.in_call = False

    def close(self) -> None:
        """Put ``torch.distributed``'s functions back."""
        import torch.distributed as dist

        for name, fn in self._original.items():
            setattr(dist, name, fn)

    def _counted(self, fn, name):
        def counted(out, *args, **kw):
            if self.active:
                outs = out if isinstance(out, list) else [out]
                self.now["collective"] += sum(t.numel() for t in outs)
            return fn(out, *args, **kw)
        return counted


def box_commands(atoms) -> str:
    """A LAMMPS box for ``atoms`` (already in LAMMPS's frame): periodic axes from the cell,
    open axes shrink-wrapped."""
    c = atoms.cell.array.tolist()
    pbc = atoms.pbc
    bound = " ".join("p" if p else "s" for p in pbc)
    lo = atoms.positions.min(0) - 1.0
    hi = atoms.positions.max(0) + 1.0
    lim = [(0.0, c[k][k]) if pbc[k] else (float(lo[k]), float(hi[k])) for k in range(3)]
    tilt = (c[1][0] if pbc[0] else 0.0, c[2][0] if pbc[0] else 0.0,
            c[2][1] if pbc[1] else 0.0)
    return (f"boundary {bound}\n"
            f"region box prism {lim[0][0]!r} {lim[0][1]!r} {lim[1][0]!r} {lim[1][1]!r} "
            f"{lim[2][0]!r} {lim[2][1]!r} {tilt[0]!r} {tilt[1]!r} {tilt[2]!r} units box\n")


NVE = "fix md all nve\ntimestep 0.002\n"


def _stress_atom(case: dict) -> bool:
    """Single points read ``compute stress/atom`` (not the traffic case, which counts the
    messages of a call without per-atom virials)."""
    return case["task"] == "point" and not case.get("traffic")


def _force_field(lmp, model, types, case: dict) -> XnnFixExternal:
    """The model as LAMMPS's force field, with the computes the results read."""
    fix = XnnFixExternal(lmp, model, species=types, mode=case.get("mode", "spatial"),
                         skin=case.get("skin"))
    lmp.commands_string("compute pa all pe/atom\ncompute pv all pressure NULL virial\n"
                        "thermo_style custom step pe press vol\nthermo_modify norm no\n")
    if _stress_atom(case):  # per-atom virials: LAMMPS asks for them at the thermo step
        lmp.commands_string("compute sa all stress/atom NULL virial\n"
                            "compute sr all reduce sum c_sa[1] c_sa[2] c_sa[3] c_sa[4] "
                            "c_sa[5] c_sa[6]\nthermo_style custom step pe press vol c_sr[1]\n")
    return fix


def run_case(case: dict, comm, out: Path) -> None:
    lammps = require_lammps()
    atoms = read(case["structure"])
    model = load_model(case["model"])
    held = Held()
    model.register_forward_pre_hook(held)
    lmp = lammps.lammps(comm=comm, cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    types = sorted({int(z) for z in atoms.numbers})
    lmp.commands_string("units metal\natom_style atomic\natom_modify map yes\n"
                        + box_commands(atoms) + f"create_box {len(types)} box\n")
    for t, z in enumerate(types, start=1):
        lmp.command(f"mass {t} {float(atoms.get_masses()[atoms.numbers == z][0])!r}")
    n = len(atoms)
    # ids 1..n in the order of the file; every rank passes all, each keeps those it owns
    kinds = [types.index(int(z)) + 1 for z in atoms.numbers]
    lmp.create_atoms(n, list(range(1, n + 1)), kinds, atoms.positions.reshape(-1).tolist())
    fix = _force_field(lmp, model, types, case)
    traffic = Traffic(fix.potential.layout) if case.get("traffic") else None
    steps = int(case.get("steps", 0))
    if case["task"] in ("nve", "restart"):
        lmp.command("velocity all create 600 4928 loop geom")
        lmp.commands_string(NVE)
    if case["task"] == "restart":  # half the NVE steps, a restart file, a new LAMMPS
        fix.run(steps // 2)
        lmp.command(f"write_restart {out / case['name']}.restart")
        lmp.close()
        lmp = lammps.lammps(comm=comm, cmdargs=["-log", "none", "-screen", "none",
                                                "-nocite"])
        lmp.command(f"read_restart {out / case['name']}.restart")
        fix = _force_field(lmp, model, types, case)
        lmp.commands_string(NVE)
        steps -= steps // 2
    elif case["task"] == "npt":
        lmp.command("velocity all create 600 4928 loop geom")
        lmp.command("fix md all npt temp 600 600 0.05 tri 0 0 0.5")
        lmp.command("timestep 0.002")
    # collect LAMMPS's owned + ghost counts at every force call (before xnn's callback)
    seen: list[int] = []
    inner = fix._callback

    def counting(caller, ntimestep, nlocal, tag, x, f):
        seen.append(int(nlocal) + int(lmp.extract_setting("nghost")))
        if traffic is None:
            inner(caller, ntimestep, nlocal, tag, x, f)
        else:
            traffic.call(inner, caller, ntimestep, nlocal, tag, x, f)

    lmp.set_fix_external_callback(fix.fix_id, counting)
    fix.run(steps)
    nlocal = lmp.extract_setting("nlocal")
    rows = {k: np.array(lmp.numpy.extract_atom(k))[:nlocal] for k in ("id", "x", "v", "f")}
    rows["pe_atom"] = np.array(lmp.numpy.extract_compute("pa", 1, 1))[:nlocal]
    if _stress_atom(case):
        rows["stress_atom"] = np.array(lmp.numpy.extract_compute("sa", 1, 2))[:nlocal]
    gathered = {k: np.concatenate(comm.allgather(v)) for k, v in rows.items()}
    over = max((h - s for h, s in zip(held.sizes, seen)), default=0)
    over = comm.allreduce(over, op=MPI.MAX)
    rebuilds = fix.potential.stats()["rebuilds"] if fix.manager is not None else 0
    rebuilds = comm.allreduce(rebuilds, op=MPI.MAX)
    origin = np.asarray(lmp.extract_box()[0])
    from xnn.interop.lammps import lammps_cell

    _, cell, pbc = lammps_cell(lmp)
    result = {
        "pe": lmp.get_thermo("pe"), "vol": lmp.get_thermo("vol"),
        "pressure_virial": np.array(lmp.numpy.extract_compute("pv", 0, 1)),
        "nktv2p": lmp.extract_global("nktv2p"), "origin": origin, "cell": cell, "pbc": pbc,
        "held_over_lammps": over, "rebuilds": rebuilds, "evaluations": len(held.sizes),
        "mode": fix.mode, "ghost_cutoff": fix.ghost_cutoff}
    if _stress_atom(case):
        result["stress_atom_sum"] = np.array(lmp.numpy.extract_compute("sr", 0, 1))
    if traffic is not None:  # per rank: [collective, p2p, n_ghost, n_send, lookup] per build
        rows = [[b[k] for k in ("collective", "p2p", "n_ghost", "n_send", "lookup_received")]
                for b in traffic.builds]
        result["traffic"] = np.array(comm.allgather(rows))
        result["call_p2p"] = np.array(comm.allgather(traffic.calls))
        traffic.close()
    lmp.close()
    if comm.Get_rank() == 0:
        order = np.argsort(gathered["id"])
        result.update({k: v[order] for k, v in gathered.items()})
        np.savez(out / f"{case['name']}.npz", **result)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    comm = MPI.COMM_WORLD
    for case in spec["cases"]:
        run_case(case, comm, out)


if __name__ == "__main__":
    main()
