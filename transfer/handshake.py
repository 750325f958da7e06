"""Handshake: decide, once per peer, whether two endpoints can exchange a request's state.

Order: schema version, backend, the model digest field by field, then the per-tensor schema
(block size, dtypes, axis labels, conv segments, global shapes). The first difference that no
plan can bridge raises `HandshakeError(field, local, remote)`; nothing is coerced, transposed or
re-derived by heuristic. Tensor-parallel sizes may differ: the plan re-shards a -> b. One dtype
difference is bridged, in one direction: a float32 GDN recurrent state on the sender feeding a
bfloat16 one on the receiver (the sender casts it, `transfer.plan.CASTS`).
"""

from __future__ import annotations

from transfer.errors import HandshakeError
from transfer.plan import castable
from transfer.schema import SCHEMA_VERSION, ModelDigest, PeerInfo, RankSchema

# Digest fields in the order they are compared: the layer count before the layer kinds, so a
# shorter model is reported as such rather than as a kind mismatch.
DIGEST_FIELDS: tuple[str, ...] = (
    "architecture",
    "num_layers",
    "layer_types",
    "hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rope_theta",
    "rotary_dim",
    "mrope_section",
    "rms_norm_eps",
    "vision",
    "dtype",
    "recurrent_dtype",
    "num_speculative_slots",
    "speculative_method",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_layers",
    "norm_topk_prob",
    "weight_quantization",
    "rope_scaling",
    "batch_invariant",
)
assert set(DIGEST_FIELDS) == set(ModelDigest.__struct_fields__), "compare every digest field"


_ROTARY = (
    "the decode node would continue keys cached with one rotary setting with another and produce wrong "
    "tokens: give both nodes the same --rope-theta, --rope-scaling and --hf-overrides (docs/transfer.md)"
)
# why a difference cannot be bridged, where the field alone does not say it
_DETAIL = {
    "rope_theta": _ROTARY,
    "rotary_dim": _ROTARY,
    "mrope_section": _ROTARY,
    "rope_scaling": _ROTARY,
    "rms_norm_eps": "the state each layer hands on depends on its norms: give both nodes the same config.json "
    "and --hf-overrides",
    "recurrent_dtype": "the GDN recurrent state (--mamba-ssm-cache-dtype) may differ only from a float32 "
    "prefill node to a bfloat16 decode node, which the sender casts; a bfloat16 state cannot give back "
    "float32 bits, and no other pair is cast (docs/transfer.md)",
    "batch_invariant": "--batch-invariant must be set on every node or on none: a request's tokens after a "
    "hand-off or a move are exact only when both nodes compute the same bits (docs/engine.md)",
}


def _cast(kind: str, a: str, b: str, local_sends: bool | None) -> bool:
    """The dtypes differ in the one way a plan casts, sender -> receiver (None: no direction known)."""
    if local_sends is None:
        return False
    return castable(kind, a, b) if local_sends else castable(kind, b, a)


def check_digest(local: ModelDigest, remote: ModelDigest, local_sends: bool | None = None) -> None:
    """`local_sends`: True when `local` is the sender, False when the receiver; with None no
    difference is bridged (the recurrent dtype's cast has a direction)."""
    for name in DIGEST_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b and not (name == "recurrent_dtype" and _cast("gdn_recurrent", a, b, local_sends)):
            raise HandshakeError(name, a, b, _DETAIL.get(name, ""))


def check_schema(local: RankSchema, remote: RankSchema, local_sends: bool | None = None) -> None:
    """Refuse two rank schemas that no plan can bridge (see the module docstring for the order)."""
    if local.version != remote.version:
        raise HandshakeError("schema_version", local.version, remote.version)
    check_digest(local.digest, remote.digest, local_sends)
    if local.block_size != remote.block_size:
        raise HandshakeError(
            "block_size",
            local.block_size,
            remote.block_size,
            "pages of different sizes are not mapped by token position in this version",
        )
    mine = {t.key: t for t in local.tensors}
    theirs = {t.key: t for t in remote.tensors}
    if mine.keys() != theirs.keys():
        raise HandshakeError("tensors", sorted(mine), sorted(theirs))
    for key in sorted(mine):
        a, b = mine[key], theirs[key]
        what = f"{a.kind} layer {a.layer}"
        if a.dtype != b.dtype and not _cast(a.kind, a.dtype, b.dtype, local_sends):
            raise HandshakeError(f"dtype of {what}", a.dtype, b.dtype)
        if a.axes != b.axes:
            field = {"gdn_conv": "conv layout", "gdn_recurrent": "recurrent axis order"}.get(a.kind, "kv page layout")
            raise HandshakeError(f"{field} of {what}", a.axes, b.axes, "a one-sided write cannot transpose")
        if a.global_shape != b.global_shape:
            raise HandshakeError(f"global shape of {what}", a.global_shape, b.global_shape)
        if a.shard_axis != b.shard_axis:
            raise HandshakeError(f"shard axis of {what}", a.shard_axis, b.shard_axis)
        seg_a = [(s.name, s.global_offset, s.width, s.head_size) for s in a.segments]
        seg_b = [(s.name, s.global_offset, s.width, s.head_size) for s in b.segments]
        if seg_a != seg_b:
            raise HandshakeError(f"conv segments of {what}", seg_a, seg_b)
        if a.block_size != b.block_size:
            raise HandshakeError(f"block_size of {what}", a.block_size, b.block_size)


def check_peer(local: PeerInfo, remote: PeerInfo) -> None:
    """Compatibility first (version, backend, model digest), then the schemas; roles must pair up."""
    if remote.version != SCHEMA_VERSION:
        raise HandshakeError("schema_version", SCHEMA_VERSION, remote.version)
    if local.backend != remote.backend:
        raise HandshakeError("backend", local.backend, remote.backend)
    if local.role == remote.role:
        raise HandshakeError("role", local.role, remote.role, "a sender pairs with a receiver")
    check_schema(local.schema, remote.schema, local.role == "sender")
