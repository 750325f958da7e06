"""Logprobs as text, through the official `openai` client against `pdserve up` (one prefill + one
decode node, tiny model with a byte-level tokenizer): completions' `text_offset` points into
`text` where each token's character starts (multi-byte characters split across tokens, a
special token written in an echoed prompt), and chat's `bytes` are each token's own bytes,
against transformers' tokenizer and GPT-2's byte alphabet; chat top-logprobs come in order."""

from __future__ import annotations

import pytest

GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def tok(ckpt):
    from engine.tokenizer import Tokenizer

    return Tokenizer(ckpt)


def _hf_bytes(ckpt, ids: list[int], skip: bool) -> list[bytes]:
    """Each token's bytes in decoded text, by transformers' tokenizer and GPT-2's byte alphabet."""
    from transformers import AutoTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = AutoTokenizer.from_pretrained(ckpt)
    alphabet = {c: b for b, c in bytes_to_unicode().items()}
    added = {i: t for i, t in hf.added_tokens_decoder.items()}
    out = []
    for i in ids:
        if i in added:
            out.append(b"" if skip and added[i].special else added[i].content.encode())
        else:  # an id past the tokenizer's (the tiny model's vocabulary is larger) stands for nothing
            piece = hf.convert_ids_to_tokens(i)
            out.append(b"" if piece is None else bytes(alphabet[c] for c in piece))
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_point_into_the_text(oai, model, ckpt, tok, stream):
    """A prompt of multi-byte characters and a special token, echoed: each token's text_offset is
    where its character starts in `text` (the complete characters before its bytes, by a naive
    loop over transformers' token bytes); the special token, written in the prompt, is echoed
    and named as written."""
    prompt = "hé 😀 中文 ok <|im_start|>x"
    ids = tok.encode(prompt)
    assert 1 in ids  # <|im_start|>: one special token
    kw = dict(model=model, prompt=prompt, max_tokens=4, echo=True, logprobs=1, temperature=0)
    if stream:
        chunks = list(oai.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        offsets = [o for lp in lps for o in lp.text_offset]
        tokens = [t for lp in lps for t in lp.tokens]
    else:
        c = oai.completions.create(**kw).choices[0]
        text, offsets, tokens = c.text, c.logprobs.text_offset, c.logprobs.tokens
    out_ids = tok.encode(text[len(prompt) :])  # the output's ids, as its text re-encodes (ASCII-safe check below)
    assert text.startswith(prompt)
    raw = _hf_bytes(ckpt, ids, skip=False) + [b""] * (len(offsets) - len(ids))
    want = [len(b"".join(raw[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert offsets[: len(ids)] == want
    assert tokens[ids.index(1)] == "<|im_start|>" and text[offsets[ids.index(1)] :].startswith("<|im_start|>x")
    assert offsets[len(ids)] == len(prompt) and offsets == sorted(offsets)
    assert all(o <= len(text) for o in offsets), (offsets, len(text), out_ids)


def test_chat_top_logprobs_in_order(oai, model, ckpt):
    msgs = [{"role": "user", "content": "Say something."}]
    r = oai.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        vals = [t.logprob for t in e.top_logprobs]
        assert len(vals) == 5 and vals == sorted(vals, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.logprob == vals[0]  # greedy: the most likely
    ids = r.choices[0].model_extra["token_ids"]  # return_token_ids: the tokens the entries are for
    assert [bytes(e.bytes) for e in content] == _hf_bytes(
        ckpt, ids, skip=True
    )  # raw bytes, even of a part of a character
    chunks = list(
        oai.chat.completions.create(
            model=model, messages=msgs, max_tokens=4, logprobs=True, top_logprobs=5, stream=True, **GREEDY
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    # the same tokens; the repeat may resume from a prefix snapshot (a message break), which moves
    # logprobs by float rounding only
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], rel=1e-5, abs=1e-6)


def test_top_logprobs_of_ids_with_one_text_keep_the_likeliest(oai, model, ckpt):
    """lm-evaluation-harness's loglikelihood with `logprobs: N` > 1: a prompt and its greedy
    continuation, echoed. Several of the 20 most likely ids decode to the same text (here ids past
    the tokenizer's vocabulary, all ""; in Qwen's, the byte tokens of a split character, all "�"):
    their shared key holds the likeliest of them, so a greedy token is the largest value of its
    position, as the harness's `is_greedy` check reads it. Reference: transformers' log-softmax,
    top 20, each id decoded alone."""
    import torch
    from transformers import AutoTokenizer

    from tests.helpers import hybrid_ckpt as hc

    hf = AutoTokenizer.from_pretrained(ckpt)
    ctx = hf.encode("Question: what is the colour of the sky?\nAnswer:", add_special_tokens=False)
    cont = hc.hf_greedy(ckpt, ctx, 4)
    every = ctx + cont
    with torch.inference_mode():
        ref = torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([every])).logits[0].float(), -1)
    r = oai.completions.create(model=model, prompt=[every], max_tokens=0, echo=True, logprobs=20, temperature=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(every)
    shared = 0
    for pos in range(1, len(every)):
        vals, ids = torch.topk(ref[pos - 1], 20)
        want: dict[str, float] = {}
        for i, v in [*zip(ids.tolist(), vals.tolist()), (every[pos], ref[pos - 1, every[pos]].item())]:
            key = hf.decode([i], skip_special_tokens=True)
            want[key] = max(v, want.get(key, v))
        shared += len(want) < 20
        assert lp.top_logprobs[pos] == pytest.approx(want, abs=1e-4), pos
    assert shared  # the case this checks did occur
    tokens_lp, tops = lp.token_logprobs[len(ctx) :], lp.top_logprobs[len(ctx) :]
    assert all(t == max(top.values()) for t, top in zip(tokens_lp, tops))  # lm-eval's is_greedy
