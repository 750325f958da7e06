"""bfloat16 output against transformers' bfloat16 output (float32 is pinned token for token
in test_matches_transformers.py).

The checkpoint's weights are drawn wider than the default (std 0.1) so that most positions
have a clear argmax; bfloat16 near-ties may go either way, in transformers as here."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import cpu_ops
from tests.helpers import hybrid_ckpt as hc

NEW = 16
TOL = 0.25  # a logit gap bfloat16 rounding cannot bridge: the engine's token is never further below the max


@pytest.mark.parametrize("cpu_ops_on", [True, False], ids=["fused", "eager"])
def test_bf16_greedy_follows_transformers_bf16(ckpt_bf16, cpu_ops_on, monkeypatch):
    if not cpu_ops_on:
        monkeypatch.setattr(cpu_ops, "available", lambda dtype=None: False)
    prompts = hc.prompts(lens=(3, 40, 200))
    with LLM(ckpt_bf16, dtype="bfloat16") as llm:
        outs = llm.generate(
            prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        )
    not_argmax = 0
    for p, o in zip(prompts, outs):
        toks = o.output_token_ids
        short = hc.hf_logit_shortfall(ckpt_bf16, p, toks, dtype=torch.bfloat16)
        bad = (short > TOL).nonzero().flatten().tolist()
        assert not bad, f"prompt of {len(p)} tokens: tokens {bad} are more than {TOL} below transformers' bf16 max"
        not_argmax += int((short > 0).sum())
    # the rest are near-ties (seen: 2 of 48)
    assert not_argmax <= len(prompts) * NEW // 8, f"{not_argmax} of {len(prompts) * NEW} are not transformers' argmax"
