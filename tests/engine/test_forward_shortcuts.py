"""The CPU forward's shortcuts against the layer-by-layer path and transformers: the decode step
in one C call (engine/model/fused_decode.py: same greedy tokens as transformers and the same
log-probabilities as the per-op path to the bit, in float32 and in bfloat16 with batch-invariant
mode, it runs the same C ops in the same order), and a prefill's last layer computing its output
only at the rows that sample."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.helpers import hybrid_ckpt as hc

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)


def _run(path, prompts, fused: bool, dtype: str = "float32", params: SamplingParams = GREEDY):
    kw = {"batch_invariant": True} if dtype == "bfloat16" else {}  # bfloat16 weights packed: that mode's
    with LLM(path, dtype=dtype, **kw) as llm:
        model = llm.engine.executor.worker.model
        calls = []
        if not fused:  # the layer-by-layer path: as if the model were one the call does not cover
            model._fused_decode = lambda *a: None
        else:
            orig = model._fused_decode

            def spy(*a):
                got = orig(*a)
                calls.append(got is not None)
                return got

            model._fused_decode = spy
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    return outs, calls


def test_fused_decode_matches_layer_by_layer_and_transformers(ckpt_hv2, prompts, hf_ref_hv2):
    fused, calls = _run(ckpt_hv2, prompts, True)
    per_op, _ = _run(ckpt_hv2, prompts, False)
    assert sum(calls) >= GREEDY.max_tokens - 2, "the decode steps did not take the one-call path"
    for p, f, o, ref in zip(prompts, fused, per_op, hf_ref_hv2):
        assert f.output_token_ids == ref[: GREEDY.max_tokens], f"prompt of {len(p)} tokens diverges from transformers"
        assert f.output_token_ids == o.output_token_ids
        assert len(f.logprobs) == len(o.logprobs) == GREEDY.max_tokens
        assert f.logprobs == o.logprobs  # (token, logprob, top 3) of every step


def test_bfloat16_fused_decode_matches_layer_by_layer_to_the_bit(ckpt_hv2, prompts):
    """bfloat16 with batch-invariant mode (packed bfloat16 weights): the one-call decode gives the
    per-op path's tokens and log-probabilities to the bit, greedy and sampled with seeds."""
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=3)
    for params in (GREEDY, sampled):
        fused, calls = _run(ckpt_hv2, prompts, True, "bfloat16", params)
        per_op, _ = _run(ckpt_hv2, prompts, False, "bfloat16", params)
        assert sum(calls) >= params.max_tokens - 2, "the decode steps did not take the one-call path"
        for f, o in zip(fused, per_op):
            assert f.output_token_ids == o.output_token_ids
            assert f.logprobs == o.logprobs


def test_prefill_last_layer_output_only_where_logits_are_wanted(ckpt_hv2, prompts):
    """A prefill's last layer runs its output projection and MLP on the sampled rows only, and the
    logits still match transformers'."""
    with LLM(ckpt_hv2, dtype="float32") as llm:
        model = llm.engine.executor.worker.model
        mlp, seen = model.layers[-1].mlp, []

        def spy(h):
            seen.append(h.shape[0])
            return mlp(h)

        model.layers[-1].mlp = spy
        got = llm.compute_logits(prompts)
    assert seen == [len(prompts)], f"the last layer's MLP saw {seen} rows, not one per prompt"
    for p, g in zip(prompts, got):
        ref = hc.hf_last_logits(ckpt_hv2, p)
        rel = ((g - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"prompt of {len(p)} tokens: logits rel err {rel:.2e}"
