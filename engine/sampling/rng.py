"""Counter-based randomness for seeded requests: one SplitMix64 uniform per (seed, position),
computed in tensor ops on the logits' device, so a seeded request's i-th draw is the same whatever
batch, node or tensor-parallel size computes it."""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # exact in float32: uniforms are k / 2**24, k in [0, 2**24)


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
