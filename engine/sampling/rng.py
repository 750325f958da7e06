"""Counter-based randomness for seeded requests: one SplitMix64 uniform per (seed, position), and
one exponential per (seed, position, token id) for the race that filtered draws run (a second
SplitMix64 round keyed by the id), computed in tensor ops on the logits' device, so a seeded
request's i-th draw is the same whatever batch, node or tensor-parallel size computes it."""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # exact in float32: uniforms are k / 2**24, k in [0, 2**24)
RACE_BITS = 23  # the race's uniforms are (k + 1/2) / 2**23, exact in float32 and never 0 or 1


def as_int64(v: int) -> int:
    """An unsigned 64-bit value (taken modulo 2**64) as the signed int64 with the same bits."""
    v &= MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """seeds, counters: int64 [N] -> int64 [N], the bits of output `counter` (1-based) of
    SplitMix64 seeded with `seed`."""
    z = seeds + counters * as_int64(GAMMA)
    z = (z ^ _shr(z, 30)) * as_int64(MIX1)
    z = (z ^ _shr(z, 27)) * as_int64(MIX2)
    return z ^ _shr(z, 31)


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """seeds (as int64 bits), positions: int64 [N] -> float32 [N] in [0, 1): the uniform that
    position `position` of a request seeded with `seed` samples with."""
    bits = _shr(splitmix64(seeds, positions + 1), 64 - UNIFORM_BITS)
    return bits.to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


def token_exponentials(seeds: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """seeds (as int64 bits), positions: int64 [N]; ids int64 [N, C] -> float32 [N, C] of
    Exp(1) variates, -log((k + 1/2) / 2**23) with k the top 23 bits of SplitMix64 output
    `id + 1` seeded with the bits `seeded_uniforms` takes its uniform from: each token's own,
    whatever the order or the number of the candidates it is drawn among."""
    row = splitmix64(seeds, positions + 1)
    bits = _shr(splitmix64(row[:, None], ids + 1), 64 - RACE_BITS)
    return -torch.log((bits.to(torch.float32) + 0.5) * (1.0 / (1 << RACE_BITS)))
