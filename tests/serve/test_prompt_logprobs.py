"""Scoring prompts over /v1/completions as vLLM's clients do, against `pdserve up` (one prefill and
one decode node, --max-model-len 64): vLLM's `prompt_logprobs` (per prompt token after the first,
{token_id: {logprob, rank, decoded_token}}, the prompt's token first, then the N most likely)
equal transformers' log-softmax over the prompt, whole and streamed, beside echo's logprobs; a
prompt of exactly max_model_len tokens is scored with echo and max_tokens 0; a prompt sent as
token ids is echoed with its special tokens, as vLLM detokenizes it; chat's `prompt_logprobs` (vLLM's,
at the answer's top level) over the rendered chat prompt."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

from tests.helpers import hybrid_ckpt as hc
from tests.helpers.serve_harness import Up, log_url

CTX = 64


@pytest.fixture(scope="module")
def url(ckpt):
    args = ["--model", ckpt, "--dtype", "float32", "--decode", "1", "--prefill", "1", "--http-port", "0"]
    up = Up(*args, "--max-model-len", str(CTX))
    yield log_url(up, r"OpenAI-compatible HTTP on (http://\S+/v1)")
    assert up.stop() == 0, up.output()


@pytest.fixture(scope="module")
def hf_tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


def _post(url: str, body: dict, route: str = "/completions") -> tuple[int, dict | list]:
    req = urllib.request.Request(url + route, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if body.get("stream"):
        return status, [json.loads(x[6:]) for x in raw.split("\n\n") if x.startswith("data: {")]
    return status, json.loads(raw)


def _ref(ckpt, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax at every position (row p predicts token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(hc._hf_model(ckpt)(torch.tensor([ids])).logits[0].float(), -1)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, 600, (n - 1,), generator=g).tolist()  # <|im_start|> first: a special token


def test_prompt_logprobs_match_transformers(url, ckpt, hf_tok):
    ids, k = _ids(24, 0), 3
    body = {"prompt": ids, "max_tokens": 0, "prompt_logprobs": k, "echo": True, "logprobs": 1}
    status, out = _post(url, body)
    assert status == 200, out
    (c,) = out["choices"]
    ref = _ref(ckpt, ids)
    plp = c["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        row, tok = ref[pos - 1], ids[pos]
        d = {int(t): v for t, v in plp[pos].items()}
        assert next(iter(d)) == tok  # the prompt's token first
        lp = row[tok].item()
        assert d[tok]["logprob"] == pytest.approx(lp, abs=1e-4), pos
        assert 1 + (row > lp + 1e-4).sum().item() <= d[tok]["rank"] <= 1 + (row > lp - 1e-4).sum().item(), pos
        top = sorted((v["rank"], t, v["logprob"]) for t, v in d.items() if v["rank"] <= k)
        vals, top_ids = torch.topk(row, k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), pos
        assert [v for _, _, v in top] == pytest.approx(vals.tolist(), abs=1e-4), pos
        assert top[0][1] == top_ids[0].item(), pos
        assert len(d) == k + (tok not in top_ids.tolist())
        for t, v in d.items():  # each id decoded alone, special tokens kept (vLLM's decoded_token)
            assert v["decoded_token"] == hf_tok.decode([t]), (pos, t)
    # echo's logprobs keep their own 1 alternative (+ the token itself), with the same numbers
    lps = c["logprobs"]
    assert lps["token_logprobs"][0] is None and len(lps["token_logprobs"]) == len(ids)
    for pos in range(1, len(ids)):
        assert lps["token_logprobs"][pos] == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
        assert 1 <= len(lps["top_logprobs"][pos]) <= 2
    # the echoed prompt sent as ids keeps its special tokens, as vLLM's decode of the prompt does
    assert c["text"] == hf_tok.decode(ids) and c["text"].startswith("<|im_start|>")
    # streamed: the choice's first chunk carries the same prompt_logprobs
    status, chunks = _post(url, dict(body, stream=True))
    assert status == 200
    assert chunks[0]["choices"][0]["prompt_logprobs"] == plp
    assert all("prompt_logprobs" not in ch["choices"][0] for ch in chunks[1:] if ch["choices"])


def test_prompt_logprobs_alone_and_with_output(url, ckpt):
    """Without echo, text prompt, a generated token after: the prompt's entries are the same."""
    ids = _ids(12, 1)
    status, out = _post(url, {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 0, "temperature": 0})
    assert status == 200, out
    plp = out["choices"][0]["prompt_logprobs"]
    ref = _ref(ckpt, ids)
    assert [list(d) for d in plp[1:]] == [[str(t)] for t in ids[1:]]  # 0 alternatives: the token alone
    assert [d[str(t)]["logprob"] for d, t in zip(plp[1:], ids[1:])] == pytest.approx(
        [ref[p, t].item() for p, t in enumerate(ids[1:])], abs=1e-4
    )
    assert out["usage"]["completion_tokens"] == 2 and out["choices"][0]["logprobs"] is None


def test_a_prompt_of_max_model_len_tokens_is_scored(url, ckpt):
    """echo + max_tokens 0 asks for no room; a prompt one token longer, or one that asks for
    new tokens, is refused."""
    ids = _ids(CTX, 2)
    status, out = _post(url, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert status == 200, out
    ref = _ref(ckpt, ids)
    got = out["choices"][0]["logprobs"]["token_logprobs"]
    assert got[1:] == pytest.approx([ref[p, t].item() for p, t in enumerate(ids[1:])], abs=1e-4)
    usage = out["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (CTX, 0, CTX)
    status, out = _post(url, {"prompt": ids, "max_tokens": 0, "prompt_logprobs": 1})  # vLLM's way to score
    assert status == 200 and len(out["choices"][0]["prompt_logprobs"]) == CTX, out
    for body in ({"prompt": ids + [5], "max_tokens": 0, "echo": True}, {"prompt": ids, "max_tokens": 4}):
        status, out = _post(url, body)
        assert status == 400 and "leaves no room" in out["error"]["message"], out


def test_prompt_logprobs_refusals(url):
    for body, param in (
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ):
        status, out = _post(url, body)
        assert status == 400 and out["error"]["param"] == param, out
    msgs = [{"role": "user", "content": "hi"}]
    for body in ({"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}):  # as vLLM: not streamed
        status, out = _post(url, {"messages": msgs, "max_tokens": 1, **body}, "/chat/completions")
        assert status == 400 and out["error"]["param"] == "prompt_logprobs", out


def test_chat_prompt_logprobs_match_transformers(url, ckpt, hf_tok):
    """vLLM's chat: `prompt_logprobs` at the answer's top level, over the rendered chat prompt
    (transformers' apply_chat_template), equal to transformers' log-softmax over those tokens."""
    msgs = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
    text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = hf_tok.encode(text, add_special_tokens=False)
    k = 2
    body = {"messages": msgs, "max_tokens": 1, "prompt_logprobs": k, "return_token_ids": True, "n": 2}
    status, out = _post(url, body, "/chat/completions")
    assert status == 200, out
    assert out["prompt_token_ids"] == ids
    plp = out["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert all("prompt_logprobs" not in c for c in out["choices"])
    ref = _ref(ckpt, ids)
    for pos in range(1, len(ids)):
        row, tok = ref[pos - 1], ids[pos]
        d = {int(t): v for t, v in plp[pos].items()}
        assert next(iter(d)) == tok and d[tok]["logprob"] == pytest.approx(row[tok].item(), abs=1e-4), pos
        top = sorted((v["rank"], t, v["logprob"]) for t, v in d.items() if v["rank"] <= k)
        assert [v for _, _, v in top] == pytest.approx(torch.topk(row, k).values.tolist(), abs=1e-4), pos
        assert all(v["decoded_token"] == hf_tok.decode([t]) for t, v in d.items()), pos
    status, out = _post(url, {"messages": msgs, "max_tokens": 1}, "/chat/completions")
    assert status == 200 and "prompt_logprobs" not in out, out  # not asked: not there
