"""The OpenAI options that evaluation and benchmark clients use, through the official `openai`
client against `pdserve up` (one prefill + one decode node, disaggregated, tiny model with a
tokenizer), each against an independent reference: string stop sequences (one split across
two tokens, streamed and not), echo with prompt logprobs equal to the log-softmax of
transformers' float32 logits, penalties equal to a per-token loop over
transformers' logits, logit_bias equal to transformers' generate with the same bias, n > 1 with seeds equal to single requests with seed + i, and the requests
lm-evaluation-harness's `local-completions` model sends for `generate_until` and
loglikelihood tasks."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from tests.helpers import hybrid_ckpt as hc

PROMPT = "Hello world! How are you"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})
NO_THINK = dict(temperature=0.0, extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})


@pytest.fixture(scope="module")
def sdk(http_up):
    from client import Client

    with Client(http_up.address, timeout=120) as c:
        c.wait_ready(timeout=60)
        yield c


@pytest.fixture(scope="module")
def tok(ckpt):
    from engine.tokenizer import Tokenizer

    return Tokenizer(ckpt)


def _hf_logprobs(ckpt, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([ids])).logits[0].float(), -1)


def test_stop_string_split_across_two_tokens(oai, model, sdk, tok):
    ids = sdk.generate(prompt=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True).token_ids
    ends = [len(tok.decode(ids[:k])) for k in range(len(ids) + 1)]  # text length after k tokens
    text = tok.decode(ids)
    # a boundary between two tokens of 2+ characters each, with clean text around it
    k = next(
        k
        for k in range(1, len(ids) - 1)
        if ends[k] - ends[k - 1] >= 2
        and ends[k + 1] - ends[k] >= 2
        and "\ufffd" not in text[ends[k - 1] : ends[k + 1]]
        and tok.decode(ids[:k]) == text[: ends[k]]
    )
    stop = text[ends[k] - 2 : ends[k] + 2]
    want = text[: text.find(stop)]
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, stop=[stop, "never-seen"], **GREEDY)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.choices[0].model_extra["stop_reason"] == stop  # vLLM's: which stop ended it
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == stop
    assert len(chunks) >= 2  # text deltas, then the last with finish_reason; none carried any of `stop`
    # the SDK (gRPC) takes the same stop strings
    g = sdk.generate(prompt=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    assert (g.text, g.finish_reason) == (want, "stop")
    g = sdk.generate(
        prompt=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert (g.text, g.finish_reason) == (want + stop, "stop")
    # chat: the same text-level matching
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, **NO_THINK
    )
    full = chat.choices[0].message.content
    if len(full) >= 4:
        cut = oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=12, stop=[full[2:4]], **NO_THINK
        )
        assert cut.choices[0].message.content == full[: full.find(full[2:4])]
        assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_match_transformers(oai, model, sdk, ckpt, tok, max_tokens):
    """What loglikelihood scoring asks for: the prompt's logprobs (and the next token's)."""
    ids = tok.encode(PROMPT)
    r = oai.completions.create(model=model, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=3, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
    assert c.text == tok.decode(ids) + "".join(lp.tokens[len(ids) :])
    # the same request over gRPC gives token ids: check them against transformers
    g = sdk.generate(
        prompt_token_ids=ids, max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    assert g.prefill_node == ""  # prompt logprobs make the request prefill on the decode node
    every = ids + g.token_ids
    ref = _hf_logprobs(ckpt, every)
    for pos, e in enumerate(g.prompt_logprobs + g.logprobs, start=1):  # the entry of token `pos`
        assert e.token_id == every[pos]
        assert e.logprob == pytest.approx(ref[pos - 1, every[pos]].item(), abs=1e-4), pos
        vals, top_ids = torch.topk(ref[pos - 1], 3)
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4), pos
        assert e.top[0][0] == top_ids[0].item()
        if pos < len(ids) + max_tokens:  # HTTP: the same numbers under token strings
            assert lp.token_logprobs[pos] == e.logprob
            # the 3 most likely and, as OpenAI's, the prompt's own token (up to 4 entries); ids
            # decoding to one text share its key, the likeliest of their values
            want: dict[str, float] = {}
            for i, v in [*e.top, (every[pos], ref[pos - 1, every[pos]].item())]:
                want[tok.decode([i])] = max(v, want.get(tok.decode([i]), v))
            assert lp.top_logprobs[pos] == pytest.approx(want, abs=1e-4)
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.usage.completion_tokens == max_tokens and r.usage.prompt_tokens == len(ids)


def test_token_logprobs_come_through_the_prefill_pool(sdk, ckpt):
    """A request asking for its tokens' logprobs (not the prompt's) is prefilled by the prefill node,
    which sends the first token's logprobs with it; the decode node sends the rest. Each equals the
    log-softmax of transformers' float32 logits at its position, top entries in order. (Such
    requests used to be prefilled on the decode node, a long prompt stalling its streams.)"""
    ids = hc.prompts(lens=[150], seed=77)[0]
    r = sdk.generate(prompt_token_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    assert r.prefill_node == "prefill-0" and r.transfer_bytes > 0
    ref = _hf_logprobs(ckpt, ids + r.token_ids)
    assert [e.token_id for e in r.logprobs] == r.token_ids
    for k, e in enumerate(r.logprobs):
        row = ref[len(ids) + k - 1]
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4), k
        vals, top_ids = torch.topk(row, 2)
        assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=1e-4), k
        assert e.top[0][0] == top_ids[0].item()


def _naive_greedy(ckpt, prompt: list[int], n: int, rep: float, pres: float, freq: float) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        row = hc.hf_last_logits(ckpt, prompt + out).tolist()
        for t in set(prompt + out):
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        for t in set(out):
            row[t] -= pres + freq * out.count(t)
        out.append(max(range(len(row)), key=row.__getitem__))
    return out


def test_penalties_match_naive_reference(oai, model, sdk, ckpt):
    prompt = [7, 7, 7, 8, 8, 9, 10, 7, 8, 9]
    pen = dict(presence_penalty=-0.5, frequency_penalty=0.4)  # favour repeats, less so the more there are
    want = _naive_greedy(ckpt, prompt, 6, 0.5, -0.5, 0.4)
    # gRPC through the prefill node, which samples the first token (with the repetition penalty)
    g = sdk.generate(
        prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True, repetition_penalty=0.5, **pen
    )
    plain = sdk.generate(prompt_token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    assert g.token_ids == want and g.prefill_node and want != plain.token_ids
    r = oai.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=6,
        **pen,
        temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 0.5},
    )
    assert r.choices[0].text == g.text


def test_logit_bias_matches_transformers(oai, model, sdk, ckpt, tok):
    """HTTP and the SDK, through the prefill node (which samples the first token, and with logprobs
    sends its logprobs: the model's own, before the bias), against transformers' generate with
    its own additive bias."""
    import openai

    from client import PdserveError

    prompt, n = tok.encode(PROMPT), 5
    plain = sdk.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids
    bias = {plain[0]: -100.0, plain[2]: -2.5}  # ban the first token, discourage the third
    want = hc.hf_biased_greedy(ckpt, prompt, n, bias)
    assert want[0] == torch.topk(hc.hf_last_logits(ckpt, prompt), 2).indices[1].item() and want != plain
    g = sdk.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True, logit_bias=bias)
    assert g.token_ids == want and g.prefill_node
    lp = sdk.generate(
        prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True, logit_bias=bias, logprobs=1
    )
    assert lp.token_ids == want and lp.prefill_node == "prefill-0"
    assert lp.logprobs[0].top[0][0] == plain[0]  # the model's own log-probabilities, before the bias
    http_bias = {str(t): b for t, b in bias.items()}
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=n, logit_bias=http_bias, **GREEDY)
    assert r.choices[0].text == g.text == tok.decode(want)
    forced = next(t for t in range(200, 300) if t not in plain)
    c = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logit_bias={str(forced): 100},
        logprobs=True,
        **GREEDY,
    )
    assert [e.token for e in c.choices[0].logprobs.content] == [tok.decode([forced])] * 3
    # bad maps: 400 naming the field (HTTP), INVALID_ARGUMENT (gRPC); the server keeps serving
    for bad in (
        {"x": 1},
        {"-1": 1},
        {"5": 101},
        {"5": "1"},
        {"5": True},
        {str(i): 1 for i in range(301)},
        [5, 1],
        {"1000000": 1},
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"logit_bias": bad})
        body = ei.value.body
        assert ei.value.status_code == 400 and body["param"] == "logit_bias" and body["type"], (bad, body)
    for bad in ({5: 101.0}, {10**6: 1.0}):
        with pytest.raises(PdserveError) as ei:
            sdk.generate(prompt_token_ids=prompt, max_tokens=2, logit_bias=bad)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in ei.value.message
    assert sdk.generate(prompt_token_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True).token_ids == plain


def test_n_with_seed(oai, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    r = oai.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    singles = [oai.completions.create(seed=7 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1
    # logprobs prefill on the decode node, which then samples the first token too: same tokens
    assert oai.completions.create(seed=8, logprobs=0, **kw).choices[0].text == singles[1]
    chunks = list(oai.completions.create(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kw))
    texts = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == singles and chunks[-1].usage.completion_tokens == 24


def test_seeds_at_the_ends_of_int64_with_n(oai, model):
    """vLLM takes any int64 seed: near 2^63 - 1, choice i's seed + i wraps (modulo 2^63, docs/api.md)
    and equals a single request with that seed; -1 is 2^63 - 1; the same request, the same text."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    top = 2**63 - 1
    r = oai.completions.create(n=2, seed=top, **kw)
    singles = [oai.completions.create(seed=s, **kw).choices[0].text for s in (top, 0)]
    assert [c.text for c in r.choices] == singles
    assert oai.completions.create(seed=-1, **kw).choices[0].text == singles[0]
    assert [c.text for c in oai.completions.create(n=2, seed=top, **kw).choices] == singles


def test_min_p_one_is_greedy(oai, model, sdk):
    """min_p through HTTP and the SDK: at 1 only the most likely token stays, so a hot seeded
    request decodes greedily; below, it does not."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3)
    greedy = oai.completions.create(model=model, prompt=PROMPT, max_tokens=8, **GREEDY).choices[0].text
    assert oai.completions.create(**kw, extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text == greedy
    assert oai.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text != greedy
    ids = sdk.generate(prompt=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    assert (
        sdk.generate(prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3, min_p=1.0, ignore_eos=True).token_ids == ids
    )


def test_temperature_below_1e5_is_greedy(oai, model):
    """A temperature the logits cannot be divided by (1e-40: they overflow to infinity) decodes
    greedily, as vLLM's below 1e-5; it was an HTTP 500 naming an index out of range."""
    greedy = oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, **GREEDY).choices[0].text
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, seed=1, extra_body={"ignore_eos": True})
    assert oai.completions.create(temperature=1e-40, **kw).choices[0].text == greedy


def test_min_tokens_and_max_completion_tokens(oai, model, sdk, tok):
    ids = sdk.generate(prompt=PROMPT, max_tokens=3, temperature=0.0, ignore_eos=True).token_ids
    r = oai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "x"}],
        max_completion_tokens=3,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = oai.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.0,
        extra_body={"stop_token_ids": [ids[0]], "min_tokens": 1},
    )
    assert r.usage.completion_tokens >= 1 and not r.choices[0].text.startswith(tok.decode(ids[:1]) or "\0")


def test_lm_eval_requests(oai, model, tok):
    """The payloads lm-evaluation-harness's `local-completions` sends (token-id prompts in a batch
    of one), read the way it reads them."""
    ctx, cont = tok.encode("Question: What is 2+2?\nAnswer:"), tok.encode(" 4")
    gen = oai.completions.create(
        model=model, prompt=[ctx], max_tokens=32, temperature=0.0, seed=1234, stop=["\n\n", "Question:"]
    )
    assert "\n\n" not in gen.choices[0].text and "Question:" not in gen.choices[0].text
    ll = oai.completions.create(
        model=model, prompt=[ctx + cont], max_tokens=1, temperature=0.0, logprobs=1, echo=True, seed=1234
    )
    lp = ll.choices[0].logprobs
    tokens_lp, tops = lp.token_logprobs[len(ctx) : -1], lp.top_logprobs[len(ctx) : -1]
    assert len(tokens_lp) == len(cont) and all(math.isfinite(x) and x < 0 for x in tokens_lp)
    assert all(1 <= len(t) <= 2 for t in tops)  # the most likely and, when another, the token itself
    is_greedy = all(t == max(top.values()) for t, top in zip(tokens_lp, tops))
    assert isinstance(is_greedy, bool)
    # lm-eval's --batch_size N: a batch of prompts, one choice each, in order
    other = tok.encode("Question: Name a color.\nAnswer: blue")
    batch = oai.completions.create(
        model=model, prompt=[ctx + cont, other], max_tokens=1, temperature=0.0, logprobs=1, echo=True, seed=1234
    )
    assert [c.index for c in batch.choices] == [0, 1]
    again = batch.choices[0].logprobs.token_logprobs  # may resume from a snapshot: float rounding
    assert again[0] is None and again[1:] == pytest.approx(lp.token_logprobs[1:], rel=1e-5, abs=1e-6)
    assert len(batch.choices[1].logprobs.token_logprobs) == len(other) + 1
    assert batch.usage.prompt_tokens == len(ctx + cont) + len(other)


def test_unsupported_options_name_the_parameter(oai, model):
    import openai

    for kw, param in (
        (dict(extra_body={"top_logprobs": 2}), "top_logprobs"),
        (dict(extra_body={"suffix": "x"}), "suffix"),
        (dict(n=0), "n"),
        (dict(extra_body={"best_of": 3}), "best_of"),
        (dict(extra_body={"tool_choice": "required"}), "tool_choice"),
        (dict(extra_body={"cache_salt": ""}), "cache_salt"),
        (dict(extra_body={"cache_salt": "x" * 1025}), "cache_salt"),
    ):
        with pytest.raises(openai.BadRequestError) as ei:
            oai.completions.create(model=model, prompt=PROMPT, max_tokens=2, **kw)
        assert ei.value.body["param"] == param, ei.value.body
    with pytest.raises(openai.BadRequestError) as ei:
        oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=2
        )
    assert ei.value.body["param"] == "top_logprobs"


def test_cache_salt_over_http(oai, model, ckpt):
    """vLLM's `cache_salt` on completions, chat and responses: a later prompt shares a cached one
    only under the same salt (usage's cached_tokens); the tokens are transformers' greedy."""
    from transformers import AutoTokenizer

    def run(p, salt=None):
        body = {"ignore_eos": True, "return_token_ids": True} | ({"cache_salt": salt} if salt else {})
        r = oai.completions.create(model=model, prompt=p, max_tokens=3, temperature=0.0, extra_body=body)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].token_ids  # type: ignore[attr-defined]

    prompt = hc.prompts(lens=(70,), seed=47)[0]
    more = prompt + [11, 12, 13]
    first = run(prompt, "s1")
    other, plain, mine = run(more, "s2"), run(more), run(more, "s1")
    assert (first[0], other[0], plain[0], mine[0]) == (0, 0, 0, len(prompt))
    assert other[1] == plain[1] == mine[1] == hc.hf_greedy(ckpt, more, 3)
    # a chat and a responses request leave their prompts cached under their salts only
    hf = AutoTokenizer.from_pretrained(ckpt)
    text = "a salted conversation"
    ids = hf.encode(
        hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=2, extra_body={"cache_salt": "s3"}
    )
    oai.responses.create(model=model, input=text, max_output_tokens=2, extra_body={"cache_salt": "s4"})
    assert [run(ids + [11], salt)[0] for salt in ("s5", "s3", "s4")] == [0, len(ids), len(ids)]


def test_continuous_usage_stats(oai, model):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (its
    completion tokens rising to the final count), the last chunk the whole usage as without it."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, stream=True, **GREEDY)
    chunks = list(oai.completions.create(stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    plain = list(oai.completions.create(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage == chunks[-1].usage
    # n = 2: a chunk's usage is its own choice's so far, as vLLM's; the last one the whole request's
    two = list(
        oai.completions.create(n=2, stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw)
    )
    for i in (0, 1):
        mine = [c.usage.completion_tokens for c in two if c.choices and c.choices[0].index == i]
        assert mine == sorted(mine) and mine[-1] == 6, (i, mine)
    assert two[-1].usage.completion_tokens == 12
    # chat: the role chunk opening each choice too (the prompt, no tokens yet), as vLLM's does
    msgs = [{"role": "user", "content": PROMPT}]
    chat = list(
        oai.chat.completions.create(
            model=model,
            messages=msgs,
            max_tokens=4,
            stream=True,
            n=2,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            **GREEDY,
        )
    )
    roles = [c for c in chat if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(roles) == 2 and all(c.usage is not None for c in chat if c.choices)
    p = chat[-1].usage.prompt_tokens
    assert [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in roles] == [(p, 0), (p, 0)]


def test_max_tokens_defaults(oai, model):
    """Without max_tokens, chat generates as many tokens as the context leaves, as OpenAI's chat
    does, not 16: here until a stop token that logit_bias forces once
    min_tokens allows it (token 21); completions keep OpenAI's legacy default of 16."""
    stop = {"stop_token_ids": [42], "logit_bias": {"42": 100}, "min_tokens": 20}
    msgs = [{"role": "user", "content": "Count."}]
    r = oai.chat.completions.create(model=model, messages=msgs, temperature=0.0, extra_body=stop)
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (21, "stop")
    assert r.choices[0].model_extra["stop_reason"] == 42  # the stop id that ended it, as vLLM says
    c = oai.completions.create(model=model, prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True})
    assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (16, "length")
    assert c.choices[0].model_extra["stop_reason"] is None


def test_stop_matcher_holds_back_partial_matches():
    from router.stops import StopMatcher

    m = StopMatcher(["Question:", "\n\n"])
    assert m.push("The answer") == ("The answer", False)
    assert m.push(" is 4.\n") == (" is 4.", False)  # "\n" may start "\n\n"
    assert m.push("Que") == ("\n", False)  # it did not; "Que" may start "Question:"
    assert m.push("st") == ("", False)
    assert m.push("ion: next") == ("", True)  # the match and everything after it are dropped
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False) and m.flush() == "a"
    m = StopMatcher(["cd", "bc", "b"], include=True)  # the first match kept, the longest of those starting there
    assert m.push("abcde") == ("abc", True)


def test_tokenize_and_detokenize_as_vllm_answers_them(oai, model, ckpt):
    """`/tokenize` (a prompt, or chat messages as the chat route renders them) against
    transformers' tokenizer and chat template, `/detokenize` back; bad bodies are 400s."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    root = str(oai.base_url).removesuffix("/").removesuffix("/v1")

    def post(path: str, body: dict) -> tuple[int, dict]:
        r = oai._client.post(root + path, json=body)
        return r.status_code, r.json()

    code, t = post("/tokenize", {"model": model, "prompt": PROMPT, "return_token_strs": True})
    ids = hf.encode(PROMPT, add_special_tokens=False)
    assert code == 200 and (t["tokens"], t["count"]) == (ids, len(ids))
    assert t["token_strs"] == hf.convert_ids_to_tokens(ids) and t["max_model_len"] > len(ids)
    msgs = [{"role": "user", "content": "hi"}]
    code, c = post("/tokenize", {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}})
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert code == 200 and c["tokens"] == hf.encode(want, add_special_tokens=False) and c["token_strs"] is None
    chat = oai.chat.completions.create(model=model, messages=msgs, max_tokens=1, **NO_THINK)
    assert chat.usage.prompt_tokens == c["count"]  # what the chat route sends
    code, d = post("/detokenize", {"model": model, "tokens": ids})
    assert code == 200 and d["prompt"] == hf.decode(ids)
    # the chat prompt's ids back to its text, special tokens and all (as vLLM's and transformers'
    # decode), and that text to the same ids
    code, d = post("/detokenize", {"tokens": c["tokens"]})
    assert code == 200 and d["prompt"] == want == hf.decode(c["tokens"]) and "<|im_start|>" in want
    assert post("/tokenize", {"prompt": d["prompt"]})[1]["tokens"] == c["tokens"]
    for path, body, status in [
        ("/tokenize", {"prompt": 5}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
        ("/tokenize", {"messages": "x"}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": "x"}, 400),
    ]:
        code, e = post(path, body)
        assert code == status and "message" in e["error"], (path, body, code, e)
