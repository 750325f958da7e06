"""`pdserve up --hf-overrides` (vLLM's flag, as Qwen3.5's and Qwen3-Next's cards give it) on a
checkpoint of a 64-position context with no rope scaling: YaRN factor 4 added on the command line
reaches the router and both nodes, so `--max-model-len 256` starts and the router's /v1/models
reports 256; past the original context, a 200-token prompt's greedy tokens (the first from the
prefill node, the rest from the decode node) and their log-probabilities, and its prompt
log-probabilities (computed on the decode node), are transformers' for the checkpoint with those
fields written into its config.json."""

from __future__ import annotations

import dataclasses
import json
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, log_url

ORIGINAL, CONTEXT, NEW = 64, 256, 6
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = Path(tmp_path_factory.mktemp("served-overrides"))
    plain = hc.make(base / "plain", dataclasses.replace(hc.SPEC_HV2, layers=4, max_positions=ORIGINAL))
    return plain, hc.with_rope(plain, base / "edited", YARN)


def test_served_context_and_logprobs_follow_the_override(ckpts):
    from client import Client

    plain, edited = ckpts
    prompt = hc.prompts(lens=(200,), seed=32)[0]
    over = json.dumps({"rope_parameters": YARN})
    up = Up(
        "--model", plain, "--dtype", "float32", "--http-port", "0", "--hf-overrides", over, "--max-model-len", "256"
    )
    try:
        url = log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
        with urllib.request.urlopen(url + "/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["max_model_len"] == CONTEXT
        with Client(up.address, timeout=60) as c:
            c.wait_ready(timeout=60)
            # pushed from the prefill node (its first token) to the decode node (the rest)
            gen = c.generate(prompt_token_ids=prompt, max_tokens=NEW, temperature=0.0, logprobs=0, ignore_eos=True)
            # prompt log-probabilities are computed on the decode node
            scored = c.generate(prompt_token_ids=prompt, max_tokens=1, temperature=0.0, prompt_logprobs=0)
    finally:
        assert up.stop() == 0, up.output()
    assert gen.prefill_node == "prefill-0" and len(gen.token_ids) == NEW
    seq = prompt + gen.token_ids
    with torch.inference_mode():
        want = hc._hf_model(edited)(torch.tensor([seq[:-1]])).logits[0].float().log_softmax(-1)
    picked = want.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    out = picked[len(prompt) - 1 :]  # each output token: transformers' greedy choice, at its log-probability
    assert (want[len(prompt) - 1 :].max(-1).values - out).max() < 1e-4
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in gen.logprobs]), out, rtol=0, atol=1e-4)
    assert [lp.token_id for lp in scored.prompt_logprobs] == prompt[1:]
    got = torch.tensor([lp.logprob for lp in scored.prompt_logprobs])
    torch.testing.assert_close(got, picked[: len(prompt) - 1], rtol=0, atol=1e-4)
