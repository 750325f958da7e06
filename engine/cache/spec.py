"""Typed cache specs, one frozen type per cache kind, per rank.

`page_size_bytes` is what the allocator, the capacity report and the transfer handshake all
read. Paged attention grows with the sequence (a page per `block_size` tokens); GDN state is a
fixed-size slot per request (conv state in the model dtype, recurrent state in float32, or in
bfloat16 with --mamba-ssm-cache-dtype: the kernels compute in float32 either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.config import EngineConfig, ModelConfig, dtype_name
from engine.shard import Segment, conv_segments, head_range, kv_head_range


@dataclass(frozen=True)
class PagedAttentionSpec:
    """KV pages of one full-attention layer.

    The kernels see the pool as [num_blocks, 2, KVH_local, block_size, hd] (`pool_shape`); the
    memory behind it is head-major, [KVH_local, num_blocks, 2, block_size, hd] (`storage_shape`),
    so one head's K and V of a run of consecutive blocks is one contiguous byte range: what a
    transfer between ranks holding different heads moves as one piece.
    """

    kind: ClassVar[str] = "paged_kv"
    storage_axes: ClassVar[tuple[str, ...]] = ("head", "block", "kv", "token", "dim")
    layer: int
    block_size: int
    num_kv_heads: int  # held by this rank
    kv_heads: tuple[int, ...]  # their global indices
    head_dim: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.page_size_bytes // self.block_size

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The kernels' (logical) view of the pool."""
        return (num_blocks, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The pool's memory, axes `storage_axes` (head-major)."""
        return (self.num_kv_heads, num_blocks, 2, self.block_size, self.head_dim)


@dataclass(frozen=True)
class MTPAttentionSpec(PagedAttentionSpec):
    """KV pages of a multi-token-prediction layer (layer index num_layers + j): pages of their own,
    indexed by the same block tables as the main KV, so the block budget pays for both. A cache
    kind of its own in the transfer schema ("mtp_kv"), next to the main KV and the GDN state."""

    kind: ClassVar[str] = "mtp_kv"


@dataclass(frozen=True)
class GDNStateSpec:
    """Conv + recurrent state of one GDN layer, one slot per request.

    conv pool [S, conv_dim_local, Kc-1] ("DS" layout), recurrent pool [S, Hv_local, dk, dv] in
    `recurrent_dtype` ("head", "dk", "dv" axis order, as transformers).
    """

    kind: ClassVar[str] = "gdn"
    recurrent_axes: ClassVar[tuple[str, ...]] = ("head", "dk", "dv")
    conv_layout: ClassVar[str] = "DS"
    layer: int
    conv_segments: tuple[Segment, ...]
    conv_width: int  # Kc - 1
    conv_dtype: torch.dtype
    num_v_heads: int  # held by this rank
    v_heads: tuple[int, ...]
    key_head_dim: int
    value_head_dim: int
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def conv_dim(self) -> int:
        return sum(s.local_width for s in self.conv_segments)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_width)

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.key_head_dim, self.value_head_dim)

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * self.conv_width * self.conv_dtype.itemsize

    @property
    def recurrent_bytes(self) -> int:
        n = self.num_v_heads * self.key_head_dim * self.value_head_dim
        return n * self.recurrent_dtype.itemsize

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one slot (conv + recurrent)."""
        return self.conv_bytes + self.recurrent_bytes


CacheSpec = PagedAttentionSpec | MTPAttentionSpec | GDNStateSpec


@dataclass(frozen=True)
class PrefixSnapshotSpec:
    """One saved prefix state (prefix caching, engine/cache/prefix.py): the conv + recurrent state
    of every GDN layer after the prefix's last token, and the prefix's last partial KV page of
    every attention layer (the tokens after its last full page; full pages are shared by
    reference, not copied). Snapshots live in a pool of their own, sized by the operator's share
    of the cache budget, apart from the running requests' slots and pages.

    Pool per GDN layer: conv [M, *conv_shape], recurrent [M, *recurrent_shape]; per attention
    layer: tail [M, 2, KVH_local, block_size, hd] (one page of the kernels' view). With MTP
    drafting also hidden [M, H]: the main model's hidden state at the prefix's last token, from
    which a resuming request recomputes the drafter's KV there (`SnapshotCopy.last`).
    """

    kind: ClassVar[str] = "prefix_snapshot"
    gdn: tuple[GDNStateSpec, ...]
    attention: tuple[PagedAttentionSpec, ...]
    hidden_size: int = 0  # H with MTP drafting, else 0
    hidden_dtype: torch.dtype = torch.float32

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one snapshot, all layers."""
        hidden = self.hidden_size * self.hidden_dtype.itemsize
        return sum(s.page_size_bytes for s in self.gdn) + sum(s.page_size_bytes for s in self.attention) + hidden

    @classmethod
    def of(cls, specs: list[CacheSpec], hidden_size: int = 0) -> PrefixSnapshotSpec:
        """hidden_size: H when snapshots keep the hidden state for the MTP layer (its dtype)."""
        mtp = [s for s in specs if isinstance(s, MTPAttentionSpec)]
        return cls(
            tuple(s for s in specs if isinstance(s, GDNStateSpec)),
            tuple(s for s in specs if isinstance(s, PagedAttentionSpec)),
            hidden_size if mtp else 0,
            mtp[0].dtype if mtp else torch.float32,
        )


def build_specs(cfg: EngineConfig, rank: int) -> list[CacheSpec]:
    """One spec per layer, in layer order, for tensor-parallel `rank`; MTP layers (when MTP
    speculative decoding is on) follow the main layers."""
    m: ModelConfig = cfg.model
    t = cfg.parallel.tensor_parallel_size
    specs: list[CacheSpec] = []
    for i, kind in enumerate(m.layer_types):
        if kind == "full_attention":
            heads = tuple(kv_head_range(m.num_kv_heads, t, rank))
            specs.append(PagedAttentionSpec(i, cfg.cache.block_size, len(heads), heads, m.head_dim, m.dtype))
        else:
            vh = tuple(head_range(m.linear_num_value_heads, t, rank))
            specs.append(
                GDNStateSpec(
                    layer=i,
                    conv_segments=conv_segments(m, t, rank),
                    conv_width=m.linear_conv_kernel_dim - 1,
                    conv_dtype=m.dtype,
                    num_v_heads=len(vh),
                    v_heads=vh,
                    key_head_dim=m.linear_key_head_dim,
                    value_head_dim=m.linear_value_head_dim,
                    recurrent_dtype=getattr(torch, cfg.cache.recurrent_dtype),
                )
            )
    if cfg.speculative.mtp:
        heads = tuple(kv_head_range(m.num_kv_heads, t, rank))
        for j in range(m.mtp_num_layers):
            specs.append(
                MTPAttentionSpec(m.num_layers + j, cfg.cache.block_size, len(heads), heads, m.head_dim, m.dtype)
            )
    return specs


def describe(spec: CacheSpec) -> str:
    if isinstance(spec, PagedAttentionSpec):
        return f"{spec.kind}(layer {spec.layer}, {spec.num_kv_heads}x{spec.head_dim} {dtype_name(spec.dtype)}, page {spec.page_size_bytes} B)"
    return f"gdn(layer {spec.layer}, conv {spec.conv_shape}, recurrent {spec.recurrent_shape}, slot {spec.page_size_bytes} B)"
