"""transfer.schema round trip and transfer.handshake: one refusal test per field."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest
import torch

from engine.config import SpeculativeConfig
from tests.helpers.xfer_state import engine_cfg, make_pools, tiny_model
from transfer.errors import HandshakeError
from transfer.handshake import check_peer, check_schema
from transfer.schema import SCHEMA_VERSION, PeerInfo, build_schema, decode_peer, decode_schema, encode


def schema(tp=1, rank=0, **model_over):
    cfg = engine_cfg(tiny_model(**model_over), tp)
    return build_schema(cfg, rank, make_pools(cfg, rank))


def peer(s, role="receiver", backend="nixl") -> PeerInfo:
    return PeerInfo(SCHEMA_VERSION, backend, f"{role}-x", "x", "n0", role, s, b"blob")


def test_schema_round_trip():
    s = schema(tp=2, rank=1, kvh=1)
    assert decode_schema(encode(s)) == s
    p = peer(s)
    assert decode_peer(encode(p)) == p


def test_schema_describes_pools():
    cfg = engine_cfg(tiny_model(kvh=1), 2)
    pools = make_pools(cfg, 1)
    s = build_schema(cfg, 1, pools)
    kv = s.tensor(1, "paged_kv")
    nb = pools.capacity.num_blocks
    assert kv.local_shape == (1, nb, 2, 4, 8) and kv.axes == ("head", "block", "kv", "token", "dim")
    assert kv.base_addr == pools.kv[1].data_ptr() and kv.nbytes == pools.kv[1].numel() * 2
    assert kv.heads == (0,) and kv.replication == 2 and kv.replica == 1
    assert kv.page_stride == pools.specs[1].page_size_bytes and kv.num_pages == nb
    conv = s.tensor(0, "gdn_conv")
    assert [g.name for g in conv.segments] == ["q", "k", "v"] and conv.axes == ("slot", "channel", "time")
    rec = s.tensor(0, "gdn_recurrent")
    assert rec.dtype == "float32" and rec.axes == ("slot", "head", "dk", "dv") and rec.heads == (4, 5, 6, 7)


def test_schema_describes_head_major_kv():
    """KVH 2 on one rank: the registered region is the whole head-major storage, a block of one
    head is page_stride bytes and the next head starts after all of the first head's blocks."""
    cfg = engine_cfg(tiny_model(kvh=2), 1)
    pools = make_pools(cfg, 0)
    kv = build_schema(cfg, 0, pools).tensor(1, "paged_kv")
    nb, pool = pools.capacity.num_blocks, pools.kv[1]
    assert tuple(pool.shape) == (nb, 2, 2, 4, 8) and not pool.is_contiguous()  # the kernels' view
    assert kv.local_shape == (2, nb, 2, 4, 8) and kv.global_shape == (2, 2, 4, 8)
    assert kv.page_stride == 2 * 4 * 8 * 2 and kv.head_stride == nb * kv.page_stride
    assert kv.base_addr == pool.data_ptr() and kv.nbytes == pool.numel() * pool.element_size()
    # block 3, V, head 1, token 2, dim 0: at 1 * head_stride + 3 * page_stride in the region
    pool.zero_()
    pool[3, 1, 1, 2, 0] = 1.0
    (kind, layer, region), *_ = [t for t in pools.tensors() if t[:2] == ("paged_kv", 1)]
    flat = region.reshape(-1).view(torch.uint8)
    off = kv.head_stride + 3 * kv.page_stride + (4 + 2) * 8 * 2
    assert flat.nonzero().min().item() == off and int(flat.count_nonzero()) <= 2


def test_decode_is_typed():
    with pytest.raises(msgspec.ValidationError):
        decode_schema(msgspec.msgpack.encode({"version": 1, "digest": "nope"}))


def test_compatible_across_tp():
    check_schema(schema(tp=1), schema(tp=2, rank=1))
    check_peer(peer(schema(tp=2), "sender"), peer(schema(tp=1)))


def _with_tensor(s, kind, **changes):
    tensors = tuple(msgspec.structs.replace(t, **changes) if t.kind == kind else t for t in s.tensors)
    return msgspec.structs.replace(s, tensors=tensors)


@pytest.mark.parametrize(
    "field,remote",
    [
        ("dtype", lambda: schema(dtype=torch.float32)),
        ("num_layers", lambda: schema(layer_types=("linear_attention", "full_attention"))),
        ("layer_types", lambda: schema(layer_types=("full_attention", "linear_attention") * 2)),
        ("linear_num_key_heads", lambda: schema(hk=2)),
        ("linear_num_value_heads", lambda: schema(hv=4)),
        ("linear_key_head_dim", lambda: schema(linear_key_head_dim=8)),
        ("linear_value_head_dim", lambda: schema(linear_value_head_dim=4)),
        ("linear_conv_kernel_dim", lambda: schema(linear_conv_kernel_dim=3)),
        ("num_kv_heads", lambda: schema(kvh=4)),
        ("head_dim", lambda: schema(head_dim=16)),
        # what --rope-theta, --rope-scaling and --hf-overrides change: before, not in the digest
        ("num_attention_heads", lambda: schema(num_attention_heads=4)),
        ("rope_theta", lambda: schema(rope_theta=1e6)),
        ("rotary_dim", lambda: schema(partial_rotary_factor=0.5)),
        ("rms_norm_eps", lambda: schema(rms_norm_eps=1e-5)),
        ("norm_topk_prob", lambda: schema(norm_topk_prob=False)),
        (
            "num_speculative_slots",
            lambda: build_schema(
                c := replace(engine_cfg(tiny_model(), 1), speculative=SpeculativeConfig(2)), 0, make_pools(c, 0)
            ),
        ),
        ("schema_version", lambda: msgspec.structs.replace(schema(), version=SCHEMA_VERSION + 1)),
        ("block_size", lambda: build_schema(c := engine_cfg(tiny_model(), 1, block_size=8), 0, make_pools(c, 0))),
        ("conv layout", lambda: _with_tensor(schema(), "gdn_conv", axes=("slot", "time", "channel"))),
        ("kv page layout", lambda: _with_tensor(schema(), "paged_kv", axes=("block", "kv", "head", "token", "dim"))),
        ("recurrent axis order", lambda: _with_tensor(schema(), "gdn_recurrent", axes=("slot", "head", "dv", "dk"))),
        ("dtype of gdn_recurrent", lambda: _with_tensor(schema(), "gdn_recurrent", dtype="bfloat16")),
        (
            "rope_scaling",
            lambda: msgspec.structs.replace(
                schema(), digest=msgspec.structs.replace(schema().digest, rope_scaling="RopeScaling(kind='yarn', ...)")
            ),
        ),
    ],
)
def test_handshake_refuses(field, remote):
    local, other = schema(), remote()
    with pytest.raises(HandshakeError) as e:
        check_schema(local, other)
    assert e.value.field.startswith(field), str(e.value)
    msg = str(e.value)
    assert field in msg and repr(e.value.local) in msg and repr(e.value.remote) in msg


@pytest.mark.parametrize("version", [1, SCHEMA_VERSION + 7], ids=["v1-block-major-kv", "newer"])
def test_handshake_refuses_version_before_decoding(version):
    data = encode(msgspec.structs.replace(peer(schema()), version=version))
    with pytest.raises(HandshakeError, match="schema_version"):
        decode_peer(data)


def test_handshake_refuses_backend_and_role():
    with pytest.raises(HandshakeError, match="backend"):
        check_peer(peer(schema(), "sender"), peer(schema(), backend="ucxx"))
    with pytest.raises(HandshakeError, match="role"):
        check_peer(peer(schema()), peer(schema()))


def _bf16_state_schema(tp=1, rank=0):
    c = engine_cfg(tiny_model(), tp)
    c = replace(c, cache=replace(c.cache, recurrent_dtype="bfloat16"))
    return build_schema(c, rank, make_pools(c, rank))


def test_schema_carries_a_bfloat16_recurrent_state():
    s = _bf16_state_schema()
    rec, f32 = s.tensor(0, "gdn_recurrent"), schema().tensor(0, "gdn_recurrent")
    assert s.digest.recurrent_dtype == rec.dtype == "bfloat16" and rec.itemsize == 2
    assert rec.page_stride * 2 == f32.page_stride and rec.axes == f32.axes
    check_schema(_bf16_state_schema(tp=1), _bf16_state_schema(tp=2, rank=1))  # same dtype: any TP pair


@pytest.mark.parametrize("sender_local", [True, False], ids=["checked-by-sender", "checked-by-receiver"])
def test_handshake_refuses_a_bfloat16_state_feeding_a_float32_one_naming_both(sender_local):
    """bfloat16 -> float32 cannot give back the float32 bits: refused whichever end checks
    (float32 -> bfloat16 is the one cast a plan declares, tests/transfer/test_recurrent_cast.py)."""
    sender, receiver = peer(_bf16_state_schema(), "sender"), peer(schema())
    with pytest.raises(HandshakeError, match="--mamba-ssm-cache-dtype") as e:
        check_peer(sender, receiver) if sender_local else check_peer(receiver, sender)
    assert e.value.field == "recurrent_dtype"
    assert {e.value.local, e.value.remote} == {"float32", "bfloat16"}
    assert "'float32'" in str(e.value) and "'bfloat16'" in str(e.value)


def test_the_cast_bridges_the_recurrent_dtype_only():
    """With the recurrent cast in play, any other difference is refused as before: the model
    dtype, and a recurrent dtype compared with no direction (check_schema alone)."""
    c = engine_cfg(tiny_model(dtype=torch.float32), 1)
    f32_model = build_schema(c, 0, make_pools(c, 0))
    with pytest.raises(HandshakeError) as e:
        check_peer(peer(f32_model, "sender"), peer(_bf16_state_schema()))
    assert e.value.field == "dtype"
    with pytest.raises(HandshakeError, match="--mamba-ssm-cache-dtype"):
        check_schema(schema(), _bf16_state_schema())


@pytest.mark.parametrize("sender_invariant", [False, True], ids=["plain-to-invariant", "invariant-to-plain"])
def test_handshake_refuses_nodes_that_disagree_on_batch_invariance(sender_invariant):
    """A prefill node and a decode node must agree on --batch-invariant: either way round the
    handshake refuses, naming the option."""

    def with_option(on: bool):
        c = engine_cfg(tiny_model(), 1)
        c = replace(c, model=replace(c.model, batch_invariant=on))
        return build_schema(c, 0, make_pools(c, 0))

    sender, receiver = with_option(sender_invariant), with_option(not sender_invariant)
    assert sender.digest.batch_invariant is sender_invariant
    with pytest.raises(HandshakeError, match="--batch-invariant must be set on every node") as e:
        check_peer(peer(sender, "sender"), peer(receiver))
    assert e.value.field == "batch_invariant"
    check_peer(peer(with_option(True), "sender"), peer(with_option(True)))  # agreeing nodes pass
