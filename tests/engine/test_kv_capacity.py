"""A KV cache smaller than max_model_len: a request stops (length, with a warning) only where its
own context fills every page, and start-up says so; a request short of pages that other requests
hold outside the running batch (a decode node's reservations) waits for them instead, and then
decodes on exactly as transformers does."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams

GREEDY48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def _budget(llm_hv2, slots: int, blocks: int) -> int:
    """kv_cache_memory that buys `slots` GDN state slots and `blocks` KV pages (no snapshots)."""
    c = llm_hv2.capacity()
    return slots * (c.state_bytes // c.num_state_slots) + blocks * (c.kv_bytes // c.num_blocks)


def _drain(engine, rid):
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                return o
    raise AssertionError(f"{rid} never finished")


def test_context_that_fills_the_cache_stops_with_length_and_warnings(ckpt_hv2, llm_hv2, prompts, hf_ref_hv2, caplog):
    """65 prompt tokens and 48 to generate need 113 positions; the cache has 6 pages (96 tokens):
    the request gets the 96 - 65 + 1 tokens the pages hold (the last needs none), as transformers'
    first ones, without being preempted, and both start-up and the stop say why."""
    prompt, ref = prompts[5], hf_ref_hv2[5]
    kv = _budget(llm_hv2, 2, 6)
    with caplog.at_level(logging.WARNING, logger="pdserve"):
        with LLM(ckpt_hv2, dtype="float32", kv_cache_memory=kv, max_num_seqs=2, enable_prefix_caching=False) as llm:
            assert llm.capacity().max_tokens == 96
            (out,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY48)
            assert llm.engine.blocks.num_free == 6 and llm.engine.slots.num_free == 2
    assert out.finish_reason == "length" and out.output_token_ids == ref[: 96 - 65 + 1]
    assert out.metrics["num_preemptions"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any("is more than the KV cache holds (96 tokens)" in m for m in lines), lines
    assert any("its context fills the KV cache's 96 tokens" in m for m in lines), lines


def test_resumed_request_longer_than_the_cache_is_refused(ckpt_hv2, llm_hv2):
    kv = _budget(llm_hv2, 2, 6)
    with LLM(ckpt_hv2, dtype="float32", kv_cache_memory=kv, max_num_seqs=2, enable_prefix_caching=False) as llm:
        with pytest.raises(ValueError, match="a context stops at 97 tokens"):
            llm.engine.resume_request(list(range(60)), GREEDY48, list(range(40)))
        assert not llm.engine.has_unfinished()


def test_request_waits_for_pages_a_reservation_holds(ckpt_hv2, llm_hv2, prompts, hf_ref_hv2):
    """A decode engine of 12 pages with 7 reserved for a transfer: a local request that needs 8
    preempts itself when its pages run out, waits for the reservation to go, and then finishes
    its 48 tokens as transformers does (it used to stop with "length" after 15)."""
    kv = _budget(llm_hv2, 2, 12)
    with LLM(ckpt_hv2, dtype="float32", kv_cache_memory=kv, max_num_seqs=2, enable_prefix_caching=False) as llm:
        D = llm.engine
        assert D.capacity.num_blocks == 12
        assert D.reserve(list(range(100)), GREEDY48, "transfer") is not None  # 7 pages
        D.add_request(prompts[5], GREEDY48, "local")
        for _ in range(200):
            D.step()
            if not D.scheduler.running:
                break
        req = D.requests["local"]
        assert not req.status.is_final and req.num_preemptions == 1, (req.status, req.output_token_ids)
        assert D.scheduler.preemptions_total == 1  # vllm:num_preemptions_total on a node
        D.release("transfer")
        out = _drain(D, "local")
        assert out.finish_reason == "length" and out.output_token_ids == hf_ref_hv2[5]
        assert D.blocks.num_free == 12 and D.slots.num_free == 2
