"""What a decomposed run tells its user (gloo, 2 ranks, fp64): safety stops that name the
global atom ids (and their ranks) exactly as one process names them, and the decomposition
line printed with the log rows that follow ghost-plan rebuilds (``output.log_rebuilds``).

One set of ranks is spawned for the module; it runs every case."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
import torch
from dist_helpers import FreshPorts, spawn
from helpers import hot, primitive, rattled_argon

from xnn.dynamics.safety import SimulationError
from xnn.models.classical import LennardJones

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

KICKS = {5: (500.0, 0.0, 0.0), 40: (0.0, -400.0, 0.0)}  # atom id -> added force (eV/Å)
NAN_ID, HOT_ID, CLOSE = 17, 23, (9, 30)


class Kicked(LennardJones):
    """LJ plus a constant force on some atoms (by global id), or a NaN force on one."""

    def __init__(self, kicks=None, nan_id=None):
        super().__init__(sigma=2.3, epsilon=0.4, cutoff=5.0)
        self.kicks, self.nan_id = dict(kicks or {}), nan_id

    def forward(self, graph):
        e = super().forward(graph)
        for aid, force in self.kicks.items():
            rows = torch.nonzero(graph.atom_id == aid).flatten()
            f = torch.tensor(force, dtype=e.dtype, device=e.device)
            e = e.index_add(0, rows, -(graph.positions[rows] @ f))
        if self.nan_id is not None:
            rows = torch.nonzero(graph.atom_id == self.nan_id).flatten()
            e = e.index_add(0, rows, graph.positions[rows].sum(-1) * float("nan"))
        return e


def cases():
    """(name, model, structure) of each safety case: a 64-atom hot triclinic solid."""
    base = hot(primitive((4, 4, 4)), 2000.0)
    pos = base.positions.clone()
    i, j = (int(torch.nonzero(base.atom_id == k)[0]) for k in CLOSE)
    pos[j] = pos[i] + torch.tensor([0.3, 0.0, 0.0], dtype=pos.dtype)
    v = base.velocities.clone()
    v[int(torch.nonzero(base.atom_id == HOT_ID)[0])] *= 40.0
    return [("force", Kicked(KICKS), base), ("nan", Kicked(nan_id=NAN_ID), base),
            ("close", Kicked(), base.replace(positions=pos)),
            ("hot", Kicked(), base.replace(velocities=v))]


def safety_message(name, pot, graph, reduce):
    """The message of the check that case ``name`` trips (or ``None``)."""
    from xnn.dynamics import nve
    from xnn.dynamics.safety import check_distances, check_forces, check_temperature

    state = nve.init(graph, pot, reduce=reduce)
    try:
        if name == "close":
            check_distances(state, pot, 0.5, reduce)
        elif name == "hot":
            check_temperature(state, torch.tensor([5000.0], dtype=torch.float64), reduce)
        else:
            check_forces(state, 100.0, reduce)
    except SimulationError as err:
        return str(err)
    return None


def run_cases(rank, manager):
    from xnn.distributed import parallelize

    out = {}
    for name, model, graph in cases():
        pot = parallelize(model.double(), manager, "halo", skin=0.5)
        owned = pot.scatter(graph if rank == 0 else None)
        out[name] = (safety_message(name, pot, owned, pot.reducer), owned.atom_id.tolist())
    return out


LJ = ["model.device=cpu", "model.name=lj", "model.hyperparameters.sigma=3.405",
      "model.hyperparameters.epsilon=0.0104",
      "model.cutoff=6.5", "model.skin=0.3", "output.progress=false",
      "output.plot=false"]


def md_lines(structure, out_dir, *extra):
    """stdout of a 40-step NVE run hot enough to migrate atoms (log rows every 5 steps)."""
    from xnn.app.md import run_md
    from xnn.config.loader import load_config
    from xnn.config.md import MDConfig

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_md(load_config(MDConfig, None, [
            f"structure={structure}", f"output.dir={out_dir}", "ensemble=nve", *LJ,
            "steps=40", "timestep=4.0", "initial_temperature=150", "output.log_every=5",
            "output.trajectory_every=0", "seed=3", *extra]))
    return buf.getvalue()


def relax_lines(structure, out_dir):
    from xnn.app.relax import run_relax
    from xnn.config.loader import load_config
    from xnn.config.md import RelaxConfig

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_relax(load_config(RelaxConfig, None, [
            f"structure={structure}", f"output.dir={out_dir}", *LJ, "relax_cell=true",
            "fmax=0.005", "max_steps=8", "output.log_every=4"]))
    return buf.getvalue()


def worker(rank, world, tmp):
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    out = run_cases(rank, manager)
    ports = FreshPorts(manager, 3)
    s = f"{tmp}/ar108.xyz"
    ports.next()
    out["md"] = md_lines(s, f"{tmp}/md")
    ports.next()
    out["md_quiet"] = md_lines(s, f"{tmp}/md_quiet", "output.log_rebuilds=false")
    ports.next()
    out["relax"] = relax_lines(s, f"{tmp}/relax")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dd_report")
    rattled_argon(rep=3, amp=0.05).write(tmp / "ar108.xyz")
    return tmp, spawn(worker, 2, args=(str(tmp),), timeout_s=300)


def one_process(name):
    from xnn.dynamics.reduce import LOCAL
    from xnn.models import Potential

    for n, model, graph in cases():
        if n == name:
            return safety_message(n, Potential(model.double(), skin=0.5), graph, LOCAL)
    raise KeyError(name)


@pytest.mark.parametrize("name", ["force", "nan", "close", "hot"])
def test_safety_stops_name_global_ids_and_ranks(runs, name):
    """Every rank raises the message one process raises, naming the ids (and their ranks)
    even when the atom is owned by another rank than the one that prints."""
    _, results = runs
    single = one_process(name)
    (msg0, ids0), (msg1, _) = results[0][name], results[1][name]
    assert single is not None and msg0 == msg1
    expected_ids = {"force": list(KICKS), "nan": [NAN_ID], "close": list(CLOSE),
                    "hot": [HOT_ID]}[name]
    assert f"[{expected_ids[0]}" in single  # the worst atom first, by global id
    if name == "force":
        assert f"{list(KICKS)}" in single  # largest force first
    if name == "close":
        head, where = msg0.rsplit(" (found by rank ", 1)
        assert head == single and where[:-1] in ("0", "1")
        return
    head, ranks = msg0.rsplit(" (owned by rank", 1)
    assert head == single
    named = [int(i) for i in re.findall(r"atom_id\)?:? \[([\d, ]+)\]", single)[0].split(",")]
    owners = [0 if i in ids0 else 1 for i in named]
    assert ranks == (f" {owners[0]})" if len(set(owners)) == 1 else f"s {owners})")


def lines_of(text, command="md"):
    return [ln for ln in text.splitlines() if ln.startswith(f"xnn {command}: step ")]


def test_rebuild_lines_with_the_log_rows(runs):
    tmp, results = runs
    lines = lines_of(results[0]["md"])
    assert not lines_of(results[1]["md"])  # rank 0 prints
    assert not lines_of(results[0]["md_quiet"])  # output.log_rebuilds=false
    steps = [int(re.match(r"xnn md: step (\d+):", ln).group(1)) for ln in lines]
    assert steps[0] == 0 and "at start" in lines[0]
    assert all(s % 5 == 0 for s in steps) and len(steps) <= 9  # rate: one per log row
    assert len(steps) > 2
    summary = json.loads((tmp / "md" / "summary.json").read_text())
    pattern = (r"(\d+) ghost-plan rebuild\(s\), (\d+) with migration, .*2 ranks, grid "
               r"(\S+); atoms per rank: owned (\d+)-(\d+), ghost (\d+)-(\d+); (\d+) migrations "
               r"\((\d+) atoms moved\) and (\d+) rebuilds so far; peak memory (\d+)-(\d+) MiB")
    rows = [re.search(pattern, ln) for ln in lines]
    assert all(rows), lines
    n = [[int(x) if x.isdigit() else x for x in r.groups()] for r in rows]
    assert sum(r[0] for r in n) == n[-1][9]  # rebuilds since the last line add up
    assert sum(r[1] for r in n) == n[-1][7] > 0  # migrations, too, and atoms migrate
    assert n[-1][2] == "x".join(map(str, summary["grid"]))
    assert n[-1][7] <= summary["migrations"] and n[-1][8] > 0
    assert all(r[3] + r[4] <= 108 and r[3] <= r[4] and r[10] > 0 for r in n)
    relax = lines_of(results[0]["relax"], "relax")
    assert relax and relax[0].startswith("xnn relax: step 0:")
