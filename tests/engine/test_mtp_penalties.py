"""MTP drafts for requests with presence / frequency / repetition penalties, logit_bias,
min_tokens and logprobs (Qwen's chat settings among them): they draft, and every request, greedy
or seeded, gives the tokens (and logprobs) it gives in the same engine without drafts
(num_speculative_tokens=0), in batches that mix them with plain greedy and seeded rows."""

from __future__ import annotations

import math
from dataclasses import replace

from engine import LLM, SamplingParams

NEW = 16
QWEN_CHAT = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)


def _params(stop: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=NEW, ignore_eos=True, seed=7, **QWEN_CHAT),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0, repetition_penalty=1.3, logprobs=2),
        SamplingParams(
            max_tokens=NEW, temperature=0.0, logit_bias={stop: 3.0, 5: -2.0}, min_tokens=8, stop_token_ids=[stop]
        ),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.9, seed=3, frequency_penalty=0.4, logprobs=1),
        SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0, presence_penalty=0.2),
    ]


def _run(llm, prompts, params):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return [(o.output_token_ids, o.logprobs) for o in outs]


def _same(got, want) -> None:
    for i, ((toks, lps), (rtoks, rlps)) in enumerate(zip(got, want)):
        assert toks == rtoks, f"request {i}"
        if rlps is None:
            assert lps is None
            continue
        assert len(lps) == len(rlps) == len(toks)
        for (t, v, top), (rt, rv, rtop) in zip(lps, rlps):
            assert t == rt and math.isclose(v, rv, abs_tol=1e-4), f"request {i}"
            assert [a for a, _ in top] == [a for a, _ in rtop]


def test_penalized_requests_draft_and_keep_their_tokens(ckpt_mtp, mtp_prompts):
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.0)
    plain_seeded = SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.8, seed=5)
    with LLM(ckpt_mtp, dtype="float32", speculative_method="mtp", num_speculative_tokens=3) as llm:
        s = llm.engine.scheduler
        stop = _run(llm, mtp_prompts[:1], [greedy])[0][0][2]  # a token the model wants early
        params = _params(stop)
        prompts = [mtp_prompts[i % 3] for i in range(len(params))]
        drafts, accepted = s.num_draft_tokens, sum(s.accepted_per_position)
        off = _run(llm, prompts, [replace(p, num_speculative_tokens=0) for p in params])
        assert s.num_draft_tokens == drafts
        on = _run(llm, prompts, params)  # only penalized, biased, min_tokens and logprobs rows
        assert s.num_draft_tokens > drafts and sum(s.accepted_per_position) > accepted
        _same(on, off)
        assert stop not in off[2][0][:8]
        # the same beside plain greedy and seeded rows, each prompt twice
        mixed = params + [greedy, plain_seeded]
        prompts = [mtp_prompts[i % 3] for i in range(len(mixed))]
        want = _run(llm, prompts, [replace(p, num_speculative_tokens=0) for p in mixed])
        _same(_run(llm, prompts, mixed), want)
        _same(want[: len(params)], off)  # a request's tokens do not depend on its batch
        assert llm.engine.blocks.num_free == llm.capacity().num_blocks
