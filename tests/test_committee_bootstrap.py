"""Bootstrap committees measured (``committee.bootstrap``, issue 46): the members of an
``xnn train`` committee train on different resamples of the training set, and on held-out
structures their raw (uncalibrated) force spread is larger than that of the same committee
trained with seeds alone, so the calibration factor that turns the spread into the observed
error is smaller (the seed-only committee is the more over-confident)."""

from __future__ import annotations

import ase.io
import numpy as np
import pytest
import torch
from helpers.training import train_small

from xnn.data import keys as K
from xnn.data.graph import AtomicGraph
from xnn.models import Potential
from xnn.models.serialization import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
K_MEMBERS, N_TRAIN = 4, 24
COMMITTEE = (f"committee.size={K_MEMBERS}", "committee.seeds=[3, 4, 5, 6]", "max_steps=100",
             "data.batch_size=4", "data.shuffle=true", "optim.lr=5e-3",
             "loss.stress.weight=0.0", "logging.plots=false")


def held_out(model_path, structures) -> tuple[float, float, dict]:
    """The committee's mean raw force spread (eV/Å, calibration removed) and the force MAE
    of its mean (eV/Å) on ``structures``, and its fitted calibration."""
    committee = load_model(model_path)
    fitted = dict(committee.calibration)
    committee.set_calibration({key: 1.0 for key in fitted})
    pot, spread, err = Potential(committee), [], []
    for a in structures:
        out = pot(AtomicGraph.from_arrays(a.positions, a.numbers, a.cell.array, a.pbc,
                                          dtype=torch.float64))
        spread.append(out[K.FORCES_STD].detach().numpy())
        err.append(np.abs(out[K.FORCES].detach().numpy() - a.get_forces()).ravel())
    return float(np.concatenate(spread).mean()), float(np.concatenate(err).mean()), fitted


@pytest.mark.slow
def test_bootstrap_members_see_different_data_and_spread_more_on_held_out(tmp_path):
    from xnn.app.train_data import build_splits
    from xnn.config.loader import load_config
    from xnn.config.train import TrainConfig
    from xnn.data.emt import write_emt

    write_emt(tmp_path / "train.xyz", N_TRAIN, ["Cu"], seed=0)
    write_emt(tmp_path / "val.xyz", 6, ["Cu"], seed=1)
    write_emt(tmp_path / "test.xyz", 12, ["Cu"], seed=2)
    train_small(tmp_path / "seeds", tmp_path, *COMMITTEE)
    train_small(tmp_path / "boot", tmp_path, *COMMITTEE, "committee.bootstrap=true")

    # the resamples the bootstrap run trained on: one per member, each of N_TRAIN draws
    cfg = load_config(TrainConfig, None, [f"data.datasets.0.path={tmp_path / 'train.xyz'}",
                                          f"data.val.0.path={tmp_path / 'val.xyz'}",
                                          *COMMITTEE, "committee.bootstrap=true"])
    splits = build_splits(cfg.data, cfg.loss, 3.0, cfg.seed, bootstrap=(K_MEMBERS, cfg.seed))
    w = torch.cat([splits.train[i][K.MEMBER_WEIGHT] for i in range(N_TRAIN)]).numpy()
    assert w.shape == (N_TRAIN, K_MEMBERS) and (w.sum(0) == N_TRAIN).all()
    assert len({tuple(col) for col in w.T}) == K_MEMBERS  # every member its own resample
    out_of_bag = (w == 0).mean(0)
    assert (out_of_bag > 0).all()  # each member never sees some structures (1/e expected)

    test = ase.io.read(tmp_path / "test.xyz", ":")
    (s_seed, mae_seed, cal_seed), (s_boot, mae_boot, cal_boot) = (
        held_out(tmp_path / run / "model.pt", test) for run in ("seeds", "boot"))
    print(f"bootstrap committee (K={K_MEMBERS}, {N_TRAIN} structures, out-of-bag "
          f"{out_of_bag.mean():.2f}): held-out raw force spread {s_boot * 1e3:.1f} meV/Å vs "
          f"seed-only {s_seed * 1e3:.1f} ({s_boot / s_seed:.2f}x); force MAE of the mean "
          f"{mae_boot * 1e3:.1f} vs {mae_seed * 1e3:.1f} meV/Å; forces calibration factor "
          f"{cal_boot['forces']:.2f} vs {cal_seed['forces']:.2f}")
    assert s_boot > 1.2 * s_seed
    assert cal_boot["forces"] < cal_seed["forces"]
    assert mae_boot < 2 * mae_seed  # the resampled members still fit the data
