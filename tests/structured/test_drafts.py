"""Drafts under the mask: the batched sampler rejects a draft the grammar forbids (the masked draw
cannot equal it) and keeps the ones it allows; with n-gram and MTP drafting on, constrained
outputs pass their checks and, greedy, equal the same requests decoded without drafts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.sampling import Sampler
from engine.sampling_params import SamplingParams
from engine.structured.bitmask import GrammarMask
from engine.tiny_model import make_tiny_model
from engine.tokenizer import Tokenizer
from tests.structured.cases import CONSTRAINTS, EOS, check, object_bias
from tests.structured.cases import sampling_row as _row
from tests.structured.conftest import SPEC


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_forbidden_draft_is_rejected(tok_ckpt, temperature):
    """choice "green": drafts g, x. The logits favour both drafts; x is forbidden after g, so the
    step emits g and then the token the grammar allows (re: llguidance forces the canonical
    tokenization of forced bytes), not x; an unconstrained row
    in the same batch with the same drafts and logits accepts them all."""
    tok = Tokenizer(tok_ckpt)
    g, x, re_ = (tok.token_to_id(s) for s in ("g", "x", "re"))
    sampler = Sampler(0, (EOS,), "cpu", GrammarMask(tok_ckpt, (EOS,)))
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=8, constraint={"kind": "choice", "value": ["green"]}
    )
    free = SamplingParams(temperature=0.0, max_tokens=8)
    logits = torch.zeros(6, 1024)
    for row in (0, 3):
        logits[row, g] = 30.0  # position 0: g, the first draft
        logits[row + 1, x] = 30.0  # position 1: x (the second draft), else re
        logits[row + 1, re_] = 25.0
        logits[row + 2, EOS] = 30.0
    emitted, _ = sampler(logits, [_row(params, [g, x]), _row(free, [g, x], "free")], [0, 3])
    assert emitted[0] == [g, re_]
    assert emitted[1] == [g, x, EOS]


def test_allowed_drafts_are_accepted(tok_ckpt):
    tok = Tokenizer(tok_ckpt)
    g, re_, en = (tok.token_to_id(s) for s in ("g", "re", "en"))
    sampler = Sampler(0, (EOS,), "cpu", GrammarMask(tok_ckpt, (EOS,)))
    params = SamplingParams(temperature=0.0, max_tokens=8, constraint={"kind": "choice", "value": ["green"]})
    logits = torch.zeros(3, 1024)
    logits[0, g] = logits[1, re_] = logits[2, EOS] = 30.0  # EOS is forbidden before "green" ends
    logits[2, en] = 20.0
    emitted, _ = sampler(logits, [_row(params, [g, re_])], [0])
    assert emitted == [[g, re_, en]]


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("structured-mtp") / "ckpt", dataclasses.replace(SPEC, mtp=True)))


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_drafted_constrained_decoding(tok_ckpt, mtp_ckpt, method):
    """The prompt repeats a JSON record so that n-gram drafts are proposed; MTP drafts come from an
    unfitted block (mostly rejected). Greedy: the same tokens as without drafts."""
    from engine import LLM

    path = tok_ckpt if method == "ngram" else mtp_ckpt
    tok = Tokenizer(path)
    ids = tok.encode('{"name" :"ab" ,"n" :12 ,"ok" : true} ' * 3)
    kinds = ["json_schema", "regex", "choice", "json_object", "grammar"]

    def params(k: str) -> SamplingParams:
        bias = {"logit_bias": object_bias(tok)} if k == "json_object" else {}
        return SamplingParams(max_tokens=60, temperature=0.0, constraint=CONSTRAINTS[k], **bias)

    outs = {}
    for spec in (0, 3):
        llm = LLM(path, dtype="float32", num_speculative_tokens=spec, speculative_method=method)
        try:
            outs[spec] = llm.generate(prompt_token_ids=[ids] * len(kinds), sampling_params=[params(k) for k in kinds])
        finally:
            llm.close()
    for k, a, b in zip(kinds, outs[0], outs[3]):
        check(k, b.text)
        assert a.output_token_ids == b.output_token_ids, k


def test_tokenizer_llguidance_cannot_read_ends_the_row(tmp_path, caplog):
    """A tokenizer.json llguidance cannot load: the sampler does not fail the batch; a constrained
    row may only end (EOS), an unconstrained one in the same batch draws as before."""
    (tmp_path / "tokenizer.json").write_text("{}")
    sampler = Sampler(0, (EOS,), "cpu", GrammarMask(tmp_path, (EOS,)))
    params = SamplingParams(temperature=0.0, max_tokens=8, constraint={"kind": "choice", "value": ["green"]})
    logits = torch.zeros(2, 1024)
    logits[:, 7] = 30.0
    emitted, _ = sampler(logits, [_row(params, []), _row(SamplingParams(temperature=0.0), [], "free")], [0, 1])
    assert emitted == [[EOS], [7]]
    assert "does not load into llguidance" in caplog.text


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_a_thinking_budget_under_drafting_is_decoded_as_without(tok_ckpt, mtp_ckpt, method, caplog):
    """A thinking budget is a grammar with a `max_tokens=` rule (router/thinking_budget.py), whose
    matcher llguidance cannot roll back: such a row takes no drafts, so greedy and seeded rows give
    the tokens they give without drafting, `</think>` within the budget, and no row is cut to EOS."""
    from engine import LLM
    from router.thinking_budget import constrain

    path = tok_ckpt if method == "ngram" else mtp_ckpt
    tok = Tokenizer(path)
    close = tok.token_to_id("</think>")
    ids = tok.encode("<think>" + "ab ab ab ab " * 6)
    grammar = constrain(None, close, 5).grammar
    assert "[max_tokens=5]" in grammar
    c = {"kind": "grammar", "value": grammar}
    ps = [SamplingParams(max_tokens=24, temperature=0.0, constraint=c)] + [
        SamplingParams(max_tokens=24, temperature=1.0, seed=s, constraint=c) for s in (1, 2)
    ]
    outs = {}
    for spec in (0, 3):
        llm = LLM(path, dtype="float32", num_speculative_tokens=spec, speculative_method=method)
        try:
            outs[spec] = llm.generate(prompt_token_ids=[ids] * len(ps), sampling_params=ps)
        finally:
            llm.close()
    for i, (a, b) in enumerate(zip(outs[0], outs[3], strict=True)):
        assert close in a.output_token_ids[:6], (i, a.output_token_ids)
        assert a.output_token_ids == b.output_token_ids, i
    assert "no grammar matcher" not in caplog.text


def test_a_failed_matcher_is_logged_once_a_request(tok_ckpt, caplog):
    """ignore_eos past a finished grammar: the matcher stops at EOS and every later step allows
    EOS alone; the WARNING comes once for the request, not once a step."""
    from engine import LLM

    c = {"kind": "choice", "value": ["green"]}
    llm = LLM(tok_ckpt, dtype="float32")
    try:
        (out,) = llm.generate(
            prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=12, ignore_eos=True, constraint=c)
        )
    finally:
        llm.close()
    assert len(out.output_token_ids) == 12 and out.output_token_ids[-1] == EOS
    assert caplog.text.count("no grammar matcher") == 1
