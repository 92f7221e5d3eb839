"""The prepared sharded format (``xnn data prepare``, :mod:`xnn.data.prepared`): every
structure read back equals the source's, the stored counts and statistics equal the ones
computed from the structures, writing streams and is atomic, and training from a prepared
folder follows the same trajectory as training from its extxyz or ASE-LMDB source."""

from __future__ import annotations

import csv
import pickle
import weakref

import numpy as np
import pytest
import torch

from xnn.app.data import PROPERTIES, edge_counter, prepare_files
from xnn.app.train_model import data_statistics, stored_statistics
from xnn.config.loader import load_config
from xnn.config.model import ModelConfig
from xnn.config.train import TrainConfig
from xnn.data import keys as K
from xnn.data.datasets import ConcatDataset, Subset
from xnn.data.emt import write_emt
from xnn.data.prepared import PreparedDataset, write_prepared
from xnn.data.sources import read_structures
from xnn.errors import DataFileError, InputError
from xnn.neighbors.datasets import WithEdges

KEYS = {p: p for p in PROPERTIES}
CUTOFF = 3.5
FIELDS = (K.POSITIONS, K.NUMBERS, K.CELL, K.PBC, K.ENERGY, K.FORCES, K.STRESS, K.WEIGHT,
          K.ATOM_ID, K.SYSTEM_ID, K.BATCH)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """EMT Cu-Au structures (one without energy, one without stress) and their prepared
    form in 3 shards."""
    import ase.io

    d = tmp_path_factory.mktemp("prep")
    write_emt(d / "emt.xyz", 24, ["Cu", "Au"], seed=5)
    frames = ase.io.read(d / "emt.xyz", index=":")
    for key in ("energy", "free_energy"):
        frames[4].info.pop(key, None)
        if frames[4].calc is not None:
            frames[4].calc.results.pop(key, None)
    frames[6].info.pop("stress", None)
    if frames[6].calc is not None:
        frames[6].calc.results.pop("stress", None)
    ase.io.write(d / "cuau.xyz", frames, format="extxyz")
    prepare_files([str(d / "cuau.xyz")], str(d / "prep"), 3, CUTOFF, KEYS)
    return d


def _same(a, b) -> None:
    for key in FIELDS:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(torch.nan_to_num(x, nan=1e300), torch.nan_to_num(y, nan=1e300)), key


def test_structures_counts_and_origin_equal_the_source(data):
    src = read_structures(data / "cuau.xyz")
    ds = read_structures(data / "prep")  # a folder with prepared.json
    assert isinstance(ds, PreparedDataset) and len(ds) == len(src) == 24
    for i in range(len(src)):
        _same(ds[i], src[i])
        assert ds.origin(i) == (str(data / "cuau.xyz"), i)
    assert np.array_equal(ds.n_atoms, src.n_atoms)
    assert np.array_equal(ds.label_counts(), src.label_counts())
    assert torch.isnan(ds[4].energy).all() and torch.isnan(ds[6].stress).all()
    assert ds.species() == src.species() == [29, 79]
    # shards: contiguous, non-empty, about equal in atoms
    atoms = [s["n_atoms"] for s in ds.manifest["shards"]]
    assert len(atoms) == 3 and min(atoms) > 0 and sum(atoms) == int(src.n_atoms.sum())
    assert max(atoms) - min(atoms) <= 2 * int(src.n_atoms.max())
    # the stored edge counts are those of the training's neighbor lists
    edges = WithEdges(src, CUTOFF, cache=False)
    stored = ds.stored_statistics(np.arange(len(ds)), CUTOFF)
    assert stored.n_edges.tolist() == [edges[i].edge_index.shape[1] for i in range(len(src))]
    assert np.array_equal(ds.n_edges, stored.n_edges)
    assert ds.stored_statistics([0], CUTOFF + 0.1) is None  # another cutoff: none
    # xnn data inspect: the labels a prepared folder holds (one structure has no energy)
    from xnn.app.data import inspect_file

    report = inspect_file(str(data / "prep"), None, KEYS)
    assert "24 structures" in report and "energy_key=energy: in 23 of 24" in report
    # pickles cheaply (a data-loader worker maps the arrays again), reads the same
    _ = ds.n_atoms, ds[3]
    blob = pickle.dumps(ds)
    assert len(blob) < 8000
    _same(pickle.loads(blob)[3], src[3])


def test_stored_statistics_equal_computed(data):
    """Statistics from the stored counts of a split (Subset of a Concat of prepared sets)
    equal those data_statistics computes from the structures (to 1e-12); with an extxyz
    among the data there are none; the manifest's whole-dataset figures agree too."""
    prep = PreparedDataset(data / "prep")
    src = read_structures(data / "cuau.xyz")
    pick = np.array([0, 2, 3, 5, 7, 8, 11, 13, 17, 19, 20, 23])
    species = [29, 79]
    for e0 in ("fit", "zero"):
        cfg = ModelConfig(name="schnet", cutoff=CUTOFF, e0=e0, scale_shift=True)
        for sample in (Subset(prep, pick), Subset(ConcatDataset([prep, Subset(prep, pick)]),
                                                  np.arange(30))):
            mirror = [src[int(i)] for i in _source_indices(sample)]
            got = stored_statistics(cfg, species, sample)
            want = data_statistics(cfg, species, mirror)
            assert got.keys() == want.keys()
            for key in ("avg_num_neighbors", "shift", "scale"):
                assert abs(got[key] - want[key]) <= 1e-12 * max(1.0, abs(want[key])), key
            for z in species:
                assert abs(got["e0"][z] - want["e0"][z]) <= 1e-12 * max(1, abs(want["e0"][z]))
    cfg = ModelConfig(name="schnet", cutoff=CUTOFF)
    assert stored_statistics(cfg, species, ConcatDataset([prep, src])) is None
    assert stored_statistics(ModelConfig(name="schnet", cutoff=4.0), species, prep) is None
    whole = data_statistics(ModelConfig(name="schnet", cutoff=CUTOFF), species,
                            [src[i] for i in range(len(src))])
    stats = prep.manifest["statistics"]
    assert abs(stats["avg_num_neighbors"] - whole["avg_num_neighbors"]) <= 1e-12
    assert abs(stats["force_rms"] - whole["scale"]) <= 1e-12
    for z in species:
        assert abs(stats["e0_fit"][str(z)] - whole["e0"][z]) <= 1e-8
    assert abs(stats["energy_per_atom_mean"] - whole["shift"]) <= 1e-8


def _source_indices(sample) -> list[int]:
    """The source-file index of each structure of ``sample``."""
    return [sample.origin(i)[1] for i in range(len(sample))]


class _Counting:
    """A dataset that counts the structures it handed out that are still alive."""

    def __init__(self, inner):
        self.inner, self.n_atoms, self.alive, self.peak = inner, inner.n_atoms, [], 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        g = self.inner[i]  # graphs hold no reference cycles: freed when last unreferenced
        self.alive = [r for r in self.alive if r() is not None]
        self.alive.append(weakref.ref(g.positions))
        self.peak = max(self.peak, len(self.alive))
        return g

    def origin(self, i):
        return self.inner.origin(i)

    def isolated_atoms(self):
        return self.inner.isolated_atoms()


def test_writing_streams_and_is_atomic(data, tmp_path):
    """At most two chunks of structures are alive while writing (memory does not grow with
    the input); an existing non-empty folder is refused without --overwrite, replaced with
    it, and no .tmp folder is left; a structure with coincident atoms is refused, naming
    its file and index, and leaves no output."""
    from xnn.data.hdf5 import write_hdf5

    src = read_structures(data / "cuau.xyz")
    write_hdf5(tmp_path / "lazy.h5", (src[i] for i in range(len(src))))
    counting = _Counting(read_structures(tmp_path / "lazy.h5"))  # new graphs at each read
    out = tmp_path / "out"
    write_prepared(counting, out, 2, CUTOFF, count_edges=edge_counter(CUTOFF), chunk=3)
    assert counting.peak <= 6 and len(PreparedDataset(out)) == 24
    with pytest.raises(InputError, match="not empty.*--overwrite"):
        prepare_files([str(data / "cuau.xyz")], str(out), 1, CUTOFF, KEYS)
    prepare_files([str(data / "cuau.xyz")], str(out), 1, CUTOFF, KEYS, overwrite=True)
    assert len(PreparedDataset(out).manifest["shards"]) == 1
    assert not (tmp_path / "out.tmp").exists()
    with pytest.raises(InputError, match="--shards"):
        prepare_files([str(data / "cuau.xyz")], str(tmp_path / "x"), 25, CUTOFF, KEYS)
    import ase.io

    frames = ase.io.read(data / "cuau.xyz", index=":")
    frames[9].positions[1] = frames[9].positions[0] + 0.01
    ase.io.write(tmp_path / "bad.xyz", frames, format="extxyz")
    with pytest.raises(DataFileError, match=r"structure 9 of .*bad.xyz.*coincident"):
        prepare_files([str(tmp_path / "bad.xyz")], str(tmp_path / "bad"), 2, CUTOFF, KEYS)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()


def _aselmdb(path, xyz) -> None:
    """The structures of ``xyz`` in an ASE-LMDB file, labels in a single-point calculator
    (as OMat24 stores them)."""
    import ase.db
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    with ase.db.connect(str(path)) as db:
        for atoms in ase.io.read(xyz, index=":"):
            results = {k: v for k, v in atoms.calc.results.items()
                       if k in ("energy", "forces", "stress")}
            atoms.calc = SinglePointCalculator(atoms, **results)
            db.write(atoms)


def _losses(tmp, data_path, name) -> list[float]:
    from xnn.app.train import train

    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={data_path}", f"output_dir={tmp / name}", "model.name=schnet",
        f"model.cutoff={CUTOFF}", "model.hyperparameters={num_features: 8, num_filters: 8, "
        "num_interactions: 1, num_basis: 8}", "precision=fp64", "device=cpu",
        "data.batch_size=4", "data.val_fraction=0.25", "max_epochs=2",
        "logging.every_n_steps=1", "logging.plots=false", "logging.progress_bar=false"])
    train(cfg)
    with open(tmp / name / "steps.csv", newline="") as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def test_training_from_prepared_equals_sources(data, tmp_path, capsys):
    """fp64, 2 epochs: the loss of every step from the prepared folder equals that from its
    extxyz source, and from an ASE-LMDB source and its prepared folder (to 1e-12)."""
    pytest.importorskip("ase_db_backends")
    xyz = data / "cuau.xyz"
    # the ASE-LMDB copy: every label (energy, forces, stress) on every structure
    write_emt(tmp_path / "full.xyz", 16, ["Cu", "Au"], seed=8)
    _aselmdb(tmp_path / "full.aselmdb", tmp_path / "full.xyz")
    prepare_files([str(tmp_path / "full.aselmdb")], str(tmp_path / "full_prep"), 2, CUTOFF,
                  KEYS)
    ref = _losses(tmp_path, xyz, "xyz")
    capsys.readouterr()
    got = _losses(tmp_path, data / "prep", "prep")
    assert "statistics: from the counts stored" in capsys.readouterr().out
    assert len(ref) == len(got) == 10
    assert max(abs(a - b) for a, b in zip(ref, got)) <= 1e-12
    lmdb = _losses(tmp_path, tmp_path / "full.aselmdb", "lmdb")
    full = _losses(tmp_path, tmp_path / "full.xyz", "full")
    lmdb_prep = _losses(tmp_path, tmp_path / "full_prep", "lmdb_prep")
    assert len(lmdb) == len(lmdb_prep) == 6
    assert max(abs(a - b) for a, b in zip(lmdb, lmdb_prep)) <= 1e-12
    assert max(abs(a - b) for a, b in zip(full, lmdb)) <= 1e-12


def test_several_inputs_isolated_atoms_and_no_cutoff(data, tmp_path):
    """Two inputs become one dataset: each entry names its own file and index; the
    isolated-atom entries (config_type=IsolatedAtom) of the second keep their energies and
    ``model.e0=isolated`` finds the same E0s as from the files; without a cutoff no edge
    counts are stored and training computes its statistics."""
    import ase.io
    from ase import Atoms

    from xnn.app.train_data import build_splits

    iso = []
    for z, e in ((29, -0.25), (79, -0.5)):
        a = Atoms(numbers=[z], positions=[[5.0, 5.0, 5.0]], cell=[10.0] * 3, pbc=False)
        a.info = {"config_type": "IsolatedAtom", "energy": e}
        a.arrays["forces"] = np.zeros((1, 3))
        iso.append(a)
    frames = ase.io.read(data / "cuau.xyz", index=":8")
    ase.io.write(tmp_path / "second.xyz", [frames[0], iso[0], frames[1], iso[1]],
                 format="extxyz")
    files = [str(data / "cuau.xyz"), str(tmp_path / "second.xyz")]
    prepare_files(files, str(tmp_path / "both"), 2, None, KEYS)
    ds = PreparedDataset(tmp_path / "both")
    assert len(ds) == 28 and ds.origin(23) == (files[0], 23) and ds.origin(26) == (files[1], 2)
    assert ds.isolated_atoms() == {25: (29, -0.25), 27: (79, -0.5)}
    assert ds.manifest["statistics"]["e0_isolated"] == {"29": -0.25, "79": -0.5}
    assert ds.manifest["statistics"]["avg_num_neighbors"] is None and ds.n_edges is None
    assert ds.stored_statistics([0, 1], CUTOFF) is None
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={tmp_path / 'both'}",
                                          "model.e0=isolated", f"model.cutoff={CUTOFF}"])
    splits = build_splits(cfg.data, cfg.loss, CUTOFF, 0, isolated_atoms=True)
    assert splits.isolated_e0 == {29: -0.25, 79: -0.5}
    assert len(splits.raw_train) + len(splits.val) == 26


def _identical(a, b) -> None:
    """Every field of two graphs: the same names, dtypes, shapes and values (NaN = NaN)."""
    assert set(a.keys()) == set(b.keys())
    for key in a.keys():
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(torch.nan_to_num(x, nan=1e300), torch.nan_to_num(y, nan=1e300)), key


def test_batched_read_equals_per_structure_reads(data):
    """``read_batch`` (one gather per field and shard, one graph, one neighbor-list call) gives
    bitwise the batch that collating the per-structure reads gives: across shards, in any
    order, with repeats, through a subset, in float32 with a weight, with edges; and the
    training's ``BatchSharding.load`` hands it to the predictor."""
    from xnn.data.datasets import collate
    from xnn.training.sharding import BatchSharding

    ds = read_structures(data / "prep")
    idx = [23, 0, 6, 12, 4, 6, 17, 1]  # three shards, unordered, a repeat, missing labels
    perm = np.random.default_rng(3).permutation(len(ds))
    light = PreparedDataset(data / "prep", weight=2.5, dtype=torch.float32)
    for d in (ds, Subset(ds, perm), light, WithEdges(ds, CUTOFF, cache=False),
              WithEdges(Subset(light, perm), CUTOFF, cache=False),
              WithEdges(ds, CUTOFF, cache=True)):
        batch = d.read_batch(idx)
        _identical(batch, collate([d[i] for i in idx]))
        assert batch.n_systems == len(idx)
    assert light.read_batch(idx).positions.dtype == torch.float32
    assert torch.equal(ds.read_batch(idx).system_id, torch.tensor(idx))
    edges = WithEdges(Subset(ds, perm), CUTOFF, cache=False)
    (got,) = BatchSharding().load(edges, idx)
    _identical(got, collate([edges[i] for i in idx]))
    assert got.edge_index.shape[1] > 0
    # decomposed training takes one graph per structure, without edges
    apart = BatchSharding(without_edges=True).load(edges, idx)
    assert len(apart) == len(idx) and K.EDGE_INDEX not in apart[0].keys()
    assert BatchSharding().load(edges, []) == []
    with pytest.raises(IndexError):
        ds.read_batch([0, len(ds)])


class _Plain:
    """The least a dataset is: ``len``, ``[i]`` and ``n_atoms``."""

    def __init__(self, graphs):
        self.graphs, self.n_atoms = graphs, np.array([g.n_atoms for g in graphs])

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int):
        return self.graphs[index]


def test_batched_edges_equal_per_structure_edges_for_every_cell():
    """One neighbor-list call over a batch of periodic, triclinic, mixed-pbc, tiny and
    non-periodic (zero cell) structures gives each structure's own list, offset; a batch
    holding coincident atoms is refused with the per-structure refusal (the first bad one)."""
    from helpers import structures as S

    from xnn.data.datasets import InMemoryDataset, collate

    graphs = [S.cubic(), S.triclinic(), S.molecule(), S.slab(), S.tiny(), S.vacuum_slab(),
              S.cluster()]
    ds = WithEdges(InMemoryDataset(graphs), 4.0, cache=False)
    order = [3, 0, 6, 2, 5, 1, 4]
    _identical(ds.read_batch(order), collate([ds[i] for i in order]))
    plain = WithEdges(_Plain(graphs), 4.0, cache=False)  # any dataset, not a LabelledDataset
    _identical(plain.read_batch(order), collate([ds[i] for i in order]))
    bad = [g.replace({K.POSITIONS: g.positions.clone()}) for g in graphs]
    for k in (5, 2):  # two bad structures: the first read is named
        bad[k].positions[1] = bad[k].positions[0] + 0.05
    bad_ds = WithEdges(InMemoryDataset(bad), 4.0, cache=False)
    with pytest.raises(DataFileError) as batched:
        bad_ds.read_batch(order)
    with pytest.raises(DataFileError) as single:
        bad_ds[2]
    assert "coincident" in str(batched.value) and str(batched.value) == str(single.value)


@pytest.mark.parametrize("gap, found", [(0.0995, True), (0.1005, False), (0.102, False)])
def test_close_edge_found_at_the_threshold(gap, found):
    """The numpy pre-check of :func:`first_close_edge` (a 1 % margin) never hides a pair
    closer than 0.1 Å, through a periodic image too, and the exact check decides between."""
    from xnn.data.graph import AtomicGraph
    from xnn.neighbors import with_edges
    from xnn.neighbors.coincident import first_close_edge

    for pos in ([[0.0, 0.0, 0.0], [gap, 0.0, 0.0]], [[0.0, 0.0, 0.0], [4.0 - gap, 1.0, 1.0]]):
        pos[1][1:] = [0.0, 0.0]
        g = with_edges(AtomicGraph.from_arrays(np.array(pos), [29, 29], cell=np.eye(3) * 4.0,
                                               pbc=[True] * 3), 1.0)
        pair = first_close_edge(g)
        assert (pair is not None) == found
        if found:
            assert pair.distance == pytest.approx(gap, rel=1e-9)
