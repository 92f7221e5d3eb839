"""Reference energies ``model.e0``: ``isolated`` (MACE's IsolatedAtom convention, checked
against mace-torch's own reader), a ``{element: eV}`` map, ``average`` (= ``fit``), the
one-line refusals, the record in the model file and an end-to-end ``xnn train``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ase import Atoms
from ase.calculators.emt import EMT

from xnn.app.train_data import build_splits
from xnn.app.train_model import data_statistics, reference_energies
from xnn.config.loader import ConfigError, load_config
from xnn.config.model import ModelConfig
from xnn.config.train import TrainConfig
from xnn.data.emt import generate_emt
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


def _isolated(symbol: str) -> Atoms:
    atoms = Atoms(symbol, positions=[[5.0, 5.0, 5.0]], cell=[10.0] * 3, pbc=False)
    atoms.calc = EMT()
    atoms.info = {"config_type": "IsolatedAtom", "REF_energy": atoms.get_potential_energy()}
    atoms.arrays["REF_forces"] = atoms.get_forces()
    atoms.calc = None
    return atoms


def _labelled(atoms: Atoms) -> Atoms:
    """EMT labels under MACE's REF_ keys (mace-torch reads isolated-atom energies from
    ``info[energy_key]``)."""
    out = Atoms(atoms.numbers, atoms.positions, cell=atoms.cell, pbc=atoms.pbc)
    out.info = {"config_type": atoms.info["config_type"],
                "REF_energy": atoms.get_potential_energy()}
    out.arrays["REF_forces"] = atoms.get_forces()
    return out


@pytest.fixture(scope="module")
def cuau(tmp_path_factory):
    """Cu-Au EMT structures with an isolated atom of each element among them, a one-atom
    structure *without* the mark (an ordinary structure, as in MACE), as extxyz."""
    import ase.io

    frames = [_labelled(a) for a in generate_emt(10, ["Cu", "Au"], seed=3)]
    plain = Atoms("Cu", positions=[[0, 0, 0]], cell=[2.6] * 3, pbc=True)
    plain.calc = EMT()
    plain = _labelled(_with_type(plain, "bulk1"))
    frames[3:3] = [_isolated("Au")]
    frames[7:7] = [_isolated("Cu"), plain]
    path = tmp_path_factory.mktemp("e0") / "cuau.xyz"
    ase.io.write(path, frames, format="extxyz")
    return path


def _with_type(atoms: Atoms, kind: str) -> Atoms:
    atoms.info["config_type"] = kind
    return atoms


def _cfg(path, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={path}", "data.datasets.0.energy_key=REF_energy",
        "data.datasets.0.forces_key=REF_forces", "model.cutoff=3.0", TINY,
        "data.batch_size=3", "data.val_fraction=0.2", "loss.stress.weight=0",
        "logging.plots=false", "logging.progress_bar=false", *extra])


def _mace_e0(path) -> tuple[dict, int]:
    from mace.data.utils import KeySpecification, load_from_xyz

    keys = KeySpecification(info_keys={"energy": "REF_energy", "stress": "REF_stress",
                                       "head": "head"},
                            arrays_keys={"forces": "REF_forces"})
    e0, configs = load_from_xyz(str(path), keys, extract_atomic_energies=True)
    return e0, len(configs)


def test_isolated_atoms_read_and_equal_mace(cuau):
    """The isolated-atom entries are the one-atom IsolatedAtom frames, with their energy
    labels; their E0s equal mace-torch's (load_from_xyz) exactly and MACE keeps the same
    number of training structures (the unmarked one-atom structure stays)."""
    import ase.io

    ds = read_structures(cuau, energy_key="REF_energy", forces_key="REF_forces")
    frames = ase.io.read(cuau, index=":")
    found = ds.isolated_atoms()
    assert sorted(found) == [3, 7]
    for index, (z, energy) in found.items():
        assert z == frames[index].numbers[0]
        assert energy == frames[index].info["REF_energy"]
    cfg = _cfg(cuau, "model.e0=isolated", "data.val_fraction=0")
    splits = build_splits(cfg.data, cfg.loss, 3.0, 0, isolated_atoms=True)
    pytest.importorskip("mace.data.utils")
    mace_e0, mace_count = _mace_e0(cuau)
    assert set(splits.isolated_e0) == set(mace_e0) == {29, 79}
    for z, v in mace_e0.items():
        assert abs(splits.isolated_e0[z] - v) <= 1e-12
    # isolated entries left out of training, as MACE (keep_isolated_atoms=False)
    assert len(splits.train) == mace_count == len(frames) - 2
    assert 3 not in splits.membership["train"][0]["indices"]
    assert 7 not in splits.membership["train"][0]["indices"]
    assert 8 in splits.membership["train"][0]["indices"]  # unmarked one-atom: kept
    species = splits.species
    e0 = reference_energies(cfg.model, species, [], splits.isolated_e0)
    assert e0 == {z: float(mace_e0[z]) for z in species}
    # scale/shift (MACE's rms_forces_scaling): force RMS and mean per-atom energy less the
    # isolated-atom E0s, over the training structures (the isolated atoms left out)
    train = [splits.raw_train[i] for i in range(len(splits.raw_train))]
    stats = data_statistics(cfg.model, species, train, None, None, splits.isolated_e0)
    assert stats["e0"] == e0
    per_atom = [(float(g.energy.reshape(-1)[0]) - sum(e0[int(z)] for z in g.numbers))
                / g.n_atoms for g in train]
    forces = np.concatenate([g.forces.numpy().reshape(-1) for g in train])
    assert abs(stats["shift"] - np.mean(per_atom)) <= 1e-12
    assert abs(stats["scale"] - np.sqrt(np.mean(forces ** 2))) <= 1e-12


def test_other_conventions_keep_isolated_entries(cuau):
    """``fit`` reads the file as before: every structure is trained on."""
    cfg = _cfg(cuau, "data.val_fraction=0")
    splits = build_splits(cfg.data, cfg.loss, 3.0, 0)
    assert splits.isolated_e0 is None
    assert len(splits.train) == 13


def test_average_equals_fit_and_mace(cuau):
    """``average`` is MACE's name for ``fit``: the same numbers, equal to mace-torch's
    compute_average_E0s on the same structures."""
    ds = read_structures(cuau, energy_key="REF_energy", forces_key="REF_forces")
    graphs = [ds[i] for i in range(len(ds))]
    fit = reference_energies(ModelConfig(name="schnet", cutoff=3.0, e0="fit"), [29, 79], graphs)
    avg = reference_energies(ModelConfig(name="schnet", cutoff=3.0, e0="average"), [29, 79],
                             graphs)
    assert fit == avg
    pytest.importorskip("mace.data.utils")
    from mace.data.utils import compute_average_E0s
    from mace.tools import AtomicNumberTable

    class Config:  # mace reads .properties["energy"] and .atomic_numbers only
        def __init__(self, g):
            self.properties = {"energy": float(g.energy.reshape(-1)[0])}
            self.atomic_numbers = g.numbers.numpy()

    mace = compute_average_E0s([Config(g) for g in graphs], AtomicNumberTable([29, 79]))
    for z in (29, 79):
        assert abs(mace[z] - avg[z]) <= 1e-12 * max(1.0, abs(avg[z]))


def test_map_form_symbols_and_numbers():
    cfg = load_config(TrainConfig, None, ["model.e0={Cu: -0.0052, 79: -0.0031}"])
    assert cfg.model.e0_table() == {29: -0.0052, 79: -0.0031}
    assert cfg.model.e0_convention() == "given"
    assert reference_energies(cfg.model, [29, 79], []) == {29: -0.0052, 79: -0.0031}
    # elements beyond the model's species are ignored
    assert reference_energies(cfg.model, [29], []) == {29: -0.0052}


def test_refusals_one_line(cuau, tmp_path):
    """A map without an element of the model, an unknown element, a bad value, a name that
    is not a convention, isolated atoms missing for an element: one line each."""
    cfg = load_config(TrainConfig, None, ["model.e0={Cu: -0.0052}"])
    with pytest.raises(InputError, match=r"no reference energy of \['Au'\]") as e:
        reference_energies(cfg.model, [29, 79], [])
    assert "\n" not in str(e.value)
    for bad, match in (("{Xx: 1.0}", "not an element"), ("{Cu: abc}", "not a finite number"),
                       ("{Cu: .nan}", "finite"), ("isolate", "not a valid choice"),
                       ("{Cu: 1.0, 29: 2.0}", "twice")):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(TrainConfig, None, [f"model.e0={bad}"])
        assert "\n" not in str(e.value)
    # Cu only as an isolated atom: Au missing
    import ase.io

    frames = [a for a in ase.io.read(cuau, index=":")
              if a.info.get("config_type") != "IsolatedAtom" or a.numbers[0] == 29]
    path = tmp_path / "cu_iso.xyz"
    ase.io.write(path, frames, format="extxyz")
    cfg = _cfg(path, "model.e0=isolated")
    splits = build_splits(cfg.data, cfg.loss, 3.0, 0, isolated_atoms=True)
    with pytest.raises(InputError, match=r"no isolated atom .* of \['Au'\].*model.e0=fit") as e:
        data_statistics(cfg.model, splits.species, [splits.raw_train[0]], None, None,
                        splits.isolated_e0)
    assert "\n" not in str(e.value)


def test_isolated_entry_refusals(cuau, tmp_path):
    """An isolated atom without an energy, or two of one element that disagree, are refused."""
    import ase.io

    frames = ase.io.read(cuau, index=":")
    second = _isolated("Cu")
    second.info["REF_energy"] += 0.1
    path = tmp_path / "two.xyz"
    ase.io.write(path, [*frames, second], format="extxyz")
    cfg = _cfg(path, "model.e0=isolated")
    with pytest.raises(DataFileError, match="second isolated atom of Cu"):
        build_splits(cfg.data, cfg.loss, 3.0, 0, isolated_atoms=True)
    bare = _isolated("Cu")
    del bare.info["REF_energy"]
    path = tmp_path / "bare.xyz"
    ase.io.write(path, [*frames[:3], bare], format="extxyz")
    cfg = _cfg(path, "model.e0=isolated", "loss.energy.weight=0")
    with pytest.raises(DataFileError, match="without an energy label"):
        build_splits(cfg.data, cfg.loss, 3.0, 0, isolated_atoms=True)


def test_train_isolated_end_to_end_records_convention(cuau, tmp_path, capsys):
    """``xnn train model.e0=isolated`` trains, its model's E0s are the isolated-atom labels,
    and the model file, summary and log record the convention."""
    from xnn.app.train import train
    from xnn.models.serialization import load_model, model_metadata

    cfg = _cfg(cuau, "model.e0=isolated", f"output_dir={tmp_path / 'run'}", "max_epochs=1")
    summary = train(cfg)
    mace_e0 = {29: None, 79: None}
    ds = read_structures(cuau, energy_key="REF_energy", forces_key="REF_forces")
    for z, energy in ds.isolated_atoms().values():
        mace_e0[z] = energy
    model_file = tmp_path / "run" / "model.pt"
    meta = model_metadata(model_file)
    assert meta["e0_convention"] == "isolated"
    assert meta["e0"] == mace_e0
    assert load_model(model_file).e0 == mace_e0
    assert summary["e0"] == {"convention": "isolated",
                             "values": {"Cu": mace_e0[29], "Au": mace_e0[79]}}
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["e0"]["convention"] == "isolated"
    log = capsys.readouterr().out
    assert "E0 (isolated: IsolatedAtom entries of 2 elements, left out of training)" in log
    assert "data: 9 training, 2 validation" in log  # 13 structures less the 2 isolated atoms
    # the map form records "given"; the E0s are the map's
    cfg = _cfg(cuau, "model.e0={Cu: -0.25, Au: 0.5}", f"output_dir={tmp_path / 'map'}",
               "max_epochs=1")
    train(cfg)
    meta = model_metadata(tmp_path / "map" / "model.pt")
    assert meta["e0_convention"] == "given"
    assert meta["e0"] == {29: -0.25, 79: 0.5}


def test_isolated_resume_is_bitwise(cuau, tmp_path):
    """A run with ``model.e0=isolated`` resumed mid-way ends where the uninterrupted run
    ends (the same splits without the isolated atoms, the same E0s)."""
    import torch

    from xnn.app.train import train
    from xnn.training.checkpoint import load_checkpoint

    common = ("model.e0=isolated", "precision=fp64", "max_epochs=5")
    train(_cfg(cuau, *common, f"output_dir={tmp_path / 'full'}", "max_steps=5"))
    train(_cfg(cuau, *common, f"output_dir={tmp_path / 'part'}", "max_steps=2"))
    train(_cfg(cuau, *common, f"output_dir={tmp_path / 'part'}", "max_steps=5", "resume=auto"))
    a, b = (load_checkpoint(tmp_path / run / "checkpoints" / "last.pt")["model"]["state_dict"]
            for run in ("full", "part"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
