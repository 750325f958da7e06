"""Conversations taking turns on a small snapshot pool (five entries), through the engine: three
conversations whose histories keep each reply id for id, A B C A B C A B C. Each turn's prompt
saves grid points, its end and its final state, more than the pool holds for all three; every
turn after a conversation's first resumes from that conversation's final state (its prompt and
reply but the last token), and the replies equal those of an engine without prefix caching."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
TURNS, NAMES = 3, "ABC"
ARGS = dict(dtype="float32", prefix_snapshot_interval=32, kv_cache_memory="64MiB")


def _messages() -> dict[str, list[list[int]]]:
    rng = random.Random(5)
    return {c: [[rng.randrange(1, 1000) for _ in range(rng.randrange(30, 60))] for _ in range(TURNS)] for c in NAMES}


def _talk(llm: LLM) -> tuple[list[list[int]], list[tuple[str, int, int, int]]]:
    """Every turn's reply, and (conversation, turn, cached tokens, its final state's length)."""
    msgs = _messages()
    hist: dict[str, list[int]] = {c: [] for c in NAMES}
    replies: list[list[int]] = []
    hits: list[tuple[str, int, int, int]] = []
    for t in range(TURNS):
        for c in NAMES:
            prompt = hist[c] + msgs[c][t]
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)[0]
            replies.append(out.output_token_ids)
            hits.append((c, t, out.num_cached_tokens, len(hist[c]) - 1))
            hist[c] = prompt + out.output_token_ids
    return replies, hits


def test_alternating_conversations_each_resume_from_their_final_state(ckpt_hv2):
    """Before, a turn's grid points and end evicted the other conversations' final states (the
    oldest first: the next to run): with five entries no turn after the second resumed at all."""
    with LLM(ckpt_hv2, enable_prefix_caching=False, **ARGS) as llm:
        want, _ = _talk(llm)
    with LLM(ckpt_hv2, prefix_snapshot_memory=0.02, **ARGS) as llm:
        assert llm.capacity().num_snapshots == 5
        got, hits = _talk(llm)
    assert got == want
    later = [(c, t, n, final) for c, t, n, final in hits if t > 0]
    assert [n for _, _, n, _ in later] == [final for _, _, _, final in later], later
