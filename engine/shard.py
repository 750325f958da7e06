"""Tensor-parallel partition of the hybrid stack (docs/DESIGN.md §2): one source of truth for which
global heads and channels a rank holds (GDN by segments, KV heads split or replicated, MLP and
experts by intermediate rows), read by the loader, the cache specs and the transfer plans."""

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
