"""Counter-based random numbers: every draw is a pure function of its key.

A draw is keyed by ``(seed, step, stream)`` (Python ints, the same on every rank) and by
integer *words* (tensors, e.g. system index, global atom id, component). Nothing is
carried from one draw to the next, so the numbers an atom gets do not depend on how many
atoms a process holds, on their order, or on the number of ranks, and a run resumed at
step ``n`` draws what an uninterrupted run draws at step ``n``.

The hash is a chain of SplitMix64 finalisers (Steele, Lea & Flood 2014): the key becomes
two 64-bit values ``k₁, k₂``; then ``h ← mix(h + w·γ)`` for each word ``w`` starting from
``h = k₁``, and the output is ``mix(h ⊕ k₂)``. The final xor with a second key keeps two
keys whose chains happen to meet from producing shifted copies of each other. The
arithmetic is int64 with wrapping multiplication; right shifts are masked to be logical.
Integer bits are identical on CPU and CUDA; the float transforms below (log, cos, sqrt)
are deterministic on each device.

Streams (:data:`STREAMS`) separate the users of one seed, so the Maxwell–Boltzmann
velocities, the Langevin noise and the CSVR/NPT draws of the same ``seed`` are independent.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB

#: stream numbers of the MD engine's draws (the third part of every key)
STREAMS = {"velocities": 1, "langevin": 2, "csvr": 3, "npt": 4}


def as_int64(x: int) -> int:
    """The int64 (two's complement) value with the bits of ``x mod 2**64`` (a Python int)."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def mix64_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (unsigned 64-bit result)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _srl(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 ``x`` by ``k`` bits (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on an int64 tensor (bits as :func:`mix64_int`)."""
    x = (x ^ _srl(x, 30)) * as_int64(_M1)
    x = (x ^ _srl(x, 27)) * as_int64(_M2)
    return x ^ _srl(x, 31)


def stream_key(seed: int, step: int, stream: int) -> tuple[int, int]:
    """The two 64-bit keys (as int64 values) of ``(seed, step, stream)``."""
    k = mix64_int(int(seed) + _GOLDEN * (int(stream) + 1))
    k = mix64_int(k + _GOLDEN * (int(step) + 1))
    return as_int64(k), as_int64(mix64_int(k ^ _M2))


def random_bits(seed: int, step: int, stream: int, *words: Tensor) -> Tensor:
    """int64 tensor of 64 random bits per element of the broadcast of ``words``.

    Args:
        seed, step, stream: the key (Python ints).
        words: int64 tensors (broadcastable, on one device), e.g. ``[n_atoms, 1]`` atom ids
            and ``[3]`` components. At least one.
    """
    if not words:
        raise ValueError("random_bits needs at least one word tensor")
    k1, k2 = stream_key(seed, step, stream)
    h = None
    for w in words:
        w = w.to(torch.int64) * as_int64(_GOLDEN)
        h = mix64(w + k1 if h is None else h + w)
    return mix64(h ^ k2)


def uniform(seed: int, step: int, stream: int, *words: Tensor) -> Tensor:
    """float64 uniforms in ``(0, 1]`` (53 random bits each), shaped like the words' broadcast."""
    bits = _srl(random_bits(seed, step, stream, *words), 11)
    return (bits + 1).to(torch.float64) * 2.0**-53


def normal(seed: int, step: int, stream: int, *words: Tensor) -> Tensor:
    """float64 standard normals (Box–Muller on two uniforms), shaped like the words' broadcast."""
    two = torch.arange(2, device=words[0].device)
    u = uniform(seed, step, stream, *(w.unsqueeze(-1) for w in words), two)
    return torch.sqrt(-2.0 * torch.log(u[..., 0])) * torch.cos((2 * math.pi) * u[..., 1])


def gamma(
    seed: int, step: int, stream: int, shape: Tensor, *words: Tensor, n_candidates: int = 16
) -> Tensor:
    """float64 Gamma(``shape``, 1) variates, one per element of ``shape`` (``>= 0``).

    Marsaglia & Tsang (2000) with a fixed number of candidates per variate, the first
    accepted one kept (shape ``< 1``: ``Gamma(a) = Gamma(a + 1) U^(1/a)``; shape 0 gives 0).
    A candidate is accepted with probability ``>= 0.951`` (shape 1, the worst case; it
    tends to 1 as the shape grows), so all ``n_candidates = 16`` are rejected with
    probability ``< 0.049**16 ≈ 1e-21`` per variate; then the variate is the mean ``a``
    (for shape ``a >= 1``), a bias far below anything a simulation can detect.

    Args:
        shape: float tensor of shapes ``a >= 0``.
        words: int64 word tensors broadcastable to ``shape`` (e.g. the system index).
    """
    return gamma_with(lambda *w: normal(seed, step, stream, *w),
                      lambda *w: uniform(seed, step, stream, *w), shape, *words,
                      n_candidates=n_candidates)


def gamma_with(normal_of, uniform_of, shape: Tensor, *words: Tensor,
               n_candidates: int = 16) -> Tensor:
    """:func:`gamma` with the draws given as functions of the words: ``normal_of(*words)``
    and ``uniform_of(*words)`` (float64 normals and uniforms of one key, shaped like the
    words' broadcast), e.g. those of a key made in a compiled graph
    (:func:`xnn.dynamics.compiled_random.gamma_keyed`)."""
    a = shape.to(torch.float64)
    a1 = torch.where(a < 1, a + 1, a)
    d = a1 - 1.0 / 3.0
    c = 1.0 / torch.sqrt(9.0 * d)
    w = [x.unsqueeze(-1) for x in words]
    j = torch.arange(n_candidates, device=a.device)
    x = normal_of(*w, torch.zeros_like(j), j)
    u = uniform_of(*w, torch.ones_like(j), j)
    v = (1.0 + c.unsqueeze(-1) * x) ** 3
    dd = d.unsqueeze(-1)
    log_v = torch.log(v.clamp(min=torch.finfo(torch.float64).tiny))
    ok = (v > 0) & (torch.log(u) < 0.5 * x * x + dd - dd * v + dd * log_v)
    first = torch.argmax(ok.to(torch.int8), dim=-1, keepdim=True)  # first accepted candidate
    g = (dd * v).gather(-1, first).squeeze(-1)
    g = torch.where(ok.any(-1), g, a1)
    two = torch.full((), 2, dtype=torch.int64, device=a.device)
    boost = uniform_of(*words, two, torch.zeros_like(two))
    g = torch.where(a < 1, g * boost ** (1.0 / a.clamp(min=1e-300)), g)
    return torch.where(a > 0, g, torch.zeros_like(g))


def chi_squared(seed: int, step: int, stream: int, dof: Tensor, *words: Tensor) -> Tensor:
    """float64 sums of ``dof`` squared standard normals, as ``2 Gamma(dof / 2)`` (exact)."""
    return 2.0 * gamma(seed, step, stream, 0.5 * dof.to(torch.float64), *words)


def atom_words(batch: Tensor, atom_id: Tensor, n_components: int,
               systems: tuple[Tensor, ...] | None = None) -> tuple[Tensor, ...]:
    """Words ``(system, global atom id, component)`` of ``[n_atoms, n_components]`` draws.

    ``systems``: per-system words (each ``[n_systems]``, from
    :func:`~xnn.dynamics.state.system_words`) in place of the system index ``batch``.
    """
    comp = torch.arange(n_components, device=atom_id.device)
    if systems is None:
        return batch[:, None], atom_id[:, None], comp
    return (*(w[batch][:, None] for w in systems), atom_id[:, None], comp)
