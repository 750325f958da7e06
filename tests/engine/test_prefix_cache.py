"""Prefix caching end to end in the engine: greedy float32 tokens with the cache on equal the
tokens with it off and transformers', for prompts that share a prefix of every length class,
and every page, slot and snapshot pin is back afterwards."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = _rand(100, 5)
SHORT = BASE[:10]  # shorter than a page (16 tokens): its end-of-prompt snapshot is all there is
LONG = BASE[:80] + _rand(5, 1)  # snapshots at 32, 64 (the grid) and 85 (its end)
# (prompt, cached tokens expected once SHORT and LONG ran)
LATER = [
    (BASE[:10] + _rand(5, 2), 10),  # shorter than a page: SHORT's end, copied partial page
    (BASE[:50] + _rand(7, 3), 32),  # between snapshots: trimmed to the grid snapshot at 32
    (BASE[:64] + _rand(3, 4), 64),  # exactly at a grid snapshot, on a page boundary
    (LONG + _rand(4, 5), 85),  # exactly at LONG's end, mid-page
]


@pytest.fixture(scope="module")
def refs(ckpt_hv2):
    return [hc.hf_greedy(ckpt_hv2, p, 12) for p, _ in LATER]


def test_cached_prefixes_give_the_same_tokens(ckpt_hv2, refs):
    prompts = [p for p, _ in LATER]
    with LLM(ckpt_hv2, dtype="float32", enable_prefix_caching=False) as llm:
        assert llm.engine.prefix is None and llm.capacity().num_snapshots == 0
        off = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        first = [llm.generate(prompt_token_ids=[p], sampling_params=GREEDY)[0] for p in (SHORT, LONG)]
        assert [o.num_cached_tokens for o in first] == [0, 10]  # LONG starts with SHORT
        on = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        e = llm.engine
        assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
        assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
        st = e.prefix.stats
        assert st.hit_tokens == 10 + sum(n for _, n in LATER)
        assert st.query_tokens == len(SHORT) + len(LONG) + sum(len(p) for p in prompts)
    for (p, n), a, b, ref in zip(LATER, on, off, refs):
        assert a.num_cached_tokens == n and b.num_cached_tokens == 0
        assert a.output_token_ids == b.output_token_ids == ref, f"{len(p)}-token prompt, {n} cached"


def test_next_turn_resumes_past_the_reply(ckpt_hv2):
    """Turn 2 = turn 1's prompt + its 12 generated tokens + a new message: the engine resumes at
    turn 1's final state (prompt + 11 tokens: the last one has no KV yet), shares the reply's full
    pages, and gives transformers' greedy tokens; nothing is held afterwards."""
    turn1 = BASE[:37]
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        r1 = llm.generate(prompt_token_ids=[turn1], sampling_params=GREEDY)[0]
        turn2 = turn1 + r1.output_token_ids + _rand(6, 7)
        r2 = llm.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0]
        e = llm.engine
        assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
        assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
    assert r1.num_cached_tokens == 0 and r2.num_cached_tokens == len(turn1) + 12 - 1
    assert r1.output_token_ids == hc.hf_greedy(ckpt_hv2, turn1, 12)
    assert r2.output_token_ids == hc.hf_greedy(ckpt_hv2, turn2, 12)


def test_prompt_logprob_requests_resume_from_the_cache(ckpt_hv2):
    """Multiple choice as evaluation harnesses send it (one context, several endings, prompt
    logprobs): later endings resume at the grid snapshot inside the context, whose kept logprobs
    fill the skipped tokens' entries; every entry still matches transformers. A request asking
    for more alternatives than were kept, and one whose token at the snapshot differs, do not
    take it."""
    from tests.engine.test_sampling_options import _check_logprobs

    context = BASE[:70]
    endings = [context + _rand(6, 10 + i) for i in range(3)]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    wide = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=5)
    branch = context[:64] + _rand(8, 20)  # shares 64 tokens, but token 64 differs
    with LLM(ckpt_hv2, dtype="float32", prefix_snapshot_interval=32) as llm:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p in endings]
        assert [o.num_cached_tokens for o in outs] == [0, 64, 64]
        more = llm.generate(prompt_token_ids=[endings[1]], sampling_params=wide)[0]
        assert more.num_cached_tokens == 0  # 2 alternatives kept, 5 asked for
        other = llm.generate(prompt_token_ids=[branch], sampling_params=sp)[0]
        assert other.num_cached_tokens == 32
        e = llm.engine
        assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
    for p, o in zip(endings, outs):
        _check_logprobs(ckpt_hv2, p, o, 2, 1)
    _check_logprobs(ckpt_hv2, endings[1], more, 5, 1)
    _check_logprobs(ckpt_hv2, branch, other, 2, 1)
