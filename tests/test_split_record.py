"""The split record of a run at 10^8-structure scale (issue 45): the membership is held as the
splits' own int32 arrays (the very structures of the int64 list code path it replaced, bit
for bit), ``split.json`` keeps only row places and ``split.npy`` the indices (4 bytes each),
version-1 records (indices as JSON lists) still read, and a run resumed over one finishes
with the same membership in the new form."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from xnn.app.evaluate import read_split_record
from xnn.app.split_record import (
    INDICES_FILE,
    ROW_KEYS,
    SELECTION_KEY,
    read_split,
    write_split,
)
from xnn.app.train_data import build_splits
from xnn.cli.main import main
from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.errors import InputError

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")


def _old_split_indices(n: int, val_fraction: float, test_fraction: float, seed: int):
    """The int64 code path the compact split replaced: ``permutation(n)``, sorted copies."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test = int(round(n * val_fraction)), int(round(n * test_fraction))
    return (np.sort(perm[n_val + n_test:]), np.sort(perm[:n_val]),
            np.sort(perm[n_val:n_val + n_test]))


def write_v1(record: dict, path) -> None:
    """A split record as xnn wrote it before version 2 (the indices as JSON lists, one line
    each), from a record read back by :func:`read_split`."""
    old = {k: v for k, v in record.items() if k != "indices"}
    old["version"] = 1
    for key in ROW_KEYS:
        if key in record:
            old[key] = [{"file": r["file"], "indices": np.asarray(r["indices"]).tolist()}
                        for r in record[key]]
    if record.get(SELECTION_KEY) is not None:
        old[SELECTION_KEY] = np.asarray(record[SELECTION_KEY]).tolist()
    text = json.dumps(old, indent=1)
    text = re.sub(r"\[\n\s*([-\d,\s]*?)\n\s*\]", lambda m: f"[{' '.join(m[1].split())}]", text)
    path.write_text(text + "\n")


def test_membership_is_the_old_lists_bit_for_bit_in_int32(tmp_path):
    """Two split files (seeds ``seed + 7919 k``) and an explicit validation file: every row is
    the old code path's list, held as an int32 array; a split's row is its Subset's own
    buffer (no copy), a whole file an arange."""
    sizes = (37, 23)
    for k, n in enumerate(sizes):
        write_emt(tmp_path / f"d{k}.xyz", n, ["Cu"], seed=k)
    write_emt(tmp_path / "v.xyz", 5, ["Cu"], seed=9)
    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={tmp_path / 'd0.xyz'}",
        f"data.datasets.1.path={tmp_path / 'd1.xyz'}",
        "data.test_fraction=0.2", f"data.val.0.path={tmp_path / 'v.xyz'}", "seed=11"])
    splits = build_splits(cfg.data, cfg.loss, 3.0, cfg.seed)
    m = splits.membership
    for k, n in enumerate(sizes):
        old_train, old_val, old_test = _old_split_indices(n, 0.0, 0.2, 11 + 7919 * k)
        assert len(old_val) == 0
        (train,) = [r["indices"] for r in m["train"] if r["file"] == k]
        (test,) = [r["indices"] for r in m["test"] if r["file"] == k]
        assert train.dtype == np.int32 and test.dtype == np.int32
        assert train.tolist() == old_train.tolist() and test.tolist() == old_test.tolist()
        assert train.nbytes == 4 * len(old_train)
    assert np.shares_memory(m["train"][0]["indices"], splits.raw_train.datasets[0].indices)
    (val,) = m["val"]
    assert val["file"] == 2 and val["indices"].dtype == np.int32
    assert val["indices"].tolist() == list(range(5))


def _membership(n: int, rng) -> dict:
    perm = rng.permutation(n).astype(np.int32)
    return {"files": [{"config_key": "data.datasets.0", "path": "a.xyz"},
                      {"config_key": "data.replay.0", "path": "b.xyz"}],
            "train": [{"file": 0, "indices": np.sort(perm[n // 5:])}],
            "val": [{"file": 0, "indices": np.sort(perm[:n // 10])}],
            "test": [{"file": 0, "indices": perm[n // 10:n // 5]}],  # any order is kept
            "replay_train": [{"file": 1, "indices": np.arange(7, dtype=np.int32)}],
            "replay_val": [],
            "replay_selection": np.asarray([3, 1, 4, 1, 5], dtype=np.int32)}


def test_record_round_trip_holds_4_bytes_an_index(tmp_path):
    """``split.npy`` holds every index once as int32 (the JSON only row places: its size does
    not grow with the splits); read back, every row is its array, in order."""
    n = 200_000
    m = _membership(n, np.random.default_rng(0))
    path = tmp_path / "split.json"
    write_split(m, {"seed": 3, "files": m["files"]}, path)
    npy = np.load(tmp_path / INDICES_FILE, mmap_mode="r")
    assert npy.dtype == np.int32 and len(npy) == n + 7 + 5
    assert (tmp_path / INDICES_FILE).stat().st_size < 4 * len(npy) + 200
    assert path.stat().st_size < 2000
    got = read_split(path)
    assert got["version"] == 2 and got["seed"] == 3 and got["files"] == m["files"]
    for key in ("train", "val", "test", "replay_train", "replay_val"):
        assert [r["file"] for r in got[key]] == [r["file"] for r in m[key]]
        for a, b in zip(got[key], m[key]):
            assert a["indices"].dtype == np.int32
            assert np.array_equal(a["indices"], b["indices"])
    assert np.array_equal(got["replay_selection"], m["replay_selection"])
    m["replay_selection"] = None  # every pool structure once
    m["test"] = [{"file": 0, "indices": np.asarray([2**31 + 5, 0], dtype=np.int64)}]
    write_split(m, {"seed": 3}, path)
    got = read_split(path)
    assert got["replay_selection"] is None
    assert got["test"][0]["indices"].dtype == np.int64  # a file of 2^31 structures or more
    assert got["test"][0]["indices"].tolist() == [2**31 + 5, 0]


def test_old_records_read_and_a_foreign_index_file_is_refused(tmp_path):
    m = _membership(50, np.random.default_rng(1))
    path = tmp_path / "split.json"
    write_split(m, {"seed": 0}, path)
    new = read_split(path)
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    write_v1(new, old_dir / "split.json")
    old = read_split(old_dir / "split.json")
    assert old["version"] == 1
    for key in ROW_KEYS:
        for a, b in zip(old[key], m[key], strict=True):
            assert np.array_equal(a["indices"], b["indices"])
    assert np.array_equal(old[SELECTION_KEY], m[SELECTION_KEY])
    other = tmp_path / "x"
    other.mkdir()
    write_split(_membership(50, np.random.default_rng(2)), {"seed": 0}, other / "split.json")
    (tmp_path / INDICES_FILE).write_bytes((other / INDICES_FILE).read_bytes())
    with pytest.raises(InputError, match="not the index array"):
        read_split(path)
    (tmp_path / INDICES_FILE).unlink()
    with pytest.raises(InputError, match="split.npy, which is missing"):
        read_split(path)


def test_resume_over_an_old_format_split_json(tmp_path, capsys):
    """A run folder whose split.json is version 1 (an earlier xnn's): ``xnn eval --split``
    reads it, a resumed run finishes and rewrites it as version 2 with the same membership,
    and both evaluate the same test structures to the same errors."""
    write_emt(tmp_path / "cu.xyz", 12, ["Cu"], seed=4)
    run = tmp_path / "run"
    args = ["train", f"data.datasets.0.path={tmp_path / 'cu.xyz'}", f"output_dir={run}",
            "model.cutoff=3.0", TINY, "data.batch_size=4", "data.val_fraction=0.25",
            "data.test_fraction=0.25", "logging.progress_bar=false", "logging.plots=false",
            "seed=2"]
    assert main([*args, "max_epochs=1"]) == 0
    first = read_split_record(run)
    write_v1(first, run / "split.json")
    (run / INDICES_FILE).unlink()
    capsys.readouterr()
    assert _eval_test(run, tmp_path)["energy_mae"] > 0  # the first model, the old record
    assert main([*args, "max_epochs=2", "resume=auto"]) == 0
    assert "resumed from" in capsys.readouterr().out
    again = read_split_record(run)
    assert again["version"] == 2 and (run / INDICES_FILE).is_file()
    for key in ("train", "val", "test"):
        assert [r["file"] for r in again[key]] == [r["file"] for r in first[key]]
        for a, b in zip(again[key], first[key]):
            assert a["indices"].tolist() == b["indices"].tolist()
    on_new = _eval_test(run, tmp_path)
    write_v1(again, run / "split.json")  # the resumed model on the same split, old record
    (run / INDICES_FILE).unlink()
    on_old = _eval_test(run, tmp_path)
    for name in ("energy_mae", "forces_mae"):
        assert on_old[name] == on_new[name]


def _eval_test(run, tmp_path) -> dict:
    out = tmp_path / "m.json"
    assert main(["eval", "--split", "test", str(run), "--device", "cpu", "--json", str(out)]) == 0
    return json.loads(out.read_text())
