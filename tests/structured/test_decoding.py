"""Constrained decoding in the offline engine on a random-weight checkpoint with a tokenizer: the
output of each constraint kind passes an independent check (jsonschema, Python's re, the list of
choices), greedy and sampled rows mixed with an unconstrained row in one batch (which still gives
transformers' greedy tokens), the mask starting after `start_after_token`, a resumed request
continuing its grammar, and a prefix-cache hit keeping the constraint."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tests.helpers import hybrid_ckpt as hc
from tests.structured.cases import CONSTRAINTS, check, object_bias

PROMPT = "Hello world, the answer is"


def _params(kind: str, tok: Tokenizer, **kw) -> SamplingParams:
    extra = {"logit_bias": object_bias(tok)} if kind == "json_object" else {}
    return SamplingParams(max_tokens=80, constraint=CONSTRAINTS[kind], **extra, **kw)


def test_mixed_batch_greedy_sampled_and_unconstrained(llm, tok_ckpt):
    tok = Tokenizer(tok_ckpt)
    rows = [(k, _params(k, tok, temperature=0.0)) for k in CONSTRAINTS]
    rows += [(k, _params(k, tok, temperature=1.0, seed=s)) for s, k in enumerate(CONSTRAINTS)]
    rows += [(k, _params(k, tok, temperature=0.8, top_p=0.9)) for k in ("json_schema", "regex")]
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = tok.encode(PROMPT)
    outs = llm.generate(prompt_token_ids=[ids] * (len(rows) + 1), sampling_params=[p for _, p in rows] + [free])
    for (kind, p), o in zip(rows, outs):
        assert o.finish_reason == "stop", (kind, p.temperature, o.text)
        check(kind, o.text)
    assert outs[-1].output_token_ids == hc.hf_greedy(tok_ckpt, ids, 12)


def test_mask_starts_after_the_start_token(llm, tok_ckpt):
    """The start token, all but forced by a bias, comes first (unconstrained), then the grammar,
    which itself forbids the start token."""
    tok = Tokenizer(tok_ckpt)
    start = tok.encode("#")[0]
    c = {**CONSTRAINTS["regex"], "start_after_token": start}
    o = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, constraint=c, logit_bias={start: 50.0}))[0]
    assert o.output_token_ids[0] == start and o.finish_reason == "stop"
    check("regex", tok.decode(o.output_token_ids[1:]))


@pytest.mark.parametrize("kind", ["json_schema", "choice"])
def test_resumed_request_continues_its_grammar(llm, tok_ckpt, kind):
    """A request that arrives with tokens already produced (a moved request) continues the grammar
    from them: the whole output still passes, and greedy gives the uninterrupted run's tokens."""
    tok = Tokenizer(tok_ckpt)
    ids = tok.encode(PROMPT)
    p = _params(kind, tok, temperature=0.0)
    whole = llm.generate(prompt_token_ids=[ids], sampling_params=p)[0].output_token_ids
    cut = max(1, len(whole) // 2)
    rid = llm.engine.resume_request(ids, p, whole[:cut])
    got: list[int] = []
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.request_id == rid:
                got = o.output_token_ids  # the whole output, the tokens it came with included
    assert got[:cut] == whole[:cut]
    check(kind, tok.decode(got))
    assert got == whole


def test_prefix_cache_hit_keeps_the_constraint(llm, tok_ckpt):
    """The constraint is not part of the cache key: a second request on the same 300-token prompt
    takes its first 256 tokens (a snapshot grid point) from the cache and is still constrained
    (here by a different constraint)."""
    tok = Tokenizer(tok_ckpt)
    ids = hc.prompts(lens=(300,), seed=4)[0]
    first = llm.generate(prompt_token_ids=[ids], sampling_params=_params("json_schema", tok, temperature=0.0))[0]
    check("json_schema", first.text)
    again = llm.generate(prompt_token_ids=[ids], sampling_params=_params("choice", tok, temperature=0.0))[0]
    assert again.num_cached_tokens == 256
    check("choice", again.text)


def test_finished_and_aborted_requests_leave_no_matcher(llm, tok_ckpt):
    """The sampling rank forgets a request's matcher when it finishes or is aborted."""
    tok = Tokenizer(tok_ckpt)
    ids = tok.encode(PROMPT)
    eng = llm.engine
    grammar = eng.executor.worker.grammar
    done = eng.add_request(ids, _params("choice", tok, temperature=0.0))
    cut = eng.add_request(ids, _params("json_schema", tok, temperature=0.0))
    for _ in range(3):
        eng.step()
    assert eng.abort(cut) is not None
    while eng.has_unfinished():
        eng.step()
    # the finished ids reach the worker with the next step that has rows (as the penalty counts do)
    llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1))
    assert done not in grammar._matchers._states and cut not in grammar._matchers._states
    assert len(grammar._matchers) == 0


def test_tensor_parallel_two_ranks(tok_ckpt):
    """TP 2 (spawned rank processes): rank 0 holds the matchers; the outputs pass their checks and
    equal TP 1's (greedy)."""
    from engine import LLM

    tok = Tokenizer(tok_ckpt)
    ids = tok.encode(PROMPT)
    kinds = ["json_schema", "choice"]
    got = {}
    for tp in (1, 2):
        llm = LLM(tok_ckpt, dtype="float32", tensor_parallel_size=tp)
        try:
            outs = llm.generate(
                prompt_token_ids=[ids] * 2, sampling_params=[_params(k, tok, temperature=0.0) for k in kinds]
            )
        finally:
            llm.close()
        got[tp] = [o.output_token_ids for o in outs]
        for k, o in zip(kinds, outs):
            check(k, o.text)
    assert got[1] == got[2]


def test_no_end_before_the_start_token(llm, tok_ckpt):
    """Before its start token a constrained output may not end (the constrained part must come):
    with EOS all but forced, the unconstrained request ends at once, the constrained one runs to
    max_tokens without EOS; once the start token is drawn the grammar holds and may end."""
    tok = Tokenizer(tok_ckpt)
    eos, start = llm.engine.cfg.model.eos_token_ids, tok.encode("#")[0]
    ends = {t: 30.0 for t in eos}
    c = {**CONSTRAINTS["regex"], "start_after_token": start}
    free = SamplingParams(max_tokens=12, temperature=0.0, logit_bias=ends)
    held = SamplingParams(max_tokens=12, temperature=0.0, logit_bias=ends, constraint=c)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, logit_bias=ends, constraint=c)
    o_free, o_held, o_sampled = llm.generate([PROMPT] * 3, [free, held, sampled])
    assert o_free.finish_reason == "stop" and len(o_free.output_token_ids) == 1  # the bias works
    for o in (o_held, o_sampled):
        assert o.finish_reason == "length" and not set(o.output_token_ids) & set(eos)
    bias = {**ends, start: 60.0}  # the start token first, then the grammar, which may end
    o = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, constraint=c, logit_bias=bias))[0]
    assert o.output_token_ids[0] == start and o.finish_reason == "stop"
    check("regex", tok.decode(o.output_token_ids[1:]))
