"""The engine's disaggregation hooks: a prefill engine HOLDs a prompt's state, a decode engine
RESERVEs room for it, the state is copied across, and decoding continues with the same tokens."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

SP = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(ckpt_hv2):
    with LLM(ckpt_hv2, dtype="float32", max_num_batched_tokens=64) as p, LLM(ckpt_hv2, dtype="float32") as d:
        yield p.engine, d.engine


def _copy_state(src, dst, src_blocks, src_slot, dst_blocks, dst_slot):
    sp, dp = src.executor.worker.pools, dst.executor.worker.pools
    for layer, kv in sp.kv.items():
        for a, b in zip(src_blocks, dst_blocks):
            dp.kv[layer][b].copy_(kv[a])
    for layer in sp.conv:
        dp.conv[layer][dst_slot].copy_(sp.conv[layer][src_slot])
        dp.recurrent[layer][dst_slot].copy_(sp.recurrent[layer][src_slot])


def _drain(engine, rid):
    toks = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                if o.finished:
                    return toks, o.finish_reason
    raise AssertionError("request never finished")


def test_prefill_hold_reserve_activate_matches_colocated(pair, llm_hv2, prompts):
    P, D = pair
    free_p = (P.blocks.num_free, P.slots.num_free)
    free_d = (D.blocks.num_free, D.slots.num_free)
    expected = [o.output_token_ids for o in llm_hv2.generate(prompt_token_ids=prompts, sampling_params=SP)]
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        P.add_request(prompt, SP, rid, prefill_only=True)
        first, reason = _drain(P, rid)
        assert reason == "prefilled" and len(first) == 1
        src_blocks, src_slot = P.held(rid)
        assert len(src_blocks) == P.blocks.blocks_for(len(prompt))
        dst_blocks, dst_slot, _ = D.reserve(prompt, SP, rid)
        assert len(dst_blocks) == D.blocks.blocks_for(len(prompt) + 1)
        _copy_state(P, D, src_blocks, src_slot, dst_blocks, dst_slot)
        P.release(rid)
        out = D.activate(rid, first[0])
        assert out.new_token_ids == first
        rest, reason = _drain(D, rid)
        assert first + rest == expected[i], f"prompt of {len(prompt)} tokens"
        assert reason == "length"
    assert (P.blocks.num_free, P.slots.num_free) == free_p
    assert (D.blocks.num_free, D.slots.num_free) == free_d


def test_release_of_reservation_and_refusal_when_full(pair):
    _, D = pair
    free = (D.blocks.num_free, D.slots.num_free)
    got = D.reserve([1, 2, 3], SP, "x")
    assert got is not None and D.blocks.num_free == free[0] - 1 and D.slots.num_free == free[1] - 1
    with pytest.raises(ValueError, match="already in flight"):
        D.reserve([1, 2, 3], SP, "x")
    D.release("x")
    assert (D.blocks.num_free, D.slots.num_free) == free
    held = []
    while True:  # exhaust the state slots
        r = D.reserve([5], SP, f"fill{len(held)}")
        if r is None:
            break
        held.append(f"fill{len(held)}")
    assert len(held) == free[1] and D.slots.num_free == 0
    for rid in held:
        D.release(rid)
    assert (D.blocks.num_free, D.slots.num_free) == free


def test_first_token_that_finishes(pair):
    P, D = pair
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    D.reserve([7, 8, 9], one, "short")
    out = D.activate("short", 42)
    assert out.finished and out.finish_reason == "length" and out.output_token_ids == [42]
    assert "short" not in D.requests
    with pytest.raises(ValueError, match="not reserved"):
        P.add_request([1, 2], SP, "busy")
        P.activate("busy", 3)
    P.abort("busy")


def test_reserve_shares_cached_prompt_pages_and_frees_them_by_reference(pair):
    """A decode engine that holds a prompt's leading full pages reserves only the rest; a shared
    page goes back to the free list once no reservation uses it."""
    _, D = pair
    bs = D.blocks.block_size
    prompt = list(range(500, 500 + 2 * bs + 3))  # two full pages and a partial one
    free = (D.blocks.num_free, D.slots.num_free)
    first, _, cached = D.reserve(prompt, SP, "t1")
    assert cached == 0 and len(first) == D.blocks.blocks_for(len(prompt) + 1)
    D.activate("t1", 7)
    _drain(D, "t1")  # its decode steps register the full prompt pages
    assert (D.blocks.num_free, D.slots.num_free) == free
    a, _, ca = D.reserve(prompt + [1, 2], SP, "a")
    b, _, cb = D.reserve(prompt, SP, "b")
    assert ca == cb == 2 and a[:2] == b[:2] == first[:2] and not set(a[2:]) & set(b)
    assert D.blocks.num_free == free[0] - len(a) - (len(b) - 2)
    D.release("a")
    assert not any(D.blocks.is_free(p) for p in first[:2])  # "b" still uses them
    assert D.blocks.num_free == free[0] - len(b)
    c, _, cc = D.reserve([9, *prompt], SP, "c")  # another first page: nothing shared
    assert cc == 0 and not set(c) & set(b)
    D.release("b")
    D.release("c")
    assert (D.blocks.num_free, D.slots.num_free) == free
