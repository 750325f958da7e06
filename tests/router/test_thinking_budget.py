"""router/thinking_budget.py against llguidance itself: the grammar it builds around each kind of
answer constraint compiles, and a matcher over the checkpoint's tokenizer allows exactly
`</think>` once the budget's text tokens are in (and `</think>` earlier too), then the answer."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import numpy as np
import pytest

from engine.structured.grammar import check
from engine.structured.matcher import load_tokenizer
from proto import pb
from router.thinking_budget import constrain

ANSWERS = [
    None,
    pb.Constraint(json_object=True),
    pb.Constraint(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
    pb.Constraint(regex="a/b[0-9]+"),
    pb.Constraint(choice=pb.ChoiceList(choices=["yes", 'say "no"'])),
    pb.Constraint(grammar='start: "x" NUM\nNUM: /[0-9]+/'),
]


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    return hf, load_tokenizer(ckpt, vocab, (hf.eos_token_id,))


def _allowed(m: llguidance.LLMatcher) -> set[int]:
    return set(np.nonzero(np.frombuffer(m.compute_logit_bias(), dtype=np.uint8))[0].tolist())


@pytest.mark.parametrize("answer", ANSWERS, ids=["free", "json_object", "json_schema", "regex", "choice", "grammar"])
def test_budget_then_close_then_the_answer(tok, answer):
    hf, lt = tok
    close = hf.convert_tokens_to_ids("</think>")
    c = constrain(answer, close, 3)
    check("grammar", c.grammar)
    m = llguidance.LLMatcher(lt, c.grammar)
    text = hf.encode(" so we think about it", add_special_tokens=False)
    assert close in _allowed(m)  # the model may close early
    for t in text[:3]:
        assert t in _allowed(m)
        assert m.consume_token(t)
    assert _allowed(m) == {close}  # the budget is spent
    assert m.consume_token(close)
    after = _allowed(m)
    if answer is None:
        assert len(after) == lt.vocab_size  # anything
    else:
        assert close not in after and len(after) < lt.vocab_size / 2  # the answer's own grammar


def test_budget_zero_closes_at_once(tok):
    hf, lt = tok
    close = hf.convert_tokens_to_ids("</think>")
    m = llguidance.LLMatcher(lt, constrain(None, close, 0).grammar)
    assert _allowed(m) == {close}
