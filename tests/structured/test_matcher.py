"""Matchers.sync: a request's matcher follows its output (after the start token), rolling back
what is no longer there; its mask always equals that of a fresh matcher fed the same tokens."""

from __future__ import annotations

import llguidance

from engine.structured.grammar import grammar_text
from engine.structured.matcher import Matchers, begin, load_tokenizer
from engine.structured.spec import Constraint
from engine.tokenizer import Tokenizer


def _fresh_mask(tok, c: Constraint, tokens: list[int]) -> bytes:
    m = llguidance.LLMatcher(tok, grammar_text(c.kind, c.value), log_level=0)
    assert m.consume_tokens(tokens)
    return m.compute_bitmask()


def test_sync_follows_appends_and_rollbacks(tok_ckpt):
    t = Tokenizer(tok_ckpt)
    tok = load_tokenizer(tok_ckpt, 1024, (0,))
    ms = Matchers(tok)
    c = Constraint("regex", "[a-z]{1,40}")
    a, b, x = t.encode("ab")[0], t.encode("c")[0], t.encode("x")[0]
    for out in ([a], [a, b], [a, b, b], [a, x], [x] * 12, [x] * 11 + [a]):
        m = ms.sync("r", c, out)
        assert m is not None and m.compute_bitmask() == _fresh_mask(tok, c, out), out
    assert len(ms) == 1
    ms.drop(["r"])
    assert len(ms) == 0


def test_start_token():
    assert begin([5, 6, 7], None) == 0
    assert begin([5, 6, 7], 6) == 2
    assert begin([5, 6, 7], 9) is None
