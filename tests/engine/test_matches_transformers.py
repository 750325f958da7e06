"""Greedy tokens identical to transformers' generate; last-position logits within 1e-4."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

GREEDY48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _check(outs, refs, prompts):
    for p, o, ref in zip(prompts, outs, refs):
        assert o.output_token_ids == ref, f"prompt of {len(p)} tokens diverges from transformers"
        assert o.finish_reason == "length"


def test_greedy_matches_transformers_hv_twice_hk(llm_hv2, prompts, hf_ref_hv2):
    outs = llm_hv2.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
    _check(outs, hf_ref_hv2, prompts)


def test_greedy_matches_transformers_hv_equals_hk(ckpt_hv1, prompts, hf_ref_hv1):
    with LLM(ckpt_hv1, dtype="float32") as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
    _check(outs, hf_ref_hv1, prompts)


@pytest.mark.parametrize("ckpt_name", ["ckpt_hv2", "ckpt_hv1"])
def test_last_position_logits(request, ckpt_name, prompts):
    path = request.getfixturevalue(ckpt_name)
    with LLM(path, dtype="float32", max_num_batched_tokens=64) as llm:  # chunked prefill path too
        got = llm.compute_logits(prompts)
    for p, g in zip(prompts, got):
        ref = hc.hf_last_logits(path, p)
        rel = ((g - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"prompt of {len(p)} tokens: logits rel err {rel:.2e}"


@pytest.mark.parametrize("budget", [16, 64, None], ids=["chunk16", "chunk64", "unlimited"])
def test_chunked_prefill_same_tokens(ckpt_hv2, prompts, hf_ref_hv2, budget):
    with LLM(ckpt_hv2, dtype="float32", max_num_batched_tokens=budget or 100_000) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
        _check(outs, hf_ref_hv2, prompts)
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        assert llm.engine.slots.num_free == llm.capacity().num_state_slots


def test_preemption_same_tokens(ckpt_hv2, prompts, hf_ref_hv2):
    # Room for ~20 blocks of 16 tokens: the 7 prompts (+48 new each) need far more at once.
    with LLM(ckpt_hv2, dtype="float32", kv_cache_memory="2.6MiB", max_num_seqs=8) as llm:
        assert llm.capacity().num_blocks < 40
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
        _check(outs, hf_ref_hv2, prompts)
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the cache was meant to force preemption"
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
        assert llm.engine.slots.num_free == llm.capacity().num_state_slots


def test_tensor_parallel_2_same_tokens(ckpt_hv2, prompts, hf_ref_hv2):
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
    _check(outs, hf_ref_hv2, prompts)


def test_tensor_parallel_2_hv_equals_hk(ckpt_hv1, prompts, hf_ref_hv1):
    with LLM(ckpt_hv1, dtype="float32", tensor_parallel_size=2) as llm:
        outs = llm.generate(prompt_token_ids=prompts[:4], sampling_params=GREEDY48)
    _check(outs, hf_ref_hv1[:4], prompts[:4])


@pytest.mark.slow
def test_tensor_parallel_4_same_tokens(ckpt_hv2, prompts, hf_ref_hv2):
    with LLM(ckpt_hv2, dtype="float32", tensor_parallel_size=4) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY48)
    _check(outs, hf_ref_hv2, prompts)
