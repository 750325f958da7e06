"""Sampling options against independent references: prompt and output logprobs equal the
log-softmax of transformers' float32 logits (in chunks of a small step budget too), top-n in
order; penalties equal a per-token loop over the same logits; logit_bias equals transformers'
generate with its own additive bias, after the penalties and before the min_tokens ban;
min_tokens holds stop tokens back; with speculative decoding such requests decode without
drafts and give the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

PROMPTS = [[5, 17, 300, 42, 9, 77, 1000, 3], list(range(100, 170))]  # 70 tokens: chunked at budget 32


def _hf_logprobs(ckpt, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([tokens])).logits[0].float(), -1)


def _prompt_entries(out, k: int) -> list:
    """vLLM's prompt logprobs ([None, {token_id: Logprob}, ...]: the prompt token first, then the k
    most likely) as (token, logprob, top) per prompt token after the first, its rank checked
    against the top list."""
    assert out.prompt_logprobs[0] is None
    rows = []
    for d in out.prompt_logprobs[1:]:
        tok = next(iter(d))
        top = sorted(((t, x.logprob) for t, x in d.items() if x.rank <= k), key=lambda e: -e[1])
        assert len(top) == k and [d[t].rank for t, _ in top] == list(range(1, k + 1))
        rows.append((tok, d[tok].logprob, top))
    return rows


def _check_logprobs(ckpt, prompt, out, n_prompt, n_out):
    ref = _hf_logprobs(ckpt, prompt + out.output_token_ids)
    assert len(out.prompt_logprobs) == len(prompt) and len(out.logprobs) == len(out.output_token_ids)
    for pos, d in enumerate(out.prompt_logprobs[1:]):  # the prompt token's rank: 1 + the more likely tokens
        tok = prompt[pos + 1]
        row, lp = ref[pos], ref[pos, tok].item()
        assert next(iter(d)) == tok
        assert 1 + (row > lp + 1e-4).sum().item() <= d[tok].rank <= 1 + (row > lp - 1e-4).sum().item(), pos
    entries = _prompt_entries(out, n_prompt) + out.logprobs
    for pos, (tok, lp, top) in enumerate(entries):  # entry pos: token pos + 1, predicted at position pos
        assert tok == (prompt + out.output_token_ids)[pos + 1]
        assert lp == pytest.approx(ref[pos, tok].item(), abs=1e-4), f"position {pos}"
        vals, ids = torch.topk(ref[pos], n_prompt if pos < len(prompt) - 1 else n_out)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4), f"position {pos}"
        assert [i for i, _ in top][:1] == ids.tolist()[:1]


@pytest.fixture(scope="module")
def llm_chunked(ckpt_hv2):
    """n-gram speculation and a 32-token step budget (prompts prefill in chunks)."""
    with LLM(ckpt_hv2, dtype="float32", num_speculative_tokens=2, max_num_batched_tokens=32) as llm:
        yield llm


@pytest.mark.parametrize("which", ["plain", "chunked+spec"])
def test_prompt_and_output_logprobs_match_transformers(ckpt_hv2, llm_hv2, llm_chunked, which):
    llm = llm_hv2 if which == "plain" else llm_chunked
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(PROMPTS, llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)):
        _check_logprobs(ckpt_hv2, prompt, out, 2, 3)
        assert out.output_token_ids == [t for t, _, top in out.logprobs if top[0][0] == t]  # greedy = top-1


def _naive_penalized(logits: torch.Tensor, prompt, output, p: SamplingParams) -> torch.Tensor:
    """One token at a time, as the definitions read (docs/api.md)."""
    row = logits.tolist()
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return torch.tensor(row)


def _adjusted(logits: torch.Tensor, p: SamplingParams, prompt, output, eos=()) -> torch.Tensor:
    """[V] logits -> the batched sampler's adjusted logits for one row with this history."""
    from engine.sampling import Sampler
    from engine.step import RowInput

    row = RowInput(
        "r",
        [(output or prompt)[-1]],
        len(prompt) + len(output) - 1,
        0,
        [],
        True,
        True,
        params=p,
        history=(prompt, output),
        num_output=len(output),
    )
    x = logits[None].clone()
    Sampler(eos_token_ids=eos).adjust(x, [row], [0])
    return x[0]


def test_penalty_arithmetic_matches_naive_reference():
    """Both signs of logits, tokens in the prompt only, the output only, and both."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=g) * 3
    prompt, output = [1, 2, 3, 3, 40], [3, 5, 5, 5, 40, 41]
    for pen in (
        dict(repetition_penalty=1.7),
        dict(repetition_penalty=0.4),
        dict(presence_penalty=1.2),
        dict(frequency_penalty=-0.8),
        dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    ):
        p = SamplingParams(**pen)
        want = _naive_penalized(logits, prompt, output, p)
        assert torch.allclose(_adjusted(logits, p, prompt, output), want, atol=1e-6), pen


# The tiny random model's greedy text does not repeat on its own, so these penalties favour
# repeats (negative ones) or mix both signs: each changes the greedy tokens.
@pytest.mark.parametrize(
    "pen",
    [
        dict(repetition_penalty=0.5),
        dict(presence_penalty=-1.0),
        dict(presence_penalty=-1.0, frequency_penalty=0.6),
        dict(repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=0.4),
    ],
    ids=["repetition", "presence", "presence+frequency", "all"],
)
def test_penalties_match_naive_reference(ckpt_hv2, llm_hv2, llm_chunked, pen):
    prompt = [7, 7, 7, 8, 8, 9, 10, 7, 8, 9]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **pen)
    got = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].output_token_ids
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=greedy)[0].output_token_ids
    assert got != plain
    want: list[int] = []
    for _ in range(6):
        with torch.inference_mode():
            lg = hc._hf_model(ckpt_hv2)(torch.tensor([prompt + want])).logits[0, -1].float()
        want.append(int(_naive_penalized(lg, prompt, want, sp).argmax()))
    assert got == want
    # speculative decoding (n-gram, k=2) and chunked prefill give the same tokens
    assert llm_chunked.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].output_token_ids == got


def test_min_tokens_holds_back_stop_tokens(llm_hv2):
    prompt = PROMPTS[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    greedy = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=sp)[0].output_token_ids
    stop = greedy[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop])
    early = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    assert early.output_token_ids == [stop] and early.finish_reason == "stop"
    sp = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop], min_tokens=2, logprobs=2)
    held = llm_hv2.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    assert stop not in held.output_token_ids[:2]
    first = held.logprobs[0][2]
    assert first[0][0] == stop and held.output_token_ids[0] == first[1][0]  # the runner-up


def test_every_request_speculates_unless_it_asks_for_no_drafts():
    """Penalties, logit_bias, min_tokens and logprobs apply at each draft position (the sampler's
    verification), so they keep their drafts; num_speculative_tokens=0 alone turns them off."""
    for kw in (
        dict(),
        dict(temperature=0.5, seed=1),
        dict(logprobs=0),
        dict(prompt_logprobs=1),
        dict(min_tokens=1),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=-0.1),
        dict(repetition_penalty=1.1),
        dict(logit_bias={3: 0.5}),
    ):
        assert SamplingParams(**kw).speculates, kw
    assert not SamplingParams(presence_penalty=1.5, num_speculative_tokens=0).speculates


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(logprobs=21), "logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens"),
        (dict(logit_bias={5: 100.5}), "logit_bias"),
        (dict(logit_bias={5: float("nan")}), "logit_bias"),
        (dict(logit_bias={5: True}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
        (dict(logit_bias=[5, 1.0]), "logit_bias"),
        (dict(seed=True), "seed"),
        (dict(top_k=True), "top_k"),
        (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids"),
        (dict(stop_token_ids="5"), "stop_token_ids must be a list of token ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_options_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_logit_bias_arithmetic_order():
    """The bias, the min_tokens ban, then the penalties (vLLM's order, docs/api.md), against the
    definitions: a biased token in the prompt has its biased logit divided or multiplied."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3
    prompt, output = [1, 2, 3], [3, 5, 5]
    bias = {3: 2.5, 5: -1.0, 7: 100.0, 9: -100.0, 63: 0.75}
    p = SamplingParams(
        repetition_penalty=1.7,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=bias,
        min_tokens=4,
        max_tokens=8,
        stop_token_ids=[7],
    )
    biased = logits.clone()
    for t, b in bias.items():
        biased[t] += b
    biased[7] = biased[11] = float("-inf")  # the stop id and the EOS, whatever their bias
    want = _naive_penalized(biased, prompt, output, p)
    got = _adjusted(logits, p, prompt, output, eos=(11,))
    assert torch.allclose(got, want, atol=1e-5)


def test_logit_bias_matches_transformers(ckpt_hv2, llm_hv2, llm_chunked):
    prompt, n = PROMPTS[0], 5
    greedy = dict(max_tokens=n, temperature=0.0, ignore_eos=True)

    def run(llm, **kw):
        return llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**greedy, **kw))[0]

    plain = run(llm_hv2).output_token_ids
    forced = next(t for t in range(200, 300) if t not in plain)
    assert run(llm_hv2, logit_bias={forced: 100}).output_token_ids == [forced] * n
    # -100 on the unbiased run's first token: the first token becomes transformers' runner-up
    top2 = torch.topk(hc.hf_last_logits(ckpt_hv2, prompt), 2).indices.tolist()
    assert top2[0] == plain[0]
    banned = run(llm_hv2, logit_bias={plain[0]: -100}, logprobs=2)
    assert banned.output_token_ids[0] == top2[1]
    assert banned.output_token_ids == hc.hf_biased_greedy(ckpt_hv2, prompt, n, {plain[0]: -100.0})
    assert banned.logprobs[0][2][0][0] == plain[0]  # logprobs are the model's own, before the bias
    # moderate biases of both signs at once
    mixed = {plain[1]: -3.5, plain[2]: -2.0, top2[1]: 0.5, 77: 1.25}
    got = run(llm_hv2, logit_bias=mixed).output_token_ids
    assert got != plain and got == hc.hf_biased_greedy(ckpt_hv2, prompt, n, mixed)
    # n-gram speculation drafts the repeats of `forced`: verified with the bias at each draft
    # position, the same tokens
    sched = llm_chunked.engine.scheduler
    drafts = sched.num_draft_tokens
    assert run(llm_chunked, logit_bias={forced: 100}).output_token_ids == [forced] * n
    assert sched.num_draft_tokens > drafts
    assert run(llm_chunked, logit_bias=mixed).output_token_ids == got


def test_logit_bias_outside_the_vocabulary_refused(llm_hv2):
    vocab = llm_hv2.engine.cfg.model.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm_hv2.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(logit_bias={vocab: 1.0}))


def test_stop_token_ids_outside_the_vocabulary_refused(llm_hv2):
    """As logit_bias ids are: the vocabulary is the model's, known to the engine."""
    vocab = llm_hv2.engine.cfg.model.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 0: stop_token_ids \[{vocab}\] out of range \[0, {vocab}\)"):
        llm_hv2.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=SamplingParams(stop_token_ids=[3, vocab]))
    last = SamplingParams(stop_token_ids=(np.int64(vocab - 1),))  # numpy ids are ints
    assert last.stop_token_ids == (vocab - 1,) and type(last.stop_token_ids[0]) is int
    out = llm_hv2.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=last)[0]
    assert out.finish_reason in ("stop", "length")
