"""Conversations with MTP drafting (k = 2, pages of 16 tokens) whose replies end at draft depth 0,
as replies do when the drafts are rejected (under sampling above all; here a block not fitted to
these prompts, greedy and with Qwen's sampling settings): the drafter has deferred the last
positions' KV, and the finished request's final snapshot computes them first
(docs/prefix-caching.md "With MTP drafting"). Every turn after the first resumes past the
previous reply (its prompt and reply but the last token), and gives the tokens of an engine
without the cache (greedy: transformers'); every first draft is the reference block's argmax, so
the drafter's KV over the resumed reply is whole; every page, slot and deferred fill is back.
Also a reply whose stop token was an accepted draft with more accepted after it (its final state
taken back at the stop token), and a decode node's request that its first token ended."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

TURNS, NEW = 3, 24
ARGS = dict(dtype="float32", speculative_method="mtp", num_speculative_tokens=2, kv_cache_memory="64MiB")
GREEDY2 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)  # Qwen3.5's chat settings


def _msg(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _talk(llm: LLM, seed: int, sampled: bool):
    """A conversation of TURNS turns, each prompt the history (previous prompt and reply, id for
    id) and a new message; per turn (prompt, request, drafts seen, MTP KV)."""
    hist: list[int] = []
    turns = []
    for t in range(TURNS):
        prompt = hist + _msg(20 + 7 * t, seed + t)
        extra = dict(QWEN, seed=seed + t) if sampled else dict(temperature=0.0)
        sp = SamplingParams(max_tokens=NEW - 3 * t, ignore_eos=True, **extra)
        req, seen, kv = hc.mtp_run(llm, prompt, sp)
        turns.append((prompt, req, seen, kv))
        hist = prompt + req.output_token_ids
    return turns


CONVERSATIONS = [(50, False), (60, True)]  # (messages' seed, sampled)


@pytest.fixture(scope="module")
def llms(ckpt_mtp):
    """(with the prefix cache, without it)"""
    with (
        LLM(ckpt_mtp, prefix_snapshot_interval=32, **ARGS) as on,
        LLM(ckpt_mtp, enable_prefix_caching=False, **ARGS) as off,
    ):
        yield on, off


@pytest.fixture(scope="module")
def runs(llms):
    on, off = llms
    return [_talk(on, seed, sampled) for seed, sampled in CONVERSATIONS], [
        _talk(off, seed, sampled) for seed, sampled in CONVERSATIONS
    ]


def _all_back(llm: LLM) -> None:
    """Every page, slot and snapshot pin is free, and no deferred fill is left once the next step ran."""
    e, cap = llm.engine, llm.capacity()
    assert (e.blocks.num_free, e.slots.num_free) == (cap.num_blocks, cap.num_state_slots)
    assert not e.blocks.ref and all(s.ref == 0 for s in e.prefix._by_key.values())
    llm.generate(prompt_token_ids=[[7]], sampling_params=SamplingParams(max_tokens=1))
    assert not e.executor.worker.drafter.pending


def _same_drafting(ckpt: str, a, b, what: str) -> None:
    """The same drafts as the run without the cache (each the reference block's argmax) and the
    same MTP KV over the prompt."""
    (prompt, req, seen, kv), (_, _, seen_ref, kv_ref) = a, b
    assert seen == seen_ref and seen, what
    assert ((kv - kv_ref).abs().max() / kv_ref.abs().max()).item() < 1e-5, what
    logits, _ = hc.hf_mtp_logits(ckpt, prompt + req.output_token_ids)
    assert [int(logits[n - 2].argmax()) for n, _ in seen] == [d for _, d in seen], what


@pytest.mark.parametrize("which", [0, 1], ids=["greedy", "sampled"])
def test_next_turn_resumes_past_a_reply_that_ended_at_depth_zero(llms, runs, ckpt_mtp, which):
    on, off = runs[0][which], runs[1][which]
    for t, (a, b) in enumerate(zip(on, off)):
        what = f"turn {t}"
        (prompt, req, _, _), (p_ref, ref, _, _) = a, b
        assert prompt == p_ref and req.output_token_ids == ref.output_token_ids, what
        if t < TURNS - 1:  # the gap this covers: the reply ended with its drafts paused
            assert req.spec.depth == 0, what
        if t > 0:
            prev_prompt, prev, _, _ = on[t - 1]
            assert req.num_cached_tokens == len(prev_prompt) + len(prev.output_token_ids) - 1, what
        _same_drafting(ckpt_mtp, a, b, what)
        if not CONVERSATIONS[which][1]:
            assert req.output_token_ids == hc.hf_greedy(ckpt_mtp, prompt, len(req.output_token_ids)), what
    _all_back(llms[0])


@pytest.mark.parametrize("back", [1, 2])
def test_next_turn_resumes_past_a_stop_token_that_accepted_drafts_ran_past(llms, ckpt_mtp, mtp_prompts, back):
    """The 1-token prompt the block was fitted to, stopped at a token of its greedy reply that a
    step accepts as a draft with `back` more accepted after it: the state after the step holds
    tokens the output does not, so the final snapshot takes the one before them from the
    verification's per-token states. The next turn resumes past the reply."""
    prompt = mtp_prompts[0]
    reply = hc.hf_greedy(ckpt_mtp, prompt, 12)
    stop = {2: 4, 1: 5}[back]  # positions of the reply whose step runs `back` tokens past them
    salt = f"back {back}"  # each case its own cache view: the other's final state is a prefix of this one's
    sp = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[reply[stop]], cache_salt=salt)
    first, _, _ = hc.mtp_run(llms[0], prompt, sp)
    assert first.output_token_ids == reply[: stop + 1] and first.finish_reason == "stop"
    assert first.num_computed_tokens - (first.num_tokens - 1) == back  # the case under test
    turn2 = prompt + first.output_token_ids + _msg(5, 70 + back)
    a, b = (hc.mtp_run(llm, turn2, dataclasses.replace(GREEDY2, cache_salt=salt)) for llm in llms)
    assert a[0].num_cached_tokens == len(prompt) + stop
    assert a[0].output_token_ids == b[0].output_token_ids == hc.hf_greedy(ckpt_mtp, turn2, GREEDY2.max_tokens)
    _same_drafting(ckpt_mtp, (turn2, *a), (turn2, *b), f"{back} past the stop")
    _all_back(llms[0])


def test_decode_side_request_ended_by_its_first_token(llms):
    """A reservation activated with a stop token as its first token (a decode node's request the
    prefill node's token ended) while another request ran the last step: it ends with "stop"
    and everything goes back. Before, its final snapshot looked up the hidden state of a row the
    last step did not have (KeyError out of `activate`, the request left in the engine)."""
    on = llms[0]
    e, stop = on.engine, 5
    sp = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    assert e.reserve(_msg(40, 80), sp, "landed") is not None
    hc.mtp_run(on, _msg(20, 81), SamplingParams(max_tokens=3, temperature=0.0))  # the last step: another slot
    out = e.activate("landed", stop, [1, 2])
    assert (out.finished, out.finish_reason, out.output_token_ids) == (True, "stop", [stop])
    assert "landed" not in e.requests
    _all_back(on)
