"""Cache specs, capacity and free lists."""

from __future__ import annotations

import pytest
import torch

from engine.cache import BlockManager, GDNStateSpec, PagedAttentionSpec, SlotPool, build_specs, plan_capacity
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, parse_bytes


def model_cfg(**kw) -> ModelConfig:
    base = dict(
        path="unused",
        architecture="Qwen3_5ForCausalLM",
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        layer_types=tuple(["linear_attention"] * 3 + ["full_attention"]) * 2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_spec_sizes_by_hand():
    cfg = EngineConfig(model_cfg(), cache=CacheConfig(block_size=16))
    specs = build_specs(cfg, 0)
    attn = [s for s in specs if isinstance(s, PagedAttentionSpec)]
    gdn = [s for s in specs if isinstance(s, GDNStateSpec)]
    assert [s.layer for s in attn] == [3, 7] and len(gdn) == 6
    # K and V, 2 heads of 64, 16 tokens, bf16
    assert attn[0].page_size_bytes == 2 * 2 * 64 * 16 * 2
    # conv: (2*4*32 + 8*32) channels x 3 columns, bf16; recurrent 8 x 32 x 32 float32
    assert gdn[0].conv_shape == (512, 3) and gdn[0].recurrent_shape == (8, 32, 32)
    assert gdn[0].page_size_bytes == 512 * 3 * 2 + 8 * 32 * 32 * 4
    assert gdn[0].recurrent_dtype == torch.float32 and gdn[0].conv_dtype == torch.bfloat16


def test_capacity_divides_by_attention_bytes_only():
    """Full attention is 1/4 of the layers: tokens = KV memory / attention bytes per token,
    not a quarter of it (dividing by every cache group would understate it 4x)."""
    cfg = EngineConfig(
        model_cfg(),
        cache=CacheConfig(block_size=16, kv_cache_memory="64MiB"),
        scheduler=SchedulerConfig(max_num_seqs=10),
    )
    specs = build_specs(cfg, 0)
    cap = plan_capacity(specs, cfg.cache.memory_bytes, cfg.num_state_slots, 16)
    attn_bytes_per_token = 2 * (2 * 2 * 64 * 2)  # two attention layers, K+V, 2 heads x 64, bf16
    state = 10 * 6 * (512 * 3 * 2 + 8 * 32 * 32 * 4)
    kv_memory = parse_bytes("64MiB") - state
    assert cap.kv_bytes_per_token == attn_bytes_per_token
    assert cap.state_bytes == state
    assert cap.max_tokens == (kv_memory // (attn_bytes_per_token * 16)) * 16
    assert cap.max_tokens > 0.99 * kv_memory / attn_bytes_per_token
    assert cap.max_concurrency == 10


def test_capacity_reported_by_llm(llm_hv2):
    cap = llm_hv2.capacity()
    cfg = llm_hv2.config
    specs = build_specs(cfg, 0)
    per_tok = sum(s.bytes_per_token for s in specs if isinstance(s, PagedAttentionSpec))
    state = cfg.num_state_slots * sum(s.page_size_bytes for s in specs if isinstance(s, GDNStateSpec))
    # the prefix snapshot pool (10% by default) comes off the budget first: whole GDN states plus one
    # partial page per attention layer each; it bounds resumable prefixes, not tokens
    snap = state // cfg.num_state_slots + per_tok * 16
    snaps = int(cfg.cache.memory_bytes * 0.1) // snap
    assert (cap.num_snapshots, cap.snapshot_bytes) == (snaps, snaps * snap)
    assert cap.max_tokens == (cfg.cache.memory_bytes - state - snaps * snap) // (per_tok * 16) * 16
    pools = llm_hv2.engine.executor.worker.pools
    assert pools.snapshots.recurrent[0].shape == (snaps, 8, 32, 32) and pools.snapshots.tail[3].shape[0] == snaps
    assert pools.kv[3].shape == (cap.num_blocks, 2, 2, 16, 64)  # the kernels' view ...
    storage = dict(((kind, layer), t) for kind, layer, t in pools.tensors())[("paged_kv", 3)]
    assert storage.shape == (2, cap.num_blocks, 2, 16, 64) and storage.is_contiguous()  # ... of head-major memory
    assert storage.data_ptr() == pools.kv[3].data_ptr() and torch.equal(storage.permute(1, 2, 0, 3, 4), pools.kv[3])
    assert pools.recurrent[0].shape == (cap.num_state_slots, 8, 32, 32)
    assert pools.recurrent[0].dtype == torch.float32


def test_budget_too_small_is_refused():
    cfg = EngineConfig(model_cfg(), scheduler=SchedulerConfig(max_num_seqs=64))
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_num_seqs"):
        plan_capacity(build_specs(cfg, 0), 1 << 20, 64, 16)


def test_tp_shards_follow_segments():
    cfg = EngineConfig(model_cfg(), parallel=ParallelConfig(2))
    g0 = build_specs(cfg, 0)[0]
    g1 = build_specs(cfg, 1)[0]
    assert [(s.name, s.local_offset, s.local_width, s.rank_start) for s in g1.conv_segments] == [
        ("q", 0, 64, 64),
        ("k", 64, 64, 64),
        ("v", 128, 128, 128),
    ]
    assert g0.v_heads == (0, 1, 2, 3) and g1.v_heads == (4, 5, 6, 7)
    a3 = build_specs(EngineConfig(model_cfg(), parallel=ParallelConfig(4)), 3)[3]
    assert a3.kv_heads == (1,)  # 4 ranks, 2 KV heads: replicated, rank 3 holds head 1


@pytest.mark.parametrize(
    "kw, t, words",
    [
        (dict(linear_num_key_heads=2, linear_num_value_heads=4), 4, "linear_num_key_heads=2"),
        (dict(num_attention_heads=6, num_kv_heads=2), 4, "num_attention_heads=6"),
        (dict(num_kv_heads=3, num_attention_heads=12), 2, "num_key_value_heads=3"),
    ],
    ids=["key_heads", "attention_heads", "kv_heads"],
)
def test_tp_that_does_not_divide_names_the_count(kw, t, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(model_cfg(**kw), parallel=ParallelConfig(t))


def test_block_manager_exact_ids():
    bm = BlockManager(6, 16)
    assert bm.blocks_for(1) == 1 and bm.blocks_for(16) == 1 and bm.blocks_for(17) == 2
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert (a, b, bm.num_free) == ([0, 1], [2, 3, 4], 1)
    assert not bm.can_allocate(2)
    with pytest.raises(MemoryError):
        bm.allocate(2)
    bm.free(a)
    assert bm.num_free == 3 and bm.allocate(3) == [5, 0, 1]
    with pytest.raises(ValueError, match="freed twice"):
        bm.free([0, 0])


def test_slot_pool():
    sp = SlotPool(2)
    s0, s1 = sp.allocate(), sp.allocate()
    assert (s0, s1, sp.allocate(), sp.num_free) == (0, 1, None, 0)
    sp.free(s0)
    assert sp.num_free == 1 and sp.allocate() == 0
    with pytest.raises(ValueError):
        sp.free(7)


def test_memory_size_parsing():
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(4096) == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")
