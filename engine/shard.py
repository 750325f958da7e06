"""Tensor-parallel partition of the hybrid stack (docs/DESIGN.md §2): one source of truth
for which global heads and channels a rank holds, read by the loader, the cache specs and
the transfer plans.

GDN: rank r holds key heads [r*Hk/t, (r+1)*Hk/t) for q and k and value heads
[r*Hv/t, (r+1)*Hv/t) for v, z, a, b, A_log, dt_bias. Its conv channels are the three
segments [q_r | k_r | v_r], NOT a contiguous 1/t slice of conv_dim.
Attention: query heads split evenly; KV heads split when t <= KVH, else rank r holds the one
head r // (t / KVH) (replicated).
MLP and MoE: rank r holds rows [r*I/t, (r+1)*I/t) of the intermediate dimension of the dense
MLP, of every routed expert and of the shared expert (all columns of gate/up, those columns of
down); the router and shared_expert_gate are replicated (docs/ARCHITECTURE.md, engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig


@dataclass(frozen=True)
class Segment:
    """A named range of a concatenated axis: global offset/width, and this rank's piece."""

    name: str
    global_offset: int
    global_width: int
    head_size: int
    local_offset: int  # where this rank's piece starts in its local concatenated axis
    local_width: int
    rank_start: int  # global offset (within the segment) of this rank's piece


def head_range(n_heads: int, tp: int, rank: int) -> range:
    per = n_heads // tp
    return range(rank * per, (rank + 1) * per)


def intermediate_range(size: int, tp: int, rank: int) -> range:
    """Rows of an MLP's (or an expert's) intermediate dimension held by `rank`."""
    return head_range(size, tp, rank)


def kv_head_range(n_kv: int, tp: int, rank: int) -> range:
    if tp <= n_kv:
        return head_range(n_kv, tp, rank)
    h = rank // (tp // n_kv)
    return range(h, h + 1)


def conv_segments(m: ModelConfig, tp: int, rank: int) -> tuple[Segment, ...]:
    """The [q | k | v] channel segments of the GDN conv as held by `rank`."""
    kd, vd = m.key_dim, m.value_dim
    segs, local = [], 0
    for name, g_off, width, hs in (
        ("q", 0, kd, m.linear_key_head_dim),
        ("k", kd, kd, m.linear_key_head_dim),
        ("v", 2 * kd, vd, m.linear_value_head_dim),
    ):
        w = width // tp
        segs.append(Segment(name, g_off, width, hs, local, w, rank * w))
        local += w
    return tuple(segs)


def conv_channel_index(m: ModelConfig, tp: int, rank: int) -> list[int]:
    """Global conv channels held by `rank`, in local order."""
    idx = []
    for s in conv_segments(m, tp, rank):
        start = s.global_offset + s.rank_start
        idx.extend(range(start, start + s.local_width))
    return idx
