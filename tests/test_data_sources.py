"""Lazy dataset sources (:mod:`xnn.data.sources`): extxyz through a frame index, ASE SQLite
and ASE-LMDB databases (one file, a folder of shards, a glob) equal the in-memory reading of
the same structures bit for bit, read their atom counts without building a structure, pickle
without their handles, and train exactly as an extxyz file does."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import ase.io
import numpy as np
import pytest
import torch
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from ase.db import connect
from error_helpers import raises_one_line

from xnn.data import keys as K
from xnn.data.datasets import ConcatDataset
from xnn.data.sources import FORMATS, open_source, read_structures
from xnn.data.sources.extxyz import frame_index
from xnn.errors import DataFileError, InputError

FIELDS = (K.POSITIONS, K.CELL, K.PBC, K.NUMBERS, K.MASSES, K.ENERGY, K.FORCES, K.STRESS,
          K.WEIGHT, K.ATOM_ID, K.SYSTEM_ID)


def _frames(n=9, seed=0):
    """Cu/Au cells of 4-12 atoms with calculator labels (one without stress), and an
    isolated-atom entry."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        a = bulk("Cu", cubic=True) * (1, 1, 1 + i % 3)
        a.numbers[rng.random(len(a)) < 0.3] = 79
        a.rattle(0.05, seed=seed + i)
        labels = dict(energy=rng.normal(-3.0 * len(a)), forces=rng.normal(size=(len(a), 3)))
        if i != 4:
            labels["stress"] = rng.normal(size=6) * 1e-2
        a.calc = SinglePointCalculator(a, **labels)
        a.info["config_type"] = "bulk"
        out.append(a)
    iso = bulk("Au")[:1]
    iso.cell, iso.pbc = [12.0, 12.0, 12.0], False
    iso.info["config_type"] = "IsolatedAtom"
    iso.calc = SinglePointCalculator(iso, energy=-0.25, forces=np.zeros((1, 3)))
    return out + [iso]


def _write_db(path, frames, delete=()):
    db = connect(str(path), type="aselmdb" if str(path).endswith("lmdb") else "db")
    for a in frames:
        db.write(a, config_type=a.info["config_type"])
    if delete:
        db.delete(list(delete))
    del db
    return path


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    """Structures exactly representable in extxyz (read back from one), so every format
    holds the same numbers."""
    path = tmp_path_factory.mktemp("src") / "all.xyz"
    ase.io.write(path, _frames(), format="extxyz")
    return ase.io.read(path, ":")


def _same(a, b):
    """Two one-structure graphs equal bit for bit (NaN where a label is missing)."""
    for key in FIELDS:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _paths(tmp_path, frames):
    xyz = tmp_path / "d.xyz"
    ase.io.write(xyz, frames, format="extxyz")
    return {"extxyz": xyz, "db": _write_db(tmp_path / "d.db", frames),
            "aselmdb": _write_db(tmp_path / "d.aselmdb", frames)}


@pytest.mark.parametrize("fmt", ["extxyz", "db", "aselmdb"])
def test_each_format_equals_the_in_memory_reading(tmp_path, frames, fmt):
    path = _paths(tmp_path, frames)[fmt]
    whole = open_source(path, "ase", weight=0.5)  # every structure read by ase.io.read
    ds = open_source(path, weight=0.5)
    assert type(ds).__name__ == {"extxyz": "ExtxyzSource", "db": "SQLiteSource",
                                 "aselmdb": "LMDBSource"}[fmt]
    assert len(ds) == len(whole) == len(frames)
    assert ds.n_atoms.tolist() == [len(a) for a in frames]
    for i in range(len(ds)):
        _same(ds[i], whole[i])
        assert ds.origin(i) == (str(path), i)
    assert (ds.label_counts() == whole.label_counts()).all()
    assert ds.label_masks()[K.STRESS].tolist() == [i not in (4, 9) for i in range(10)]
    assert ds.species() == whole.species() == [29, 79]
    assert ds.isolated_atoms() == {9: (79, -0.25)}


def test_shards_in_a_folder_and_a_glob_are_one_dataset(tmp_path, frames):
    folder = tmp_path / "omat"
    folder.mkdir()
    parts = [frames[:4], frames[4:5], frames[5:]]
    for k, part in enumerate(parts):
        _write_db(folder / f"data.{k:04d}.aselmdb", part)
    (folder / "notes.txt").write_text("not a shard\n")
    whole = open_source(_paths(tmp_path, frames)["extxyz"])
    for path in (folder, folder / "*.aselmdb", str(folder) + "/data.000[0-2].aselmdb"):
        ds = open_source(path)
        assert isinstance(ds, ConcatDataset) and ds.name == str(path)
        assert ds.n_atoms.tolist() == whole.n_atoms.tolist()
        assert ds.origin(4) == (str(folder / "data.0001.aselmdb"), 0)
        assert ds.origin(7) == (str(folder / "data.0002.aselmdb"), 2)
        assert ds.isolated_atoms() == {9: (79, -0.25)}
        assert ds.species() == [29, 79]
        for i in range(len(ds)):
            a, b = ds[i], whole[i]
            for key in (K.POSITIONS, K.CELL, K.NUMBERS, K.ENERGY, K.FORCES, K.STRESS):
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True)
            # atom ids and system ids count within each shard, as for separate files
            assert a[K.SYSTEM_ID].item() == ds.origin(i)[1]


@pytest.mark.parametrize("suffix", ["db", "aselmdb"])
def test_deleted_rows_leave_gaps_in_the_ids(tmp_path, frames, suffix):
    path = _write_db(tmp_path / f"gaps.{suffix}", frames, delete=(2, 3, 7))
    kept = [a for i, a in enumerate(frames) if i + 1 not in (2, 3, 7)]
    ds = open_source(path)
    assert ds.ids.tolist() == [1, 4, 5, 6, 8, 9, 10]
    assert ds.n_atoms.tolist() == [len(a) for a in kept]
    ref = open_source(_paths(tmp_path, kept)["extxyz"])
    for i in range(len(ds)):
        _same(ds[i], ref[i])


def test_labels_under_other_keys_in_key_value_pairs_and_data(tmp_path, frames):
    """Custom keys find a row's key-value pairs (energy) and its data (forces, stress)."""
    path = tmp_path / "ref.aselmdb"
    db = connect(str(path))
    for a in frames:
        plain = a.copy()
        r = a.calc.results
        data = {"REF_forces": r["forces"]}
        if "stress" in r:
            data["REF_stress"] = r["stress"]
        db.write(plain, REF_energy=float(r["energy"]), data=data)
    del db
    ds = open_source(path, energy_key="REF_energy", forces_key="REF_forces",
                     stress_key="REF_stress")
    ref = open_source(_paths(tmp_path, frames)["db"])
    for i in range(len(ds)):
        _same(ds[i], ref[i])


def test_inspect_and_label_errors_see_a_rows_keys(tmp_path, frames):
    """``xnn data inspect`` of shards, and the missing-label error of ``xnn train``, list
    the keys of the rows' key-value pairs and data (the keys training can read)."""
    from xnn.app.data import inspect_file
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig

    folder = tmp_path / "ref"
    folder.mkdir()
    for k, part in enumerate((frames[:5], frames[5:9])):
        db = connect(str(folder / f"{k}.aselmdb"))
        for a in part:
            db.write(a.copy(), REF_energy=float(a.calc.results["energy"]),
                     data={"REF_forces": a.calc.results["forces"]})
        del db
    text = inspect_file(str(folder), None, {"energy": "energy", "forces": "forces",
                                            "stress": "stress", "virial": "virial"})
    assert "REF_energy" in text and "REF_forces" in text and "9 structures" in text, text
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={folder}",
                                          f"output_dir={tmp_path / 'out'}", "device=cpu"])
    msg = raises_one_line(DataFileError, train, cfg)
    assert "energy_key=REF_energy" in msg and "REF_forces" in msg, msg
    assert not (tmp_path / "out").exists()


def test_atom_counts_and_species_build_no_structure(tmp_path, frames, monkeypatch):
    import ase

    paths = _paths(tmp_path, frames)
    built = []
    init = ase.Atoms.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(ase.Atoms, "__init__", counting)
    for fmt, path in paths.items():
        ds = open_source(path)
        assert ds.n_atoms.tolist() == [len(a) for a in frames]
        if fmt != "extxyz":  # read from the index / the records' first bytes
            assert ds.species() == [29, 79]
        assert built == [], fmt
    ds[3]
    assert built  # the counter sees a structure read


def test_a_pickled_source_reads_the_same_in_a_new_process(tmp_path, frames):
    paths = _paths(tmp_path, frames)
    ds = ConcatDataset([open_source(p) for p in paths.values()])
    before = [ds[i] for i in range(len(ds))]  # handles open in this process
    blob = pickle.dumps(ds)
    assert len(blob) < 8000  # indices and names, no structures or handles
    (tmp_path / "ds.pkl").write_bytes(blob)
    out = tmp_path / "read.pt"
    code = ("import pickle, sys, torch; ds = pickle.load(open(sys.argv[1], 'rb')); "
            f"torch.save([{{k: ds[i][k] for k in {list(FIELDS)!r}}} for i in range(len(ds))],"
            " sys.argv[2])")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "ds.pkl"), str(out)],
                   check=True, env=env, timeout=120)
    for a, b in zip(before, torch.load(out), strict=True):
        _same(a, b)


class _Positions(torch.utils.data.Dataset):
    """The positions of a dataset's structures (what a DataLoader worker sends back)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index][K.POSITIONS]


def test_forked_dataloader_workers_read_an_open_source(tmp_path, frames):
    """Workers forked while this process holds the files open (the ASE-LMDB one included,
    which lmdb refuses to open twice in a process) read every structure."""
    ds = ConcatDataset([open_source(p) for p in _paths(tmp_path, frames).values()])
    ref = [ds[i][K.POSITIONS] for i in range(len(ds))]
    loader = torch.utils.data.DataLoader(_Positions(ds), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    got = list(loader)
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(ds[len(ds) - 1][K.POSITIONS], ref[-1])  # reopened here too


def test_non_finite_labels_are_refused_when_read(tmp_path, frames):
    bad = [a.copy() for a in frames]
    for a, b in zip(frames, bad):
        b.calc = SinglePointCalculator(b, **a.calc.results)
    bad[6].calc.results["forces"][2, 1] = np.nan
    path = _write_db(tmp_path / "bad.aselmdb", bad)
    ds = open_source(path)  # lazy: only the index is read
    ds[5]
    msg = raises_one_line(DataFileError, ds.__getitem__, 6)
    for words in (str(path), "structure 6", "forces label 'forces' of atom [2]", "nan"):
        assert words in msg, (words, msg)
    msg = raises_one_line(DataFileError, read_structures, path)  # checks every structure
    assert "structure 6" in msg


def test_bad_paths_and_formats_are_one_line(tmp_path, frames):
    path = _paths(tmp_path, frames)["extxyz"]
    msg = raises_one_line(InputError, open_source, path, "lmdb")
    assert all(f in msg for f in FORMATS)
    (tmp_path / "empty").mkdir()
    raises_one_line(DataFileError, open_source, tmp_path / "empty", match="holds no dataset")
    raises_one_line(DataFileError, open_source, tmp_path / "none" / "*.aselmdb",
                    match="no file matches")
    raises_one_line(DataFileError, open_source, tmp_path / "missing.aselmdb",
                    match="does not exist")
    raises_one_line(DataFileError, open_source, tmp_path, match="several formats")
    empty = tmp_path / "empty" / "none.aselmdb"
    _write_db(empty, [])
    raises_one_line(DataFileError, open_source, empty, match="no structures in")
    (tmp_path / "empty" / "none.xyz").write_text("\n")
    raises_one_line(DataFileError, open_source, tmp_path / "empty" / "none.xyz",
                    match="no structures in")
    from xnn.config.loader import ConfigError, load_config
    from xnn.config.train import TrainConfig

    msg = raises_one_line(ConfigError, load_config, TrainConfig, None,
                          [f"data.datasets.0.path={path}", "data.datasets.0.format=lmdb"])
    assert "data.datasets.0.format" in msg and all(f in msg for f in FORMATS)
    # an explicit format overrides the suffix: extxyz under another name
    other = tmp_path / "frames.txt"
    other.write_bytes(path.read_bytes())
    ds = open_source(other, "extxyz")
    _same(ds[2], open_source(path)[2])


@pytest.mark.parametrize("text,frames_found", [
    (b"1\nc\nH 0 0 0\n2\nc\nH 0 0 0\nH 0 0 1\n", [1, 2]),
    (b"1\nc\nH 0 0 0\n2\nc\nH 0 0 0\nH 0 0 1", [1, 2]),  # no final line break
    (b"1\nc\nH 0 0 0\n\n\n  \n", [1]),  # blank lines after the last frame
])
def test_frame_index(tmp_path, text, frames_found):
    path = tmp_path / "f.xyz"
    path.write_bytes(text)
    offsets, counts = frame_index(path)
    assert counts.tolist() == frames_found
    for k in range(len(counts)):
        atoms = ase.io.read(path, k)
        assert len(atoms) == counts[k]
        assert text[offsets[k]:].startswith(str(counts[k]).encode())


@pytest.mark.parametrize("text,words", [
    (b"1\nc\nH 0 0 0\n3\nc\nH 0 0 0\n", "frame 1 is cut short"),
    (b"1\nc\nH 0 0 0\nx\nc\n", "line 4 should hold the atom count of frame 1"),
    (b"1\nc\nH 0 0 0\n\n1\nc\nH 0 0 0\n", "a blank line where frame 1 should start"),
    (b"1\nc\nH 0 0 0\n2", "frame 1 has only its atom-count line"),
])
def test_frame_index_refuses_a_broken_file(tmp_path, text, words):
    path = tmp_path / "f.xyz"
    path.write_bytes(text)
    raises_one_line(DataFileError, frame_index, path, match=words)


def test_training_on_aselmdb_equals_extxyz(tmp_path, frames):
    """``xnn train`` on an ASE-LMDB file (fp64) follows the extxyz run of the same
    structures exactly, and a folder of its shards with ``format`` given does too."""
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.training.checkpoint import load_checkpoint

    paths = _paths(tmp_path, frames[:9])
    shards = tmp_path / "shards"
    shards.mkdir()
    _write_db(shards / "a.lmdb", frames[:5])
    _write_db(shards / "b.lmdb", frames[5:9])

    def history(name, path, *extra):
        cfg = load_config(TrainConfig, None, [
            f"data.datasets.0.path={path}", *extra, f"output_dir={tmp_path / name}",
            "model.cutoff=3.0", "model.hyperparameters={num_features: 8, num_filters: 8, "
            "num_interactions: 1, num_basis: 8}", "data.batch_size=3", "max_epochs=2",
            "data.val_fraction=0.25", "precision=fp64", "loss.stress.weight=1.0",
            "logging.plots=false", "logging.progress_bar=false", "device=cpu"])
        train(cfg)
        hist = load_checkpoint(tmp_path / name / "checkpoints/last.pt")["progress"]["history"]
        return [{k: v for k, v in h.items() if k.startswith(("train_", "val_", "lr", "step"))}
                for h in hist]

    ref = history("xyz", paths["extxyz"])
    assert len(ref) == 2 and "train_loss" in ref[1] and "val_forces_mae" in ref[1]
    assert history("lmdb", paths["aselmdb"]) == ref
    assert history("shards", shards, "data.datasets.0.format=aselmdb") == ref


# ------------------------------------------------------------------ the stored index
def _varied(frames):
    """``frames`` with the labels varied: no energy, no forces, a virial instead of the
    stress, no labels at all (the label counts of each branch)."""
    out = [a.copy() for a in frames]
    for a, b in zip(frames, out):
        b.calc = SinglePointCalculator(b, **a.calc.results)
    del out[1].calc.results["energy"]
    del out[2].calc.results["forces"]
    virial = out[3].calc.results.pop("stress")
    out[3].info["virial"] = np.diag(virial[:3]) * 5.0
    out[5].calc = None
    return out


def _full_pass(ds):
    """The label counts and species of reading every structure as a graph."""
    from xnn.data.datasets import count_labels_by_reading

    graphs = [ds[i] for i in range(len(ds))]
    return (count_labels_by_reading(ds),
            sorted(set(torch.cat([g.numbers for g in graphs]).tolist())))


@pytest.mark.parametrize("fmt", ["extxyz", "db", "aselmdb"])
def test_a_second_open_reads_the_stored_index(tmp_path, frames, fmt, monkeypatch):
    """The first open stores atom counts, label counts and species equal to a full pass;
    the second reads them back without reading the file's structures or scanning it."""
    from xnn.data.sources import index

    monkeypatch.setenv("XNN_CACHE_DIR", str(tmp_path / "cache"))
    path = _paths(tmp_path, _varied(frames))[fmt]
    ds = read_structures(path, workers=0)
    counts, species = _full_pass(ds)
    assert (ds.label_counts() == counts).all() and ds.species() == species
    stress_of_virial = 9 if fmt == "extxyz" else 0  # a database keeps no info["virial"]
    assert counts[1:6].tolist() == [[0, 3 * len(frames[1]), 9], [1, 0, 9],
                                    [1, 3 * len(frames[3]), stress_of_virial],
                                    [1, 3 * len(frames[4]), 0], [0, 0, 0]]
    beside, cached = index.index_paths(path, fmt, dict(
        energy_key="energy", forces_key="forces", stress_key="stress", virial_key="virial"))
    assert beside.is_file() and not cached.exists()
    cls = type(ds)
    monkeypatch.setattr(cls, "_atoms", lambda self, i: pytest.fail("a structure was read"))
    monkeypatch.setattr(cls, "_scan", lambda self: pytest.fail("the file was scanned"))
    again = read_structures(path, workers=0)
    # held as int32 on both opens (4 bytes a count; 12 a structure's label counts)
    assert again.n_atoms.dtype == ds.n_atoms.dtype == np.int32
    assert again.label_counts().dtype == ds.label_counts().dtype == np.int32
    assert again.n_atoms.tolist() == ds.n_atoms.tolist()
    assert (again.label_counts() == counts).all() and again.species() == species
    monkeypatch.undo()
    other = read_structures(path, energy_key="REF_energy", workers=0)  # another index
    assert len(list(tmp_path.glob(f".{path.name}.*.xnn-index.npz"))) == 2
    assert other.label_counts()[:, 0].sum() == 0
    assert (other.label_counts()[:, 1:] == counts[:, 1:]).all()


@pytest.mark.parametrize("fmt", ["extxyz", "aselmdb"])
def test_a_changed_file_rebuilds_its_index(tmp_path, frames, fmt):
    path = _paths(tmp_path, frames)[fmt]
    first = read_structures(path, workers=0)
    assert (first.label_counts()[:, 2] > 0).sum() == 8
    st = os.stat(path)
    changed = _varied(frames)[::-1] + _varied(frames)[:3]
    if fmt == "extxyz":
        ase.io.write(path, changed, format="extxyz")
    else:
        for f in (path, path.with_name(path.name + "-lock")):
            f.unlink(missing_ok=True)
        _write_db(path, changed)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # only the size tells
    again = read_structures(path, workers=0)
    counts, species = _full_pass(again)
    assert len(again) == len(changed)
    assert again.n_atoms.tolist() == [len(a) for a in changed]
    assert (again.label_counts() == counts).all() and again.species() == species
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # touched: made again
    assert (read_structures(path, workers=0).label_counts() == counts).all()


def test_the_index_goes_to_the_cache_where_the_folder_cannot_take_it(tmp_path, frames,
                                                                   monkeypatch):
    from xnn.data.sources import index

    monkeypatch.setenv("XNN_CACHE_DIR", str(tmp_path / "cache"))
    path = _paths(tmp_path, frames)["extxyz"]
    beside, cached = index.index_paths(path, "extxyz", dict(
        energy_key="energy", forces_key="forces", stress_key="stress", virial_key="virial"))
    beside.mkdir()  # the name is taken: the index cannot be written there
    counts = read_structures(path, workers=0).label_counts()
    assert cached.is_file() and cached.parent == tmp_path / "cache" / "index"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    assert index.load_index(path, "extxyz", index.identity(path, "extxyz", dict(
        energy_key="energy", forces_key="forces", stress_key="stress",
        virial_key="virial"))["keys"]) is not None
    assert (open_source(path).label_counts() == counts).all()


@pytest.mark.parametrize("fmt", ["extxyz", "aselmdb"])
def test_the_first_pass_over_workers_equals_one_process(tmp_path, frames, fmt, monkeypatch):
    """Ranges of structures read by two forked workers give the counts and species of one
    process, and the first broken structure's refusal, in the same words."""
    from xnn.data.sources import scan

    monkeypatch.setattr(scan, "MIN_PARALLEL", 0)
    many = _varied(frames) * 3
    bad = [a.copy() for a in many]
    for a, b in zip(many, bad):
        b.calc = None if a.calc is None else SinglePointCalculator(b, **a.calc.results)
    bad[17].calc.results["energy"] = np.inf
    bad[23].calc.results["forces"][0, 0] = np.nan
    for name, frames_ in (("good", many), ("bad", bad)):
        (tmp_path / name).mkdir()
        path = _paths(tmp_path / name, frames_)[fmt]
        if name == "good":
            one = open_source(path, workers=0).label_counts()
            two = open_source(path, workers=2)
            assert (two.label_counts() == one).all() and two.species() == [29, 79]
            assert (one == _full_pass(two)[0]).all()
        else:
            msg = raises_one_line(DataFileError, read_structures, path, workers=0)
            assert "structure 17" in msg and "inf" in msg, msg
            assert raises_one_line(DataFileError, read_structures, path, workers=2) == msg


def _mixed_rows(frames):
    """Rows with labels in every place a record holds them: calculator results, key-value
    pairs and data under other keys, 3x3 stress, virial of a slab, a molecule with forces only,
    a structure without labels, per-atom arrays and a constraint."""
    from ase.build import molecule
    from ase.constraints import FixAtoms

    rng = np.random.default_rng(3)
    rows = [(a, {}, {}) for a in frames]
    slab = bulk("Cu", cubic=True) * (2, 1, 1)
    slab.pbc = [True, True, False]
    slab.calc = SinglePointCalculator(slab, energy=-7.5)
    rows.append((slab, {"REF_energy": -7.25}, {"virial": rng.normal(size=(3, 3)),
                                               "REF_stress": rng.normal(size=(3, 3))}))
    mol = molecule("H2O")
    mol.set_initial_charges([0.1, -0.2, 0.1])
    mol.set_tags([1, 2, 3])
    mol.set_constraint(FixAtoms([0]))
    mol.calc = SinglePointCalculator(mol, forces=rng.normal(size=(3, 3)))
    rows.append((mol, {"REF_energy": 1.5}, {"REF_forces": rng.normal(size=(3, 3))}))
    bare = bulk("Au", cubic=True)
    bare.set_initial_magnetic_moments([1.0, 0, 0, 0])
    rows.append((bare, {"kind": "bare"}, {}))
    return rows


def test_the_first_pass_reads_lmdb_records_as_it_reads_atoms(tmp_path, frames):
    """The first pass over ASE-LMDB decodes each record without building an ``Atoms``; the
    label counts and species it finds are those of the rows read as ``Atoms``, under every
    key mapping, and a broken row is refused as before."""
    from xnn.data.sources.asedb import _RecordAtoms
    from xnn.data.sources.frames import _label_row

    path = tmp_path / "mixed.aselmdb"
    db = connect(str(path))
    for atoms, kvp, data in _mixed_rows(frames):
        db.write(atoms, data=data, **kvp)
    del db
    key_sets = [{}, {"energy_key": "REF_energy", "forces_key": "REF_forces",
                     "stress_key": "REF_stress"}, {"stress_key": None, "virial_key": None}]
    for keys in key_sets:
        ds = open_source(path, **keys)
        for i in range(len(ds)):
            lean, full = ds._counted_atoms(i), ds.atoms(i)
            assert isinstance(lean, _RecordAtoms)
            assert np.array_equal(lean.numbers, full.numbers)
            assert np.array_equal(_label_row(lean, ds.keys), _label_row(full, ds.keys)), i
        counts, species = ds.count_range(0, len(ds))
        ref = [_label_row(ds.atoms(i), ds.keys) for i in range(len(ds))]
        assert np.array_equal(counts, np.stack(ref))
        assert species.tolist() == sorted({int(z) for i in range(len(ds))
                                           for z in ds.atoms(i).numbers})
        assert counts.sum() > 0
    bad = [a.copy() for a in frames]
    for a, b in zip(frames, bad):
        b.calc = SinglePointCalculator(b, **a.calc.results)
    bad[6].calc.results["forces"][2, 1] = np.nan
    bad[2].cell[2] = bad[2].cell[1]  # singular along z
    for broken, words in ((bad[3:7], "structure 3"), (bad[:3], "structure 2")):
        p = _write_db(tmp_path / f"bad{len(broken)}.aselmdb", broken)
        msg = raises_one_line((DataFileError, InputError), open_source(p).count_range, 0,
                              len(broken))
        assert words in msg, msg


def test_cell_faces_are_numpy_cross_products():
    from xnn.data.ase_io import _faces

    rng = np.random.default_rng(0)
    for _ in range(2000):
        cell = rng.normal(size=(3, 3)) * 10 ** rng.uniform(-8, 3)
        ref = np.stack([np.cross(cell[(a + 1) % 3], cell[(a + 2) % 3]) for a in range(3)])
        assert np.array_equal(_faces(cell), ref)


# --------------------------------------------------------------------------- batched reads
def _same_batch(a, b):
    """Two batched graphs: the same fields, dtypes, shapes and bits (NaN = NaN)."""
    assert set(a.keys()) == set(b.keys()), (sorted(a.keys()), sorted(b.keys()))
    for key in a.keys():
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, key=key: f"{key}: {m}")


def _no_single_reads(monkeypatch, ds):
    def refuse(self, index):
        raise AssertionError("read structure by structure")
    monkeypatch.setattr(type(ds), "__getitem__", refuse)


@pytest.mark.parametrize("fmt", ["extxyz", "db", "aselmdb"])
def test_batched_reads_equal_per_structure_reads(tmp_path, frames, fmt, monkeypatch):
    """``read_batch`` of an ASE source (rows read at once, one conversion) gives bitwise the
    collated per-structure graphs: in any order, with repeats, a structure without stress,
    an isolated atom, labels under other keys, a virial, a molecule with forces only; a
    batch is built without per-structure reads (labels some structures lack are NaN there
    too), and a broken structure is refused with the per-structure message."""
    from xnn.data.datasets import collate

    ds = open_source(_paths(tmp_path, frames)[fmt], weight=0.5)
    for idx in ([9, 0, 4, 4, 2, 7], [3], [8, 1, 6, 1, 0]):
        _same_batch(ds.read_batch(idx), collate([ds[i] for i in idx]))
    for idx in ([8, 1, 6, 1, 0], [9, 0, 4, 4, 2, 7]):  # the second: stress in some only
        want = collate([ds[i] for i in idx])
        with monkeypatch.context() as m:
            _no_single_reads(m, ds)
            _same_batch(ds.read_batch(idx), want)
    assert torch.isnan(want.stress[[0, 2, 3]]).all() and torch.isfinite(want.stress[1]).all()
    mixed = tmp_path / f"mixed.{fmt if fmt != 'extxyz' else 'db'}"
    db = connect(str(mixed))
    for atoms, kvp, data in _mixed_rows(frames):
        db.write(atoms, data=data, **kvp)
    del db
    for keys in ({}, {"energy_key": "REF_energy", "forces_key": "REF_forces",
                      "stress_key": "REF_stress"}):
        ds = open_source(mixed, **keys)
        order = list(range(len(ds)))[::-1]
        _same_batch(ds.read_batch(order), collate([ds[i] for i in order]))
    # rows with their own masses, momenta, magnetic moments, a constraint: read at once
    from ase.constraints import FixAtoms

    own = [a.copy() for a in frames[:4]]
    for k, (a, b) in enumerate(zip(frames, own)):
        b.calc = SinglePointCalculator(b, **a.calc.results)
        b.set_masses(a.get_masses() * (1.0 + 0.1 * k))
        b.set_momenta(np.full((len(b), 3), 0.01 * k))
        b.set_initial_magnetic_moments(np.full(len(b), 0.5))
        b.set_constraint(FixAtoms([0]))
    ds = open_source(_write_db(tmp_path / f"own.{fmt if fmt != 'extxyz' else 'db'}", own))
    want = collate([ds[i] for i in (3, 0, 2, 1)])
    with monkeypatch.context() as m:
        _no_single_reads(m, ds)
        _same_batch(ds.read_batch([3, 0, 2, 1]), want)
    assert not torch.equal(want.masses[-len(own[1]):], torch.as_tensor(frames[1].get_masses()))
    bad = [a.copy() for a in frames]
    for a, b in zip(frames, bad):
        b.calc = SinglePointCalculator(b, **a.calc.results)
    bad[6].calc.results["forces"][2, 1] = np.inf
    ds = open_source(_write_db(tmp_path / f"bad.{fmt if fmt != 'extxyz' else 'db'}", bad))
    msg = raises_one_line(DataFileError, lambda: ds[6])
    assert raises_one_line(DataFileError, ds.read_batch, [1, 6, 0]) == msg


def test_batched_hdf5_reads_equal_per_structure_reads(tmp_path, frames, monkeypatch):
    """``read_batch`` of an HDF5 file (one read per array for the batch: its structures'
    row ranges) gives bitwise the collated per-structure graphs, in any order, with repeats,
    missing labels, in float32 and with a weight; no structure is read one by one."""
    from xnn.data.ase_io import from_ase
    from xnn.data.datasets import HDF5Source, collate
    from xnn.data.hdf5 import HDF5Dataset, write_hdf5

    path = tmp_path / "d.h5"
    write_hdf5(path, [from_ase([a]) for a in frames])
    idx = [9, 0, 4, 4, 2, 7, 1]
    for ds in (HDF5Source(path, weight=0.5), HDF5Dataset(path, dtype=torch.float32)):
        want = collate([ds[i] for i in idx])
        with monkeypatch.context() as m:
            _no_single_reads(m, ds)
            got = ds.read_batch(idx)
        _same_batch(got, want)
        assert got.n_systems == len(idx)
        with pytest.raises(IndexError):
            ds.read_batch([0, len(ds)])
    assert torch.isnan(got.stress[2]).all() and got.positions.dtype == torch.float32


def test_batched_reads_of_shards_equal_per_structure_reads(tmp_path, frames, monkeypatch):
    """A folder of ASE-LMDB shards (OMat24's layout): one batched read per shard the batch
    touches, put back in the batch's order, bitwise the collated per-structure graphs."""
    from xnn.data.datasets import collate

    folder = tmp_path / "omat"
    folder.mkdir()
    for k, part in enumerate([frames[:4], frames[4:5], frames[5:]]):
        _write_db(folder / f"data.{k:04d}.aselmdb", part)
    ds = open_source(folder)
    for idx in ([7, 0, 5, 3, 0, 8], [2, 1], [4, 0], [4]):
        want = collate([ds[i] for i in idx])
        with monkeypatch.context() as m:
            for part in ds.datasets:
                _no_single_reads(m, part)
            got = ds.read_batch(idx)
        _same_batch(got, want)
    assert got.n_systems == 1 and got.system_id.tolist() == [0]  # index in its shard
    # two broken structures in two shards: the batch's first is named, as one by one
    bad = [a.copy() for a in frames]
    for a, b in zip(frames, bad):
        b.calc = SinglePointCalculator(b, **a.calc.results)
    for k in (1, 6):
        bad[k].calc.results["forces"][0, 0] = np.nan
    folder = tmp_path / "bad"
    folder.mkdir()
    for k, part in enumerate([bad[:4], bad[4:]]):
        _write_db(folder / f"data.{k:04d}.aselmdb", part)
    ds = open_source(folder)
    msg = raises_one_line(DataFileError, ds.read_batch, [6, 1])
    assert msg == raises_one_line(DataFileError, lambda: ds[6]) and "structure 2" in msg
