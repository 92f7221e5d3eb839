"""Tracebacks and misleading messages become one line that says what was wrong and what to
do (issue 42, item 5): training a model with nothing to train, exporting under a file, a
path given to ``xnn.Calculator``, non-finite charges, a folder given as a file, and the
LAMMPS bridge's species and coincident-atom checks."""

from __future__ import annotations

import numpy as np
import pytest
from error_helpers import raises_one_line

from xnn.cli.main import main
from xnn.errors import InputError

LJ_HP = "model.hyperparameters={sigma: 2.3, epsilon: 0.4}"
TINY = ["model.cutoff=3.0", "data.batch_size=3", "data.val_fraction=0.25", "max_epochs=1",
        "logging.plots=false", "logging.progress_bar=false", "device=cpu"]


def cli_fails(capsys, args, *words) -> str:
    """``xnn ARGS`` (in process) exits 2 with one line of error holding every word."""
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def cu_data(tmp_path_factory):
    from xnn.data.emt import write_emt

    path = tmp_path_factory.mktemp("emt") / "cu.xyz"
    write_emt(path, 8, ["Cu"], seed=0)
    return path


# ------------------------------------------------------------ nothing to train
def test_training_a_model_without_trainable_parameters_is_refused(tmp_path, cu_data, capsys):
    from xnn.app.train import train
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.models import build
    from xnn.models.serialization import save_model

    out = tmp_path / "run"
    base = ["train", f"data.datasets.0.path={cu_data}", f"output_dir={out}", *TINY]
    cli_fails(capsys, base + ["model.name=lj", LJ_HP], "model.name=lj has no trainable "
              "parameters", "model.name=schnet", "pretrained=", "xnn eval")
    frozen = ("model.hyperparameters={terms: [{name: lj, sigma: 2.3, epsilon: 0.4, "
              "trainable: false}, {name: morse, D: 0.3, alpha: 1.4, r0: 2.5, trainable: false}]}")
    cli_fails(capsys, base + ["model.name=sum", frozen], "model.name=sum has no trainable")
    lj = save_model(build("lj", sigma=2.3, epsilon=0.4, cutoff=3.0), tmp_path / "lj.pt")
    cli_fails(capsys, base + [f"pretrained={lj}"], f"pretrained={str(lj)!r} has no trainable")
    cli_fails(capsys, base + [f"pretrained={lj}", "validation_only=true"], "xnn eval")
    assert not out.exists()
    # a frozen LJ under a trainable SchNet trains (delta learning)
    delta = ("model.hyperparameters={terms: [{name: lj, sigma: 2.3, epsilon: 0.4, "
             "trainable: false}, {name: schnet, num_features: 8, num_filters: 8, "
             "num_interactions: 1, num_basis: 8}]}")
    summary = train(load_config(TrainConfig, None, base[1:] + ["model.name=sum", delta]))
    assert (out / "model.pt").is_file() and np.isfinite(summary["epochs"])
