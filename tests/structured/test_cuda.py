"""Structured outputs on a CUDA device: the bitmask goes to the device and unpacks there, the
constrained rows of a mixed greedy / sampled batch pass their checks (regex, choice, JSON object,
Lark grammar) and the unconstrained row gives the same tokens as on the CPU; a forbidden draft is
rejected by the CUDA sampler as by the CPU's."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import GrammarMask, forbidden, unpack
from engine.tokenizer import Tokenizer
from tests.structured.cases import CONSTRAINTS, EOS, check, object_bias
from tests.structured.cases import sampling_row as _row

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch.device("cuda")


def test_unpack_on_the_device_matches_the_cpu(cuda):
    bm = torch.randint(-(2**31), 2**31 - 1, (5, 4748), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    want = ~unpack(bm, 151_936)
    assert torch.equal(forbidden(bm, 151_936, torch.device("cpu")), want)
    assert torch.equal(forbidden(bm, 151_936, cuda).cpu(), want)


def test_constrained_batch_on_cuda(tok_ckpt, cuda):
    from engine import LLM

    tok = Tokenizer(tok_ckpt)
    kinds = ["regex", "choice", "json_object", "grammar"]
    params = [
        SamplingParams(
            max_tokens=80,
            temperature=t,
            seed=5,
            constraint=CONSTRAINTS[k],
            logit_bias=object_bias(tok) if k == "json_object" else None,
        )
        for k in kinds
        for t in (0.0, 1.0)
    ]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = tok.encode("Hello world, the answer is")
    got = {}
    for dev in ("cpu", "cuda"):
        llm = LLM(tok_ckpt, dtype="float32", device=dev)
        try:
            got[dev] = llm.generate(prompt_token_ids=[ids] * (len(params) + 1), sampling_params=[*params, free])
        finally:
            llm.close()
    for i, o in enumerate(got["cuda"][:-1]):
        assert o.finish_reason == "stop", o.text
        check(kinds[i // 2], o.text)
    assert got["cuda"][-1].output_token_ids == got["cpu"][-1].output_token_ids


def test_forbidden_draft_rejected_on_cuda(tok_ckpt, cuda):
    tok = Tokenizer(tok_ckpt)
    g, x, re_ = (tok.token_to_id(s) for s in ("g", "x", "re"))
    sampler = Sampler(0, (EOS,), cuda, GrammarMask(tok_ckpt, (EOS,)))
    params = SamplingParams(temperature=0.0, max_tokens=8, constraint={"kind": "choice", "value": ["green"]})
    logits = torch.zeros(3, 1024)
    logits[0, g] = logits[1, x] = logits[2, EOS] = 30.0
    logits[1, re_] = 25.0
    emitted, _ = sampler(logits.to(cuda), [_row(params, [g, x])], [0])
    assert emitted == [[g, re_]]
