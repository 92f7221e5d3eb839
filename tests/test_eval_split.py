"""``xnn eval``: the split of a training run is saved with it and ``xnn eval --split test
RUN`` evaluates exactly those structures; NaN weights or NaN errors end with one line and
exit status 2; the parity plots get a stress panel when there are stress labels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from error_helpers import cli_fails

from xnn.app.evaluate import read_split_record
from xnn.cli.main import main
from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt

TINY = ("model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, "
        "num_basis: 8}")
N = 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-epoch SchNet run on 16 EMT structures (4 validation, 4 test, stress labelled)."""
    from xnn.app.train import train

    d = tmp_path_factory.mktemp("split")
    write_emt(d / "cu.xyz", N, ["Cu"], seed=3)
    cfg = load_config(TrainConfig, None, [
        f"data.datasets.0.path={d / 'cu.xyz'}", f"output_dir={d / 'run'}", "model.cutoff=3.0",
        TINY, "data.batch_size=4", "data.val_fraction=0.25", "data.test_fraction=0.25",
        "max_epochs=2", "logging.progress_bar=false", "loss.stress.weight=1.0", "seed=5"])
    summary = train(cfg)
    return d / "run", d / "cu.xyz", summary


def eval_json(capsys, tmp_path, *args) -> dict:
    out = tmp_path / "m.json"
    assert main([*map(str, args), "--device", "cpu", "--json", str(out)]) == 0
    capsys.readouterr()
    return json.loads(out.read_text())


def test_split_json_partitions_the_data(run):
    folder, data, _ = run
    record = read_split_record(folder)
    (f,) = record["files"]
    assert f["path"] == str(data) and f["energy_key"] == "energy" and "sha256" in f["fingerprint"]
    sets = {s: [i for row in record[s] for i in row["indices"]] for s in ("train", "val", "test")}
    assert [len(sets[s]) for s in ("train", "val", "test")] == [8, 4, 4]
    assert sorted(sets["train"] + sets["val"] + sets["test"]) == list(range(N))


def test_eval_split_evaluates_exactly_the_runs_test_set(run, capsys, tmp_path):
    """The run's own test (and validation) errors, computed by training on the structures it
    held out, are reproduced by ``xnn eval --split``; the whole file gives other errors."""
    folder, data, summary = run
    m = summary["metrics"]
    for split in ("test", "val"):
        got = eval_json(capsys, tmp_path, "eval", "--split", split, folder)
        for name in ("energy_mae", "forces_mae", "stress_mae", "forces_rmse"):
            assert got[name] == pytest.approx(m[f"{split}_{name}"], rel=1e-5), (split, name)
    whole = eval_json(capsys, tmp_path, "eval", folder / "model.pt", data)
    assert whole["energy_mae"] != pytest.approx(m["test_energy_mae"], rel=1e-3)
    assert (folder / "parity_test_eval.png").is_file()


def test_eval_split_refuses_a_changed_data_file(run, capsys):
    folder, data, _ = run
    original = data.read_bytes()
    try:
        data.write_bytes(original.replace(b"Cu ", b"Cu  ", 1))  # same structures, other bytes
        line = cli_fails(capsys, ["eval", "--split", "test", folder])
        assert "not the file the run was trained on" in line and str(data) in line
    finally:
        data.write_bytes(original)
    line = cli_fails(capsys, ["eval", "--split", "test", folder, data])
    assert "only the run folder" in line
    line = cli_fails(capsys, ["eval", "--split", "test", data.parent])
    assert "no split.json" in line


def _saved_schnet(path, scale: float | None = None, nan: bool = False):
    from xnn.models import build
    from xnn.models.serialization import save_model

    model = build("schnet", species=[29], cutoff=3.0, num_features=8, num_filters=8,
                  num_interactions=1, num_basis=8)
    with torch.no_grad():
        p = next(model.parameters())
        if nan:
            p.view(-1)[0] = float("nan")
        if scale is not None:
            for q in model.parameters():
                q.fill_(scale)
    save_model(model, path)
    return path


def test_eval_with_nan_weights_exits_2_in_one_line(run, capsys, tmp_path):
    _, data, _ = run
    model = _saved_schnet(tmp_path / "nan.pt", nan=True)
    plot = tmp_path / "p.png"
    line = cli_fails(capsys, ["eval", model, data, "--device", "cpu", "--plot", plot])
    assert "non-finite weights" in line and "nan.pt" in line
    assert not plot.exists()


def test_eval_with_non_finite_errors_exits_2_in_one_line(run, capsys, tmp_path):
    """Finite weights whose predictions overflow float32: the errors are inf or NaN."""
    _, data, _ = run
    model = _saved_schnet(tmp_path / "huge.pt", scale=1e30)
    plot, out = tmp_path / "p.png", tmp_path / "m.json"
    line = cli_fails(capsys, ["eval", model, data, "--device", "cpu", "--plot", plot,
                              "--json", out])
    assert "are not finite" in line and "energy_mae" in line
    assert not plot.exists() and not out.exists()


def test_parity_plots_have_a_stress_panel_when_stress_is_labelled(run):
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    from xnn.plotting import parity_figure

    folder, _, _ = run
    e, f, s = np.ones((3, 2)), np.ones((12, 2)), np.ones((18, 2))
    for stress, panels in ((None, 2), (np.zeros((0, 2)), 2), (s, 3)):
        fig = parity_figure(e, f, "test", stress)
        assert len(fig.axes) == panels
        assert [ax.get_title().split("\n")[0] for ax in fig.axes][-1] == \
            ("test stress" if panels == 3 else "test forces")
        plt.close(fig)
    # the run's test parity plot (stress labelled): three panels side by side, 13.5 x 4.4 in
    height, width = mpimg.imread(folder / "parity_test.png").shape[:2]
    assert (width, height) == (int(13.5 * 110), int(4.4 * 110))


def test_eval_output_folders_are_made_and_files_in_the_way_refused(run, capsys, tmp_path):
    """``--plot``/``--json`` in a folder that does not exist yet are written there (was a
    FileNotFoundError traceback after the evaluation); under a file: one line, before any
    evaluation."""
    _, data, _ = run
    model = _saved_schnet(tmp_path / "m.pt")
    plot, out = tmp_path / "new" / "p.png", tmp_path / "new2" / "m.json"
    assert main(["eval", str(model), str(data), "--device", "cpu", "--plot", str(plot),
                 "--json", str(out)]) == 0
    assert plot.is_file() and "energy_mae" in json.loads(out.read_text())
    blocker = tmp_path / "afile"
    blocker.write_text("")
    line = cli_fails(capsys, ["eval", model, data, "--device", "cpu", "--plot",
                              blocker / "p.png"])
    assert "'afile' is a file, not a folder" in line.replace(str(tmp_path) + "/", "")
