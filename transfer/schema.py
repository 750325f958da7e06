"""The transfer schema (docs/DESIGN.md §4): typed, versioned msgspec records a rank publishes (a
`TensorDesc` per pool, a `ModelDigest`, a `RankSchema`), derived from the engine's cache specs and
pools, decoded with typed decoders so a malformed record fails at decode time."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import msgspec
import torch

from engine.cache.allocator import CachePools, kv_storage
from engine.cache.spec import GDNStateSpec, PagedAttentionSpec, build_specs
from engine.config import EngineConfig, dtype_name
from transfer.encoded.messages import vision_digest
from transfer.errors import HandshakeError
from transfer.links import Host

SCHEMA_VERSION = 6  # 2: head-major KV pools, described by axes + page_stride + head_stride;
# 3: the MTP layer's KV ("mtp_kv", layers num_layers + j) and the speculative method in the digest;
# 4: the MoE sizes, sparse layers and weight quantization in the digest; 5: Begin carries rope_delta;
# 6: the rotary settings (theta, rotary dims, mrope sections), attention heads, norm epsilon, the vision
# tower's digest and the MoE top-k renormalisation in the digest

Kind = Literal["paged_kv", "gdn_conv", "gdn_recurrent", "mtp_kv"]
KINDS: tuple[Kind, ...] = ("paged_kv", "gdn_conv", "gdn_recurrent", "mtp_kv")
PAGED_KINDS: tuple[str, ...] = ("paged_kv", "mtp_kv")  # pages indexed by the request's block table
PAGE_AXIS = {
    "paged_kv": "block",
    "gdn_conv": "slot",
    "gdn_recurrent": "slot",
    "mtp_kv": "block",
}  # label of the page axis


class SegmentDesc(msgspec.Struct, frozen=True):
    """A named range of a concatenated axis (the GDN conv channels [q | k | v])."""

    name: str
    global_offset: int  # first channel of the segment in the unsharded axis
    width: int  # channels of the segment in the unsharded axis
    head_size: int
    local_offset: int  # where this rank's piece starts on its local axis
    local_width: int  # channels of this rank's piece
    rank_start: int  # offset, inside the segment, of this rank's first channel


class TensorDesc(msgspec.Struct, frozen=True):
    """One pool tensor of one rank, as it lies in memory (the registered region).

    A page is a KV block or a state slot; the page axis is labelled "block" or "slot" in `axes`
    and need not lead. KV pools are head-major, axes ("head", "block", "kv", "token", "dim"):
    one head's K and V of one block is `page_stride` bytes, a head's blocks follow each other,
    and the next head starts `head_stride` bytes further. State pools lead with "slot".
    Byte offset of (page p, head i) in the region = p * page_stride + i * head_stride.
    """

    kind: Kind
    layer: int
    dtype: str  # e.g. "bfloat16"; the recurrent state's is --mamba-ssm-cache-dtype
    global_shape: tuple[int, ...]  # unsharded sizes of the axes other than the page axis, in memory
    # order: (KVH, 2, bs, hd) | (conv_dim, Kc-1) | (Hv, dk, dv)
    local_shape: tuple[int, ...]  # the whole pool on this rank, in memory order (row-major, contiguous)
    axes: tuple[str, ...]  # labels of local_shape, e.g. ("slot", "head", "dk", "dv"), ("head", "block", ...)
    shard_axis: str  # "head" | "channel"
    segments: tuple[SegmentDesc, ...]  # concatenated-axis segments (gdn_conv), else ()
    heads: tuple[int, ...]  # global heads held (KV heads or GDN value heads); () for conv
    replication: int  # ranks holding each of these heads (tp / KVH when tp > KVH, else 1)
    replica: int  # this rank's index among those ranks
    tp_size: int
    tp_rank: int
    block_size: int  # tokens per page for paged kinds; 0 for per-sequence state
    tokens_per_page: int  # tokens one page covers: block_size, or 0 = the whole prefix (state)
    page_stride: int  # bytes from one page (block or slot) to the next along the page axis
    head_stride: int  # bytes from one head to the next along the "head" axis; 0 without one (conv)
    num_pages: int
    itemsize: int
    mem_type: Literal["DRAM", "VRAM"]
    device_id: int
    base_addr: int  # start of the pool's memory; with nbytes this is the registered region
    nbytes: int
    region: str  # registration handle: the region's name, unique per rank ("L3.paged_kv")

    @property
    def key(self) -> tuple[int, str]:
        return (self.layer, self.kind)


class ModelDigest(msgspec.Struct, frozen=True):
    """Every model property the transferred state depends on. Compared field by field."""

    architecture: str
    num_layers: int
    layer_types: tuple[str, ...]
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # the rotary positions keys are cached with and the norms every layer's state passes through:
    # what --rope-theta, --rope-scaling and --hf-overrides can change (engine/config_overrides.py)
    rope_theta: float
    rotary_dim: int  # head dims rotated: head_dim x partial_rotary_factor
    mrope_section: tuple[int, ...]  # rotary frequencies of (t, h, w) for images; () without a vision tower
    rms_norm_eps: float
    # an image prompt's state depends on its tower: vision_digest of the vision config ("" without one)
    vision: str
    dtype: str  # model dtype: KV pages and conv state
    recurrent_dtype: str
    num_speculative_slots: int  # draft tokens verified per decode row (EngineConfig.speculative.num_tokens)
    speculative_method: str  # "ngram" | "mtp": with "mtp" the MTP layer's KV is part of the state
    # MoE adds no state, but P and D must run the same model: experts, top-k, sizes, sparse layers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    weight_quantization: str = ""  # "" or "fp8 [bn, bk]": the checkpoint's block-quantized weights
    rope_scaling: str = ""  # "" or the scaling's parameters: keys are rotated with them (engine/rope.py)
    batch_invariant: bool = False  # --batch-invariant: the state's bits depend on it (docs/engine.md)

    def fingerprint(self) -> str:
        """What nodes are matched by (router, targets): a hash of every field but the recurrent
        dtype, followed by "+bfloat16" for a bfloat16 recurrent state, so that `feeds` can tell
        the one cast a plan declares (float32 -> bfloat16) from any other difference."""
        h = hashlib.sha256(msgspec.msgpack.encode(msgspec.structs.replace(self, recurrent_dtype=""))).hexdigest()
        return h[:16] if self.recurrent_dtype == "float32" else f"{h[:16]}+{self.recurrent_dtype}"


def feeds(src: str, dst: str) -> bool:
    """Whether a node of fingerprint `src` can hand its state to one of fingerprint `dst`: the
    same fingerprint, or a float32 recurrent state feeding a bfloat16 one (transfer.plan.CASTS)."""
    return src == dst or ("+" not in src and dst == f"{src}+bfloat16")


class RankSchema(msgspec.Struct, frozen=True):
    """What one rank publishes: version, model digest, its TP place and one TensorDesc per pool."""

    version: int
    digest: ModelDigest
    tp_size: int
    tp_rank: int
    block_size: int
    num_blocks: int
    num_slots: int
    tensors: tuple[TensorDesc, ...]  # layer order; kinds in KINDS order within a layer

    def tensor(self, layer: int, kind: str) -> TensorDesc:
        for t in self.tensors:
            if t.layer == layer and t.kind == kind:
                return t
        raise KeyError(f"rank {self.tp_rank} schema has no {kind} tensor for layer {layer}")


class PeerInfo(msgspec.Struct, frozen=True):
    """Published by every transfer endpoint at handshake (out of band: router, test harness)."""

    version: int
    backend: str  # "nixl" | "ucxx"
    agent: str  # unique name, includes the incarnation
    incarnation: str
    node: str  # the node (TP group) this rank belongs to
    role: Literal["sender", "receiver"]
    schema: RankSchema
    transport: bytes  # backend connection blob (NIXL agent metadata, UCX worker address)
    host: Host = Host()  # its machine, pools' memory and RDMA devices (transfer/links.py)


class _VersionProbe(msgspec.Struct):
    version: int


def model_digest(cfg: EngineConfig) -> ModelDigest:
    m = cfg.model
    return ModelDigest(
        architecture=m.architecture,
        num_layers=m.num_layers,
        layer_types=tuple(m.layer_types),
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim,
        rope_theta=float(m.rope_theta),
        rotary_dim=m.rotary_dim,
        mrope_section=m.vision.mrope_section if m.vision is not None else (),
        rms_norm_eps=float(m.rms_norm_eps),
        vision="" if m.vision is None else vision_digest(m.vision, dtype_name(m.dtype)),
        dtype=dtype_name(m.dtype),
        recurrent_dtype=cfg.cache.recurrent_dtype,
        num_speculative_slots=cfg.speculative.num_tokens,
        speculative_method=cfg.speculative.method if cfg.speculative.num_tokens else "none",
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size,
        moe_layers=m.moe_layers,
        norm_topk_prob=m.norm_topk_prob,
        weight_quantization="" if m.fp8_block_size is None else f"fp8 {list(m.fp8_block_size)}",
        rope_scaling="" if m.rope_scaling.kind == "default" else repr(m.rope_scaling),
        batch_invariant=m.batch_invariant,
    )


def _mem(t: torch.Tensor) -> tuple[Literal["DRAM", "VRAM"], int]:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


def _kind(name: str) -> Kind:
    for k in KINDS:
        if k == name:
            return k
    raise ValueError(f"no transfer kind {name!r}; known kinds: {', '.join(KINDS)}")


def _desc(
    kind: str,
    spec: PagedAttentionSpec | GDNStateSpec,
    pool: torch.Tensor,
    global_shape: tuple[int, ...],
    axes: tuple[str, ...],
    shard_axis: str,
    *,
    segments: Sequence[SegmentDesc] = (),
    heads: Sequence[int] = (),
    replication: int = 1,
    replica: int = 0,
    tp: int,
    rank: int,
    block_size: int = 0,
) -> TensorDesc:
    if not pool.is_contiguous() or len(axes) != pool.dim():
        raise ValueError(
            f"{kind} pool of layer {spec.layer} {tuple(pool.shape)} is not contiguous or not labelled by {axes}; "
            "the transfer registers pools as they lie in memory"
        )
    mem_type, dev = _mem(pool)
    page_axis = axes.index(PAGE_AXIS[kind])
    return TensorDesc(
        kind=_kind(kind),
        layer=spec.layer,
        dtype=dtype_name(pool.dtype),
        global_shape=tuple(global_shape),
        local_shape=tuple(pool.shape),
        axes=axes,
        shard_axis=shard_axis,
        segments=tuple(segments),
        heads=tuple(heads),
        replication=replication,
        replica=replica,
        tp_size=tp,
        tp_rank=rank,
        block_size=block_size,
        tokens_per_page=block_size,
        page_stride=pool.stride(page_axis) * pool.element_size(),
        head_stride=pool.stride(axes.index("head")) * pool.element_size() if "head" in axes else 0,
        num_pages=pool.shape[page_axis],
        itemsize=pool.element_size(),
        mem_type=mem_type,
        device_id=dev,
        base_addr=pool.data_ptr(),
        nbytes=pool.numel() * pool.element_size(),
        region=f"L{spec.layer}.{kind}",
    )


def build_schema(cfg: EngineConfig, rank: int, pools: CachePools) -> RankSchema:
    """The schema of `rank`, from the engine's specs for that rank and the pools built from them."""
    m = cfg.model
    t = cfg.parallel.tensor_parallel_size
    specs = build_specs(cfg, rank)
    if specs != list(pools.specs.values()):
        raise ValueError(
            f"pools were not built from build_specs(cfg, rank={rank}); the schema would describe other memory"
        )
    tensors: list[TensorDesc] = []
    for s in specs:
        if isinstance(s, PagedAttentionSpec):
            rep = t // m.num_kv_heads if t > m.num_kv_heads else 1
            tensors.append(
                _desc(
                    s.kind,
                    s,
                    kv_storage(pools.kv[s.layer]),
                    (m.num_kv_heads, 2, s.block_size, s.head_dim),
                    s.storage_axes,
                    "head",
                    heads=s.kv_heads,
                    replication=rep,
                    replica=rank % rep,
                    tp=t,
                    rank=rank,
                    block_size=s.block_size,
                )
            )
        else:
            segs = [
                SegmentDesc(
                    g.name, g.global_offset, g.global_width, g.head_size, g.local_offset, g.local_width, g.rank_start
                )
                for g in s.conv_segments
            ]
            conv_axes = {"DS": ("slot", "channel", "time"), "SD": ("slot", "time", "channel")}[s.conv_layout]
            tensors.append(
                _desc(
                    "gdn_conv",
                    s,
                    pools.conv[s.layer],
                    (m.conv_dim, s.conv_width),
                    conv_axes,
                    "channel",
                    segments=segs,
                    tp=t,
                    rank=rank,
                )
            )
            tensors.append(
                _desc(
                    "gdn_recurrent",
                    s,
                    pools.recurrent[s.layer],
                    (m.linear_num_value_heads, *s.recurrent_shape[1:]),
                    ("slot", *s.recurrent_axes),
                    "head",
                    heads=s.v_heads,
                    tp=t,
                    rank=rank,
                )
            )
    return RankSchema(
        version=SCHEMA_VERSION,
        digest=model_digest(cfg),
        tp_size=t,
        tp_rank=rank,
        block_size=cfg.cache.block_size,
        num_blocks=pools.capacity.num_blocks,
        num_slots=pools.capacity.num_state_slots,
        tensors=tuple(tensors),
    )


_encoder = msgspec.msgpack.Encoder()
_schema_decoder = msgspec.msgpack.Decoder(RankSchema)
_peer_decoder = msgspec.msgpack.Decoder(PeerInfo)
_probe_decoder = msgspec.msgpack.Decoder(_VersionProbe)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_schema(data: bytes) -> RankSchema:
    return _schema_decoder.decode(data)


def decode_peer(data: bytes) -> PeerInfo:
    """Decode a peer's PeerInfo; a different schema version is refused before the full decode."""
    version = _probe_decoder.decode(data).version
    if version != SCHEMA_VERSION:
        raise HandshakeError("schema_version", SCHEMA_VERSION, version)
    return _peer_decoder.decode(data)
