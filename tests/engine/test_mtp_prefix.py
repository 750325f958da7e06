"""Prefix caching with MTP drafting (k = 2), pages of 16 tokens, snapshots every 32: prompts that
share a prefix of every length class give transformers' greedy tokens; the drafter's KV over the
prompt, every draft and each request's acceptance are those of a run without the cache; every
page, slot, snapshot pin and deferred fill is back afterwards.

The MTP layer's KV at position p pairs the hidden state at p with token p + 1, so the last
position of a cached prefix (p - 1 for a resume at p) is computed again with the request's own
token p, and a cached page is shared only where the token after it is the request's too
(docs/ARCHITECTURE.md "Prefix caching with MTP drafting"): C1 branches off B1 right at a page
boundary 32, so C1's next turn resumes at 32, not at C1's end (48). A request that finishes
while it still drafts leaves a final snapshot (with the hidden state at its last position), so
D1's next turn resumes past D1's reply."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ARGS = dict(dtype="float32", speculative_method="mtp", num_speculative_tokens=2, kv_cache_memory="64MiB")


def _rand(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def case(ckpt_mtp, mtp_prompts):
    """The requests in order, with the tokens each should resume from, and transformers' tokens.
    B1 is the 40-token prompt the block was fitted to (conftest.py), so its drafts are accepted."""
    base = mtp_prompts[2]
    a1, b1, c1 = base[:10], base, base[:32] + _rand(16, 24)
    out_b1, out_c1 = hc.hf_greedy(ckpt_mtp, b1, NEW + 8), hc.hf_greedy(ckpt_mtp, c1, NEW)
    d1 = b1 + out_b1[:8]
    reqs = [
        (a1, 0),
        (a1 + _rand(30, 22), 10),  # shorter than a page: a1's end, its partial page copied
        (b1, 10),  # snapshots at 32 (the grid) and 40 (its end)
        (b1 + _rand(14, 23), 40),  # between snapshots: b1's end, mid-page
        (c1, 32),  # exactly at a grid snapshot, on a page boundary; ends on one (48)
        # c1's next turn: page 1 was cached with b1's token 32 after it, so neither c1's end nor
        # its final state (which need page 1) is usable: the snapshot at 32 keeps page 1 itself
        (c1 + out_c1 + _rand(6, 25), 32),
        (d1, 40),  # ends on a page boundary
        # d1's next turn: past d1's reply (its final snapshot: 48 + NEW - 1 computed tokens)
        (d1 + out_b1[8:] + _rand(6, 26), 48 + NEW - 1),
    ]
    refs = {i: hc.hf_greedy(ckpt_mtp, reqs[i][0], NEW) for i in (0, 1, 3, 5, 7)}
    refs.update({2: out_b1[:NEW], 4: out_c1, 6: out_b1[8:]})
    return ckpt_mtp, reqs, [refs[i] for i in range(len(reqs))]


def _run(llm, prompt):
    """One request to the end: its output, its drafts (tokens so far, first draft) after every
    step, (drafted, accepted), and the MTP layer's KV [len(prompt), 2, KVH, hd] over the prompt."""
    s = llm.engine.scheduler
    n0, a0 = s.num_draft_tokens, s.num_accepted_tokens
    req, seen, kv = hc.mtp_run(llm, prompt, GREEDY)
    return req, seen, (s.num_draft_tokens - n0, s.num_accepted_tokens - a0), kv


def test_mtp_with_prefix_caching_matches_a_run_without(case):
    ckpt, reqs, refs = case
    with LLM(ckpt, enable_prefix_caching=False, **ARGS) as llm:
        assert llm.engine.prefix is None
        off = [_run(llm, p) for p, _ in reqs]
    with LLM(ckpt, prefix_snapshot_interval=32, **ARGS) as llm:
        e = llm.engine
        assert e.prefix is not None and e.prefix.mtp and llm.capacity().num_snapshots > 0
        on = [_run(llm, p) for p, _ in reqs]
        assert (e.blocks.num_free, e.slots.num_free) == (llm.capacity().num_blocks, llm.capacity().num_state_slots)
        assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
        llm.generate(prompt_token_ids=[[7]], sampling_params=SamplingParams(max_tokens=1))
        assert not e.executor.worker.drafter.pending
    drafted = 0
    for (p, cached), ref, a, b in zip(reqs, refs, on, off):
        what = f"{len(p)}-token prompt, {cached} cached"
        assert a[0].output_token_ids == b[0].output_token_ids == ref, what
        assert (a[0].num_cached_tokens, b[0].num_cached_tokens) == (cached, 0), what
        assert a[2] == b[2], what  # (drafted, accepted) of this request
        assert ((a[3] - b[3]).abs().max() / b[3].abs().max()).item() < 1e-5, what
        logits, _ = hc.hf_mtp_logits(ckpt, p + ref)
        assert [int(logits[n - 2].argmax()) for n, _ in a[1]] == [d for _, d in a[1]], what
        drafted += a[2][0]
    assert drafted > 0 and sum(a[2][1] for a in on) > 0


def test_reply_pages_filled_by_accepted_drafts_are_cached_for_the_next_turn(ckpt_mtp, mtp_prompts):
    """The 1-token prompt the block was fitted to: its reply fills pages 0 and 1 with runs of
    accepted drafts, which the step verifies before it appends them. Its next turn resumes from
    its final state (every token but the last: docs/prefix-caching.md), as without drafting, and
    gives transformers' tokens."""
    prompt = mtp_prompts[0]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(ckpt_mtp, **ARGS) as llm:
        first = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        assert llm.engine.scheduler.num_accepted_tokens > 20  # the pages were filled by accepted runs
        turn2 = prompt + first.output_token_ids + _rand(5, 27)
        second = llm.generate(prompt_token_ids=[turn2], sampling_params=GREEDY)[0]
    assert second.num_cached_tokens == len(prompt) + 40 - 1
    assert not hc.hf_greedy_violations(ckpt_mtp, turn2, second.output_token_ids)
