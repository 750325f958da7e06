"""Penalties, logit_bias, min_tokens and logprobs on rows with drafts (engine/sampling/adjust.py):
each draft position's adjusted logits equal a naive per-row reference that counts the drafts
before it as emitted, and a batch of such rows beside plain greedy and seeded rows emits, step
after step, exactly the tokens and logprobs of the same rows sampled one token per step without
drafts (a second sampler), with drafts mostly right, sometimes wrong (the Triton kernels' run:
tests/kernels/test_sampling_triton.py)."""

from __future__ import annotations

import math

import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from tests.engine.test_sampler_batched import _naive_adjusted, _row

V, EOS = 40, (7,)
PARAMS: list[dict] = [
    dict(repetition_penalty=1.8, presence_penalty=0.5, temperature=0.0),
    dict(presence_penalty=1.5, top_k=20, top_p=0.8, temperature=0.7, seed=4),  # Qwen's chat settings
    dict(repetition_penalty=0.5, frequency_penalty=-0.7, temperature=0.9, seed=11, logprobs=3),
    dict(logit_bias={3: 2.5, 9: -100.0}, min_tokens=5, stop_token_ids=[4], temperature=0.0),
    dict(temperature=0.0),
    dict(presence_penalty=-1.0, logit_bias={0: 1.0}, min_tokens=4, stop_token_ids=[5], seed=1, logprobs=2),
    dict(temperature=0.8, seed=9),
    dict(frequency_penalty=0.9, temperature=0.0, logprobs=0),
]
PROMPTS = [[1, 2, 3, 3, 30], [4, 4, 9], [0, 39, 12], [5, 6], [1], [8, 8, 8, 2], [2, 3], [6, 6, 1]]


def _logits(n: int) -> list[torch.Tensor]:
    """Each request's logits for its i-th new token, a few values large so tokens repeat."""
    g = torch.Generator().manual_seed(n)
    out = []
    for _ in range(30):
        x = torch.randn(V, generator=g) * 2
        x[torch.randint(0, V, (3,), generator=g)] += 4.0
        out.append(x)
    return out


def test_draft_positions_adjusted_as_if_the_drafts_before_them_were_emitted():
    params = [SamplingParams(**kw) for kw in PARAMS]
    g = torch.Generator().manual_seed(3)
    outputs = [[int(t) for t in torch.randint(0, V, (i,), generator=g)] for i in range(len(params))]
    drafts = [[int(t) for t in torch.randint(0, V, (1 + i % 3,), generator=g)] for i in range(len(params))]
    drafts[0] = [outputs[0][-1] if outputs[0] else 5, 5, 5]  # a repeated draft, counted twice
    rows = [_row(f"r{i}", p, prompt=PROMPTS[i], output=outputs[i], drafts=drafts[i]) for i, p in enumerate(params)]
    pos, n = [], 0
    for r in rows:
        pos.append(n)
        n += r.num_draft + 1
    logits = torch.randn(n, V, generator=g) * 3
    x = logits.clone()
    sampler = Sampler(seed=2, eos_token_ids=EOS)
    sampler.adjust(x, rows, pos)
    for i, p in enumerate(params):
        for d in range(len(drafts[i]) + 1):
            q = pos[i] + d
            want = _naive_adjusted(logits[q].tolist(), p, PROMPTS[i], outputs[i] + drafts[i][:d], EOS)
            assert torch.allclose(x[q], torch.tensor(want), atol=1e-5), f"row {i} draft position {d}"
    # the scratch rows lent to the draft positions went back to the table
    assert len(sampler.counts.free) + len(sampler.counts.entries) == sampler.counts.tok.shape[0]


def _reference(params, steps: int, device: str) -> tuple[list[list[int]], list[list]]:
    """Each request decoded one token per step, no drafts: its tokens and logprobs."""
    sampler = Sampler(seed=2, eos_token_ids=EOS, device=device)
    table = [_logits(i) for i in range(len(params))]
    outs: list[list[int]] = [[] for _ in params]
    lps: list[list] = [[] for _ in params]
    for _ in range(steps):
        rows = [_row(f"r{i}", p, prompt=PROMPTS[i], output=outs[i]) for i, p in enumerate(params)]
        logits = torch.stack([table[i][len(outs[i])] for i in range(len(params))])
        emitted, got_lp = sampler(logits.to(device), rows, list(range(len(rows))))
        for i, (r, t) in enumerate(zip(rows, emitted)):
            outs[i] += t
            lps[i] += got_lp.get(r.request_id, [])
    return outs, lps


def test_batch_with_drafts_emits_the_tokens_and_logprobs_of_one_token_steps():
    check_drafted_batch("cpu")


def check_drafted_batch(device: str) -> None:
    """The batch test on `device` (tests/kernels/test_sampling_triton.py: with the Triton kernels,
    the reference too)."""
    params = [SamplingParams(**kw) for kw in PARAMS]
    ref, ref_lp = _reference(params, 28, device)
    table = [_logits(i) for i in range(len(params))]
    g = torch.Generator().manual_seed(5)
    sampler = Sampler(seed=2, eos_token_ids=EOS, device=device)
    outs: list[list[int]] = [[] for _ in params]
    lps: list[list] = [[] for _ in params]
    proposed = accepted = 0
    while min(len(o) for o in outs) < 16:
        rows, logits, live = [], [], [i for i in range(len(params)) if len(outs[i]) < 16]
        for i in live:  # a request past 16 tokens leaves the batch
            p, n = params[i], len(outs[i])
            k = max(0, min((n + i) % 4, 26 - n))  # 0 to 3 drafts, mostly the reference's tokens, some wrong
            drafts = [ref[i][n + j] if torch.rand(1, generator=g) < 0.8 else (ref[i][n + j] + 1) % V for j in range(k)]
            rows.append(_row(f"r{i}", p, prompt=PROMPTS[i], output=outs[i], drafts=drafts))
            logits += [table[i][n + d] for d in range(k + 1)]
        first, j = [], 0
        for r in rows:
            first.append(j)
            j += r.num_draft + 1
        emitted, got_lp = sampler(torch.stack(logits).to(device), rows, first)
        for i, r, t in zip(live, rows, emitted):
            assert 1 <= len(t) <= r.num_draft + 1
            proposed += r.num_draft
            accepted += len(t) - 1
            outs[i] += t
            lps[i] += got_lp.get(r.request_id, [])
            assert len(got_lp.get(r.request_id, [])) == (len(t) if params[i].logprobs is not None else 0)
    assert 0 < accepted < proposed
    for i in range(len(params)):
        n = len(outs[i])
        assert outs[i] == ref[i][:n], f"request {i}: {PARAMS[i]}"
        if params[i].logprobs is not None:
            for (t, v, top), (rt, rv, rtop) in zip(lps[i], ref_lp[i][:n]):
                assert t == rt and math.isclose(v, rv, abs_tol=1e-5)
                assert [a for a, _ in top] == [a for a, _ in rtop]
    # min_tokens held back the stop ids through the draft positions too
    assert 4 not in outs[3][:5] and 5 not in outs[5][:4] and 7 not in outs[5][:4]


def test_a_call_that_raises_gives_its_scratch_rows_back():
    """A draw that fails (a grammar error, say) after the draft positions' table rows were lent:
    the rows go back, so failed steps cannot drain the table."""
    params = [SamplingParams(**kw) for kw in PARAMS[:3]]
    rows = [_row(f"r{i}", p, prompt=PROMPTS[i], output=[1, 2], drafts=[3, 4]) for i, p in enumerate(params)]
    sampler = Sampler(seed=2, eos_token_ids=EOS)

    def fail(*a, **k):
        raise RuntimeError("draw failed")

    sampler._pick = fail  # type: ignore[method-assign]
    for _ in range(3):
        try:
            sampler(torch.randn(9, V), rows, [0, 3, 6])
        except RuntimeError:
            pass
        else:
            raise AssertionError("the draw did not fail")
        c = sampler.counts
        assert len(c.free) + len(c.entries) == c.tok.shape[0], "scratch rows kept by a failed call"
