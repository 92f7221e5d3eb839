"""The counter-based draws of :mod:`xnn.dynamics.random` with the step an int64 tensor,
for compiled MD steps: the key of step ``n`` is computed in the graph from a step counter
on the device, so one compiled graph draws the numbers of every step, bit for bit those
of the eager functions (the same int64 hash with wrapping multiplication, the same float
transforms; checked against them in ``tests/test_compiled_thermo.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from xnn.dynamics import random
from xnn.dynamics.state import RNG_KEY, RNG_STEP0

_G = random.as_int64(random._GOLDEN)


def stream_key_of(seed: int, stream: int, step: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`xnn.dynamics.random.stream_key` with ``step`` an int64 0-d tensor (same bits)."""
    k0 = random.as_int64(random.mix64_int(int(seed) + random._GOLDEN * (int(stream) + 1)))
    k = random.mix64((step.to(torch.int64) + 1) * _G + k0)
    return k, random.mix64(k ^ random.as_int64(random._M2))


def system_keys(seed: int, stream: int, vars: Mapping[str, Tensor], step: Tensor,
                n_systems: int) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """The key and per-system words of :func:`xnn.dynamics.state.system_words` at the step
    ``step`` (int64 0-d tensor): ``k1, k2, words``."""
    if RNG_KEY in vars:  # the key step is -1 and the system's own step a word
        k1, k2 = (torch.tensor(k, device=step.device)
                  for k in random.stream_key(seed, -1, stream))
        return k1, k2, (vars[RNG_KEY].to(torch.int64), step - vars[RNG_STEP0].to(torch.int64))
    k1, k2 = stream_key_of(seed, stream, step)
    return k1, k2, (torch.arange(n_systems, device=step.device),)


def uniform_keyed(k1: Tensor, k2: Tensor, *words: Tensor) -> Tensor:
    """:func:`xnn.dynamics.random.uniform` with the key ``k1, k2`` (int64 0-d tensors)."""
    h = None
    for w in words:
        w = w.to(torch.int64) * _G
        h = random.mix64(w + k1 if h is None else h + w)
    bits = random._srl(random.mix64(h ^ k2), 11)
    return (bits + 1).to(torch.float64) * 2.0**-53


def normal_keyed(k1: Tensor, k2: Tensor, *words: Tensor) -> Tensor:
    """:func:`xnn.dynamics.random.normal` with the key ``k1, k2``."""
    two = torch.arange(2, device=words[0].device)
    u = uniform_keyed(k1, k2, *(w.unsqueeze(-1) for w in words), two)
    return torch.sqrt(-2.0 * torch.log(u[..., 0])) * torch.cos((2 * math.pi) * u[..., 1])


def gamma_keyed(k1: Tensor, k2: Tensor, shape: Tensor, *words: Tensor,
                n_candidates: int = 16) -> Tensor:
    """:func:`xnn.dynamics.random.gamma` with the key ``k1, k2`` (the same candidates,
    through :func:`xnn.dynamics.random.gamma_with`)."""
    return random.gamma_with(lambda *w: normal_keyed(k1, k2, *w),
                             lambda *w: uniform_keyed(k1, k2, *w), shape, *words,
                             n_candidates=n_candidates)


def csvr_draws(seed: int, step: Tensor, stage: int, nf: Tensor,
               vars: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """:func:`xnn.dynamics.csvr.draws` (``R``, ``S`` ``[n_systems]`` float64) at the step
    ``step`` (int64 0-d tensor)."""
    k1, k2, system = system_keys(seed, random.STREAMS["csvr"], vars, step, nf.shape[0])
    half = torch.full((), int(stage), dtype=torch.int64, device=nf.device)
    r = normal_keyed(k1, k2, *system, half, torch.zeros_like(half))
    count = (nf - 1).round().clamp(min=0)
    s = 2.0 * gamma_keyed(k1, k2, 0.5 * count.to(torch.float64), *system, half,
                          torch.ones_like(half))
    return r, s
