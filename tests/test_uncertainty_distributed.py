"""A committee decomposed over 2 gloo ranks equals one process: ``forces_std`` by atom id,
``energy_std`` (the spread of the members' *total* energies), ``stress_std`` and the means, in
every mode (halo, sync, graph) on a periodic system and a molecule, and so does a ``Sum`` of
a committee and Lennard-Jones (halo: the spread by atom id); ``xnn md`` under torchrun
logs the same uncertainty columns and its guard stops at the same step, the frame written.

One set of ranks is spawned for the module; it runs every case."""

from __future__ import annotations

import ase.io
import numpy as np
import pytest
import torch
from dist_helpers import FreshPorts, spawn
from helpers.uncertainty import committee, committee_files, first_record, md_args

from xnn.app.md import run_md
from xnn.config.loader import load_config
from xnn.config.md import MDConfig
from xnn.data import keys as K
from xnn.dynamics.safety import SimulationError
from xnn.io.thermo import read_log
from xnn.models import Potential, Sum
from xnn.models.committee import Committee
from xnn.testing.decomposition import decomposed, default_decomposition_systems

pytestmark = [pytest.mark.distributed, pytest.mark.usefixtures("one_thread")]

PER_ATOM = (K.FORCES_STD, K.FORCES, K.ENERGIES)
PER_SYSTEM = (K.ENERGY_STD, K.ENERGY, K.ENERGY_MEMBERS)
#: the decompositions of each model ("sync" and "graph" need sync points: a Sum has none)
MODES = {"schnet": ("halo", "sync", "graph"), "equivariant": ("halo", "sync", "graph"),
         "sum": ("halo",)}


def models() -> dict[str, torch.nn.Module]:
    """SchNet (halo, sync, graph), the equivariant model (its sync points per member) and a
    ``Sum`` of the SchNet committee and Lennard-Jones (a wider cutoff, no spread of its own)."""
    from helpers.models import SMALL, lj

    eq = Committee({"name": "equivariant", "species": [29], "cutoff": 3.0,
                    "num_interactions": 2, **SMALL["equivariant"]}, size=2,
                   seeds=[4, 9]).double()
    return {"schnet": committee(), "equivariant": eq,
            "sum": Sum([committee(), lj(4.0, torch.float64)])}


def spread_sums(graph, step):
    """A ``global`` hook: partial sums of the owned atoms' force spread (summed over ranks)."""
    std = graph[K.FORCES_STD]
    return {"sum": std.sum(), "sum_sq": (std * std).sum(), "atoms": torch.tensor(std.numel())}


def frame_spread(graph, step):
    """A ``rank0`` hook on the gathered frame: its largest spread, the atom that has it."""
    std = graph[K.FORCES_STD]
    return {"max": std.max(), "atom_id": graph.atom_id[int(torch.argmax(std))].double(),
            "energy_std": graph[K.ENERGY_STD][0]}


def hooks():
    from xnn.dynamics.callable_hooks import FrameCallable, GlobalCallable

    return [GlobalCallable(spread_sums, every=2, name="spread_sums"),
            FrameCallable(frame_spread, every=4, name="frame_spread", frame_format="graph")]


def _single_points(rank, manager, cases) -> dict:
    from xnn.data.graph import AtomicGraph

    out = {}
    for mname, model in cases["models"].items():
        for sname, fields in cases["systems"].items():
            g = AtomicGraph(fields) if rank == 0 else None
            for mode in MODES[mname]:
                pot = decomposed(model, manager, mode, g)
                res = pot.single_point(g)
                out[f"{mname}-{sname}-{mode}"] = {k: v.clone() for k, v in res.items()}
    return out


def worker(rank, world, tmp, threshold, cases):
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    points = _single_points(rank, manager, cases)
    from xnn.distributed.calculator import DistributedCalculator

    atoms = ase.io.read(f"{tmp}/cu.xyz")
    atoms.calc = DistributedCalculator(cases["models"]["schnet"], manager, mode="halo")
    atoms.get_potential_energy()
    ase_results = dict(atoms.calc.results)
    ports = FreshPorts(manager, 2)
    ports.next()
    run_md(load_config(MDConfig, None, md_args(f"{tmp}/cu.xyz", f"{tmp}/committee.pt",
                                               f"{tmp}/dd_free")), hooks=hooks())
    ports.next()
    try:
        run_md(load_config(MDConfig, None, md_args(
            f"{tmp}/cu.xyz", f"{tmp}/committee.pt", f"{tmp}/dd_stop",
            f"safety.max_force_uncertainty={threshold!r}")))
        stop = None
    except SimulationError as err:
        stop = (err.step, str(err))
    return {"points": points if rank == 0 else None, "stop": stop, "ase": ase_results}


def test_committee_decomposed_equals_one_process(tmp_path):
    committee_files(tmp_path)
    free = run_md(load_config(MDConfig, None, md_args(tmp_path / "cu.xyz",
                                                      tmp_path / "committee.pt",
                                                      tmp_path / "free")), hooks=hooks())
    log = read_log(free / "thermo.csv")
    k, threshold = first_record(log["max_force_std_eV_A"])
    systems, committees = default_decomposition_systems([29]), models()
    cases = {"models": committees,  # graphs travel as their fields
             "systems": {n: g.without_edges().fields for n, g in systems.items()}}
    results = spawn(worker, 2, (str(tmp_path), threshold, cases), timeout_s=900)

    # single points: every mode, by atom id, to 1e-10
    failures = []
    for mname, model in committees.items():
        for sname, g in systems.items():
            ref = Potential(model)(g)
            order = torch.argsort(g.atom_id)
            assert ref[K.FORCES_STD].max() > 0 and ref[K.ENERGY_STD][0] > 0
            for mode in MODES[mname]:
                out = results[0]["points"][f"{mname}-{sname}-{mode}"]
                assert torch.equal(out[K.ATOM_ID], g.atom_id[order])
                keys = [*((q, ref[q][order]) for q in PER_ATOM),
                        *((q, ref[q]) for q in PER_SYSTEM)]
                if bool(g.pbc.all()):
                    keys.append((K.STRESS_STD, ref[K.STRESS_STD]))
                for q, want in keys:
                    err = float((out[q] - want).abs().max() / want.abs().max())
                    if not err <= 1e-10:
                        failures.append(f"{mname}-{sname}-{mode} {q}: {err:.2e}")
    assert not failures, failures

    # the decomposed ASE calculator: xnn.Calculator's committee results, in the Atoms' order
    import xnn

    atoms = ase.io.read(tmp_path / "cu.xyz")
    atoms.calc = xnn.Calculator(committees["schnet"], device="cpu")
    atoms.get_potential_energy()
    ref = atoms.calc.results
    for r in results:
        got = r["ase"]
        assert set(xnn.Calculator.committee_properties) <= set(got)
        for key in xnn.Calculator.committee_properties:
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-10,
                                       atol=1e-10 * np.abs(ref[key]).max(), err_msg=key)

    # xnn md on 2 ranks: the same uncertainty columns, the same stop and frame
    dd = read_log(tmp_path / "dd_free" / "thermo.csv")
    for col in ("max_force_std_eV_A", "mean_force_std_eV_A", "energy_std_eV"):
        np.testing.assert_allclose(dd[col], log[col], rtol=1e-9, atol=0, err_msg=col)
    for name in ("spread_sums", "frame_spread"):  # the hooks see the spread: global, rank0
        a, b = (read_log(tmp_path / run / "hooks" / f"{name}.csv") for run in ("free", "dd_free"))
        assert list(a) == list(b) and len(a["step"]) >= 3, name
        for col in a:
            np.testing.assert_allclose(b[col], a[col], rtol=1e-9, atol=0, err_msg=col)
    sums = read_log(tmp_path / "free" / "hooks" / "spread_sums.csv")
    assert sums["atoms"] == [16.0] * len(sums["step"])
    np.testing.assert_allclose(np.array(sums["sum"]) / 16,
                               log["mean_force_std_eV_A"][::2], rtol=1e-12)
    stops = [r["stop"] for r in results]
    assert stops[0] is not None and stops[0][0] == k and stops[1][0] == k  # every rank
    assert stops[0][1].startswith(f"step {k}: force uncertainty") and "owned by rank" in \
        stops[0][1]
    frames = ase.io.read(tmp_path / "dd_stop" / "trajectory.xyz", ":")
    assert frames[-1].info["step"] == k
    assert ase.io.read(tmp_path / "dd_stop" / "uncertain.xyz").info["step"] == k
    assert read_log(tmp_path / "dd_stop" / "thermo.csv")["step"][-1] == k


def points_worker(rank, world, cases):
    from xnn.distributed import DistributedManager

    torch.set_default_dtype(torch.float64)
    manager = DistributedManager.initialize(backend="gloo", timeout_s=120)
    return _single_points(rank, manager, cases)


@pytest.mark.slow
def test_committee_on_three_ranks_equals_one_process():
    """The same single points on 3 ranks (a split in two directions, ghost shells wider than
    a box), every mode."""
    systems, committees = default_decomposition_systems([29], seed=5), models()
    cases = {"models": committees,
             "systems": {n: g.without_edges().fields for n, g in systems.items()}}
    points = spawn(points_worker, 3, (cases,), timeout_s=900)[0]
    failures = []
    for mname, model in committees.items():
        for sname, g in systems.items():
            ref, order = Potential(model)(g), torch.argsort(g.atom_id)
            for mode in MODES[mname]:
                out = points[f"{mname}-{sname}-{mode}"]
                for q, want in [*((q, ref[q][order]) for q in PER_ATOM),
                                *((q, ref[q]) for q in PER_SYSTEM)]:
                    err = float((out[q] - want).abs().max() / want.abs().max())
                    if not err <= 1e-10:
                        failures.append(f"{mname}-{sname}-{mode} {q}: {err:.2e}")
    assert not failures, failures
