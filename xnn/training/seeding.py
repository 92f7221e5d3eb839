"""Seeds of a training run: start-up (weights, splits) and the per-step random streams.

* :func:`seed_everything` ``(seed, rank)``: before the model is built (its initial weights
  are then broadcast from rank 0).
* :func:`seed_streams` ``(seed, rank, epoch, step)``: the training loop reseeds the global
  torch, numpy and python generators with it at the start of every epoch, after every
  optimizer step (for the next one) and on resume, so every step of every rank draws its
  own stream, and a resumed run draws what the uninterrupted run drew.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int, rank: int = 0, step: int = 0) -> None:
    """Seed torch, numpy and random with ``seed + 1_000_003 rank + 7_919 step`` (start-up:
    weight initialisation and data splits; training steps use :func:`seed_streams`)."""
    s = int(seed) + 1_000_003 * int(rank) + 7_919 * int(step)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def stream_seed(seed: int, rank: int, epoch: int, step: int) -> int:
    """A 63-bit seed that is a hash of ``(seed, rank, epoch, step)`` (numpy's
    ``SeedSequence``): distinct tuples give unrelated streams (no linear offsets that two
    ranks or steps could share)."""
    entropy = [int(seed) % 2**64, int(rank), int(epoch), int(step)]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


def seed_streams(seed: int, rank: int, epoch: int, step: int) -> None:
    """Reseed the global torch (CPU and CUDA), numpy and python generators from
    :func:`stream_seed` ``(seed, rank, epoch, step)``."""
    s = stream_seed(seed, rank, epoch, step)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


__all__ = ["seed_everything", "seed_streams", "stream_seed"]
