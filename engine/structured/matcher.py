"""Per-request grammar matchers on the sampling rank. A matcher is not state to carry: it is
re-derived from the request's output tokens, so a request that arrives with tokens already
produced (the decode node after the prefill node's first token, a preempted or moved request)
continues its grammar where the tokens left it, never at the root.

Lifecycle: Matchers.sync(rid, constraint, output ids) before a step's mask makes (or reuses) the
request's matcher and brings it to exactly the output after `start_after_token`: it feeds the
tokens it has not seen and rolls back the ones no longer there (rejected drafts never reach it,
they are only tried inside the mask computation). Compiled grammars are cached by (kind, value)
and copied per request; drop() forgets finished requests."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import llguidance

from engine.structured.grammar import grammar_text
from engine.structured.spec import Constraint

log = logging.getLogger(__name__)
MAX_COMPILED = 64  # compiled grammars kept (copied for each new request)


def load_tokenizer(path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The checkpoint's tokenizer.json as llguidance's tokenizer over the model's vocab_size logits
    (ids past the tokenizer's own are never allowed) with every model EOS id as an end token."""
    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise ValueError(f"structured outputs need the checkpoint's tokenizer: no tokenizer.json in {path}")
    eos = list(eos_token_ids) or None
    return llguidance.LLTokenizer(f.read_text(), n_vocab=vocab_size, eos_token=eos)


def begin(output: list[int], start_after_token: int | None) -> int | None:
    """Index in `output` where the constrained part starts; None: not yet (the start token is not
    in the output)."""
    if start_after_token is None:
        return 0
    try:
        return output.index(start_after_token) + 1
    except ValueError:
        return None


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    key: tuple[str, str | tuple[str, ...]]
    fed: list[int] = field(default_factory=list)  # tokens the matcher has consumed


class Matchers:
    def __init__(self, tokenizer: llguidance.LLTokenizer):
        self.tokenizer = tokenizer
        self._compiled: OrderedDict[tuple[str, str | tuple[str, ...]], llguidance.LLMatcher] = OrderedDict()
        self._states: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)

    def fresh(self, c: Constraint) -> llguidance.LLMatcher:
        """A new matcher at the grammar's root (a copy of the cached compiled one)."""
        m = self._compiled.get(c.key)
        if m is None:
            m = llguidance.LLMatcher(self.tokenizer, grammar_text(c.kind, c.value), log_level=0)
            if m.is_error():  # checked at the request's validation; a tokenizer-specific failure
                log.warning("constraint %s does not compile for this tokenizer: %s", c.kind, m.get_error())
            self._compiled[c.key] = m
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(c.key)
        return m.deep_copy()

    def sync(self, rid: str, c: Constraint, output: list[int]) -> llguidance.LLMatcher | None:
        """The request's matcher after its constrained output so far; None while the start token
        is not in the output."""
        at = begin(output, c.start_after_token)
        if at is None:
            return None
        st = self._states.get(rid)
        if st is None or st.key != c.key:
            st = self._states[rid] = _State(self.fresh(c), c.key)
        want = output[at:]
        same = _common(st.fed, want)
        if same < len(st.fed):
            back = len(st.fed) - same
            if not st.matcher.rollback(back):  # beyond its rollback window: start again and replay
                st.matcher, same = self.fresh(c), 0
            del st.fed[same:]
        new = want[same:]
        if new:
            st.matcher.consume_tokens(new)
            st.fed += new
        return st.matcher


def _common(fed: list[int], want: list[int]) -> int:
    """The length of the common prefix of `fed` and `want`. The usual step only appends to the
    output, so the last few fed tokens are checked first (a whole scan each step would cost the
    output's length, every step, for every constrained row)."""
    n = len(fed)
    tail = max(0, n - 8)
    if n <= len(want) and want[tail:n] == fed[tail:]:
        return n
    same = 0
    for a, b in zip(fed, want):
        if a != b:
            break
        same += 1
    return same
