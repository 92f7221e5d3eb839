"""Model files: round trips, weights-only loading, clear errors, export with the same forces."""

import os
import pickle

import pytest
import torch

import xnn
from xnn.data import keys as K
from xnn.errors import InputError, ModelFileError
from xnn.models import build
from xnn.models.serialization import (
    FORMAT_VERSION,
    export_model,
    load_exported,
    load_model,
    model_payload,
    save_model,
)
from xnn.neighbors import with_edges
from xnn.testing.common import evaluate
from xnn.testing.systems import random_periodic_system

SPECIES = [29, 79]


def _graph(seed=0, n_atoms=8, dtype=torch.float64):
    return random_periodic_system(
        SPECIES, n_atoms=n_atoms, volume_per_atom=14.0, min_distance=1.9, seed=seed, dtype=dtype
    )


def _models():
    torch.manual_seed(0)
    small = {"species": SPECIES, "cutoff": 3.5, "num_features": 16, "num_interactions": 2}
    schnet = build("schnet", **small, num_filters=8, radial_basis="bessel").double()
    painn = build("painn", **small, cutoff_fn="polynomial").double()
    for m in (schnet, painn):
        m.set_statistics(e0={29: -1.5, 79: -2.25}, scale=1.3, shift=0.1)
    lj = build("lj", sigma={"Cu": 2.3, "Au": 2.6}, epsilon={29: 0.4, 79: 0.5}, cutoff=5.0)
    morse = build("morse", D=0.3, alpha=1.3, r0=2.6, cutoff=5.0)
    return {"schnet": schnet, "painn": painn, "lj": lj, "morse": morse}


@pytest.mark.parametrize("name", ["schnet", "painn", "lj", "morse"])
def test_round_trip_gives_identical_results(tmp_path, name):
    model = _models()[name]
    path = save_model(model, tmp_path / "m.xnn")
    assert [p.name for p in tmp_path.iterdir()] == ["m.xnn"]  # no temp files left
    loaded = xnn.load_model(path)
    assert type(loaded) is type(model)
    assert loaded.cutoff == model.cutoff and loaded.species == model.species
    g = _graph()
    ref, out = evaluate(model, g), evaluate(loaded, g)
    for key in (K.ENERGIES, K.FORCES, K.STRESS):
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=0)


def test_payload_is_self_describing_and_dtype_is_kept(tmp_path):
    model = _models()["painn"].float()
    payload = model_payload(model)
    assert payload["format"] == "xnn-model" and payload["format_version"] == FORMAT_VERSION
    assert payload["name"] == "painn" and payload["dtype"] == "float32"
    assert payload["species"] == SPECIES and payload["e0"] == {29: -1.5, 79: -2.25}
    assert payload["units"] == {"energy": "eV", "length": "Å"}
    assert payload["xnn_version"] == xnn.__version__
    save_model(model, tmp_path / "m.xnn")
    loaded = load_model(tmp_path / "m.xnn")
    assert next(loaded.parameters()).dtype == torch.float32
    assert loaded.e0 == {29: -1.5, 79: -2.25}


def test_weights_only_even_when_env_forces_unsafe_load(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    payload = model_payload(_models()["schnet"])
    payload["hparams"]["evil"] = InputError("arbitrary object")  # not loadable weights-only
    path = tmp_path / "unsafe.xnn"
    torch.save(payload, path)
    with pytest.raises(ModelFileError, match="holds pickled objects .*InputError.*data only"):
        load_model(path)
    save_model(_models()["schnet"], tmp_path / "ok.xnn")
    load_model(tmp_path / "ok.xnn")  # a proper file still loads under the variable


def _check_one_line(err):
    assert "\n" not in str(err.value)


def test_bad_files_raise_model_file_error(tmp_path):
    good = save_model(_models()["schnet"], tmp_path / "good.xnn")
    cases = {}
    cases["missing"] = tmp_path / "nope.xnn"
    truncated = tmp_path / "truncated.xnn"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases["truncated"] = truncated
    corrupt = tmp_path / "corrupt.xnn"
    corrupt.write_bytes(b"\x00garbage" * 100)
    cases["corrupt"] = corrupt
    text = tmp_path / "text.xnn"
    text.write_text("energy: 1.0\n")
    cases["text"] = text
    not_model = tmp_path / "state.pt"
    torch.save({"weight": torch.zeros(3)}, not_model)
    cases["not a model"] = not_model
    pickled = tmp_path / "pickled.xnn"
    pickled.write_bytes(pickle.dumps({"format": "xnn-model"}))
    cases["plain pickle"] = pickled
    payload = model_payload(_models()["schnet"])
    newer = tmp_path / "newer.xnn"
    torch.save({**payload, "format_version": FORMAT_VERSION + 1}, newer)
    cases["newer"] = newer
    unknown = tmp_path / "unknown.xnn"
    torch.save({**payload, "name": "hal9000"}, unknown)
    cases["unknown name"] = unknown
    bad_state = tmp_path / "bad_state.xnn"
    torch.save({**payload, "hparams": {**payload["hparams"], "num_features": 8}}, bad_state)
    cases["incompatible state"] = bad_state
    cases["directory"] = tmp_path
    messages = {
        "missing": "does not exist", "newer": "format_version", "unknown name": "hal9000",
        "not a model": "not an xnn model", "incompatible state": "cannot rebuild",
    }
    for label, path in cases.items():
        with pytest.raises(ModelFileError, match=messages.get(label)) as err:
            load_model(path)
        _check_one_line(err)


def test_save_refuses_models_without_hparams(tmp_path):
    class Anonymous(torch.nn.Module):
        cutoff = 1.0

    with pytest.raises(InputError, match="not in the model registry"):
        save_model(Anonymous(), tmp_path / "x.xnn")
    model = _models()["schnet"]
    del model.hparams
    with pytest.raises(InputError, match="hparams"):
        save_model(model, tmp_path / "x.xnn")
    assert not os.listdir(tmp_path)


def test_failed_save_keeps_previous_file(tmp_path, monkeypatch):
    path = save_model(_models()["lj"], tmp_path / "m.xnn")
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_model(_models()["schnet"], path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.xnn"]


class _Wrapped(torch.nn.Module):
    """A model stored through the to_payload/from_payload hook (as external wrappers do)."""

    cutoff = 2.0

    def __init__(self, k: float):
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k, dtype=torch.float64))

    def to_payload(self):
        return {"k": float(self.k.detach())}

    @classmethod
    def from_payload(cls, payload):
        return cls(payload["k"])


def test_payload_hook(tmp_path):
    from xnn.models import registry

    registry.register_model("test-wrapped", _Wrapped)
    try:
        save_model(_Wrapped(2.5), tmp_path / "w.xnn")
        assert float(load_model(tmp_path / "w.xnn").k) == 2.5
    finally:
        registry._REGISTRY.pop("test-wrapped")


@pytest.mark.parametrize("name", ["schnet", "painn"])
def test_export_gives_same_energies_and_forces(tmp_path, name):
    model = _models()[name]
    path = export_model(model, tmp_path / "m.pt2")
    with pytest.raises(ModelFileError, match="unpickles.*trust=True"):  # it can run code
        load_exported(path)
    module, meta = load_exported(path, trust=True)
    assert meta["cutoff"] == 3.5 and meta["species"] == SPECIES
    from xnn.data import AtomicGraph

    g = AtomicGraph.concat([_graph(seed=1, n_atoms=9), _graph(seed=2, n_atoms=5)])
    g = with_edges(g, 3.5)
    ref = evaluate(model, g, stress=False)
    pos = g.positions.clone().requires_grad_(True)
    energies = module(pos, g.numbers, g.cell, g.pbc, g.batch, g.edge_index, g.shifts.long())
    (grad,) = torch.autograd.grad(energies.sum(), pos)
    torch.testing.assert_close(energies.detach(), ref[K.ENERGIES])
    torch.testing.assert_close(-grad, ref[K.FORCES])
    with pytest.raises(ModelFileError):
        load_exported(tmp_path / "missing.pt2")
