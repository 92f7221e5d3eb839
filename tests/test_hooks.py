"""Hooks (``xnn.dynamics.hooks`` / ``observers``): RDF against ASE and a brute-force sum
over images, MSD and per-species temperature against direct computations, user callables
in every scope, ``hooks:`` in ``xnn md`` / ``xnn relax`` (files, resume), labels and RDF
sizes refused up front, a failing hook's checkpoint and exact resume, and every scope under
2 gloo ranks (4 under ``-m slow``) equal to one process, with the MSD reference held per
owned atom and a hook failing on one rank (one set of ranks per world size)."""

from __future__ import annotations

import csv
import itertools
import shutil

import ase.io
import numpy as np
import pytest
import torch
from ase.geometry.rdf import get_rdf
from dist_helpers import spawn
from error_helpers import raises_one_line
from helpers import rattled_argon

from xnn.app.md import run_md
from xnn.app.md_setup import load_potential
from xnn.app.relax import run_relax
from xnn.cli.main import main
from xnn.config.loader import ConfigError, load_config
from xnn.config.md import MDConfig, RelaxConfig
from xnn.config.model import ModelConfig
from xnn.data import keys as K
from xnn.data.ase_io import from_ase, to_ase
from xnn.dynamics import nve
from xnn.dynamics.hooks import GlobalHook, HookError, HookRunner
from xnn.dynamics.observers import (
    MSD,
    RDF,
    FrameCallable,
    GlobalCallable,
    OwnedCallable,
    SpeciesTemperature,
    build_hook,
)
from xnn.dynamics.parallel import SerialRun
from xnn.dynamics.state import degrees_of_freedom, maxwell_boltzmann
from xnn.errors import InputError
from xnn.units import KB, MVV2E

pytestmark = pytest.mark.usefixtures("one_thread")

LJ = ["model.device=cpu", "model.name=lj", "model.hyperparameters.sigma=3.405",
      "model.hyperparameters.epsilon=0.0104", "model.cutoff=6.5", "model.skin=0.3",
      "output.progress=false", "output.plot=false"]


def argon_krypton(rep=3, amp=0.05, seed=0, a=5.3):
    """Rattled FCC argon with every third atom krypton (two species, two masses)."""
    atoms = rattled_argon(a=a, rep=rep, amp=amp, seed=seed)
    atoms.numbers[::3] = 36
    atoms.set_masses(None)
    return atoms


def potential():
    cfg = ModelConfig(name="lj", hyperparameters={"sigma": 3.405, "epsilon": 0.0104},
                      cutoff=6.5, skin=0.3, device="cpu")
    return load_potential(cfg, torch.device("cpu"), torch.float64)


def trajectory(atoms, steps, dt=5.0, temperature=300.0, runner=None):
    """NVE states of ``atoms`` (LJ) after each of ``steps`` steps, step 0 included; with a
    ``runner`` (a HookRunner factory of the potential), its hooks observe every state."""
    pot = potential()
    g = maxwell_boltzmann(from_ase([atoms], dtype=torch.float64), temperature, seed=1)
    states = [nve.init(g, pot)]
    hooks = None if runner is None else runner(pot)
    if hooks is not None:
        states[0] = hooks.prepare(states[0])
        hooks(states[0])
    for _ in range(steps):
        states.append(nve.step(states[-1], pot, dt))
        if hooks is not None:
            hooks(states[-1])
    return states, pot


# ----------------------------------------------------------------------------- RDF
@pytest.mark.parametrize("partials", [False, True])
def test_rdf_matches_ase_over_frames(partials):
    """Solid (rattled FCC, argon + krypton) frames of an MD run: g(r) and every partial
    g_ab averaged over the frames equal ASE's get_rdf of the same frames."""
    states, pot = trajectory(argon_krypton(), 6)
    rdf = RDF(every=2, r_max=7.5, bins=60, partials=partials)
    runner = HookRunner([rdf], SerialRun(pot), timestep=5.0)
    for s in states:
        runner(s)
    frames = [to_ase(s.graph)[0] for s in states[::2]]
    res = rdf.result()
    assert res["frames"] == 4
    ref, rr = get_rdf(frames, 7.5, 60)
    np.testing.assert_allclose(res["r"], rr, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res["g"][0], ref, rtol=1e-12, atol=1e-12)
    assert ref.max() > 2  # a solid: sharp shells
    if partials:
        assert sorted(res["partials"]) == ["Ar-Ar", "Ar-Kr", "Kr-Kr"]
        for key, g in res["partials"].items():
            a, b = key.split("-")
            want = get_rdf(frames, 7.5, 60, elements=[a, b], no_dists=True)
            np.testing.assert_allclose(g[0], want, rtol=1e-12, atol=1e-12, err_msg=key)
        # g = sum_ab c_a c_b g_ab over ordered pairs
        c = {"Ar": 72 / 108, "Kr": 36 / 108}
        total = sum(c[a] * c[b] * res["partials"]["-".join(sorted((a, b)))][0]
                    for a, b in itertools.product(c, c))
        np.testing.assert_allclose(total, res["g"][0], rtol=1e-12, atol=1e-12)
    else:
        assert rdf.columns == ("system", "r_A", "g")


def test_rdf_beyond_half_the_cell_counts_images():
    """A liquid-like (strongly rattled) 32-atom cell with r_max above half the cell: g(r)
    equals a numpy sum over explicit periodic images (ASE's mic refuses this r_max)."""
    atoms = rattled_argon(rep=2, amp=0.6, seed=4)
    r_max, bins = 9.0, 45
    rdf = RDF(every=1, r_max=r_max, bins=bins)
    g = from_ase([atoms], dtype=torch.float64)
    rdf.observe(nve.init(maxwell_boltzmann(g, 10.0), potential()), 0.0)
    pos, cell = atoms.positions, atoms.cell.array
    shifts = np.array(list(itertools.product(range(-2, 3), repeat=3))) @ cell
    d = np.linalg.norm(pos[None, :, None] + shifts[None, None] - pos[:, None, None], axis=-1)
    d = d[(d > 0) & (d < r_max)]
    hist = np.histogram(d, bins=bins, range=(0, r_max))[0]
    edges = np.linspace(0, r_max, bins + 1)
    shell = 4 / 3 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)
    want = hist * atoms.get_volume() / (len(atoms) ** 2 * shell)
    np.testing.assert_allclose(rdf.result()["g"][0], want, rtol=1e-12, atol=1e-12)
    assert 9.0 > atoms.cell.lengths().min() / 2


def test_rdf_refuses_a_cluster():
    atoms = rattled_argon(rep=2)
    atoms.pbc = False
    g = from_ase([atoms], dtype=torch.float64)
    with pytest.raises(InputError, match="periodic cell"):
        RDF(r_max=5.0).frame(g)


# ----------------------------------------------------------------------------- MSD, T
def test_msd_and_species_temperature_against_direct_computation():
    """A hot run: MSD from the first frame by atom id, and the kinetic temperature per
    species with the degrees of freedom shared by free atoms, computed directly."""
    msd, temp = MSD(every=2), SpeciesTemperature(every=4)
    states, pot = trajectory(argon_krypton(), 8, temperature=900.0,
                             runner=lambda p: HookRunner([msd, temp], SerialRun(p), 5.0))
    z = states[0].graph.numbers.numpy()
    x0 = states[0].positions.numpy()
    rows = msd.result()
    got = {(st, sp): v for st, sp, v in zip(rows["step"], rows["species"], rows["msd_A2"])}
    assert len(got) == 5 * 3
    for s in states[::2]:
        sq = ((s.positions.numpy() - x0) ** 2).sum(-1)
        assert got[(s.step, "all")] == pytest.approx(sq.mean(), rel=1e-12, abs=1e-14)
        assert got[(s.step, "Ar")] == pytest.approx(sq[z == 18].mean(), rel=1e-12, abs=1e-14)
        assert got[(s.step, "Kr")] == pytest.approx(sq[z == 36].mean(), rel=1e-12, abs=1e-14)
    assert got[(8, "all")] > 0.01
    rows = temp.result()
    got = {(st, sp): v for st, sp, v in zip(rows["step"], rows["species"],
                                            rows["temperature_K"])}
    for s in states[::4]:
        v, m = s.graph.velocities.numpy(), s.graph.masses.numpy()
        ke = 0.5 * MVV2E * m * (v * v).sum(-1)
        dof = 3 * len(m) - 3
        for sp, mask in (("all", z > 0), ("Ar", z == 18), ("Kr", z == 36)):
            want = 2 * ke[mask].sum() / (dof * mask.mean() * KB)
            assert got[(s.step, sp)] == pytest.approx(want, rel=1e-12)
        t_all = float(2 * ke.sum() / (float(degrees_of_freedom(s.graph)[0]) * KB))
        assert got[(s.step, "all")] == pytest.approx(t_all, rel=1e-12)
    assert got[(8, "Kr")] != pytest.approx(got[(8, "Ar")], rel=1e-3)


def test_msd_resumes_a_checkpoint_with_the_reference_in_its_meta():
    """Checkpoints of earlier xnn kept the MSD reference in the hook's meta, by atom id
    ([n_ids, 3]); resumed, each atom's row becomes its state field (by id, not by order)."""
    states, pot = trajectory(argon_krypton(rep=2), 2)
    by_id = torch.randn(32, 3, dtype=torch.float64)
    later = states[2]
    ids = torch.arange(32).flip(0)  # atoms held in another order than their ids
    later = later.replace(graph=later.graph.replace(atom_id=ids))
    msd = MSD(every=1)
    msd.load_state_dict({"reference": by_id})
    runner = HookRunner([msd], SerialRun(pot))
    prepared = runner.prepare(later)
    torch.testing.assert_close(prepared.graph[K.MSD_REFERENCE], by_id[ids], rtol=0, atol=0)
    runner(prepared)
    want = ((later.positions - by_id[ids]) ** 2).sum(-1).mean()
    assert msd.result()["msd_A2"][0] == pytest.approx(float(want), rel=1e-12)


def test_species_temperature_with_fixed_atoms():
    """Fixed atoms have no kinetic degrees of freedom: a system's 3 N_free are shared by
    the species' free atoms, and the fixed atoms are counted in n_atoms only."""
    g = from_ase([argon_krypton(rep=2)], dtype=torch.float64)
    fixed = torch.zeros(g.n_atoms, dtype=torch.bool)
    fixed[:5] = True
    g = maxwell_boltzmann(g.replace(fixed=fixed), 500.0, seed=2)
    state = nve.init(g, potential())
    hook = SpeciesTemperature(every=1)
    HookRunner([hook], SerialRun(potential()))(state)
    rows = hook.result()
    z, v, m = g.numbers.numpy(), g.velocities.numpy(), g.masses.numpy()
    free = ~fixed.numpy()
    ke = 0.5 * MVV2E * m * (v * v).sum(-1)
    for sp, mask in (("all", z > 0), ("Ar", z == 18), ("Kr", z == 36)):
        want = 2 * ke[mask].sum() / (3 * (free & mask).sum() * KB)
        i = rows["species"].index(sp)
        assert rows["temperature_K"][i] == pytest.approx(want, rel=1e-12)
        assert rows["n_atoms"][i] == mask.sum()


# ----------------------------------------------------------------------------- callables
def virial_sum(graph, step):
    """A global callable: partial sums of r·F and of the atom count over owned atoms."""
    return {"r_dot_f": (graph.positions * graph.forces).sum(), "count": graph.n_atoms * 1.0,
            "force_sum": graph.forces.sum(0)}


def kinetic_per_atom(graph, step):
    """An owned callable: each atom's kinetic energy (eV) and its x position."""
    ke = 0.5 * MVV2E * graph.masses * (graph.velocities ** 2).sum(-1)
    return torch.stack([ke, graph.positions[:, 0]], dim=1)


def frame_energy(atoms, step):
    """A rank0 callable on an ase.Atoms frame."""
    return {"energy": atoms.get_potential_energy(), "n": len(atoms),
            "max_id": int(atoms.arrays["atom_id"].max())}


def graph_energy(graph, step):
    return {"energy": graph.energy, "step_again": step}


def test_callables_in_every_scope():
    states, pot = trajectory(argon_krypton(rep=2), 4)
    hooks = [FrameCallable(frame_energy, every=2, name="frame"),
             FrameCallable(graph_energy, every=2, name="graph", frame_format="graph"),
             OwnedCallable(kinetic_per_atom, every=4, name="ke"),
             GlobalCallable(virial_sum, every=1, name="virial")]
    runner = HookRunner(hooks, SerialRun(pot), timestep=2.0)
    for s in states:
        runner(s)
    res = runner.results()
    assert res["frame"]["step"] == [0, 2, 4] and res["frame"]["time_fs"] == [0.0, 4.0, 8.0]
    want = [float(s.energy[0]) for s in states[::2]]
    assert res["frame"]["energy"] == pytest.approx(want, rel=1e-14)
    assert res["graph"]["energy"] == pytest.approx(want, rel=1e-14)
    assert res["graph"]["step_again"] == [0, 2, 4] and res["frame"]["max_id"] == [31] * 3
    last = states[4]
    ke = kinetic_per_atom(last.graph, 4)
    assert res["ke"]["atom_id"][-32:] == list(range(32))
    np.testing.assert_allclose(res["ke"]["value_0"][-32:], ke[:, 0].numpy(), rtol=1e-14)
    np.testing.assert_allclose(res["ke"]["value_1"][-32:], ke[:, 1].numpy(), rtol=1e-14)
    rdf = float((last.positions * last.forces).sum())
    assert res["virial"]["r_dot_f"][-1] == pytest.approx(rdf, rel=1e-13)
    assert res["virial"]["count"] == [32.0] * 5
    assert hooks[3].columns == ("step", "time_fs", "count", "force_sum_0", "force_sum_1",
                                "force_sum_2", "r_dot_f")


def test_hooks_are_library_code():
    """xnn.dynamics.hooks/observers import no config, io or distributed module."""
    import subprocess
    import sys

    code = ("import sys, xnn.dynamics.observers, xnn.dynamics.hooks; print([m for m in "
            "sys.modules if m.startswith(('xnn.config', 'xnn.io', 'xnn.distributed', "
            "'xnn.app'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.stdout.strip() == "[]"


def test_rdf_resumed_with_other_settings_is_refused():
    states, pot = trajectory(argon_krypton(rep=2), 0)
    rdf = RDF(every=1, r_max=4.0, bins=10)
    rdf.observe(states[0], 0.0)
    with pytest.raises(InputError, match="same settings"):
        RDF(every=1, r_max=4.0, bins=20).load_state_dict(rdf.state_dict())
    again = RDF(every=1, r_max=4.0, bins=10)
    again.load_state_dict(rdf.state_dict())
    np.testing.assert_array_equal(again.result()["g"], rdf.result()["g"])


def test_bad_hooks_are_refused_clearly():
    with pytest.raises(InputError, match="package.module:function"):
        build_hook("callable", 5, target="no_colon")
    with pytest.raises(InputError, match="cannot import"):
        build_hook("callable", 5, target="no_such_module_xyz:fn")
    with pytest.raises(InputError, match="scope"):
        build_hook("msd", 5, scope="rank0")
    with pytest.raises(InputError, match="unknown hook"):
        build_hook("vacf", 5)
    with pytest.raises(InputError, match="every"):
        MSD(every=0)
    with pytest.raises(InputError, match="unique"):
        HookRunner([MSD(), MSD()], SerialRun(None))
    owned = OwnedCallable(lambda g, s: torch.zeros(3), every=1, name="bad")
    states, pot = trajectory(argon_krypton(rep=2), 0)
    with pytest.raises(HookError, match=r"hook 'bad' failed at step 0: .*\(3,\) values for 32 "
                                        "owned atoms"):
        HookRunner([owned], SerialRun(pot))(states[0])
    for over, match in ((["hooks.0.name=callable"], "needs target"),
                        (["hooks.0.name=rdf", "hooks.0.target=a:b"], "only for name"),
                        (["hooks.0.name=rdf", "hooks.0.scope=global"], "scope"),
                        (["hooks.0.name=msd", "hooks.1.name=msd"], "give each a label"),
                        (["hooks.0.name=rdf", "hooks.0.bins=0"], "bins"),
                        (["hooks.0.name=nope"], "valid choice")):
        with pytest.raises(ConfigError, match=match):
            load_config(MDConfig, None, over)


@pytest.mark.parametrize("label", ["../../escape", "/tmp/escape", "sub/x", "..", ".hidden",
                                   "", "  ", "a\\b", "C:x", "x" * 201])
def test_hook_labels_are_plain_file_names(label):
    """A label names hooks/LABEL.csv inside output.dir: separators, '..', absolute paths,
    hidden and empty names are refused with one line, from Python and from the config."""
    msg = raises_one_line(InputError, build_hook, "msd", 5, label=label, match="label")
    assert "plain file name" in msg
    raises_one_line(InputError, MSD, every=5, name=label, match="plain file name")
    raises_one_line(InputError, build_hook, "callable", 5, target=frame_energy, label=label,
                    match="plain file name")


def test_cli_refuses_a_label_outside_output_dir(tmp_path, capsys):
    """``hooks.0.label=../../escape``: one line, exit 2, nothing written (today the CSV
    went two folders above output.dir)."""
    argon_krypton(rep=2).write(tmp_path / "s.xyz")
    out = tmp_path / "a" / "b" / "run"
    args = ["md", f"structure={tmp_path / 's.xyz'}", f"output.dir={out}", *LJ, "steps=2",
            "hooks.0.name=msd", "hooks.0.every=1", "hooks.0.label=../../escape"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("xnn md: error: hook label '../../escape'") and "\n" not in err
    assert not (tmp_path / "a").exists()


def test_rdf_refuses_an_r_max_beyond_its_pair_budget(tmp_path, capsys):
    """r_max=400 Å on a 32-atom cell would hold ~2e8 pairs per frame (tens of GB): refused
    before the run with one line giving the largest r_max that fits; at that r_max the
    frame holds at most about max_pairs pairs."""
    atoms = argon_krypton(rep=2)
    g = from_ase([atoms], dtype=torch.float64)
    msg = raises_one_line(InputError, RDF(r_max=20.0, max_pairs=20_000).frame, g,
                          match="max_pairs=2e[+]04")
    fit = float(msg.split("use r_max <= ")[1].split()[0])
    n, vol = len(atoms), atoms.get_volume()
    assert n * n * 4 / 3 * np.pi * fit ** 3 / vol == pytest.approx(20_000, rel=0.01)
    from xnn.neighbors import neighbor_list

    pairs = neighbor_list(g.positions, g.cell, g.pbc, fit, g.batch)[0].shape[1]
    assert pairs == pytest.approx(20_000, rel=0.05)
    rdf = RDF(r_max=fit, bins=20, max_pairs=20_000)
    rdf.observe(nve.init(g, potential()), 0.0)
    assert rdf.result()["g"][0, -5:].mean() == pytest.approx(1.0, abs=0.1)  # g -> 1
    atoms.write(tmp_path / "s.xyz")
    args = ["md", f"structure={tmp_path / 's.xyz'}", f"output.dir={tmp_path / 'o'}", *LJ,
            "model.cutoff=5.0", "steps=2", "hooks.0.name=rdf", "hooks.0.r_max=400"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "r_max=400 Å needs about 2.3e+08 atom pairs" in err
    fit = (5e7 * vol / (n * n * 4 / 3 * np.pi)) ** (1 / 3)  # the default max_pairs
    assert f"use r_max <= {np.floor(fit * 10) / 10:g} Å" in err
    assert not (tmp_path / "o").exists()


def boom_at_6(atoms, step):
    """A rank0 callable with a bug that shows at step 6 (fixed: :func:`boom_fixed`)."""
    if step == 6:
        raise KeyError("charges")
    return {"n": len(atoms), "e": atoms.get_potential_energy()}


def boom_fixed(atoms, step):
    return {"n": len(atoms), "e": atoms.get_potential_energy()}


def test_failing_hook_stops_after_a_checkpoint_and_resumes_exactly(tmp_path, capsys):
    """A hook raising at step 6 ends ``xnn md`` with one line naming it and the step, after
    writing checkpoint.pt at step 6; resumed with the hook fixed, every file (thermo, the
    hooks of step 6 and after) equals an uninterrupted run's."""
    argon_krypton(rep=2, amp=0.1).write(tmp_path / "s.xyz")
    base = ["md", f"structure={tmp_path / 's.xyz'}", *LJ, "model.cutoff=5.0",
            "ensemble=langevin", "temperature=300", "steps=12", "timestep=4.0",
            "output.trajectory_every=0", "output.checkpoint_every=0",
            "hooks.0.name=msd", "hooks.0.every=3", "hooks.1.name=rdf", "hooks.1.every=3",
            "hooks.1.r_max=5.0", "hooks.1.bins=10", "hooks.2.name=callable",
            "hooks.2.every=3", "hooks.2.label=frames"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*base, f"output.dir={full}", "hooks.2.target=test_hooks:boom_fixed"]) == 0
    capsys.readouterr()
    assert main([*base, f"output.dir={part}", "hooks.2.target=test_hooks:boom_at_6"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("xnn md: error: hook 'frames' failed at step 6: KeyError: 'charges'")
    assert f"resume={part / 'checkpoint.pt'}" in err
    from xnn.io.md_checkpoint import load_checkpoint

    state, meta = load_checkpoint(part / "checkpoint.pt", torch.device("cpu"))
    assert state.step == 6 and meta["hooks_rerun"] == 6
    assert [r[0] for r in read_csv(part / "hooks" / "msd.csv")[1::3]] == ["0", "3"]
    assert main([*base, f"output.dir={part}", "hooks.2.target=test_hooks:boom_fixed",
                 f"resume={part / 'checkpoint.pt'}"]) == 0
    for name in ("thermo.csv", "hooks/msd.csv", "hooks/rdf.csv", "hooks/frames.csv"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


def test_failing_hook_in_relax_checkpoints_and_resumes(tmp_path, capsys):
    """In relax, a failing hook ends the run with one line and a checkpoint at that step;
    resumed with the hook fixed, relax.csv and the hook files equal an uninterrupted run's."""
    argon_krypton(rep=2, amp=0.15).write(tmp_path / "s.xyz")
    base = ["relax", f"structure={tmp_path / 's.xyz'}", *LJ, "model.cutoff=5.0",
            "fmax=0.001", "max_steps=12", "output.trajectory_every=0",
            "hooks.0.name=msd", "hooks.0.every=2", "hooks.1.name=callable",
            "hooks.1.every=2", "hooks.1.label=frames"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main([*base, f"output.dir={full}", "hooks.1.target=test_hooks:boom_fixed"]) == 0
    assert main([*base, f"output.dir={part}", "hooks.1.target=test_hooks:boom_at_6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("xnn relax: error: hook 'frames' failed at step 6: KeyError")
    assert main([*base, f"output.dir={part}", "hooks.1.target=test_hooks:boom_fixed",
                 f"resume={part / 'checkpoint.pt'}"]) == 0
    for name in ("relax.csv", "hooks/msd.csv", "hooks/frames.csv"):
        assert (part / name).read_bytes() == (full / name).read_bytes(), name


# ----------------------------------------------------------------------------- runs
HOOKS = ["hooks.0.name=rdf", "hooks.0.every=5", "hooks.0.r_max=7.0", "hooks.0.bins=35",
         "hooks.0.partials=true", "hooks.1.name=msd", "hooks.1.every=5",
         "hooks.2.name=species_temperature", "hooks.2.every=10",
         "hooks.3.name=callable", "hooks.3.target=test_hooks:frame_energy",
         "hooks.3.every=10",
         "hooks.4.name=callable", "hooks.4.target=test_hooks:kinetic_per_atom",
         "hooks.4.scope=owned", "hooks.4.every=20",
         "hooks.5.name=callable", "hooks.5.target=test_hooks:virial_sum",
         "hooks.5.scope=global", "hooks.5.every=5"]
FILES = ("rdf", "msd", "species_temperature", "frame_energy", "kinetic_per_atom",
         "virial_sum")


def md_overrides(structure, out, *extra):
    """A hot Langevin run (1500 K start): atoms cross the boxes of the ranks."""
    return [f"structure={structure}", f"output.dir={out}", *LJ, "ensemble=langevin",
            "temperature=900", "initial_temperature=1500", "thermostat.friction=0.02",
            "steps=40", "timestep=5.0", "output.log_every=10", "output.trajectory_every=0",
            "output.checkpoint_every=20", "seed=5", *HOOKS, *extra]


def relax_overrides(structure, out):
    return [f"structure={structure}", f"output.dir={out}", *LJ, "fmax=0.01", "max_steps=30",
            "output.trajectory_every=0", "hooks.0.name=msd", "hooks.0.every=3"]


def flaky_on_atom_0(graph, step):
    """A global callable that fails at step 4 on the rank owning atom 0 only."""
    if step == 4 and bool((graph.atom_id == 0).any()):
        raise RuntimeError("atom 0 is here")
    return {"n": torch.tensor(float(graph.n_atoms))}


def flaky_fixed(graph, step):
    return {"n": torch.tensor(float(graph.n_atoms))}


def flaky_overrides(structure, out, target, *extra):
    return md_overrides(structure, out, "steps=8", "hooks.6.name=callable",
                        f"hooks.6.target=test_hooks:{target}", "hooks.6.scope=global",
                        "hooks.6.every=2", "hooks.6.label=flaky", *extra)


class ReferenceRows(GlobalHook):
    """Records, per call, this rank's owned atoms and its rows of the MSD reference, and
    how far the rows are from the atoms' start positions ``x0 [n, 3]`` (by id)."""

    def __init__(self, x0, every=5):
        super().__init__(every, "reference_rows")
        self.x0, self.seen = x0, []

    def partial(self, state):
        g = state.graph
        ref = g[K.MSD_REFERENCE]
        err = float((ref - self.x0[g.atom_id]).abs().max()) if g.n_atoms else 0.0
        self.seen.append((state.step, g.n_atoms, ref.shape[0], err))
        return {}

    def update(self, step, time_fs, sums):
        return None


def worker(rank, world, tmp):
    s = f"{tmp}/arkr.xyz"
    x0 = from_ase([ase.io.read(s)], dtype=torch.float64).positions
    msd, rows = MSD(every=5, name="msd_by_id"), ReferenceRows(x0)
    run_md(load_config(MDConfig, None, md_overrides(s, f"{tmp}/dd")), hooks=[msd, rows])
    run_md(load_config(MDConfig, None, md_overrides(s, f"{tmp}/dd_resumed", "steps=40",
                                                    f"resume={tmp}/dd_resumed/checkpoint.pt")))
    run_relax(load_config(RelaxConfig, None, relax_overrides(s, f"{tmp}/dd_relax")))
    failed = None
    try:  # the rank that owns atom 0 fails; every rank must stop (no hang), then resume
        run_md(load_config(MDConfig, None, flaky_overrides(s, f"{tmp}/dd_flaky",
                                                           "flaky_on_atom_0")))
    except HookError as err:
        failed = (err.hook, err.step, str(err))
    run_md(load_config(MDConfig, None, flaky_overrides(
        s, f"{tmp}/dd_flaky", "flaky_fixed", f"resume={tmp}/dd_flaky/checkpoint.pt")))
    held = [tuple(v.shape) for v in vars(msd).values() if isinstance(v, torch.Tensor)]
    return {"rank": rank, "held": held, "rows": rows.seen, "failed": failed}


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def assert_same_csv(a, b, tol):
    ra, rb = read_csv(a), read_csv(b)
    assert ra[0] == rb[0] and len(ra) == len(rb), a
    for x, y in zip(ra[1:], rb[1:]):
        for u, v in zip(x, y):
            try:
                assert float(u) == pytest.approx(float(v), rel=tol, abs=tol, nan_ok=True), (a, x, y)
            except ValueError:
                assert u == v


#: world sizes of the decomposed runs: 2 ranks in the fast set, the same checks on 4 slow
WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w}ranks")
def runs(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"hooks{world}")
    argon_krypton(rep=3, amp=0.1).write(tmp / "arkr.xyz")
    s = tmp / "arkr.xyz"
    frames = []  # the frames the RDF sees, kept exactly (a Python hook of the same run)
    keep = FrameCallable(lambda atoms, step: frames.append(atoms.copy()), every=5,
                         name="keep")
    run_md(load_config(MDConfig, None, md_overrides(s, tmp / "single")), hooks=[keep])
    ase.io.write(tmp / "rdf_frames.traj", frames)
    run_md(load_config(MDConfig, None, md_overrides(s, tmp / "single_20", "steps=20")))
    shutil.copytree(tmp / "single_20", tmp / "dd_resumed")  # 1 process -> the ranks
    run_relax(load_config(RelaxConfig, None, relax_overrides(s, tmp / "single_relax")))
    run_md(load_config(MDConfig, None, flaky_overrides(s, tmp / "single_flaky", "flaky_fixed")))
    ranks = spawn(worker, world, args=(str(tmp),), timeout_s=400)
    assert [r["rank"] for r in ranks] == list(range(world))
    torch.save(ranks, tmp / "ranks.pt")
    return tmp


def world_of(runs) -> int:
    return len(torch.load(runs / "ranks.pt", weights_only=False))


@pytest.mark.distributed
@pytest.mark.parametrize("name", FILES)
def test_every_scope_under_ranks_equals_one_process(runs, name):
    """Each hook's file of a decomposed run (2 or 4 gloo ranks, atoms migrating) equals the
    single-process run's, and so does a run resumed on the ranks from a 1-process
    checkpoint."""
    a, b = runs / "dd" / "hooks" / f"{name}.csv", runs / "single" / "hooks" / f"{name}.csv"
    assert_same_csv(a, b, 1e-9)
    assert_same_csv(runs / "dd_resumed" / "hooks" / f"{name}.csv", b, 1e-9)


@pytest.mark.distributed
def test_decomposed_runs_migrated_and_relax_hooks(runs):
    import json

    summary = json.loads((runs / "dd" / "summary.json").read_text())
    assert summary["ranks"] == world_of(runs) and summary["migrated_atoms"] > 0
    assert_same_csv(runs / "dd_relax" / "hooks" / "msd.csv",
                    runs / "single_relax" / "hooks" / "msd.csv", 1e-9)
    rows = read_csv(runs / "single_relax" / "hooks" / "msd.csv")
    assert rows[1][1] == "nan" and float(rows[-1][-1]) > 0


@pytest.mark.distributed
def test_rdf_of_the_hot_run_matches_ase(runs):
    """The RDF file of the hot run (the crystal heated at 900-1500 K, far above argon's
    melting point; the ranks equal it, above) equals ASE's get_rdf of the 9 frames it saw,
    total and partials."""
    frames = ase.io.read(runs / "rdf_frames.traj", ":")
    assert len(frames) == 9
    rows = read_csv(runs / "single" / "hooks" / "rdf.csv")
    cols = {c: np.array([float(r[i]) for r in rows[1:]]) for i, c in enumerate(rows[0])}
    g, r = get_rdf(frames, 7.0, 35)
    np.testing.assert_allclose(cols["r_A"], r, rtol=1e-14)
    np.testing.assert_allclose(cols["g"], g, rtol=1e-12, atol=1e-12)
    for a, b in (("Ar", "Ar"), ("Ar", "Kr"), ("Kr", "Kr")):
        want = get_rdf(frames, 7.0, 35, elements=[a, b], no_dists=True)
        np.testing.assert_allclose(cols[f"g_{a}_{b}"], want, rtol=1e-12, atol=1e-12)
    assert g[:8].max() == 0 and g.max() > 1.2  # no pair closer than 1.6 Å; a first shell


@pytest.mark.distributed
def test_hook_files_of_a_run(runs):
    """The files hold what the hooks compute: MSD grows from 0, the per-atom file has every
    atom by id, the RDF is a liquid/solid g(r) with partials."""
    d = runs / "single" / "hooks"
    msd = read_csv(d / "msd.csv")
    assert msd[0] == ["step", "time_fs", "system", "species", "n_atoms", "msd_A2"]
    assert [r[0] for r in msd[1:4]] == ["0", "0", "0"] and float(msd[1][-1]) == 0
    assert float(msd[-1][-1]) > 0.1
    ke = read_csv(d / "kinetic_per_atom.csv")
    assert [int(r[2]) for r in ke[1:]] == list(range(108)) * 3
    rdf = read_csv(d / "rdf.csv")
    assert rdf[0] == ["system", "r_A", "g", "g_Ar_Ar", "g_Ar_Kr", "g_Kr_Kr"]
    assert len(rdf) == 36 and max(float(r[2]) for r in rdf[1:]) > 1.5


def test_cli_md_with_hooks_writes_files_and_resumes(tmp_path):
    """``xnn md cfg.yaml`` with a hooks: list writes hooks/*.csv; a run resumed from its
    checkpoint writes the same files as an uninterrupted one."""
    argon_krypton(rep=2, amp=0.1).write(tmp_path / "s.xyz")
    yaml = tmp_path / "md.yaml"
    yaml.write_text(
        f"structure: {tmp_path / 's.xyz'}\nensemble: langevin\ntemperature: 600\n"
        "steps: 30\ntimestep: 4.0\n"
        "model: {name: lj, device: cpu, skin: 0.3, cutoff: 5.0, hyperparameters: {sigma: 3.405,"
        " epsilon: 0.0104}}\n"
        "output: {progress: false, plot: false, trajectory_every: 0, checkpoint_every: 10}\n"
        "hooks:\n  - {name: rdf, every: 5, r_max: 5.0, bins: 25}\n"
        "  - {name: msd, every: 5}\n  - {name: species_temperature, every: 10}\n")
    assert main(["md", str(yaml), f"output.dir={tmp_path / 'full'}"]) == 0
    files = sorted(p.name for p in (tmp_path / "full" / "hooks").iterdir())
    assert files == ["msd.csv", "rdf.csv", "species_temperature.csv"]
    assert main(["md", str(yaml), f"output.dir={tmp_path / 'part'}", "steps=10"]) == 0
    assert main(["md", str(yaml), f"output.dir={tmp_path / 'part'}",
                 f"resume={tmp_path / 'part' / 'checkpoint.pt'}"]) == 0
    for f in files:
        assert_same_csv(tmp_path / "part" / "hooks" / f, tmp_path / "full" / "hooks" / f,
                        1e-12)
    assert len(read_csv(tmp_path / "full" / "hooks" / "msd.csv")) == 1 + 7 * 3


def test_run_md_python_hooks(tmp_path):
    """Hook objects given to run_md hold their results afterwards."""
    argon_krypton(rep=2).write(tmp_path / "s.xyz")
    rdf = RDF(every=2, r_max=5.0, bins=20)
    cfg = load_config(MDConfig, None, [f"structure={tmp_path / 's.xyz'}", *LJ, "steps=6",
                                       f"output.dir={tmp_path / 'o'}",
                                       "model.cutoff=5.0",
                                       "output.trajectory_every=0"])
    run_md(cfg, hooks=[rdf])
    assert rdf.result()["frames"] == 4 and (tmp_path / "o" / "hooks" / "rdf.csv").is_file()


@pytest.mark.distributed
def test_msd_reference_is_held_per_owned_atom_and_migrates(runs):
    """Under 2 (4) ranks with atoms migrating, each rank holds the MSD reference of its owned
    atoms only (the hook keeps no per-atom tensor), and the rows moved with their atoms
    (each equals its atom's start position); the file equals one process."""
    ranks = torch.load(runs / "ranks.pt", weights_only=False)
    summary = __import__("json").loads((runs / "dd" / "summary.json").read_text())
    assert summary["migrated_atoms"] > 0
    for r in ranks:
        assert r["held"] == []
        assert [s for s, *_ in r["rows"]] == list(range(0, 41, 5))
        for _, n_owned, n_rows, err in r["rows"]:
            assert n_rows == n_owned < 108 and err == 0.0
    assert sum(r["rows"][-1][1] for r in ranks) == 108
    assert any(len({n for _, n, _, _ in r["rows"]}) > 1 for r in ranks)  # counts changed
    a, b = read_csv(runs / "dd" / "hooks" / "msd_by_id.csv"), read_csv(
        runs / "single" / "hooks" / "msd.csv")
    assert a[0] == b[0] and len(a) == len(b)
    assert_same_csv(runs / "dd" / "hooks" / "msd_by_id.csv",
                    runs / "single" / "hooks" / "msd.csv", 1e-9)


@pytest.mark.distributed
def test_a_hook_failing_on_one_rank_stops_every_rank_after_a_checkpoint(runs):
    """A global callable raising on the rank that owns atom 0 (step 4) stops all ranks
    with a HookError naming it and the step (no hang), after a checkpoint at step 4; the run
    resumed on as many ranks with the hook fixed equals one uninterrupted process."""
    ranks = torch.load(runs / "ranks.pt", weights_only=False)
    for r in ranks:
        hook, step, msg = r["failed"]
        assert (hook, step) == ("flaky", 4) and "\n" not in msg and "atom 0 is here" in msg
    msgs = [r["failed"][2] for r in ranks]
    own = [i for i, m in enumerate(msgs)
           if m.startswith("hook 'flaky' failed at step 4: RuntimeError: atom 0 is here")]
    assert len(own) == 1  # the others name the rank that failed
    assert all(m.startswith(f"rank {own[0]} failed during the hooks: ") for i, m in
               enumerate(msgs) if i != own[0])
    for name in ("msd", "flaky", "virial_sum", "rdf"):
        assert_same_csv(runs / "dd_flaky" / "hooks" / f"{name}.csv",
                        runs / "single_flaky" / "hooks" / f"{name}.csv", 1e-9)
