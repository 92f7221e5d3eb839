"""MACEWrapper (mace-torch) against mace-torch's own ASE calculator, in float64.

Random-weight MACE models are built here (no download). The extra is imported through
``xnn.models.external._optional`` so that this module does not change ``os.environ``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from ase import Atoms

from xnn import AtomicGraph
from xnn.errors import InputError, ModelFileError, UnknownSpeciesError
from xnn.models import Potential, build, compute_properties
from xnn.models.external._optional import MissingExtraError, import_extra

_WATCHED = ("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "TORCHINDUCTOR_CACHE_DIR")
_ENV_AT_START = {k: os.environ[k] for k in _WATCHED if k in os.environ}

try:
    mace_modules, mace_calculators = import_extra("mace", "mace.modules", "mace.calculators")
except MissingExtraError as _err:
    pytest.skip(str(_err), allow_module_level=True)


from helpers import MACE_SPECIES as SPECIES  # noqa: E402
from helpers import atoms_graph as _graph  # noqa: E402
from helpers import mace_model as _mace_model  # noqa: E402
from helpers import si_cu_molecule as _molecule  # noqa: E402
from helpers import si_cu_periodic as _periodic  # noqa: E402


@pytest.fixture(scope="module")
def mace_model():
    return _mace_model()


@pytest.fixture(scope="module")
def model_path(mace_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("mace") / "tiny.model"
    torch.save(mace_model, path)
    return path


def _reference(atoms: Atoms, calc) -> dict:
    atoms = atoms.copy()
    atoms.calc = calc
    out = {"energy": atoms.get_potential_energy(), "forces": atoms.get_forces(),
           "energies": atoms.calc.results["energies"]}
    if atoms.pbc.all():
        out["stress"] = atoms.get_stress(voigt=False)
    return out


def _close(actual, expected, rtol=1e-8):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(np.abs(expected).max(), 1e-3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.mark.filterwarnings("ignore:Environment variable TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
def test_matches_mace_calculator_batched_periodic_and_molecule(mace_model, model_path, monkeypatch):
    # the calculator loads its own copy of the weights from the .model file (a pickle; mace
    # sets this variable itself on import, we preserve the environment and so set it here)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    calc = mace_calculators.MACECalculator(model_paths=str(model_path), device="cpu",
                                           default_dtype="float64")
    structures = [_periodic(), _molecule()]
    refs = [_reference(a, calc) for a in structures]
    wrapper = build("mace", model=mace_model)
    assert wrapper.cutoff == pytest.approx(3.2) and wrapper.num_interactions == 2
    assert wrapper.species == SPECIES
    graph = _graph(structures, wrapper.cutoff + 0.8)  # Verlet skin
    out = compute_properties(wrapper, graph)
    ptr = graph.ptr.tolist()
    for s, ref in enumerate(refs):
        _close(out["energy"][s].item(), ref["energy"])
        _close(out["forces"][ptr[s]:ptr[s + 1]], ref["forces"])
        _close(out["energies"][ptr[s]:ptr[s + 1]], ref["energies"])  # per-atom, with E0
    _close(out["stress"][0], refs[0]["stress"])
    assert out["stress"][1].abs().max() == 0  # non-periodic system: no stress


def test_edges_beyond_r_max_contribute_nothing(mace_model):
    wrapper = build("mace", model=mace_model)
    atoms = [_periodic()]
    tight = compute_properties(wrapper, _graph(atoms, wrapper.cutoff))
    skin = _graph(atoms, wrapper.cutoff + 1.5)
    assert skin.edge_vectors().norm(dim=-1).max() > wrapper.cutoff + 1.0
    loose = compute_properties(wrapper, skin)
    for key in ("energies", "forces", "stress"):
        torch.testing.assert_close(loose[key], tight[key], rtol=0, atol=1e-12)


def test_edges_follow_mace_neighborhood_convention(mace_model):
    (neighborhood,) = import_extra("mace", "mace.data.neighborhood")
    atoms = _periodic()
    ei, shifts, _, _ = neighborhood.get_neighborhood(
        atoms.positions, cutoff=3.2, pbc=tuple(atoms.pbc), cell=atoms.cell.array.copy()
    )
    ref_vec = atoms.positions[ei[1]] - atoms.positions[ei[0]] + shifts  # recv - send + shift
    wrapper = build("mace", model=mace_model)
    inp = wrapper.mace_inputs(_graph([atoms], 3.2))
    send, recv = inp["edge_index"]
    vec = (inp["positions"][recv] - inp["positions"][send] + inp["shifts"]).numpy()
    torch.testing.assert_close(inp["shifts"], inp["unit_shifts"] @ inp["cell"])

    def table(s, r, v):
        rows = np.column_stack([s, r, np.round(v, 6)])
        return rows[np.lexsort(rows.T[::-1])]

    ours, ref = table(send.numpy(), recv.numpy(), vec), table(ei[0], ei[1], ref_vec)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_plain_mace_class_and_model_file(model_path, mace_model):
    atoms = [_molecule()]
    with pytest.raises(ModelFileError, match="is a pickle.*trust=True"):  # runs code: refused
        build("mace", model=str(model_path))
    from_file = build("mace", model=str(model_path), trust=True)
    direct = build("mace", model=mace_model)
    graph = _graph(atoms, 3.2)
    torch.testing.assert_close(from_file(graph), direct(graph), rtol=0, atol=0)
    plain = build("mace", model=_mace_model(seed=1, cls="MACE"))
    calc = mace_calculators.MACECalculator(
        models=plain.model, device="cpu", default_dtype="float64"
    )
    ref = _reference(atoms[0], calc)
    out = compute_properties(plain, graph, stress=False)
    _close(out["energy"].item(), ref["energy"])
    _close(out["forces"], ref["forces"])


@pytest.mark.parametrize("cls", ["ScaleShiftMACE", "MACE"])
def test_save_load_roundtrip(mace_model, tmp_path, cls):
    import xnn

    wrapper = build("mace", model=mace_model if cls == "ScaleShiftMACE" else _mace_model(1, cls))
    path = xnn.save_model(wrapper, tmp_path / "wrapped.pt")
    payload = torch.load(path, weights_only=True)  # the outer file needs no unpickling
    assert "module_bytes" not in payload and payload["config"]["class"] == cls  # data only
    kwargs = payload["config"]["kwargs"]
    assert kwargs["interaction_cls"] == "RealAgnosticResidualInteractionBlock"
    assert kwargs["gate"] == "silu" and kwargs["hidden_irreps"].startswith("8x0e")
    loaded = xnn.load_model(path)
    assert type(loaded.model) is type(wrapper.model)
    graph = _graph([_periodic(), _molecule()], wrapper.cutoff)
    torch.testing.assert_close(loaded(graph), wrapper(graph), rtol=0, atol=0)
    # saved in float32 it comes back in float32, with the same energies
    single = build("mace", model=_mace_model(2, cls).float())
    back = xnn.load_model(xnn.save_model(single, tmp_path / "f32.pt"))
    assert next(back.parameters()).dtype == torch.float32
    g32 = graph.to(dtype=torch.float32)
    torch.testing.assert_close(back(g32), single(g32), rtol=0, atol=0)


def _legacy_file(model: torch.nn.Module, path) -> None:
    """An xnn model file as earlier versions wrote it: the MACE module pickled inside."""
    import io

    from xnn.models.external._optional import preserved_environ
    from xnn.models.serialization import model_payload

    payload = model_payload(build("mace", model=model))
    buf = io.BytesIO()
    with preserved_environ():
        torch.save(model, buf)
    for key in ("config", "state_dict"):
        payload.pop(key)
    payload.update(kind="mace-torch-pickle", module_bytes=buf.getvalue())
    torch.save(payload, path)


def test_pickled_payload_of_earlier_versions_needs_trust(mace_model, tmp_path):
    import xnn

    path = tmp_path / "old.pt"
    _legacy_file(mace_model, path)
    with pytest.raises(ModelFileError, match=r"old\.pt: .*pickle.*trust=True.*--trust-file"):
        xnn.load_model(path)
    loaded = xnn.load_model(path, trust=True)
    again = xnn.load_model(xnn.save_model(loaded, tmp_path / "new.pt"))  # now data only
    graph = _graph([_periodic()], loaded.cutoff)
    ref = build("mace", model=mace_model)(graph)
    for model in (loaded, again):
        torch.testing.assert_close(model(graph), ref, rtol=0, atol=0)


def test_tampered_data_payload_names_nothing_outside_mace_tables(mace_model, tmp_path):
    """The data format names classes and functions; a file naming anything else (a builtin,
    another mace class, an unknown argument) is refused before anything is built."""
    import xnn
    from xnn.models.serialization import model_payload

    good = model_payload(build("mace", model=mace_model))
    kwargs = good["config"]["kwargs"]
    tampered = {
        "interaction": {"kwargs": {**kwargs, "interaction_cls": "os.system"}},
        "gate": {"kwargs": {**kwargs, "gate": "eval"}},
        "class": {"class": "ModuleDict"},
        "argument": {"kwargs": {**kwargs, "lammps_mliap_hook": "os.system"}},
        "cueq": {"kwargs": {**kwargs, "cueq_config": {"enabled": True}}},
    }
    for i, (label, change) in enumerate(tampered.items()):
        path = tmp_path / f"t{i}.pt"
        torch.save({**good, "config": {**good["config"], **change}}, path)
        with pytest.raises(ModelFileError) as err:
            xnn.load_model(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value), label


def test_models_that_cannot_be_stored_as_data_are_refused(mace_model, tmp_path, monkeypatch):
    import xnn
    from xnn.models.external import _mace_data

    wrapper = build("mace", model=_mace_model(3))
    # a rebuild that predicts otherwise (here: a gate the extraction would miss) is refused
    real = _mace_data.build_module

    def other_gate(config, state, dtype):
        config = {**config, "kwargs": {**config["kwargs"], "gate": "tanh"}}
        return real(config, state, dtype)

    monkeypatch.setattr(_mace_data, "build_module", other_gate)
    with pytest.raises(InputError, match="predicts energies .* apart.*trust=True"):
        xnn.save_model(wrapper, tmp_path / "m.pt")
    assert not (tmp_path / "m.pt").exists()


def test_species_and_dtype_errors(mace_model):
    wrapper = build("mace", model=mace_model)
    water = Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]])
    graph = AtomicGraph.from_arrays(water.positions, water.numbers)
    with pytest.raises(UnknownSpeciesError, match="O"):
        Potential(wrapper)(graph)
    with pytest.raises(InputError, match="dtype"):
        wrapper(_graph([_molecule()], 3.2).to(dtype=torch.float32))
    with pytest.raises(InputError, match="head"):
        build("mace", model=mace_model, head="nope")
    graph = _graph([_molecule()], 3.2)
    wrapper(graph)  # mace calls requires_grad_(True) on its inputs: not on the caller's tensors
    assert not graph.positions.requires_grad


def test_importing_the_extra_leaves_environ_unchanged(monkeypatch):
    # mace sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 on import; this module imported it through
    # import_extra, which must have restored the environment
    for key in _WATCHED:
        assert os.environ.get(key) == _ENV_AT_START.get(key), key
    import importlib

    import mace

    from xnn.models.external._optional import preserved_environ

    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)
    with preserved_environ():
        importlib.reload(mace)  # re-runs mace/__init__.py, which sets the variable
        assert os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") == "1"  # the check can fail
    assert "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" not in os.environ


def test_missing_extra_raises_with_install_hint(monkeypatch):
    for name in ("mace", "mace.modules", "sevenn", "sevenn.util"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now fails
    for name, kw in (("mace", {"model": "x.model"}), ("sevenn", {"checkpoint": "7net-0"})):
        with pytest.raises(ImportError, match=rf'pip install "xnn\[{name}\]"'):
            build(name, **kw)


_NO_EXTRAS = r"""
import sys
sys.modules["mace"] = None  # make `import mace` / `import sevenn` fail
sys.modules["sevenn"] = None
import xnn, xnn.models, xnn.models.external
assert "mace" in xnn.models.available_models() and "sevenn" in xnn.models.available_models()
print("ok")
"""


def test_xnn_imports_without_extras():
    res = subprocess.run([sys.executable, "-c", _NO_EXTRAS], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.slow
def test_compiled_mace_matches_eager(mace_model, monkeypatch):
    """``Potential(compile=True)`` on a MACE wrapper (mace-torch's compile preparation and
    ``torch.compile`` with dynamic shapes): energy, forces and stress equal the eager ones,
    also after the structure (atom and edge counts) changes; training mode runs eagerly.

    Traced by dynamo and AOT autograd (where gradients could be lost) but not code-generated
    by inductor (2+ minutes on a CPU); the GPU benchmark checks inductor's forces."""
    import xnn.models.external.mace as wrapper_module

    monkeypatch.setattr(wrapper_module, "COMPILE_BACKEND", "aot_eager")
    eager = Potential(build("mace", model=mace_model))
    wrapper = build("mace", model=mace_model).eval()
    compiled = Potential(wrapper, compile=True)
    torch._dynamo.utils.counters.clear()
    for structures in ([_periodic()], [_periodic(), _molecule()]):
        g = _graph(structures, 3.2)
        for stress in (True, False):  # MD: stress at the first step, then not
            ref, out = eager(g, stress=stress), compiled(g, stress=stress)
            for key in ("energy", "forces", "stress")[: 3 if stress else 2]:
                _close(out[key].detach(), ref[key].detach(), rtol=1e-10)
    assert wrapper._compiled is not None
    # asking for stress or not does not recompile (the batch of 2 may: size-1 specialisation)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    wrapper.train()
    assert wrapper(g).requires_grad  # eager path while training


@pytest.mark.slow  # 56 s on 2 loaded cores; compiled MACE inference stays fast above
@pytest.mark.parametrize("n_systems", [1, 2])
def test_compiled_md_step_with_mace_follows_eager(mace_model, n_systems, one_thread):
    """``md.compile=true`` with a MACE model. The traced step keeps every edge of the Verlet
    list (skin) and of the capacity's padding (MACE's cutoff gives them exactly zero weight)
    and has no data-dependent shapes (``ptr``, edge selection). Over steps with rebuilds it
    follows the eager step in fp64, for one system and a batch of two."""
    from xnn.dynamics import maxwell_boltzmann, nve
    from xnn.dynamics.compiled import CompiledVerlet

    second = _periodic()
    second.rattle(0.05, seed=7)
    structures = [_periodic(), second][:n_systems]
    g = AtomicGraph.concat([AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, True)
                            for a in structures])
    wrapper = build("mace", model=mace_model)
    eager_pot, pot = Potential(wrapper, skin=0.5), Potential(wrapper, skin=0.5)
    stepper = CompiledVerlet(pot, backend="aot_eager")
    eager = compiled = nve.init(maxwell_boltzmann(g, 3000.0, seed=2), eager_pot)
    for _ in range(40):
        eager, compiled = nve.step(eager, eager_pot, 2.0), stepper.step(compiled, 2.0)
    assert stepper.n_rebuilds >= 1  # a recompile only when a rebuild overflows the capacity:
    assert stepper.n_compiles <= 2  # at 3000 K the pair count grows once in the first steps
    torch.testing.assert_close(compiled.positions, eager.positions, rtol=0, atol=1e-10)
    torch.testing.assert_close(compiled.forces, eager.forces, rtol=0, atol=1e-9)
    torch.testing.assert_close(compiled.energy, eager.energy, rtol=0, atol=1e-9)


@pytest.mark.slow
def test_mace_wrapper_contracts(mace_model, one_thread):
    """xnn.testing's execution-mode contracts on the MACE wrapper: ASE, torch-sim and LAMMPS
    give Potential's numbers; the compiled step traces it and equals eager; decomposed on two
    gloo ranks equals one process in every mode (halo; sync and graph through the wrapper's
    sync point between its two interactions)."""
    from xnn.testing import check_adapters, check_compiled_step, check_decomposition

    wrapper = build("mace", model=mace_model)
    out = check_adapters(wrapper)
    assert out["ase"] <= 1e-10, out
    assert check_compiled_step(wrapper, steps=4)["n_compiles"] == 1
    errors = check_decomposition(wrapper, world_size=2)
    assert {e["mode"] for e in errors.values()} == {"halo", "sync", "graph"}
