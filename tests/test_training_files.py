"""Training files as data: checkpoints load with ``weights_only=True`` (RNG states included),
and ``pretrained=`` refuses a config whose model section disagrees with the pretrained model."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from xnn.config.loader import load_config
from xnn.config.train import TrainConfig
from xnn.data.emt import write_emt
from xnn.errors import InputError
from xnn.io.train_checkpoint import save_checkpoint
from xnn.training import checkpoint as C

HP = "model.hyperparameters={num_features: 8, num_filters: 8, num_interactions: 1, num_basis: 8}"


def _cfg(out, data, *extra) -> TrainConfig:
    return load_config(TrainConfig, None, [
        f"data.datasets.0.path={data}", f"output_dir={out}", "data.batch_size=3",
        "logging.plots=false", "logging.progress_bar=false", "device=cpu", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from xnn.app.train import train

    d = tmp_path_factory.mktemp("run")
    write_emt(d / "cu.xyz", 8, ["Cu"], seed=0)
    train(_cfg(d / "run", d / "cu.xyz", "model.cutoff=3.0", HP, "max_steps=2"))
    return d


def test_checkpoint_is_data_and_restores_every_rng(run, tmp_path):
    path = run / "run" / "checkpoints" / "last.pt"
    payload = torch.load(path, weights_only=True)  # no pickled objects: loads as data
    assert isinstance(payload["rng"]["numpy"][1], torch.Tensor)
    # the stored states give back the same random numbers (exact resume)
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    save_checkpoint({"rng": C.rng_state()}, tmp_path / "rng.pt")
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    C.set_rng_state(C.load_checkpoint(tmp_path / "rng.pt")["rng"])
    got = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]
    # checkpoints of earlier versions (numpy's key as an ndarray) still load as data
    old = dict(payload, rng={**payload["rng"], "numpy": np.random.get_state()})
    torch.save(old, tmp_path / "old.pt")
    state = C.load_checkpoint(tmp_path / "old.pt")["rng"]["numpy"]
    assert isinstance(state[1], np.ndarray) and state[1].dtype == np.uint32


@pytest.mark.parametrize("source", ["model.pt", "checkpoints/last.pt"])
def test_pretrained_refuses_another_cutoff_or_hyperparameters(run, tmp_path, source):
    from xnn.app.train import train

    pretrained = f"pretrained={run / 'run' / source}"
    data = run / "cu.xyz"
    cases = {
        ("model.cutoff=3.5", HP): ["model.cutoff 3.5 vs 3"],
        ("model.cutoff=3.0", HP.replace("num_features: 8", "num_features: 16")):
            ["model.hyperparameters.num_features 16 vs 8"],
        (HP, ): ["model.cutoff 5 vs 3"],  # the default cutoff is not the pretrained one
        ("model.cutoff=3.0", "model.hyperparameters={num_basis: 9, no_such_key: 1}"):
            ["model.hyperparameters.no_such_key (the pretrained model has none)",
             "model.hyperparameters.num_basis 9 vs 8"],
    }
    for i, (overrides, diffs) in enumerate(cases.items()):
        with pytest.raises(InputError) as err:
            train(_cfg(tmp_path / f"o{i}", data, *overrides, pretrained, "max_epochs=0"))
        message = str(err.value)
        assert "\n" not in message and "config vs pretrained" in message, message
        for diff in diffs:
            assert diff in message, (diff, message)
    # the same cutoff and hyperparameters (or none) are accepted
    summary = train(_cfg(tmp_path / "ok", data, "model.cutoff=3.0",
                         "model.hyperparameters={num_basis: 8}", pretrained, "max_epochs=0"))
    assert summary is not None


def test_pretrained_checkpoint_whose_weights_do_not_fit_is_one_line(run, tmp_path):
    """A checkpoint whose hyperparameters describe another architecture than its weights (an
    edited or mixed-up file): one line, not torch's multi-line load_state_dict traceback."""
    from error_helpers import raises_one_line

    from xnn.errors import ModelFileError
    from xnn.training.setup import load_pretrained

    payload = torch.load(run / "run" / "checkpoints" / "last.pt", weights_only=True)
    payload["model"]["hparams"] = dict(payload["model"]["hparams"], num_features=16)
    torch.save(payload, tmp_path / "mixed.pt")
    msg = raises_one_line(ModelFileError, load_pretrained, str(tmp_path / "mixed.pt"))
    assert "weights do not fit" in msg and "mixed.pt" in msg
