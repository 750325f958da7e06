"""A sampler call over the same rows as the last, each a token further on, reuses the last call's
plan and uploads (engine/sampling/sampler.py, `Sampler._reuse`): its tokens and logprobs must be
those of a sampler planning every call afresh, whatever changes between the steps (a row
reaching its min_tokens, a penalty table growing, a row leaving, drafts), and it must upload
nothing."""

from __future__ import annotations

from unittest import mock

import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.step import RowInput
from tests.engine.test_sampler_transfers import _Transfers

V = 4096
QWEN = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5)
PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(**QWEN, seed=11),
    SamplingParams(temperature=0.9, top_p=0.95, seed=12),
    SamplingParams(temperature=1.0, min_p=0.1, seed=13, logprobs=3),
    SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.2, seed=14),
    SamplingParams(temperature=1.0, logit_bias={11: 5.0, 12: -100.0}, min_tokens=4, seed=15),
    SamplingParams(temperature=1.3, top_k=2000, seed=16),
    SamplingParams(temperature=1.1, seed=17),
    SamplingParams(**QWEN, seed=18),
]
EOS = (2,)


def _rows(outputs: list[list[int]], prompts: list[list[int]], params) -> list[RowInput]:
    return [
        RowInput(
            f"r{i}",
            [7],
            len(prompts[i]) + len(o),
            i,
            [],
            True,
            True,
            params=p,
            history=(prompts[i], o),
            num_output=len(o),
        )
        for i, (p, o) in enumerate(zip(params, outputs))
    ]


def test_reused_plans_draw_what_fresh_plans_draw(request):
    # row 4's prompt has 62 distinct tokens: its penalty table (64 wide) grows after two steps
    prompts = [list(range(100 + 7 * i, 140 + 7 * i)) for i in range(len(PARAMS))]
    prompts[4] = list(range(300, 362))
    outputs: list[list[int]] = [[] for _ in PARAMS]
    kept = Sampler(seed=3, eos_token_ids=EOS)
    planned = mock.patch.object(Sampler, "_plan_call", autospec=True, side_effect=Sampler._plan_call)
    plan_call = planned.start()
    request.addfinalizer(planned.stop)
    gen = torch.Generator().manual_seed(5)
    params = list(PARAMS)
    for step in range(10):
        if step == 7:  # a row leaves: the batch is planned again
            del params[1], outputs[1], prompts[1]
        rows = _rows(outputs, prompts, params)
        logits = torch.randn(len(rows), V, generator=gen) * 4
        first = list(range(len(rows)))
        got, lp = kept(logits.clone(), rows, first)
        want, want_lp = Sampler(seed=3, eos_token_ids=EOS)(logits.clone(), _rows(outputs, prompts, params), first)
        assert got == want, f"step {step}"
        assert lp == want_lp, f"step {step}"
        for o, t in zip(outputs, got):
            o += t
    # fresh samplers plan each of their 10 calls; the kept one at its first step, when row 5
    # reaches min_tokens, when row 4's table grows and when a row leaves
    assert 2 <= plan_call.call_count - 10 <= 5, plan_call.call_count - 10


def test_a_reused_call_uploads_nothing():
    params = [SamplingParams(**QWEN, seed=b) for b in range(16)]
    prompts = [list(range(100, 140))] * 16
    outputs: list[list[int]] = [[] for _ in params]
    sampler = Sampler()
    counts = []
    for _ in range(3):
        with _Transfers() as t:
            got, _ = sampler(torch.randn(16, V) * 4, _rows(outputs, prompts, params), list(range(16)))
        counts.append((len(t.copies), len(t.reads)))
        for o, tok in zip(outputs, got):
            o += tok
    assert counts[0][0] >= 1 and counts[1:] == [(0, 1), (0, 1)], counts
    # the same rows a token further on, but one of them rewritten (its output cut back): planned again
    outputs[3] = outputs[3][:1]
    with _Transfers() as t:
        sampler(torch.randn(16, V) * 4, _rows(outputs, prompts, params), list(range(16)))
    assert len(t.copies) >= 1


def test_engine_decode_steps_reuse_the_plan(llm_hv2):
    """In the engine, decode steps over the same requests plan once: the first decode step after
    the prompts, then none until the batch changes (the worker drops finished requests each step;
    an empty drop keeps the plan)."""
    e = llm_hv2.engine
    with mock.patch.object(Sampler, "_plan_call", autospec=True, side_effect=Sampler._plan_call) as plan_call:
        try:
            for i in range(4):
                p = (
                    SamplingParams(max_tokens=12, ignore_eos=True, seed=i, **QWEN)
                    if i % 2
                    else SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
                )
                e.add_request([3 + i, 17, 300, 42, 9], p)
            e.step()  # the prompts (their first tokens)
            e.step()  # the first decode step
            before = plan_call.call_count
            for _ in range(6):
                e.step()
            assert plan_call.call_count == before
        finally:  # the engine is shared: leave it empty
            while e.has_unfinished():
                e.step()
