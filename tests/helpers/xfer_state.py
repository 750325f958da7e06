"""Test helpers: tiny hybrid configs, a random *global* request state, and the shard map that
places it into a TP rank's pools (through engine.shard, independently of transfer.plan)."""

from __future__ import annotations

import torch

from engine.cache.allocator import CachePools, plan_capacity
from engine.cache.spec import build_specs
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.shard import conv_channel_index, head_range, kv_head_range

LAYERS = ("linear_attention", "full_attention", "linear_attention", "full_attention")


def tiny_model(hk: int = 4, hv: int = 8, kvh: int = 2, dtype: torch.dtype = torch.bfloat16, **over) -> ModelConfig:
    fields = dict(
        path="<tiny>",
        architecture="Qwen3_5ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        layer_types=LAYERS,
        num_attention_heads=8,
        num_kv_heads=kvh,
        head_dim=8,
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=4,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        dtype=dtype,
    )
    fields.update(over)
    return ModelConfig(**fields)


def engine_cfg(model: ModelConfig, tp: int, block_size: int = 4, memory: str = "96KiB", slots: int = 4) -> EngineConfig:
    return EngineConfig(
        model=model,
        parallel=ParallelConfig(tp),
        cache=CacheConfig(block_size, memory, slots),
        scheduler=SchedulerConfig(max_num_seqs=slots),
    )


def make_pools(cfg: EngineConfig, rank: int, device: str = "cpu") -> CachePools:
    specs = build_specs(cfg, rank)
    cap = plan_capacity(specs, cfg.cache.memory_bytes, cfg.num_state_slots, cfg.cache.block_size)
    return CachePools(specs, cap, device)


def global_state(model: ModelConfig, num_tokens: int, block_size: int, seed: int) -> dict:
    """Unsharded state of one request: kv[layer] [nb, 2, KVH, bs, hd], conv [conv_dim, Kc-1], rec [Hv, dk, dv]."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-num_tokens // block_size)
    out = {"kv": {}, "conv": {}, "rec": {}}
    for i, kind in enumerate(model.layer_types):
        if kind == "full_attention":
            shape = (nb, 2, model.num_kv_heads, block_size, model.head_dim)
            out["kv"][i] = torch.randn(shape, generator=g).to(model.dtype)
        else:
            out["conv"][i] = torch.randn((model.conv_dim, model.linear_conv_kernel_dim - 1), generator=g).to(
                model.dtype
            )
            out["rec"][i] = torch.randn(
                (model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim), generator=g
            )
    return out


def place(pools: CachePools, cfg: EngineConfig, rank: int, state: dict, blocks: list[int], slot: int) -> None:
    """Write the global state's shard for `rank` into `pools` at `blocks` / `slot` (the shard map)."""
    m, t = cfg.model, cfg.parallel.tensor_parallel_size
    kvh = list(kv_head_range(m.num_kv_heads, t, rank))
    ch = conv_channel_index(m, t, rank)
    vh = list(head_range(m.linear_num_value_heads, t, rank))
    for layer, kv in state["kv"].items():
        dev = pools.kv[layer].device
        pools.kv[layer][torch.tensor(blocks, dtype=torch.long, device=dev)] = kv[:, :, kvh].to(dev)
    for layer, conv in state["conv"].items():
        pools.conv[layer][slot] = conv[ch].to(pools.conv[layer].device)
        pools.recurrent[layer][slot] = state["rec"][layer][vh].to(pools.recurrent[layer].device)


def noise(pools: CachePools, seed: int) -> None:
    """Fill every pool with noise so that an unwritten byte never looks right by chance."""
    g = torch.Generator().manual_seed(seed)
    for _, _, t in pools.tensors():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))  # drawn on the CPU, copied to the pool's device


def snapshot(pools: CachePools) -> dict:
    return {(kind, layer): t.clone() for kind, layer, t in pools.tensors()}


def mismatches(pools: CachePools, expected: dict) -> list[str]:
    """Names of pool tensors that differ bit for bit from `expected` (compared as bytes)."""
    bad = []
    for kind, layer, t in pools.tensors():
        e = expected[(kind, layer)]
        a, b = t.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8)
        if not torch.equal(a, b):
            n = int((a != b).sum())
            bad.append(f"{kind} layer {layer}: {n} of {a.numel()} bytes differ")
    return bad
