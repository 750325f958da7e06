"""Qwen3.5-MoE and Qwen3-Next: tiny random checkpoints written by transformers' own classes, served
greedy in float32 to the same tokens as transformers' generate, at TP 1, 2 and 4 (8 in the slow
tier), with chunked prefill and preemption, from every checkpoint layout we accept."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from tests.helpers import hybrid_ckpt as hc

ARCHS = tuple(hc.SPEC_MOE)
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_ref(moe_ckpt, moe_prompts):
    refs = {}

    def get(arch):
        if arch not in refs:
            refs[arch] = [hc.hf_greedy(moe_ckpt(arch), p, NEW) for p in moe_prompts]
        return refs[arch]

    return get


def _tight(path, tp: int, **kw) -> dict:
    """Settings for 8-token prefill chunks and a cache of 4 GDN state slots + 16 KV blocks of 4
    tokens: the longest request alone needs 14 blocks, so running several at once preempts."""
    from engine.cache.spec import GDNStateSpec, build_specs
    from engine.config import EngineArgs

    settings = dict(dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    specs = build_specs(EngineArgs(model=str(path), **settings).engine_config(), 0)
    per_slot = sum(s.page_size_bytes for s in specs if isinstance(s, GDNStateSpec))
    per_block = sum(s.page_size_bytes for s in specs if not isinstance(s, GDNStateSpec))
    return dict(settings, kv_cache_memory=4 * per_slot + 16 * per_block, **kw)


def _preempting(path, prompts, tp: int):
    with LLM(str(path), **_tight(path, tp)) as llm:
        assert llm.capacity().num_blocks == 16
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the cache was meant to force preemption"
        assert llm.engine.blocks.num_free == 16
    return outs


def _tokens(outs):
    return [o.output_token_ids for o in outs]


def test_config_reads_moe_fields(moe_ckpt):
    a = ModelConfig.from_dir(moe_ckpt("qwen3_5_moe"))
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.shared_expert_intermediate_size) == (
        6,
        3,
        24,
        40,
    )
    assert a.moe_layers == (0, 1, 2, 3) and a.norm_topk_prob and not a.fused_gdn_projections
    n = ModelConfig.from_dir(moe_ckpt("qwen3_next"))
    assert n.moe_layers == (1, 2, 3) and n.intermediate_size == 48 and not n.norm_topk_prob and n.fused_gdn_projections
    sparse2 = ModelConfig(**{**n.__dict__, "mlp_only_layers": (), "decoder_sparse_step": 2})
    assert sparse2.moe_layers == (1, 3)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_chunked_and_preempted(arch, moe_ckpt, moe_prompts, moe_ref):
    """TP 1: whole prompts; then 8-token prefill chunks in a cache small enough to preempt."""
    ref = moe_ref(arch)
    assert hc.engine_greedy(moe_ckpt(arch), moe_prompts, NEW) == ref
    assert _tokens(_preempting(moe_ckpt(arch), moe_prompts, 1)) == ref


@pytest.mark.parametrize(
    "arch,tp",  # TP 4 of Qwen3-Next in the slow tier: its TP 2 and Qwen3.5-MoE's TP 4 run in the suite
    [
        (a, t) if (a, t) != ("qwen3_next", 4) else pytest.param(a, t, marks=pytest.mark.slow)
        for a in ARCHS
        for t in (2, 4)
    ],
)
def test_tensor_parallel_same_tokens(arch, tp, moe_ckpt, moe_prompts, moe_ref):
    """Each rank holds a slice of every expert; 8-token chunks and a small cache (preemption)."""
    assert _tokens(_preempting(moe_ckpt(arch), moe_prompts, tp)) == moe_ref(arch)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_tensor_parallel_8_same_tokens(arch, moe_ckpt, moe_prompts, moe_ref):
    """8 ranks: one KV head replicated 8 times, 3 of each expert's 24 intermediate rows per rank."""
    assert hc.engine_greedy(moe_ckpt(arch), moe_prompts, NEW, tensor_parallel_size=8) == moe_ref(arch)


def _keys(path):
    keys = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys |= set(h.keys())
    return keys


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_sharded_expert_layouts(arch, moe_ckpt, moe_prompts, moe_ref, tmp_path):
    """save_pretrained writes one tensor per expert (the published names); with
    save_original_format=False it keeps transformers' fused [E, 2I, H] / [E, H, I] experts.
    Both load, the per-expert one also sharded with an index."""
    model = hc._hf_model(moe_ckpt(arch))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    sharded, fused = _keys(tmp_path / "sharded"), _keys(tmp_path / "fused")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert (
        "model.layers.1.mlp.experts.5.gate_proj.weight" in sharded
        and "model.layers.1.mlp.shared_expert_gate.weight" in sharded
    )
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" in fused
        and "model.layers.1.mlp.experts.0.up_proj.weight" not in fused
    )
    for d in ("sharded", "fused"):
        assert hc.engine_greedy(tmp_path / d, moe_prompts[:2], NEW) == moe_ref(arch)[:2], d


def test_conditional_generation_text_part_and_mtp_skipped(tmp_path, caplog):
    """Qwen3_5MoeForConditionalGeneration: weights under model.language_model., vision ignored;
    an mtp.* head beside them is skipped with one log line."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = dict(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    d = tmp_path / "vl"
    model.save_pretrained(d)
    w = load_file(d / "model.safetensors")
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in w
    w["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    mcfg = ModelConfig.from_dir(d)
    assert mcfg.weight_prefix == "model.language_model." and mcfg.moe_layers == (0, 1, 2, 3)
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[
            0, 6:
        ].tolist()
    with caplog.at_level("INFO", logger="pdserve.loader"):
        out = hc.engine_greedy(d, [prompt], NEW)[0][:8]
    assert out == ref
    lines = [r.getMessage() for r in caplog.records if r.name == "pdserve.loader"]
    assert sum("multi-token-prediction" in m for m in lines) == 1 and sum("vision tower" in m for m in lines) == 1


def test_tp_must_divide_moe_sizes(moe_ckpt):
    from engine.config import ParallelConfig

    m = ModelConfig.from_dir(moe_ckpt("qwen3_5_moe"))
    bad = ModelConfig(**{**m.__dict__, "moe_intermediate_size": 20})
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide moe_intermediate_size=20"):
        ParallelConfig(8).check_model(bad)
    bad = ModelConfig(**{**m.__dict__, "shared_expert_intermediate_size": 36})
    with pytest.raises(ValueError, match="tensor_parallel_size=8 does not divide shared_expert_intermediate_size=36"):
        ParallelConfig(8).check_model(bad)
    ParallelConfig(8).check_model(ModelConfig(**{**m.__dict__, "intermediate_size": 0}))  # no dense layer: unused


def test_digest_names_moe_and_capacity_is_unchanged(moe_ckpt):
    """MoE adds no per-request state: same cache specs as a dense model of the same attention
    and GDN sizes; but the digest names experts, so P and D must load the same model."""
    from engine.cache.spec import build_specs
    from engine.config import EngineConfig
    from transfer.errors import HandshakeError
    from transfer.handshake import check_digest
    from transfer.schema import model_digest

    m = ModelConfig.from_dir(moe_ckpt("qwen3_5_moe"))
    dense = ModelConfig(
        **{
            **m.__dict__,
            "num_experts": 0,
            "num_experts_per_tok": 0,
            "moe_intermediate_size": 0,
            "shared_expert_intermediate_size": 0,
            "intermediate_size": 48,
        }
    )
    assert build_specs(EngineConfig(m), 0) == build_specs(EngineConfig(dense), 0)
    d = model_digest(EngineConfig(m))
    assert (d.architecture, d.num_experts, d.num_experts_per_tok, d.moe_layers) == (
        "Qwen3_5MoeForCausalLM",
        6,
        3,
        (0, 1, 2, 3),
    )
    with pytest.raises(HandshakeError, match="num_experts"):
        check_digest(d, model_digest(EngineConfig(dense)))


def _held_state(worker, slot: int) -> dict:
    """(runs on a rank) a copy of one slot's GDN conv and recurrent state."""
    p = worker.pools
    return {
        "conv": {i: t[slot].clone() for i, t in p.conv.items()},
        "rec": {i: t[slot].clone() for i, t in p.recurrent.items()},
    }


def test_qwen3_next_state_is_the_qwen35_typed_state(moe_ckpt):
    """After a prompt, Qwen3-Next's GDN state gathered from TP 2 ranks through engine.shard
    ([q_r | k_r | v_r] conv channels, value-head rows) is transformers' cache state: conv
    channels [q | k | v] by head, recurrent (Hv, dk, dv); the layout Qwen3.5's schema describes."""
    from engine.shard import conv_channel_index, head_range

    path = moe_ckpt("qwen3_next")
    prompt = hc.prompts(320, (23,), seed=9)[0]
    with torch.inference_mode():
        cache = hc._hf_model(path)(torch.tensor([prompt]), use_cache=True).past_key_values
    with LLM(path, dtype="float32", tensor_parallel_size=2) as llm:
        core, m = llm.engine, llm.config.model
        core.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0), "r", prefill_only=True)
        while core.has_unfinished():
            core.step()
        _, slot = core.held("r")
        shards = core.executor.call_all(_held_state, slot)
        core.release("r")
    for layer in m.gdn_layers:
        conv = torch.empty(m.conv_dim, m.linear_conv_kernel_dim - 1)
        rec = torch.empty(m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim)
        for r, s in enumerate(shards):
            conv[conv_channel_index(m, 2, r)] = s["conv"][layer]
            rec[list(head_range(m.linear_num_value_heads, 2, r))] = s["rec"][layer]
        torch.testing.assert_close(conv, cache.get_conv_state(layer, state_idx=0)[0, :, 1:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(rec, cache.get_recurrent_state(layer, state_idx=0)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_block_of_a_moe_model(arch, moe_prompts, tmp_path):
    """The MTP block's decoder layer carries the MoE block: the engine's drafts are the argmax of
    the block built from transformers' modules, and MTP decoding keeps transformers' tokens."""
    from dataclasses import replace

    path = hc.make(tmp_path / "ckpt", replace(hc.SPEC_MOE[arch], mtp=True))
    prompt = moe_prompts[2]
    with LLM(path, dtype="float32", speculative_method="mtp", num_speculative_tokens=1) as llm:
        first, drafts = hc.first_step_drafts(llm, prompt, GREEDY)
        logits, _ = hc.hf_mtp_logits(path, prompt + [first])
        assert drafts == [int(logits[-1].argmax())]
        while llm.engine.has_unfinished():
            llm.engine.step()
        outs = llm.generate(prompt_token_ids=moe_prompts, sampling_params=GREEDY)
    assert _tokens(outs) == [hc.hf_greedy(path, p, NEW) for p in moe_prompts]


@pytest.fixture(scope="module")
def moe_mtp(tmp_path_factory, moe_prompts):
    """Qwen3.5-MoE with an `mtp.*` block (its layer's MLP the sparse MoE block, experts one by one
    as published) fitted to the 1- and 17-token prompts' greedy continuations, so that drafts at
    every position are accepted there and mostly rejected on the other prompts."""
    from dataclasses import replace

    spec = replace(hc.SPEC_MOE["qwen3_5_moe"], mtp=True)
    path = hc.make_fitted_mtp(tmp_path_factory.mktemp("moe-mtp") / "ckpt", spec, moe_prompts[::2])
    return path, [hc.hf_greedy(path, p, NEW) for p in moe_prompts]


@pytest.mark.parametrize("tp", [1, 2])
def test_moe_mtp_k1_k2_k3_match_transformers(moe_mtp, moe_prompts, tp):
    """k = 1, 2, 3 (an engine at k = 3, each batch's requests capped with num_speculative_tokens)
    give transformers' tokens; the drafts per position show each cap held, and drafts were
    accepted at every position and rejected too."""
    from dataclasses import replace

    path, want = moe_mtp
    with LLM(path, dtype="float32", speculative_method="mtp", num_speculative_tokens=3, tensor_parallel_size=tp) as llm:
        s, before = llm.engine.scheduler, [0, 0, 0]
        for k in (1, 2, 3):
            outs = llm.generate(prompt_token_ids=moe_prompts, sampling_params=replace(GREEDY, num_speculative_tokens=k))
            assert _tokens(outs) == want, f"k = {k}"
            grew = [x - y for x, y in zip(s.drafts_per_position, before)]
            assert all(g > 0 for g in grew[:k]) and not any(grew[k:]), (k, grew)
            before = list(s.drafts_per_position)
        assert all(a > 0 for a in s.accepted_per_position), s.accepted_per_position
        assert sum(s.accepted_per_position) < sum(s.drafts_per_position)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
